"""``gradsync simulate --validate``'s second table: ``auto``'s choice against the measurement.

At every AllReduce point (hosts, world size, bytes), the candidate ``auto`` would run there (the flat
algorithms, shm on one host, hierarchical across hosts) that the model predicts fastest, and the
measured time of that pick over the measured fastest's, within each repetition.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from gradsync.bench.output import format_rows as table
from gradsync.bench.sim_validation import ALL_REDUCE, ValidationRow
from gradsync.bench.spread import paired_ratios, spread_cell, with_spread


@dataclass(frozen=True)
class Pick:
    """At one point (hosts, world size, bytes): the candidate the model predicts fastest and the one
    measured fastest (by median); ``slowdowns``: the measured time of the first over the second's,
    within each repetition (1.0: the same)."""

    hosts: int
    world_size: int
    nbytes: int
    predicted: str
    measured: str
    slowdowns: tuple[float, ...]

    @property
    def slowdown(self) -> float:
        """The median slowdown over the repetitions."""
        return statistics.median(self.slowdowns)

    @property
    def right(self) -> bool:
        """The pick is the fastest, or within ``PICK_TOLERANCE`` of it (the sweep's noise), by the median."""
        return self.slowdown <= 1 + PICK_TOLERANCE


PICK_TOLERANCE = 0.10


def auto_picks(rows: list[ValidationRow]) -> list[Pick]:
    """For every AllReduce point of ``rows``: :class:`Pick` among ``auto``'s candidates there (``auto.FLAT``, plus
    shm on one host, hierarchical across hosts) that have a row; points with fewer than two skipped.
    The prediction is the event simulation's on the profile calibrated in the run (``auto`` itself
    uses the formulas, within 5% of it, on the shipped profile)."""
    from gradsync.collectives.auto import FLAT

    points: dict[tuple[int, int, int], dict[str, ValidationRow]] = {}
    for row in rows:
        if row.collective != ALL_REDUCE:
            continue
        candidates = FLAT + (("shm",) if row.hosts == 1 else ("hierarchical",))
        if row.algorithm in candidates:
            points.setdefault((row.hosts, row.world_size, row.nbytes), {})[row.algorithm] = row
    picks = []
    for (hosts, world_size, nbytes), by_name in sorted(points.items()):
        if len(by_name) < 2:
            continue
        predicted = min(by_name, key=lambda name: by_name[name].predicted_us)
        measured = min(by_name, key=lambda name: by_name[name].measured_us)
        mine, best = by_name[predicted].runs, by_name[measured].runs
        slowdowns = (paired_ratios(mine, best) if len(mine) == len(best)
                     else [by_name[predicted].measured_us / by_name[measured].measured_us])
        picks.append(Pick(hosts, world_size, nbytes, predicted, measured, tuple(slowdowns)))
    return picks


def format_picks(picks: list[Pick]) -> str:
    """The table of :func:`auto_picks`, the slowdown as median (min-max) over the repetitions."""
    lines = [table([{**asdict(pick), **with_spread("slowdown", pick.slowdowns)} for pick in picks], [
        ("hosts", 6, lambda row: f"{row['hosts']}x{row['world_size'] // row['hosts']}"), ("size [B]", 10, "{nbytes}"),
        ("auto (model)", 17, "{predicted}"), ("measured fastest", 17, "{measured}"),
        ("slowdown", 20, spread_cell("slowdown", ".2f", "x"))])]
    right = sum(pick.right for pick in picks)
    worst = max((pick.slowdown for pick in picks), default=1.0)
    lines.append(f"# auto's model picks the fastest (within {100 * PICK_TOLERANCE:.0f}%, by the median) at {right} "
                 f"of {len(picks)} points; worst pick {worst:.2f}x the fastest")
    return "\n".join(lines)
