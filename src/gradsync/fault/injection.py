"""Fault injection for tests and demos: ``--fail-at RANK:STEP`` and ``--hang-at RANK:STEP``.

A fault fires when worker RANK is about to run optimizer step STEP (steps
count from 1), only on the first attempt (``TORCHELASTIC_RESTART_COUNT`` is 0),
so the restarted job runs through. ``GRADSYNC_FAULT_ATTEMPTS=N`` makes it fire
on the first N attempts instead, which lets tests exhaust ``--max-restarts``.

- fail: the process writes a line to stderr and ends at once with exit code
  :data:`INJECTED_EXIT_CODE`, without closing its connections: a crash.
- hang: the process writes a line to stderr and sleeps until it is killed,
  holding its connections open: the others see silence, not a closed socket.
"""

from __future__ import annotations

import os
import signal
import time

from gradsync.fault.events import EventLog, read_events

INJECTED_EXIT_CODE = 17
ATTEMPTS_ENV = "GRADSYNC_FAULT_ATTEMPTS"
# Set by the test-host harness (``--kill-host-at HOST:STEP``) for the first agent of that host only:
# its local rank 0 kills every process of the host (its PID namespace) before optimizer step STEP.
KILL_HOST_ENV = "GRADSYNC_KILL_HOST_AT"


def attempt() -> int:
    """This worker's attempt, counted from 0 (the elastic agent's restart count)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _fault_attempts() -> int:
    value = os.environ.get(ATTEMPTS_ENV, "1")
    try:
        attempts = int(value)
    except ValueError:
        attempts = -1
    if attempts < 0:
        raise ValueError(f"environment variable {ATTEMPTS_ENV}={value!r} must be an integer >= 0")
    return attempts


def check_environment() -> None:
    """Raise ValueError now, before any worker starts, if ``GRADSYNC_FAULT_ATTEMPTS`` is malformed."""
    _fault_attempts()


def _recorded_faults(events: EventLog | None, rank: int) -> int:
    """How many faults ``rank`` has already recorded in the run folder's event log."""
    if events is None:
        return 0
    try:
        return sum(1 for event in read_events(events.path.parent)
                   if event.get("event") == "fault" and event.get("rank") == rank)
    except (OSError, ValueError):
        return 0


class FaultPlan:
    """The faults this rank injects.

    Args:
        rank: this worker's rank.
        fail_at, hang_at: ``(rank, step)`` or None.
        events: where the fault is recorded (with its wall-clock time) before it fires.
    """

    def __init__(self, rank: int, fail_at: tuple[int, int] | None, hang_at: tuple[int, int] | None,
                 events: EventLog | None = None):
        # the agents of different hosts count restarts apart (one replaced by a re-rendezvous, not by a
        # failure of its own, stays at 0): the faults this rank already recorded count as attempts too
        armed = max(attempt(), _recorded_faults(events, rank)) < _fault_attempts()
        self.fail_step = fail_at[1] if armed and fail_at and fail_at[0] == rank else None
        self.hang_step = hang_at[1] if armed and hang_at and hang_at[0] == rank else None
        self.rank = rank
        self.events = events
        kill_host = os.environ.get(KILL_HOST_ENV, "")
        in_test_host = "GRADSYNC_TESTHOSTS" in os.environ and os.environ.get("LOCAL_RANK", "0") == "0"
        self.kill_host_step = int(kill_host) if kill_host.isdigit() and in_test_host else None

    def before_step(self, step: int) -> None:
        """Call before optimizer step ``step`` (1-based); fails or hangs if this is the planned step."""
        if step == self.fail_step:
            self._announce("kill", step, f"injected failure (--fail-at {self.rank}:{step}): exiting")
            os._exit(INJECTED_EXIT_CODE)
        if step == self.kill_host_step:
            self._announce("kill-host", step, "injected host loss (--kill-host-at): killing every process "
                                              "of this host")
            os.kill(-1, signal.SIGKILL)  # in a test host's PID namespace: its agent and workers, not PID 1
            os._exit(INJECTED_EXIT_CODE)
        if step == self.hang_step:
            self._announce("hang", step, f"injected hang (--hang-at {self.rank}:{step}): sleeping until stopped")
            while True:
                time.sleep(3600)

    def _announce(self, kind: str, step: int, what: str) -> None:
        if self.events is not None:
            self.events.write({"event": "fault", "fault": kind, "rank": self.rank, "step": step,
                               "attempt": attempt()})
        os.write(2, f"gradsync: rank {self.rank}, step {step}: {what}\n".encode())
