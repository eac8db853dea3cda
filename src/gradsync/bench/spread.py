"""Every measured figure with its spread: the median of ``--repeat R`` repetitions, and their min and max.

A benchmark that reports a ratio runs what it compares ``R`` times, interleaved
(or alternated, for whole runs), and writes each figure ``x`` of a row as

* ``x``: the median over the repetitions (what the tables and the goals use),
* ``x_median``, ``x_min``, ``x_max``: the median again, and the extremes.

A ratio is formed *within* each repetition (native's time in repetition k over
the algorithm's time in repetition k), so both sides saw the same noise; the
spread is then taken over the R ratios. A goal is met when the median meets it;
when the min-max range contains the goal, the row says that it straddles it
(another run could land on the other side).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable, NamedTuple, Sequence

DEFAULT_REPEAT = 5


class Spread(NamedTuple):
    """The median, minimum and maximum of ``n`` repetitions of one figure."""

    median: float
    min: float
    max: float
    n: int


def spread(values: Sequence[float]) -> Spread:
    """The :class:`Spread` of ``values`` (one per repetition).

    >>> spread([3.0, 1.0, 2.0, 10.0])
    Spread(median=2.5, min=1.0, max=10.0, n=4)

    Raises:
        ValueError: no values, or a value that is not a finite number.
    """
    values = [float(value) for value in values]
    if not values:
        raise ValueError("no repetitions to summarise")
    if any(value != value or value in (float("inf"), float("-inf")) for value in values):
        raise ValueError(f"a repetition is not a finite number: {values}")
    return Spread(statistics.median(values), min(values), max(values), len(values))


def with_spread(name: str, values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """The JSON fields of one figure: ``name`` (the median), ``name_median``, ``name_min``, ``name_max``.

    ``scale`` multiplies every value first (seconds -> microseconds: ``1e6``).

    >>> with_spread("ratio", [1.0, 2.0, 4.0])
    {'ratio': 2.0, 'ratio_median': 2.0, 'ratio_min': 1.0, 'ratio_max': 4.0}
    """
    summary = spread([value * scale for value in values])
    return {name: summary.median, f"{name}_median": summary.median, f"{name}_min": summary.min,
            f"{name}_max": summary.max}


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """``numerators[k] / denominators[k]`` for every repetition k (the two measured in the same repetition).

    >>> paired_ratios([2.0, 3.0], [1.0, 2.0])
    [2.0, 1.5]

    Raises:
        ValueError: the two have different lengths, or a denominator is not positive.
    """
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators against {len(denominators)} denominators: "
                         f"a ratio pairs the two figures of one repetition")
    if any(value <= 0 for value in denominators):
        raise ValueError(f"a ratio's denominator is not positive: {list(denominators)}")
    return [top / bottom for top, bottom in zip(numerators, denominators)]


def straddles(row: dict, name: str, goal: float) -> bool:
    """Whether the row's ``name_min``..``name_max`` contains ``goal`` (False when no spread was recorded)."""
    low, high = row.get(f"{name}_min"), row.get(f"{name}_max")
    return low is not None and high is not None and low <= goal <= high


def verdict(row: dict, name: str, goal: float, at_most: bool = True) -> str:
    """"met" or "missed" by the median ``row[name]`` against ``goal`` (``at_most``: the figure must be <= goal,
    else >=), with ", straddles" added when the min-max range contains the goal; "-" when not measured.

    >>> verdict({"r": 1.05, "r_min": 0.98, "r_max": 1.21}, "r", 1.10)
    'met, straddles'
    >>> verdict({"r": 1.2, "r_min": 1.15, "r_max": 1.3}, "r", 1.10)
    'missed'
    """
    value = row.get(name)
    if value is None:
        return "-"
    met = value <= goal if at_most else value >= goal
    return ("met" if met else "missed") + (", straddles" if straddles(row, name, goal) else "")


def fmt_spread(row: dict, name: str, spec: str, suffix: str = "") -> str:
    """``median (min-max)`` of the row's figure ``name`` formatted with ``spec`` (``"1.07x (0.95-1.20)"``);
    the bare value for a row recorded without a spread; "-" when it is missing or None.

    >>> fmt_spread({"r": 1.07, "r_min": 0.95, "r_max": 1.2}, "r", ".2f", "x")
    '1.07x (0.95-1.20)'
    """
    value = row.get(name)
    if value is None:
        return "-"
    low, high = row.get(f"{name}_min"), row.get(f"{name}_max")
    text = format(value, spec) + suffix
    if low is None or high is None:
        return text
    return f"{text} ({format(low, spec)}-{format(high, spec)})"


def spread_cell(name: str, spec: str, suffix: str = "") -> Callable[[dict], str]:
    """A :func:`gradsync.bench.output.format_rows` cell showing :func:`fmt_spread` of ``name``."""
    return lambda row: fmt_spread(row, name, spec, suffix)


def check_repeat(repeat: int) -> int:
    """``repeat`` itself when it is an int >= 1.

    Raises:
        ValueError: naming ``--repeat`` and the value.
    """
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"--repeat must be an integer >= 1 (repetitions of what is compared), got {repeat!r}")
    return repeat


def add_repeat_option(parser: argparse.ArgumentParser, default: int = DEFAULT_REPEAT, what: str = "repetitions, "
                      "interleaved") -> None:
    """Add ``--repeat R`` to a bench's parser (the one option every bench that reports a ratio shares)."""
    parser.add_argument("--repeat", type=int, default=default,
                        help=f"{what}; every time and ratio is reported as the median with its min-max "
                        f"(default %(default)s)")


def scaled_cell(name: str, scale: float, spec: str, suffix: str = "") -> Callable[[dict], str]:
    """A :func:`spread_cell` of ``name`` with its median, min and max multiplied by ``scale`` first
    (a figure recorded in seconds shown in milliseconds: ``1e3``).

    >>> scaled_cell("t_s", 1e3, ".1f")({"t_s": 0.002, "t_s_min": 0.001, "t_s_max": 0.004})
    '2.0 (1.0-4.0)'
    """
    def cell(row: dict) -> str:
        keys = (name, f"{name}_min", f"{name}_max")
        return fmt_spread({key: row[key] * scale for key in keys if row.get(key) is not None}, name, spec, suffix)
    return cell
