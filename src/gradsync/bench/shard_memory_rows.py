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
  torch's ``ZeroRedundancyOptimizer`` with ``DistributedDataParallel``;
* ``total_vs_torch_fsdp2``, ``samples_per_s_vs_torch_fsdp2``: against PyTorch's
  FSDP2 (``fully_shard``), on gradsync's rows.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from gradsync.bench.output import fmt_optional, format_rows
from gradsync.bench.shard_memory_texts import TABLE_NOTES
from gradsync.bench.spread import fmt_spread, paired_ratios, spread_cell, verdict, with_spread
from gradsync.parallel.memory import PARTS


class Setting(NamedTuple):
    """One measured implementation: ``impl`` (a key of :data:`IMPL_SHARDS`) at sharding level ``shard``."""

    impl: str
    shard: str


# What each implementation is measured at.
IMPL_SHARDS = {"gradsync": ("none", "optimizer", "gradients", "parameters"), "torch-zero": ("optimizer",),
               "torch-fsdp2": ("parameters",)}
BASELINE = Setting("gradsync", "none")
TORCH_ZERO = Setting("torch-zero", "optimizer")
TORCH_FSDP2 = Setting("torch-fsdp2", "parameters")
PEERS = {"torch_zero": TORCH_ZERO, "torch_fsdp2": TORCH_FSDP2}  # ratio suffix -> the peer gradsync's rows divide by
ROW_FIELDS = {"parameters": "parameter_bytes", "gradients": "gradient_bytes",
              "optimizer_state": "optimizer_state_bytes", "buffers": "buffer_bytes"}  # part -> row field
GOAL_AT = {"model": "gpt", "world_size": 4, "optimizer": "adamw"}   # issues 38's and 39's goals hold for these rows
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
              "samples_per_s_vs_torch_zero", 1.0, False),
         # issue 39: ZeRO-3 (shard="parameters") against shard=none and FSDP2
         Goal("peak counted bytes >= 60% below shard=none's", ("parameters",), "total_vs_none", 0.40, True),
         Goal("samples/s >= 0.8x shard=none's (paired, median)", ("parameters",), "samples_per_s_vs_none", 0.8, False),
         Goal("peak counted bytes <= FSDP2's", ("parameters",), "total_vs_torch_fsdp2", 1.0, True),
         Goal("samples/s >= 1.0x FSDP2's (paired, median)", ("parameters",), "samples_per_s_vs_torch_fsdp2", 1.0,
              False))


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


def _peer_ratios(total: int | None, times: list[float] | None, totals: dict, seconds: dict) -> dict:
    """``total_vs_<peer>`` and ``samples_per_s_vs_<peer>`` for every peer of :data:`PEERS` (None: not a
    gradsync row, or the peer not measured)."""
    ratios: dict = {}
    for suffix, peer in PEERS.items():
        ratios[f"total_vs_{suffix}"] = _ratio(total, totals.get(peer))
        ratios.update(_paired(f"samples_per_s_vs_{suffix}", times, seconds.get(peer)))
    return ratios


def memory_rows(base: dict, counted: dict[Setting, dict], timed: dict[Setting, dict] | None) -> list[dict]:
    """One row per setting of ``counted``, in its order.

    Args:
        base: the fields every row of this model and world size shares; ``samples_per_step`` (the batch
            over all ranks) and ``steps`` (timed steps per repetition) among them.
        counted: per setting, one bytes run: ``parts`` ({part: bytes} of the rank with the largest
            peak), ``peak_at``, ``total_bytes_per_rank``, ``optimizer_state_bytes_per_rank`` (optional),
            ``peak_rss_mib_per_rank``.
        timed: per setting, ``equal_to_none`` (its parameters matched the baseline's after the check
            steps), ``max_abs_diff``, optionally ``gradient_check`` (``equal``, ``max_abs_diff``: FSDP2's
            float32 gradients against the ranks' mean) and ``elapsed_s`` (seconds of the timed steps per repetition, the
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
               "gradient_equal_to_mean": (check.get("gradient_check") or {}).get("equal"),
               "gradient_max_abs_diff": (check.get("gradient_check") or {}).get("max_abs_diff"),
               **({"samples_per_s": None} if samples is None else with_spread("samples_per_s", samples)),
               "total_vs_none": None if setting == BASELINE else _ratio(totals[setting], totals.get(BASELINE)),
               "optimizer_state_vs_none": None if setting == BASELINE else _ratio(
                   entry["parts"]["optimizer_state"], counted.get(BASELINE, {}).get("parts", {}).get("optimizer_state")),
               **_paired("samples_per_s_vs_none", None if setting == BASELINE else seconds[setting],
                         seconds.get(BASELINE)),
               **_peer_ratios(totals[setting] if gradsync_row else None, seconds[setting] if gradsync_row else None,
                              totals, seconds)}
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
    if goal.field.startswith("samples") and row.get("samples_per_s") is None:
        return "not timed (--no-throughput)"
    for suffix, peer in PEERS.items():
        if goal.field.endswith(suffix):
            return f"{peer.impl} not measured: not in --impls, or it differed from shard=none, so it was not timed"
    return "shard=none not timed"


def _mib(field: str):
    return lambda row: fmt_optional(None if row.get(field) is None else row[field] / 2**20, ".1f")


def _check(row: dict) -> str:
    """The equality check before timing: ok, differs (with the largest parameter difference), grads differ
    (FSDP2's float32 gradient check failed, with its largest difference), or - (baseline)."""
    if row.get("equal_to_none") is None:
        return "-"
    if row["equal_to_none"]:
        return "ok"
    if row.get("gradient_equal_to_mean") is False:
        return f"grads differ {row.get('gradient_max_abs_diff', float('nan')):.1e}"
    return f"differs {row.get('max_abs_diff', float('nan')):.1e}"


def format_table(rows: list[dict]) -> str:
    """The rows as text (bytes in MiB per rank, the rank with the largest peak), then the goals' verdicts."""
    columns = [("model", 5, "{model}"), ("ws", 2, "{world_size}"), ("impl", 11, "{impl}"),
               ("shard", 9, "{shard}"), ("param MiB", 9, _mib("parameter_bytes")),
               ("grad MiB", 8, _mib("gradient_bytes")), ("optim MiB", 9, _mib("optimizer_state_bytes")),
               ("buffer MiB", 10, _mib("buffer_bytes")), ("total MiB", 9, _mib("total_bytes")),
               ("peak at", 8, "{peak_at}"), ("x none", 6, spread_cell("total_vs_none", ".2f")),
               ("x zero", 6, spread_cell("total_vs_torch_zero", ".2f")),
               ("x fsdp2", 7, spread_cell("total_vs_torch_fsdp2", ".2f")),
               ("RSS MiB", 8, lambda row: f"{row['peak_rss_mib']:.0f}"),
               ("samples/s", 19, spread_cell("samples_per_s", ".1f")),
               ("samples/s x none", 19, spread_cell("samples_per_s_vs_none", ".2f")),
               ("samples/s x zero", 19, spread_cell("samples_per_s_vs_torch_zero", ".2f")),
               ("samples/s x fsdp2", 19, spread_cell("samples_per_s_vs_torch_fsdp2", ".2f")),
               ("check", 14, _check)]
    return "\n".join([format_rows(rows, columns)] + TABLE_NOTES + goal_lines(rows))


def tables(rows: list[dict]) -> list[str]:
    """The report's tables: one per optimizer (the goals are judged in the one with their optimizer)."""
    optimizers = list(dict.fromkeys(row["optimizer"] for row in rows))
    return [format_table([row for row in rows if row["optimizer"] == name]) for name in optimizers]
