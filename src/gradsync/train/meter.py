"""Timing and byte accounting of optimizer steps, kept beside the loop so the loop stays readable.

A :class:`StepMeter` times the phases of one step (forward, backward,
optimizer, local SGD's average), takes the model's communication seconds
and the transport's byte count before and after, and adds the result to a
run's :class:`StepTimes`. All times are ``time.perf_counter`` seconds.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class StepTimes:
    """Seconds one rank spent in each phase, summed over the run."""

    forward_s: float = 0.0
    backward_s: float = 0.0  # includes the wait for communication at the end of backward
    comm_s: float = 0.0      # communication time, overlapped with backward or not
    exposed_comm_s: float = 0.0  # the part of comm_s the step waited for
    optimizer_s: float = 0.0
    outside_comm_s: float = 0.0  # exposed communication outside forward/backward/optimizer (local SGD's average)

    @property
    def compute_s(self) -> float:
        inside = self.exposed_comm_s - self.outside_comm_s
        return self.forward_s + self.backward_s - inside + self.optimizer_s

    def add(self, forward_s: float, backward_s: float, comm_s: float, exposed_comm_s: float,
            optimizer_s: float, outside_comm_s: float = 0.0) -> None:
        self.forward_s += forward_s
        self.backward_s += backward_s
        self.comm_s += comm_s
        self.exposed_comm_s += exposed_comm_s
        self.optimizer_s += optimizer_s
        self.outside_comm_s += outside_comm_s


@dataclass
class StepRecord:
    """One finished step's seconds and bytes (the timing part of its ``metrics.jsonl`` record)."""

    forward_s: float
    backward_s: float
    comm_s: float
    exposed_comm_s: float
    optimizer_s: float
    bytes_sent: int  # payload bytes this rank's transport sent during the step

    def as_dict(self) -> dict:
        return {"forward_s": self.forward_s, "backward_s": self.backward_s, "comm_s": self.comm_s,
                "exposed_comm_s": self.exposed_comm_s, "optimizer_s": self.optimizer_s,
                "bytes_sent": self.bytes_sent}


class StepMeter:
    """Times the phases of one optimizer step of ``model`` (DataParallel or LocalSGD).

    Args:
        model: has ``comm_seconds``, ``exposed_comm_seconds`` and ``comm.stats.bytes_sent``.
        timeline: a :class:`~gradsync.parallel.timeline.Timeline` the phase spans go to, or None.
        comm_outside: the model communicates after the optimizer step (local SGD's
            average), not inside backward.
    """

    def __init__(self, model, timeline=None, comm_outside: bool = False):
        self.model, self.timeline, self.comm_outside = model, timeline, comm_outside
        self.start()

    def start(self) -> "StepMeter":
        """Begin a step: zero the phase seconds and remember the communication counters."""
        self.seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.started_s = time.perf_counter()  # the step's start (its wall time ends where the caller says)
        self._comm0, self._exposed0 = self.model.comm_seconds, self.model.exposed_comm_seconds
        self._bytes0 = self.model.comm.stats.bytes_sent
        return self

    @contextmanager
    def phase(self, kind: str):
        """Time the block as ``kind`` (summed over micro-batches; spans also go to the timeline)."""
        started = time.perf_counter()
        yield
        self.record(kind, started, time.perf_counter())

    def record(self, kind: str, start_s: float, end_s: float) -> None:
        if kind in self.seconds:
            self.seconds[kind] += end_s - start_s
        if self.timeline is not None:
            self.timeline.add(kind, start_s, end_s)

    def exposed_s(self) -> float:
        """Communication seconds the step waited for so far."""
        return self.model.exposed_comm_seconds - self._exposed0

    def compute_s(self) -> float:
        """Forward and backward seconds so far, less the communication they waited for."""
        return self.seconds["forward"] + self.seconds["backward"] - self.exposed_s()

    def stop(self, times: StepTimes) -> StepRecord:
        """End the step: add its seconds to ``times`` and return them with its bytes."""
        comm_s, exposed_s = self.model.comm_seconds - self._comm0, self.exposed_s()
        s = self.seconds
        times.add(s["forward"], s["backward"], comm_s, exposed_s, s["optimizer"],
                  outside_comm_s=exposed_s if self.comm_outside else 0.0)
        return StepRecord(s["forward"], s["backward"], comm_s, exposed_s, s["optimizer"],
                          self.model.comm.stats.bytes_sent - self._bytes0)
