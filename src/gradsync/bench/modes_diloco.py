"""``bench modes``' DiLoCo rows, torchft's DiLoCo peer row, the bytes column and the DiLoCo goals.

``--diloco H[:COMPRESSION[:F]],...`` adds one gradsync DiLoCo row per item
(``--mode local-sgd --outer-optimizer nesterov`` with ``--outer-lr``,
``--outer-momentum``, ``--outer-compression`` and ``--outer-fragments F``);
``--torchft-diloco`` adds torchft's ``DiLoCo`` (:mod:`~gradsync.bench.torchft_diloco`)
at every H of an fp32 one-fragment DiLoCo row, with the same outer optimizer.

Bytes sent per rank over the run, one definition for every row: the
payloads a worker hands to communication for the model's synchronisation,
each AllReduce of n bytes counted as 2(p-1)/p·n (what a ring, Gloo's
ring and gradsync's two-phase exchange send per rank, p workers), whatever
algorithm ran (shared memory sends nothing over a wire, which would make
the rows incomparable). Payloads: sync, the gradient buckets of every step;
local SGD and DiLoCo, every average or fragment round as sent (encoded:
int8 one byte per value plus a float32 scale per chunk; gradsync's
``sync_payload_nbytes``); torchft, the tensors its replicas hand to
``Manager.allreduce``; async, each push of a gradient (n, to the server).
Loss, evaluation and start-up traffic is left out of every row.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from gradsync.bench.spread import fmt_spread, paired_ratios, scaled_cell, verdict, with_spread
from gradsync.parallel.outer_optimizer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM
from gradsync.parallel.outer_sync import OUTER_COMPRESSIONS
from gradsync.train.config import TrainConfig

TORCHFT = "torchft-diloco"  # the torchft row's "mode"
GOAL_PP_VS_SYNC, GOAL_BYTES_FEWER, GOAL_INT8_PP, GOAL_VS_TORCHFT = -1.0, 50.0, -0.5, 1.0
GOAL_SYNC_EVERY = 64  # the H for the accuracy and bytes goal against sync


def parse_diloco(specs: str, outer_lr: float = DILOCO_OUTER_LR, outer_momentum: float = DILOCO_OUTER_MOMENTUM,
                 torchft: bool = False) -> list[dict]:
    """The DiLoCo rows' settings of ``--diloco`` (``H[:COMPRESSION[:F]]``, comma-separated), then with
    ``torchft`` one torchft row per H of an fp32 one-fragment item. ValueError naming the option."""
    settings = []
    outer = {"outer_optimizer": "nesterov", "outer_lr": outer_lr, "outer_momentum": outer_momentum}
    items = [item.strip() for item in specs.split(",") if item.strip()]
    for item in items:
        parts = item.split(":")
        if len(parts) > 3:
            raise ValueError(f"--diloco: {item!r} is not H[:COMPRESSION[:F]]")
        every, compression, fragments = parts[0], parts[1] if len(parts) > 1 else "fp32", \
            parts[2] if len(parts) > 2 else "1"
        if not every.isdigit() or int(every) < 1 or not fragments.isdigit() or int(fragments) < 1:
            raise ValueError(f"--diloco: {item!r}: H and F must be integers >= 1")
        if compression not in OUTER_COMPRESSIONS:
            raise ValueError(f"--diloco: {item!r}: compression must be one of {', '.join(OUTER_COMPRESSIONS)}")
        setting = {"mode": "local-sgd", "sync_every": int(every), **outer, "outer_compression": compression,
                   "outer_fragments": int(fragments)}
        if setting in settings:
            raise ValueError(f"--diloco repeats a row: {specs}")
        settings.append(setting)
    if torchft:
        peers = sorted({s["sync_every"] for s in settings if s["outer_compression"] == "fp32"
                        and s["outer_fragments"] == 1})
        if not peers:
            raise ValueError("--torchft-diloco needs an fp32 one-fragment row in --diloco (e.g. --diloco 64): "
                             "torchft's row runs at its H")
        settings += [{"mode": TORCHFT, "sync_every": every, **outer} for every in peers]
    return settings


def check_torchft() -> None:
    """ValueError (one line) when torchft is not installed."""
    import importlib
    import os

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust log level, read once when torchft is imported
    try:
        importlib.import_module("torchft")
    except ImportError:
        raise ValueError("--torchft-diloco needs torchft (pip install 'gradsync[torchft]')") from None


def is_diloco(setting: dict) -> bool:
    """Whether a setting (or a row) is a DiLoCo one: torchft's, or local SGD with an outer optimizer."""
    return setting["mode"] == TORCHFT or setting.get("outer_optimizer") not in (None, "none")


def label(setting: dict) -> str:
    """``diloco H=64``, ``diloco H=64 int8 F=4``, ``torchft diloco H=64``."""
    if setting["mode"] == TORCHFT:
        return f"torchft diloco H={setting['sync_every']}"
    text = f"diloco H={setting['sync_every']}"
    if setting["outer_compression"] != "fp32":
        text += f" {setting['outer_compression']}"
    return text + (f" F={setting['outer_fragments']}" if setting["outer_fragments"] != 1 else "")


def train_config(setting: dict, **options) -> TrainConfig:
    """The gradsync options a row trains with (torchft's: what it copies, as a local-sgd run's)."""
    fields = {**setting, "mode": "local-sgd"} if setting["mode"] == TORCHFT else setting
    if setting["mode"] == TORCHFT:
        fields = {**fields, "outer_optimizer": "nesterov"}
    return TrainConfig(**fields, **options)


def run_torchft(setting: dict, config_options: dict, out_dir: Path) -> dict:
    """One torchft run of ``setting``: :func:`~gradsync.bench.modes.run_setting`'s figures and its bytes."""
    from gradsync.bench.torchft_diloco import run_torchft_diloco

    config = train_config(setting, **config_options)
    figures = run_torchft_diloco(config, out_dir)
    factor = 2 * (config.nproc - 1) / config.nproc
    return {**figures, "bytes_per_rank": figures["allreduce_payload_nbytes"] * factor}


def bytes_per_rank(summary: dict) -> float:
    """Bytes a worker sent for the model's synchronisation over the run (the module's definition)."""
    workers = summary["num_workers"]
    factor = 2 * (workers - 1) / workers
    if summary["mode"] == "async":
        pushes = statistics.mean(summary["gradients_pushed_per_worker"])
        return pushes * sum(entry["bucket_nbytes"] for entry in summary["algorithms"])
    if summary["mode"] == "local-sgd":
        return summary["local_sgd"]["sync_payload_nbytes"] * factor
    return summary["steps"] * sum(entry["bucket_nbytes"] for entry in summary["algorithms"]) * factor


def row_fields(setting: dict, runs: list[dict], sync_runs: list[dict]) -> dict:
    """A row's bytes (median, min-max; sync's bytes over the row's, paired by repetition), its outer
    optimizer and compression, and per repetition its accuracy, samples/s and bytes (for the goals)."""
    sent = [run.get("bytes_per_rank") for run in runs]
    sync_sent = [run.get("bytes_per_rank") for run in sync_runs]
    measured = None not in sent
    fewer = paired_ratios(sync_sent, sent) if measured and None not in sync_sent and all(sent) else []
    averaging = setting["mode"] in ("local-sgd", TORCHFT)
    return {**(with_spread("bytes_per_rank", sent) if measured else {"bytes_per_rank": None}),
            **(with_spread("bytes_fewer_than_sync", fewer) if fewer else {"bytes_fewer_than_sync": None}),
            "outer_optimizer": setting.get("outer_optimizer", "none") if averaging else None,
            "outer_compression": setting.get("outer_compression", "fp32") if averaging else None,
            "outer_lr": setting.get("outer_lr"), "outer_momentum": setting.get("outer_momentum"),
            "outer_fragments": setting.get("outer_fragments", 1) if setting["mode"] != "async" else None,
            "test_accuracy_runs": [run["test_accuracy"] for run in runs],
            "samples_per_s_runs": [run["samples_per_s"] for run in runs], "bytes_per_rank_runs": sent}


def columns() -> list[tuple]:
    """The table's bytes and outer columns (:func:`~gradsync.bench.output.format_rows` cells)."""
    return [("MB/rank", 22, scaled_cell("bytes_per_rank", 1e-6, ".3f")),
            ("bytes ÷ sync", 16, lambda row: fmt_spread(row, "bytes_fewer_than_sync", ".0f", "x")),
            ("outer", 8, lambda row: row.get("outer_optimizer") or "-"),
            ("delta", 5, lambda row: row.get("outer_compression") or "-")]


def goal_lines(rows: list[dict]) -> list[str]:
    """The DiLoCo goals at world size p, judged on the medians of paired repetitions (one line each)."""
    plain = [row for row in rows if row["straggler"] == 1]
    sync = next((row for row in plain if row["mode"] == "sync"), None)
    diloco = [row for row in plain if row["mode"] == "local-sgd" and row.get("outer_optimizer") == "nesterov"]
    if sync is None or not diloco:
        return []
    lines = []
    for row in [r for r in diloco if r["sync_every"] == GOAL_SYNC_EVERY]:  # other H: reported, not judged
        gap = _paired("pp", row["test_accuracy_runs"], sync["test_accuracy_runs"], difference=True)
        lines.append(f"{row['label']}: accuracy vs sync {fmt_spread(gap, 'pp', '+.2f', ' pp')} (goal >= "
                     f"{GOAL_PP_VS_SYNC:g} pp: {verdict(gap, 'pp', GOAL_PP_VS_SYNC, at_most=False)}); bytes "
                     f"{fmt_spread(row, 'bytes_fewer_than_sync', '.0f', 'x')} fewer (goal >= {GOAL_BYTES_FEWER:g}x: "
                     f"{verdict(row, 'bytes_fewer_than_sync', GOAL_BYTES_FEWER, at_most=False)})")
    for row in [r for r in diloco if r["outer_compression"] == "int8"]:
        fp32 = _twin(diloco, row, outer_compression="fp32")
        if fp32 is not None:
            gap = _paired("pp", row["test_accuracy_runs"], fp32["test_accuracy_runs"], difference=True)
            lines.append(f"{row['label']} vs {fp32['label']}: accuracy {fmt_spread(gap, 'pp', '+.2f', ' pp')} "
                         f"(goal >= {GOAL_INT8_PP:g} pp: {verdict(gap, 'pp', GOAL_INT8_PP, at_most=False)})")
    for peer in [row for row in plain if row["mode"] == TORCHFT]:
        ours = _twin(diloco, {**peer, "outer_fragments": 1}, outer_compression="fp32")
        if ours is None:
            continue
        gap = _paired("pp", ours["test_accuracy_runs"], peer["test_accuracy_runs"], difference=True)
        speed = _paired("x", ours["samples_per_s_runs"], peer["samples_per_s_runs"])
        nbytes = ours["bytes_per_rank"] / peer["bytes_per_rank"] if peer["bytes_per_rank"] else None
        lines.append(f"{ours['label']} vs {peer['label']} (bytes {nbytes:.2f}x theirs): accuracy "
                     f"{fmt_spread(gap, 'pp', '+.2f', ' pp')} (goal >= 0: {verdict(gap, 'pp', 0.0, at_most=False)}); "
                     f"samples/s {fmt_spread(speed, 'x', '.2f', 'x')} (goal >= {GOAL_VS_TORCHFT:g}x: "
                     f"{verdict(speed, 'x', GOAL_VS_TORCHFT, at_most=False)})")
    for row in [r for r in rows if r["straggler"] > 1 and is_diloco(r)]:
        lines.append(f"{row['label']} with a {row['straggler']:g}x straggler: samples/s "
                     f"{fmt_spread(row, 'samples_per_s_vs_sync', '.2f', 'x')} sync's")
    return lines


def _paired(name: str, ours: list[float], theirs: list[float], difference: bool = False) -> dict:
    """``name``'s spread over the repetitions of ours - theirs (in pp, ``difference``) or ours / theirs."""
    if difference:
        return with_spread(name, [100 * (a - b) for a, b in zip(ours, theirs)])
    return with_spread(name, paired_ratios(ours, theirs))


def _twin(rows: list[dict], like: dict, **changes) -> dict | None:
    """The row with ``like``'s H and fragments and ``changes`` (e.g. the fp32 twin of an int8 row)."""
    want = {"sync_every": like["sync_every"], "outer_fragments": like.get("outer_fragments", 1), **changes}
    return next((row for row in rows if all(row.get(key) == value for key, value in want.items())), None)
