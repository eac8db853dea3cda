"""``gradsync simulate --validate``'s arithmetic: predicted against measured rows, their errors with spread, auto's picks.

What the command does (:mod:`gradsync.bench.sim_validation_run` runs it):

1. Calibrate (:mod:`gradsync.bench.calibrate`, ``FULL`` settings: bandwidth from 1-16 MiB, out of
   cache as the large rows): this machine (2 processes over loopback) and, where test hosts can be
   made, 2 test hosts x 2 ranks with links shaped to ``--inter-host-gbit`` (1 Gbit/s).
2. Measure the AllReduce sweep ``--repeat R`` times with the bench machinery
   (:func:`gradsync.bench.allreduce.sweep`: every size and algorithm interleaved within a
   repetition, slowest rank; ``verify=False``): world sizes 2, 3, 4 on one host (``hierarchical``
   then groups by real host: one node, shm inside, as the simulation of one host does) and 2 x 2
   test hosts (shm only on one host; ``hierarchical`` = shm inside each host, halving_doubling
   across).
3. Predict every row with the event simulation (:func:`gradsync.sim.engine.simulate_all_reduce`)
   on the profile calibrated in step 1 and the row's topology, and print both with the error
   (predicted - measured) / measured: the measured time and the error as the median over the R
   repetitions with their min-max (:mod:`gradsync.bench.spread`).

Goal (issue 19): median |error| <= 10% over all rows, worst <= 25% over rows >= 64 KiB; each taken
within every repetition, met when its median over the repetitions meets it.

4. ``auto``'s choice against the measurement (:func:`auto_picks`): at every point, the candidate
   ``auto`` would run there (the flat algorithms, shm on one host, hierarchical across hosts) that
   the model predicts fastest, and the measured time of that pick over the measured fastest's,
   within each repetition.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from gradsync.bench.output import format_rows as table
from gradsync.bench.spread import fmt_spread, paired_ratios, spread_cell, verdict, with_spread
from gradsync.sim import Profile

ALGORITHMS = ("ring", "tree", "halving_doubling", "hierarchical", "shm")
ONE_HOST_WORLD_SIZES = (2, 3, 4)
HOSTS, RANKS_PER_HOST = 2, 2
DEFAULT_SIZES = "4K,64K,1M,16M,64M"
LARGE_BYTES = 64 * 2**10  # the goal's worst-case bound counts rows from here up
MEDIAN_GOAL, WORST_GOAL = 0.10, 0.25


@dataclass
class ValidationRow:
    """One measured sweep row and its prediction (times in microseconds).

    ``measured_us`` is the median over the repetitions, ``runs_us`` each repetition's time (empty:
    one measurement, ``measured_us`` itself).
    """

    algorithm: str
    nbytes: int
    world_size: int
    hosts: int
    predicted_us: float
    measured_us: float
    runs_us: tuple[float, ...] = ()

    @classmethod
    def of_runs(cls, algorithm: str, nbytes: int, world_size: int, hosts: int, predicted_us: float,
                runs_us: list[float]) -> "ValidationRow":
        """The row of ``runs_us`` (one measured time per repetition), ``measured_us`` their median."""
        return cls(algorithm, nbytes, world_size, hosts, predicted_us, statistics.median(runs_us), tuple(runs_us))

    @classmethod
    def from_dict(cls, row: dict) -> "ValidationRow":
        """The row :meth:`as_dict` wrote (``gradsync simulate --validate --json``)."""
        return cls(row["algorithm"], row["nbytes"], row["world_size"], row.get("hosts", 1), row["predicted_us"],
                   row["measured_us"], tuple(row.get("measured_us_runs") or ()))

    @property
    def runs(self) -> tuple[float, ...]:
        """The measured time of every repetition (us)."""
        return self.runs_us or (self.measured_us,)

    @property
    def errors(self) -> list[float]:
        """(predicted - measured) / measured of every repetition."""
        return [relative_error(self.predicted_us, measured) for measured in self.runs]

    @property
    def error(self) -> float:
        """The median over the repetitions of (predicted - measured) / measured."""
        return statistics.median(self.errors)

    def as_dict(self) -> dict:
        """The JSON row: the measured time and the error each as median, ``_median``, ``_min``, ``_max``,
        and ``measured_us_runs`` (every repetition's time)."""
        return {"algorithm": self.algorithm, "nbytes": self.nbytes, "world_size": self.world_size,
                "hosts": self.hosts, "predicted_us": self.predicted_us, **with_spread("measured_us", self.runs),
                **with_spread("error", self.errors), "measured_us_runs": list(self.runs)}


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured.

    Raises:
        ValueError: ``measured`` is not positive.

    >>> relative_error(110.0, 100.0)
    0.1
    """
    if not measured > 0:
        raise ValueError(f"a measured time must be > 0, got {measured}")
    return (predicted - measured) / measured


@dataclass(frozen=True)
class Summary:
    """The goal's two figures, each computed within every repetition and then summarised: ``figures``
    holds ``median_abs_error`` and ``worst_abs_error_large`` (over rows >= ``LARGE_BYTES``; None: no
    such row) as median, ``_median``, ``_min``, ``_max`` over the repetitions."""

    rows: int
    large_rows: int
    repetitions: int
    figures: dict
    worst_row: ValidationRow | None  # the row of the largest median |error| >= LARGE_BYTES

    @property
    def median_abs_error(self) -> float:
        return self.figures["median_abs_error"]

    @property
    def worst_abs_error_large(self) -> float | None:
        return self.figures["worst_abs_error_large"]

    @property
    def meets_goal(self) -> bool:
        """Both medians meet their goals."""
        return (self.median_abs_error <= MEDIAN_GOAL
                and (self.worst_abs_error_large is None or self.worst_abs_error_large <= WORST_GOAL))


def summarize(rows: list[ValidationRow]) -> Summary:
    """The median |error| over all rows and the worst |error| over rows of at least ``LARGE_BYTES``,
    each taken within every repetition, then their median, min and max over the repetitions (rows
    with different repetition counts: over the rows' median errors, one "repetition").

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("no validation rows to summarize")
    counts = {len(row.runs) for row in rows}
    if len(counts) == 1:
        errors = [[abs(row.errors[k]) for row in rows] for k in range(counts.pop())]
    else:
        errors = [[abs(row.error) for row in rows]]
    large = [i for i, row in enumerate(rows) if row.nbytes >= LARGE_BYTES]
    figures = with_spread("median_abs_error", [statistics.median(each) for each in errors])
    if large:
        figures.update(with_spread("worst_abs_error_large", [max(each[i] for i in large) for each in errors]))
    else:
        figures["worst_abs_error_large"] = None
    worst = max((rows[i] for i in large), key=lambda row: abs(row.error)) if large else None
    return Summary(len(rows), len(large), len(errors), figures, worst)


def format_rows(rows: list[ValidationRow]) -> str:
    """The table: predicted time, measured time and error, each measured figure as median (min-max)."""
    def table_row(row: ValidationRow) -> dict:
        return {**row.as_dict(), **with_spread("error_pct", [100 * error for error in row.errors])}

    return table([table_row(row) for row in rows], [
        ("hosts", 6, lambda row: f"{row['hosts']}x{row['world_size'] // row['hosts']}"), ("size [B]", 10, "{nbytes}"),
        ("algorithm", 17, "{algorithm}"), ("predicted [us]", 15, "{predicted_us:.1f}"),
        ("measured [us]", 26, spread_cell("measured_us", ".1f")),
        ("error", 22, spread_cell("error_pct", "+.1f", "%"))])


def format_summary(summary: Summary) -> str:
    worst = summary.worst_row
    where = (f" ({worst.hosts}x{worst.world_size // worst.hosts} {worst.algorithm} {worst.nbytes} B)"
             if worst else "")
    percent = {key: None if value is None else 100 * value for key, value in summary.figures.items()}
    large = fmt_spread(percent, "worst_abs_error_large", ".1f", "%")
    worst_verdict = ("" if summary.worst_abs_error_large is None
                     else f": {verdict(percent, 'worst_abs_error_large', 100 * WORST_GOAL)}")
    return (f"# median |error| {fmt_spread(percent, 'median_abs_error', '.1f', '%')} over {summary.rows} rows "
            f"(goal <= {100 * MEDIAN_GOAL:.0f}%: {verdict(percent, 'median_abs_error', 100 * MEDIAN_GOAL)}); "
            f"worst |error| {large} over {summary.large_rows} rows >= {LARGE_BYTES // 1024} KiB{where} "
            f"(goal <= {100 * WORST_GOAL:.0f}%{worst_verdict}); each the median (min-max) over "
            f"{summary.repetitions} repetition(s): {'goal met' if summary.meets_goal else 'goal MISSED'}")


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
    """For every point of ``rows``: :class:`Pick` among ``auto``'s candidates there (``auto.FLAT``, plus
    shm on one host, hierarchical across hosts) that have a row; points with fewer than two skipped.
    The prediction is the event simulation's on the profile calibrated in the run (``auto`` itself
    uses the formulas, within 5% of it, on the shipped profile)."""
    from gradsync.collectives.auto import FLAT

    points: dict[tuple[int, int, int], dict[str, ValidationRow]] = {}
    for row in rows:
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


def predict(rows: list[dict], profile: Profile) -> list[ValidationRow]:
    """A :class:`ValidationRow` per bench row (``gradsync.bench.allreduce.Row`` dicts, with ``runs_us``
    where :func:`merge_repetitions` made them) of a simulated algorithm, predicted on ``profile`` with
    the row's topology (hosts x ranks per host)."""
    from gradsync.sim import SIMULATED, Topology, simulate_all_reduce

    out = []
    for row in rows:
        if row["algorithm"] not in SIMULATED:
            continue
        hosts = row.get("hosts", 1)
        topology = (Topology.uniform(hosts, row["world_size"] // hosts) if hosts > 1
                    else Topology((row["world_size"],)))
        predicted_us = simulate_all_reduce(row["algorithm"], row["nbytes"], profile, topology).time_s * 1e6
        out.append(ValidationRow.of_runs(row["algorithm"], row["nbytes"], row["world_size"], hosts, predicted_us,
                                         list(row.get("runs_us") or [row["time_us"]])))
    return out


def merge_repetitions(repetitions: list[list[dict]]) -> list[dict]:
    """One bench row per (algorithm, size, world size, hosts) of ``repetitions`` (each a sweep's rows),
    in the first sweep's order, with ``runs_us``: its time in every repetition, and ``time_us`` their
    median.

    Raises:
        ValueError: no repetition, or a row missing from one of them.
    """
    if not repetitions:
        raise ValueError("no repetitions to merge")

    def key(row: dict) -> tuple:
        return row["algorithm"], row["nbytes"], row["world_size"], row.get("hosts", 1)

    times: dict[tuple, list[float]] = {key(row): [] for row in repetitions[0]}
    for rows in repetitions:
        if {key(row) for row in rows} != set(times):
            raise ValueError("the repetitions of the sweep measured different rows")
        for row in rows:
            times[key(row)].append(row["time_us"])
    return [dict(row, time_us=statistics.median(times[key(row)]), runs_us=times[key(row)])
            for row in repetitions[0]]
