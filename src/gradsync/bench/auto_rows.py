"""``auto`` judged by its time: its time over the fastest algorithm it may choose, measured in the same run.

For every ``auto`` row of a ``gradsync bench allreduce`` run, the *fastest* is
the candidate of :func:`gradsync.collectives.auto.choose` for that layout
(``ring``, ``tree``, ``double_binary_tree``, ``halving_doubling``, and ``shm`` on one host or
``hierarchical`` across hosts; never ``native``) with the least median time at
the same size and layout. ``auto_vs_fastest`` pairs the repetitions: auto's
time in repetition k over the fastest's time in repetition k, summarised as
median, min and max (:mod:`gradsync.bench.spread`). The goal is a median of at
most :data:`AUTO_GOAL`; a row whose min-max contains it straddles the goal.
Rows recorded before the repetitions were kept (no ``time_us_reps``) give the
ratio of the medians, without a spread. Rows of reduce_scatter and all_gather
(``collective``) are judged the same way against the candidates that carry
those collectives: the trees refuse both (issue 38), so they are no candidates.
"""

from __future__ import annotations

from gradsync.bench.output import format_rows
from gradsync.bench.spread import paired_ratios, spread_cell, verdict, with_spread
from gradsync.collectives.auto import FLAT

AUTO_GOAL = 1.10  # auto's median time over the fastest candidate's, at every size and world size (issue 37)
ALL_REDUCE_ONLY = ("tree", "double_binary_tree")  # refuse reduce_scatter and all_gather (issue 38)


def auto_candidates(hosts: int, collective: str = "all_reduce") -> tuple[str, ...]:
    """What ``auto`` may choose from on ``hosts`` real hosts for ``collective`` (shm needs one host;
    hierarchical needs several: on one host the sweep's hierarchical row runs on pretend nodes, which auto
    never uses; the trees carry all_reduce only).

    >>> auto_candidates(1), auto_candidates(2, "reduce_scatter")
    (('ring', 'tree', 'double_binary_tree', 'halving_doubling', 'shm'), ('ring', 'halving_doubling', 'hierarchical'))
    """
    flat = FLAT if collective == "all_reduce" else tuple(name for name in FLAT if name not in ALL_REDUCE_ONLY)
    return flat + (("hierarchical",) if hosts > 1 else ("shm",))


def auto_rows(rows: list[dict]) -> list[dict]:
    """One row per ``auto`` row of ``rows`` that has a candidate measured beside it (same size and layout):
    ``fastest`` (its name), ``fastest_us``, ``auto_us`` (median times), ``auto_vs_fastest`` with
    ``_median``/``_min``/``_max`` (paired per repetition), and ``verdict`` against :data:`AUTO_GOAL`
    ("incomplete" when some candidate was not measured: ``missing`` names them).

    Raises:
        ValueError: the two rows recorded different numbers of repetitions.
    """
    out = []
    for auto in (row for row in rows if row["algorithm"] == "auto"):
        hosts, collective = auto.get("hosts", 1), auto.get("collective", "all_reduce")
        candidates = auto_candidates(hosts, collective)
        same = [row for row in rows if row["algorithm"] in candidates and row["nbytes"] == auto["nbytes"]
                and row["world_size"] == auto["world_size"] and row.get("hosts", 1) == hosts
                and row.get("collective", "all_reduce") == collective]
        if not same:
            continue
        fastest = min(same, key=lambda row: row["time_us"])
        missing = [name for name in candidates if name not in {row["algorithm"] for row in same}]
        summary = {"hosts": hosts, "world_size": auto["world_size"], "nbytes": auto["nbytes"],
                   "auto_us": auto["time_us"], "fastest": fastest["algorithm"], "fastest_us": fastest["time_us"],
                   "missing": missing, **_ratio(auto, fastest)}
        # against some candidates only, the fastest may be missing: no verdict
        summary["verdict"] = "incomplete" if missing else verdict(summary, "auto_vs_fastest", AUTO_GOAL)
        out.append(summary)
    return out


def _ratio(auto: dict, fastest: dict) -> dict:
    if "time_us_reps" in auto and "time_us_reps" in fastest:
        return with_spread("auto_vs_fastest", paired_ratios(auto["time_us_reps"], fastest["time_us_reps"]))
    return {"auto_vs_fastest": auto["time_us"] / fastest["time_us"]}


def annotate_auto_rows(rows: list[dict]) -> list[dict]:
    """``rows`` with each ``auto`` row given its figures from :func:`auto_rows` (``fastest``,
    ``auto_vs_fastest*``, ``auto_verdict``), so that the JSON carries them; returns ``rows``."""
    summaries = {(row["hosts"], row["world_size"], row["nbytes"]): row for row in auto_rows(rows)}
    for row in rows:
        summary = summaries.get((row.get("hosts", 1), row["world_size"], row["nbytes"]))
        if row["algorithm"] == "auto" and summary is not None:
            row.update({key: value for key, value in summary.items() if key.startswith("auto_vs_fastest")},
                       fastest=summary["fastest"], auto_verdict=summary["verdict"])
    return rows


def format_auto_table(rows: list[dict]) -> str:
    """``auto`` against the fastest candidate measured beside it (rows of :func:`auto_rows`), goal stated first."""
    header = (f"# auto / the fastest algorithm auto may choose, same run, median (min-max) over the repetitions; "
              f"goal: median <= {AUTO_GOAL:.2f}x")
    missing = sorted({name for row in rows for name in row.get("missing", [])})
    if missing:
        header += (f"\n# incomplete: {', '.join(missing)} not measured (--algorithms), so the fastest candidate "
                   f"may be absent; no verdict")
    ratio = spread_cell("auto_vs_fastest", ".2f", "x")
    return header + "\n" + format_rows(rows, [
        ("hosts", 6, lambda row: f"{row['hosts']}x{row['world_size'] // row['hosts']}"),
        ("size [B]", 12, "{nbytes}"), ("auto [us]", 11, "{auto_us:.1f}"), ("fastest", 17, "{fastest}"),
        ("fastest [us]", 13, "{fastest_us:.1f}"), ("auto/fastest", 19, ratio),
        (f"goal <= {AUTO_GOAL:.2f}x", 17, "{verdict}")])
