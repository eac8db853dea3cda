"""Staleness of asynchronous gradients: the bound the parameter server enforces, and the record it keeps.

A gradient computed on parameter version ``v`` and applied when the server
is at version ``u`` has staleness ``u - v``: the number of other workers'
updates it did not see (Zhang et al. 2016, "Staleness-aware async-SGD";
the bounded delay of Lian et al. 2015). Synchronous training has staleness 0.

>>> gate = StalenessGate(max_staleness=1)
>>> gate.may_start(version=0); gate.start(worker=0, version=0)
True
>>> gate.may_start(version=0)  # a second worker at version 0 could be applied 1 behind: fine
True
>>> gate.start(worker=1, version=0); gate.may_start(version=0)  # a third could make one 2 behind
False
"""

from __future__ import annotations


class StalenessGate:
    """Decides when the server may hand a worker parameters, so no applied gradient is staler than the bound.

    Stale synchronous parallel (Ho et al. 2013): a worker that runs ahead of
    the slowest one waits. The bound here is on the staleness of every applied
    gradient, in server versions, which is the stronger form: while worker
    ``w`` computes on version ``v_w`` and ``k`` workers are in flight, at most
    ``k - 1`` other gradients can be applied before ``w``'s arrives, so a new
    worker may start at version ``u`` only if, for every worker in flight,
    ``(u - v_w) + (k - 1) <= max_staleness`` still holds with ``k`` counting
    it. Consequently at most ``max_staleness + 1`` workers compute at once
    (``max_staleness=0`` is serial SGD) and a worker ahead of a straggler by
    more than the bound waits for it.

    Args:
        max_staleness: the bound (>= 0), or None for no bound (Downpour SGD, Dean et al. 2012).

    Raises:
        ValueError: ``max_staleness`` is negative or not an int.
    """

    def __init__(self, max_staleness: int | None):
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an int >= 0, got {max_staleness!r}")
        self.max_staleness = max_staleness
        self.in_flight: dict[int, int] = {}  # worker -> version it is computing on

    def may_start(self, version: int) -> bool:
        """Whether one more worker may start computing on ``version`` now."""
        if self.max_staleness is None:
            return True
        others_after = len(self.in_flight)  # gradients that may land before any given one
        if others_after > self.max_staleness:
            return False
        oldest = min(self.in_flight.values(), default=version)
        return (version - oldest) + others_after <= self.max_staleness

    def start(self, worker: int, version: int) -> None:
        if worker in self.in_flight:
            raise ValueError(f"worker rank {worker} is already computing a gradient")
        self.in_flight[worker] = version

    def finish(self, worker: int) -> int:
        """Worker's gradient arrived; returns the version it was computed on."""
        return self.in_flight.pop(worker)


class StalenessStats:
    """Counts of applied gradients by staleness (index = staleness in versions).

    >>> stats = StalenessStats(); [stats.record(s) for s in (0, 2, 2)] and None
    >>> stats.histogram, stats.max, round(stats.mean, 3)
    ([1, 0, 2], 2, 1.333)
    """

    def __init__(self):
        self.histogram: list[int] = []

    def record(self, staleness: int, count: int = 1) -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if staleness >= len(self.histogram):
            self.histogram.extend([0] * (staleness + 1 - len(self.histogram)))
        self.histogram[staleness] += count

    @property
    def count(self) -> int:
        return sum(self.histogram)

    @property
    def max(self) -> int:
        return len(self.histogram) - 1 if self.histogram else 0

    @property
    def mean(self) -> float:
        total = self.count
        return sum(s * n for s, n in enumerate(self.histogram)) / total if total else 0.0

    def as_dict(self) -> dict:
        """``staleness_mean``, ``staleness_max``, ``staleness_histogram`` as summary.json holds them."""
        return {"staleness_mean": self.mean, "staleness_max": self.max,
                "staleness_histogram": list(self.histogram)}
