"""``gradsync simulate --validate``'s arithmetic: predicted against measured rows, each with its spread and verdict.

What the command does (:mod:`gradsync.bench.sim_validation_run` runs it; the split between the points
that calibrate and the points that are predicted is :mod:`gradsync.bench.sim_validation_split`):

1. Calibrate (:mod:`gradsync.bench.calibrate`, ``FULL`` settings) this machine and, where test hosts
   can be made, 2 test hosts x 2 ranks with links shaped to ``--inter-host-gbit`` (1 Gbit/s), on the
   points :func:`gradsync.bench.calibrate.calibration_points` lists, none of them a validated one.
2. Measure ``--repeat R`` times with the bench machinery (:func:`gradsync.bench.allreduce.sweep`, the
   slowest rank's time per call, ``verify=False``): every size (``DEFAULT_SIZES``) x every algorithm
   the simulator runs for each collective (AllReduce: :data:`gradsync.sim.engine.SIMULATED`;
   reduce-scatter and all-gather: those its ``collective=`` accepts), at world sizes 2, 3, 4 on one
   host and 2 x 2 test hosts; at every size the algorithms interleaved, their order rotated each
   repetition (``gradsync bench allreduce --repeat R``).
3. Predict every row with the event simulation of the algorithm's own code
   (:func:`gradsync.sim.engine.simulate_all_reduce`) on the profile calibrated in step 1.

Per row: error = (predicted - measured) / measured within every repetition, reported as the median
(min-max) over the repetitions; the machine's own spread = (max - min) / median of the measured
times; the row passes when |median error| <= max(``LARGE_BOUND``, spread) from ``LARGE_BYTES`` up and
<= max(``SMALL_BOUND``, spread) below. Goals (issue 42): median |error| <= ``MEDIAN_GOAL`` over all
rows, no row failing its bound.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from gradsync.bench.output import format_rows as table
from gradsync.bench.spread import fmt_spread, spread, spread_cell, verdict, with_spread

ONE_HOST_WORLD_SIZES = (2, 3, 4)
HOSTS, RANKS_PER_HOST = 2, 2
DEFAULT_SIZES = "4K,64K,1M,16M,64M"
LARGE_BYTES = 64 * 2**10  # rows from here up get LARGE_BOUND, below SMALL_BOUND
MEDIAN_GOAL, LARGE_BOUND, SMALL_BOUND = 0.10, 0.25, 0.40
ALL_REDUCE = "all_reduce"


@dataclass
class ValidationRow:
    """One measured point and its prediction (times in microseconds).

    ``measured_us`` is the median over the repetitions, ``runs_us`` each repetition's time (empty:
    one measurement, ``measured_us`` itself); ``collective``: all_reduce, reduce_scatter or all_gather
    (``nbytes`` as ``gradsync bench allreduce --collective`` counts it: the input of a reduce-scatter,
    the output of an all-gather).
    """

    algorithm: str
    nbytes: int
    world_size: int
    hosts: int
    predicted_us: float
    measured_us: float
    runs_us: tuple[float, ...] = ()
    collective: str = ALL_REDUCE

    @classmethod
    def of_runs(cls, algorithm: str, nbytes: int, world_size: int, hosts: int, predicted_us: float,
                runs_us: list[float], collective: str = ALL_REDUCE) -> "ValidationRow":
        """The row of ``runs_us`` (one measured time per repetition), ``measured_us`` their median."""
        return cls(algorithm, nbytes, world_size, hosts, predicted_us, statistics.median(runs_us), tuple(runs_us),
                   collective)

    @classmethod
    def from_dict(cls, row: dict) -> "ValidationRow":
        """The row :meth:`as_dict` wrote (``gradsync simulate --validate --json``; a record without
        ``collective`` is AllReduce's)."""
        return cls(row["algorithm"], row["nbytes"], row["world_size"], row.get("hosts", 1), row["predicted_us"],
                   row["measured_us"], tuple(row.get("measured_us_runs") or ()), row.get("collective", ALL_REDUCE))

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

    @property
    def spread(self) -> float:
        """The machine's own spread at this point: (max - min) / median of the measured times (0: one run)."""
        return relative_spread(self.runs)

    @property
    def bound(self) -> float:
        """The |error| this row may have: max(``LARGE_BOUND`` from ``LARGE_BYTES`` up, else ``SMALL_BOUND``,
        its spread)."""
        return max(LARGE_BOUND if self.nbytes >= LARGE_BYTES else SMALL_BOUND, self.spread)

    @property
    def excess(self) -> float:
        """|median error| - bound: > 0 for a failing row."""
        return abs(self.error) - self.bound

    @property
    def passes(self) -> bool:
        return self.excess <= 0

    @property
    def layout(self) -> str:
        """hosts x ranks per host (``1x3``, ``2x2``)."""
        return f"{self.hosts}x{self.world_size // self.hosts}"

    def as_dict(self) -> dict:
        """The JSON row: the measured time and the error each as median, ``_median``, ``_min``, ``_max``,
        ``measured_us_runs`` (every repetition's time), ``spread``, ``bound`` (fractions) and ``passes``."""
        return {"collective": self.collective, "algorithm": self.algorithm, "nbytes": self.nbytes,
                "world_size": self.world_size, "hosts": self.hosts, "predicted_us": self.predicted_us,
                **with_spread("measured_us", self.runs), **with_spread("error", self.errors),
                "measured_us_runs": list(self.runs), "spread": self.spread, "bound": self.bound,
                "passes": self.passes}


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


def relative_spread(values) -> float:
    """(max - min) / median of ``values`` (one per repetition); 0 for one value.

    >>> relative_spread([90.0, 100.0, 120.0])
    0.3

    Raises:
        ValueError: no values, one not finite, or a median that is not positive.
    """
    summary = spread(values)
    if not summary.median > 0:
        raise ValueError(f"a spread needs a positive median, got {summary.median}")
    return (summary.max - summary.min) / summary.median


@dataclass(frozen=True)
class Summary:
    """The goals' figures. ``figures`` holds ``median_abs_error`` taken within every repetition, then as
    median, ``_median``, ``_min``, ``_max`` over the repetitions; ``failing``: the rows over their bound,
    the largest excess first."""

    rows: int
    repetitions: int
    figures: dict
    failing: tuple[ValidationRow, ...]

    @property
    def median_abs_error(self) -> float:
        return self.figures["median_abs_error"]

    @property
    def meets_goal(self) -> bool:
        """The median |error| (by its median over the repetitions) meets ``MEDIAN_GOAL`` and no row fails."""
        return self.median_abs_error <= MEDIAN_GOAL and not self.failing


def summarize(rows: list[ValidationRow]) -> Summary:
    """The median |error| over all rows, within every repetition (rows with different repetition counts:
    over the rows' median errors, one "repetition"), and the rows failing their bound.

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
    figures = with_spread("median_abs_error", [statistics.median(each) for each in errors])
    failing = tuple(sorted((row for row in rows if not row.passes), key=lambda row: -row.excess))
    return Summary(len(rows), len(errors), figures, failing)


def _percent(value: float, sign: str = "") -> str:
    return f"{100 * value:{sign}.1f}%"


def format_rows(rows: list[ValidationRow]) -> str:
    """The table: predicted time, measured time and error as median (min-max), the spread, the bound and
    the verdict of every row."""
    def table_row(row: ValidationRow) -> dict:
        return {**row.as_dict(), **with_spread("error_pct", [100 * error for error in row.errors]),
                "layout": row.layout}

    return table([table_row(row) for row in rows], [
        ("collective", 14, "{collective}"), ("hosts", 5, "{layout}"), ("size [B]", 9, "{nbytes}"),
        ("algorithm", 18, "{algorithm}"), ("predicted [us]", 14, "{predicted_us:.1f}"),
        ("measured [us]", 29, spread_cell("measured_us", ".1f")), ("spread", 7, lambda r: _percent(r["spread"])),
        ("error", 27, spread_cell("error_pct", "+.1f", "%")), ("bound", 6, lambda r: _percent(r["bound"])),
        ("verdict", 7, lambda r: "pass" if r["passes"] else "FAIL")])


def _where(row: ValidationRow) -> str:
    return f"{row.layout} {row.collective} {row.algorithm} {row.nbytes} B"


def format_summary(summary: Summary) -> str:
    """The goals' lines: the median |error|, the rows failing their bound with the worst by excess."""
    percent = {key: 100 * value for key, value in summary.figures.items()}
    median = fmt_spread(percent, "median_abs_error", ".1f", "%")
    lines = [f"# median |error| {median} over {summary.rows} rows, the median (min-max) over "
             f"{summary.repetitions} repetition(s) (goal <= {100 * MEDIAN_GOAL:.0f}%: "
             f"{verdict(percent, 'median_abs_error', 100 * MEDIAN_GOAL)})"]
    failing = len(summary.failing)
    worst = ""
    if summary.failing:
        row = summary.failing[0]
        worst = (f"; worst {_where(row)}: {_percent(row.error, '+')} against a bound of {_percent(row.bound)} "
                 f"({100 * row.excess:.1f} points over)")
    lines.append(f"# rows failing their bound (|median error| <= max({100 * LARGE_BOUND:.0f}%, spread) from "
                 f"{LARGE_BYTES // 1024} KiB, max({100 * SMALL_BOUND:.0f}%, spread) below): {failing} of "
                 f"{summary.rows} (goal 0: {'met' if not failing else 'missed'}){worst}")
    lines.append(f"# {'goal met' if summary.meets_goal else 'goal MISSED'}")
    return "\n".join(lines)


def breakdown(rows: list[ValidationRow]) -> list[dict]:
    """One line per layout (``1x2`` .. ``2x2``) and per collective: its rows, median |error|, failing rows
    and the largest excess over a bound (None: none failing)."""
    groups: dict[tuple[str, str], list[ValidationRow]] = {}
    for row in rows:
        groups.setdefault(("hosts x ranks", row.layout), []).append(row)
    for row in rows:
        groups.setdefault(("collective", row.collective), []).append(row)
    out = []
    for (kind, name), members in groups.items():
        failing = [row.excess for row in members if not row.passes]
        out.append({"by": kind, "group": name, "rows": len(members),
                    "median_abs_error": statistics.median(abs(row.error) for row in members),
                    "failing": len(failing), "worst_excess": max(failing) if failing else None})
    return out


def format_breakdown(rows: list[ValidationRow]) -> str:
    """The table of :func:`breakdown`."""
    return table(breakdown(rows), [
        ("by", 13, "{by}"), ("group", 14, "{group}"), ("rows", 5, "{rows}"),
        ("median |error|", 14, lambda r: _percent(r["median_abs_error"])), ("failing", 7, "{failing}"),
        ("worst excess", 12, lambda r: "-" if r["worst_excess"] is None else f"{100 * r['worst_excess']:.1f} pts")])


def with_runs(rows: list[dict]) -> list[dict]:
    """The bench rows (``gradsync.bench.allreduce.sweep``'s dicts) with ``runs_us``: every repetition's time
    (their ``time_us_reps``; a row without it: its ``time_us``, one repetition), as :func:`predict
    <gradsync.bench.sim_validation_points.predict>` takes them.

    Raises:
        ValueError: a row without ``time_us``.
    """
    out = []
    for row in rows:
        if "time_us" not in row:
            raise ValueError(f"a bench row without a time: {row}")
        out.append(dict(row, runs_us=list(row.get("time_us_reps") or [row["time_us"]])))
    return out
