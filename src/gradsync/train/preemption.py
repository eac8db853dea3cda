"""Stop every rank at the same step boundary when the scheduler says the job will be preempted.

SLURM sends a signal before it preempts a job or its time runs out
(``#SBATCH --signal=USR1@90``: SIGUSR1 90 s before; SIGTERM before SIGKILL).
The ranks receive it at different steps, so the handler only raises a flag,
and the ranks agree on it at step boundaries: one AllReduce of two int64
(the flags' sum, and the steps until the next check, proposed by rank 0 so
that checks come about every :data:`CHECK_INTERVAL_S` seconds of training).
One 16-byte AllReduce every half second costs nothing measurable per step,
and every rank checks at the same steps. When any rank was signalled the
trainer saves a checkpoint at that step and raises :class:`Preempted` on
every rank; a rerun resumes from it (Lightning's SLURM auto-requeue does the
same from its signal handler, on rank 0's say). Handlers restart interrupted
system calls (``siginterrupt(False)``), so a signal landing inside a
collective's socket call does not fail it. Under srun, ``gradsync train``
catches the signals from its first import
(:func:`gradsync.slurm.catch_preemption_early`): one that came during
start-up is taken over here, and the first agreement (step 1) stops the job.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import torch

import gradsync
from gradsync import slurm
from gradsync.errors import GradsyncError

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)  # SLURM's --signal default choice, and its notice before SIGKILL
CHECK_INTERVAL_S = 0.5  # seconds of training between agreements (the stop comes at most this late, + 1 step)
MAX_CHECK_EVERY = 1000  # steps between agreements at most (very short steps)
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): not finished, try again (requeue)
INTERVAL_ENV = "GRADSYNC_PREEMPTION_CHECK_S"  # overrides CHECK_INTERVAL_S (tests: agree at every step)


def interval_from_env(environ=None) -> float:
    """Seconds between agreements: ``$GRADSYNC_PREEMPTION_CHECK_S`` or :data:`CHECK_INTERVAL_S`.

    Raises:
        ValueError: the variable is not a finite number > 0.
    """
    text = (os.environ if environ is None else environ).get(INTERVAL_ENV)
    if text is None:
        return CHECK_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"{INTERVAL_ENV}={text!r} must be a finite number of seconds > 0")
    return value


class Preempted(GradsyncError):
    """Every rank stopped at ``step`` after a preemption signal; the checkpoint of that step is saved."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(f"preempted at step {step}: checkpoint saved, requeue to resume ({signal_name} received)")
        self.step = step
        self.signal_name = signal_name


class Preemption:
    """The signal handlers (a context manager: installed on enter, the old ones back on exit) and the
    ranks' agreement at step boundaries.

    Args:
        signals: the signals that announce a preemption (default SIGUSR1 and SIGTERM).
        interval_s: seconds of training between two agreements (> 0).
    """

    def __init__(self, signals=SIGNALS, interval_s: float = CHECK_INTERVAL_S):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s}")
        self.signals, self.interval_s = tuple(signals), interval_s
        self.received: int | None = None  # the first signal number this process received
        self.next_check = 1  # the next step at which the ranks agree
        self.checks = 0
        self._last: tuple[float, int] | None = None  # (time, step) of the last agreement
        self._previous: dict = {}

    def __enter__(self) -> "Preemption":
        early = slurm.take_early_signal()  # one that came during start-up (gradsync train under srun)
        if early is not None and early in self.signals and self.received is None:
            self.received = early
        if threading.current_thread() is threading.main_thread():  # Python's rule for signal handlers
            for number in self.signals:
                self._previous[number] = signal.signal(number, self._handle)
                signal.siginterrupt(number, False)
        return self

    def __exit__(self, *exc) -> None:
        if self.received is not None:  # going down: a second notice (SIGTERM after USR1) must not kill it mid-exit
            return
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, number: int, frame) -> None:
        if self.received is None:
            self.received = number

    def requested(self, step: int) -> bool:
        """Whether any rank was signalled, as all ranks agree at ``step`` (False between agreements).

        Collective at the agreed steps: every rank must call it after each step with the same ``step``.
        """
        if step < self.next_check:
            return False
        now = time.perf_counter()
        flags = torch.tensor([int(self.received is not None), self._proposal(now, step)], dtype=torch.int64)
        gradsync.all_reduce(flags, op="sum", algorithm="auto")  # (flags, rank 0's steps until the next check)
        self._last = (now, step)
        self.next_check = step + int(flags[1])
        self.checks += 1
        return bool(flags[0] > 0)

    def _proposal(self, now: float, step: int) -> int:
        """Rank 0's steps to the next agreement, ~``interval_s`` of steps at the pace since the last; 0 elsewhere."""
        if gradsync.rank() != 0:
            return 0
        if self._last is None or step <= self._last[1]:
            return 1
        step_s = (now - self._last[0]) / (step - self._last[1])
        return max(1, min(MAX_CHECK_EVERY, round(self.interval_s / max(step_s, 1e-9))))

    def stop(self, step: int) -> Preempted:
        """The error every rank raises once the checkpoint of ``step`` is saved."""
        name = signal.Signals(self.received).name if self.received is not None else "a peer's signal"
        return Preempted(step, name)
