"""The torchft rows of ``gradsync bench faults --elastic`` from its runs: the fault-free reference and the chaos row."""

from __future__ import annotations

import statistics

import torch

from gradsync.bench import elastic_table
from gradsync.bench.elastic_metrics import paired_kept, pooled, reference_fields
from gradsync.bench.spread import with_spread

SAMPLES_REASON = ("counted per sample id: ids of a committed global batch that no replica in the commit trained "
                  "(lost) or that two trained (duplicated)")


def build_rows(chaos_runs: list[dict], baselines: list[dict], *, nproc: int, duration_s: float, kill_every_s: float,
               settings: dict) -> list[dict]:
    """The fault-free reference row (of ``baselines``, when any) and the chaos row (of ``chaos_runs``, when
    any); a run is :meth:`~gradsync.bench.torchft_peer.TorchftPeer.run`'s dict. Failures are pooled over
    the chaos runs; ``throughput_kept`` is paired by repetition when there is a baseline for every run."""
    common = {"system": "torchft", "elastic": True, "nproc": nproc, "duration_s": duration_s,
              "kill_every_s": kill_every_s, "settings": settings}
    rows = []
    if baselines:
        rows.append({**common, **_totals(baselines), **reference_fields(), "fault": "chaos-none", "reference": True,
                     "steps_redone": None, **with_spread("samples_per_s", [r["samples_per_s"] for r in baselines])})
    if chaos_runs:
        failures = [dict(f, repetition=run["repetition"]) for run in chaos_runs for f in run["per_failure"]]
        speeds = [r["samples_per_s"] for r in chaos_runs]
        kept = (paired_kept(speeds, [r["samples_per_s"] for r in baselines]) if len(baselines) == len(chaos_runs)
                else {**with_spread("samples_per_s", speeds), "throughput_kept": None})
        rows.append({**common, **_totals(chaos_runs), **pooled(failures), **kept, "fault": "chaos",
                     "reference": False,
                     "bitwise_equal_to_fault_free": None,  # torchft has no deterministic mode: nothing to compare
                     "replicas_equal_every_step": all(r["steps_replicas_unequal"] == 0 for r in chaos_runs),
                     "steps_replicas_compared": sum(r["steps_replicas_compared"] for r in chaos_runs),
                     "failures_detail": failures, "kills": [r["kills"] for r in chaos_runs],
                     "relaunches": sum(r["relaunches"] for r in chaos_runs), "samples_reason": SAMPLES_REASON})
    return rows


def _totals(runs: list[dict]) -> dict:
    """What a row sums, or takes the median of, over its runs (one per repetition)."""
    return {"runs": len(runs), "replicas_equal": all(r["replicas_equal"] for r in runs),
            "samples_lost": sum(r["samples_lost"] for r in runs),
            "samples_duplicated": sum(r["samples_duplicated"] for r in runs),
            "final_test_accuracy": statistics.median(r["final_test_accuracy"] for r in runs),
            "final_steps": [r["final_step"] for r in runs], "committed_steps": [r["committed_steps"] for r in runs],
            "attempts_uncommitted": [r["attempts_uncommitted"] for r in runs],
            "load_average": [r["load_average"] for r in runs], "run_folders": [r["run_folder"] for r in runs]}


def settings(lighthouse: dict, heartbeat_ms: int, split: str, launcher: str, manager: dict) -> dict:
    """The rows' ``settings``: the Lighthouse's and the Managers' options, the split, launcher and versions."""
    manager = {**manager, "heartbeat_ms": heartbeat_ms, "min_replica_size": 1, "use_async_quorum": split == "fixed",
               "world_size_mode": "DYNAMIC", "checkpoint_transport": "PGTransport", "init_sync": True}
    return {"lighthouse": lighthouse, "manager": manager, "split": split, "launcher": launcher,
            "torchft": _version("torchft"), "torch": torch.__version__}


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def format_table(rows: list[dict]) -> str:
    """Every failure of the chaos row, one line each, then the bench's tables
    (:func:`gradsync.bench.elastic_table.format_table`)."""
    def fmt(value, spec=".3f"):
        return "-" if value is None else format(value, spec)

    chaos = next((row for row in rows if not row["reference"]), {"failures_detail": []})
    lines = [f"{'rep':>3} {'victim':>6} {'detect s':>8} {'recover s':>9} {'redone':>6} {'joiner s':>8} "
             f"{'stall s':>7} {'samples lost':>12}"]
    for f in chaos["failures_detail"]:
        lines.append(f"{f['repetition']:>3} {f['victim']:>6} {fmt(f['detect_s']):>8} {fmt(f['recover_s']):>9} "
                     f"{fmt(f['steps_redone'], 'd'):>6} {fmt(f['joiner_s']):>8} {fmt(f['rejoin_stall_s']):>7} "
                     f"{f['samples_lost']:>12}")
    return "\n".join(lines + ["", elastic_table.format_table(rows)])
