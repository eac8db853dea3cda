"""``bench memory``'s rows: bytes per rank at the step's peak, peak RSS, samples/s, ratios, the goals, the table.

A row is one implementation at one sharding level (a :data:`Setting`) on one
model and world size. Its bytes come from one run (they do not vary); its
samples/s from ``--repeat`` repetitions in which every setting is timed once,
interleaved, so that each ratio pairs two measurements of one repetition
(:func:`gradsync.bench.spread.paired_ratios`) and is reported as the median
with min and max. Ratios (None where they do not apply):

* ``total_vs_none``, ``optimizer_state_vs_none``: bytes over the baseline's,
  gradsync ``DataParallel`` with ``shard="none"`` and the same settings;
* ``samples_per_s_vs_none``: samples/s over the baseline's, paired;
* ``total_vs_torch_zero``, ``samples_per_s_vs_torch_zero``: the same against
  torch's ``ZeroRedundancyOptimizer`` with ``DistributedDataParallel``.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from gradsync.bench.output import fmt_optional, format_rows
from gradsync.bench.spread import fmt_spread, paired_ratios, spread_cell, verdict, with_spread
from gradsync.parallel.memory import PARTS


class Setting(NamedTuple):
    """One measured implementation: ``impl`` (a key of :data:`IMPL_SHARDS`) at sharding level ``shard``."""

    impl: str
    shard: str


# What each implementation is measured at. Peers are added here (torch-fsdp2 with "parameters" next).
IMPL_SHARDS = {"gradsync": ("none", "optimizer", "gradients"), "torch-zero": ("optimizer",)}
BASELINE = Setting("gradsync", "none")
TORCH_ZERO = Setting("torch-zero", "optimizer")
ROW_FIELDS = {"parameters": "parameter_bytes", "gradients": "gradient_bytes",
              "optimizer_state": "optimizer_state_bytes", "buffers": "buffer_bytes"}  # part -> row field
GOAL_AT = {"model": "gpt", "world_size": 4, "optimizer": "adamw"}   # issue 38's goals hold for these rows
SHARDED = ("optimizer", "gradients")


class Goal(NamedTuple):
    """A goal on ``field`` of the gradsync rows at the levels ``shards``: ``<= bound`` (``at_most``) or ``>=``."""

    text: str
    shards: tuple[str, ...]
    field: str
    bound: float
    at_most: bool


GOALS = (Goal("optimizer-state bytes <= 1/4 of shard=none's + 1%", SHARDED, "optimizer_state_vs_none",
              0.25 * 1.01, True),
         Goal("peak counted bytes >= 30% below shard=none's", ("optimizer",), "total_vs_none", 0.70, True),
         Goal("peak counted bytes >= 45% below shard=none's", ("gradients",), "total_vs_none", 0.55, True),
         Goal("samples/s >= 0.95x shard=none's (paired, median)", SHARDED, "samples_per_s_vs_none", 0.95, False),
         Goal("peak counted bytes <= ZeroRedundancyOptimizer's", SHARDED, "total_vs_torch_zero", 1.0, True),
         Goal("samples/s >= 1.0x ZeroRedundancyOptimizer's (paired, median)", SHARDED,
              "samples_per_s_vs_torch_zero", 1.0, False))


def settings_for(impls: Sequence[str], shards: Sequence[str]) -> list[Setting]:
    """What one world measures, baseline first: gradsync at ``shards`` (``none`` always), then every other
    impl of ``impls`` at its own levels.

    >>> settings_for(["gradsync", "torch-zero"], ["gradients"])
    [Setting(impl='gradsync', shard='none'), Setting(impl='gradsync', shard='gradients'), \
Setting(impl='torch-zero', shard='optimizer')]
    """
    found = [BASELINE] + [Setting("gradsync", shard) for shard in IMPL_SHARDS["gradsync"]
                          if shard in shards and shard != "none"]
    return found + [Setting(impl, shard) for impl in impls if impl != "gradsync" for shard in IMPL_SHARDS[impl]]


def _ratio(top, bottom) -> float | None:
    return None if top is None or not bottom else top / bottom


def _paired(name: str, times: list[float] | None, reference: list[float] | None) -> dict:
    """``name`` = samples/s over the reference's, paired per repetition: the reference's time over this one's."""
    if times is None or reference is None:
        return {name: None}
    return with_spread(name, paired_ratios(reference, times))


def memory_rows(base: dict, counted: dict[Setting, dict], timed: dict[Setting, dict] | None) -> list[dict]:
    """One row per setting of ``counted``, in its order.

    Args:
        base: the fields every row of this model and world size shares; ``samples_per_step`` (the batch
            over all ranks) and ``steps`` (timed steps per repetition) among them.
        counted: per setting, one bytes run: ``parts`` ({part: bytes} of the rank with the largest
            peak), ``peak_at``, ``total_bytes_per_rank``, ``optimizer_state_bytes_per_rank`` (optional),
            ``peak_rss_mib_per_rank``.
        timed: per setting, ``equal_to_none`` (its parameters matched the baseline's after the check
            steps), ``max_abs_diff`` and ``elapsed_s`` (seconds of the timed steps per repetition, the
            slowest rank's; None when it was not timed); None when nothing was timed.
    """
    timed = timed or {}
    seconds = {setting: (timed.get(setting) or {}).get("elapsed_s") for setting in counted}
    totals = {setting: sum(entry["parts"].values()) for setting, entry in counted.items()}
    rows = []
    for setting, entry in counted.items():
        check = timed.get(setting) or {}
        samples = None if seconds[setting] is None else [
            base["samples_per_step"] * base["steps"] / value for value in seconds[setting]]
        gradsync_row = setting.impl == "gradsync"
        row = {**base, "impl": setting.impl, "shard": setting.shard,
               **{ROW_FIELDS[part]: entry["parts"][part] for part in PARTS}, "total_bytes": totals[setting],
               "peak_at": entry["peak_at"], "total_bytes_per_rank": entry["total_bytes_per_rank"],
               "optimizer_state_bytes_per_rank": entry.get("optimizer_state_bytes_per_rank"),
               "peak_rss_mib": max(entry["peak_rss_mib_per_rank"]),
               "peak_rss_mib_per_rank": entry["peak_rss_mib_per_rank"],
               "equal_to_none": None if setting == BASELINE else check.get("equal_to_none"),
               "max_abs_diff": None if setting == BASELINE else check.get("max_abs_diff"),
               **({"samples_per_s": None} if samples is None else with_spread("samples_per_s", samples)),
               "total_vs_none": None if setting == BASELINE else _ratio(totals[setting], totals.get(BASELINE)),
               "optimizer_state_vs_none": None if setting == BASELINE else _ratio(
                   entry["parts"]["optimizer_state"], counted.get(BASELINE, {}).get("parts", {}).get("optimizer_state")),
               **_paired("samples_per_s_vs_none", None if setting == BASELINE else seconds[setting],
                         seconds.get(BASELINE)),
               "total_vs_torch_zero": _ratio(totals[setting], totals.get(TORCH_ZERO)) if gradsync_row else None,
               **_paired("samples_per_s_vs_torch_zero", seconds[setting] if gradsync_row else None,
                         seconds.get(TORCH_ZERO))}
        rows.append(row)
    return rows


def goal_rows(rows: list[dict], goal: Goal) -> list[dict]:
    """The gradsync rows ``goal`` is judged on: gpt, world size 4, AdamW, at the goal's levels."""
    return [row for row in rows if row["impl"] == "gradsync" and row["shard"] in goal.shards
            and all(row.get(key) == value for key, value in GOAL_AT.items())]


def goal_lines(rows: list[dict]) -> list[str]:
    """One line per goal and level: the figure (median (min-max) for samples/s) and met / missed
    (:func:`gradsync.bench.spread.verdict`), or why it was not measured."""
    where = f"{GOAL_AT['model']}, world size {GOAL_AT['world_size']}, {GOAL_AT['optimizer']}"
    lines = []
    for goal in GOALS:
        judged = goal_rows(rows, goal)
        if not judged:
            lines.append(f"# goal ({where}): {goal.text}: not measured (no such rows)")
        for row in judged:
            if row.get(goal.field) is None:
                lines.append(f"# goal ({where}), shard={row['shard']}: {goal.text}: not measured "
                             f"({_why_missing(row, goal)})")
                continue
            lines.append(f"# goal ({where}), shard={row['shard']}: {goal.text}: "
                         f"{fmt_spread(row, goal.field, '.3f', 'x')}: {verdict(row, goal.field, goal.bound, goal.at_most)}")
    return lines


def _why_missing(row: dict, goal: Goal) -> str:
    if row.get("equal_to_none") is False:
        return "its parameters differed from shard=none's, so it was not timed"
    if row.get("samples_per_s") is None:
        return "not timed (--no-throughput)"
    if goal.field.endswith("torch_zero"):
        return "torch-zero not timed: not in --impls, or its parameters differed from shard=none's"
    return "shard=none not timed"


def _mib(field: str):
    return lambda row: fmt_optional(None if row.get(field) is None else row[field] / 2**20, ".1f")


def _check(row: dict) -> str:
    """The equality check before timing: ok, differs (with the largest difference), or - (baseline)."""
    if row.get("equal_to_none") is None:
        return "-"
    return "ok" if row["equal_to_none"] else f"differs {row.get('max_abs_diff', float('nan')):.1e}"


def format_table(rows: list[dict]) -> str:
    """The rows as text (bytes in MiB per rank, the rank with the largest peak), then the goals' verdicts."""
    columns = [("model", 5, "{model}"), ("ws", 2, "{world_size}"), ("impl", 10, "{impl}"),
               ("shard", 9, "{shard}"), ("param MiB", 9, _mib("parameter_bytes")),
               ("grad MiB", 8, _mib("gradient_bytes")), ("optim MiB", 9, _mib("optimizer_state_bytes")),
               ("buffer MiB", 10, _mib("buffer_bytes")), ("total MiB", 9, _mib("total_bytes")),
               ("peak at", 8, "{peak_at}"), ("x none", 6, spread_cell("total_vs_none", ".2f")),
               ("x zero", 6, spread_cell("total_vs_torch_zero", ".2f")),
               ("RSS MiB", 8, lambda row: f"{row['peak_rss_mib']:.0f}"),
               ("samples/s", 19, spread_cell("samples_per_s", ".1f")),
               ("samples/s x none", 19, spread_cell("samples_per_s_vs_none", ".2f")),
               ("samples/s x zero", 19, spread_cell("samples_per_s_vs_torch_zero", ".2f")),
               ("check", 14, _check)]
    notes = ["# bytes: counted from the tensors each rank holds (parameters, gradients, optimizer state, "
             "communication buffers; a storage once), sampled after forward, after backward and after the "
             "optimizer step of one step; the point with the largest total (peak at) and its parts, for the rank "
             "with the largest; x none / x zero: total bytes over shard=none's / torch-zero's",
             "# RSS: peak resident set (getrusage ru_maxrss), max over ranks, of a fresh world per row; "
             "samples/s: median (min-max) of the repetitions, every setting timed once in each; x none / x zero: "
             "paired per repetition; check: parameters allclose (rtol 1e-5, atol 1e-6) to shard=none's after 3 float64 "
             "steps, else not timed"]
    return "\n".join([format_rows(rows, columns)] + notes + goal_lines(rows))


def tables(rows: list[dict]) -> list[str]:
    """The report's tables: one per optimizer (the goals are judged in the one with their optimizer)."""
    optimizers = list(dict.fromkeys(row["optimizer"] for row in rows))
    return [format_table([row for row in rows if row["optimizer"] == name]) for name in optimizers]
