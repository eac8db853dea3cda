"""``gradsync simulate train --validate``: predicted against measured training steps here.

For each world size and benchmark model (:mod:`gradsync.bench.train`'s CNN
and 25.2M-parameter MLP, its batches): the compute is timed on one
process here (:func:`gradsync.sim.measure.measure_compute`, the thread
count a rank of that world gets, times ranks x threads / cores when they
outnumber the cores), never fitted to the run below; the step is predicted
on the ``this-machine`` profile (or ``--profile``) with DataParallel's real
buckets (``bucket_cap_mb`` 25, as the benchmark) and each bucket's
AllReduce simulated with the real algorithm code; then ``gradsync bench
train`` runs in this same command and the median step times are compared.
Rows: ``model``, ``world_size``, ``algorithm``, ``predicted_ms``,
``measured_ms``, ``error`` (predicted / measured - 1), the predicted and
measured exposed communication and compute-only step; ``predicted_local_ms``
and ``error_local``: the same prediction with the compute scaled to the
benchmark's compute-only step of that world (its "local" rows, measured in
the same run between the DataParallel rows, so under the same load of a
shared machine), never to the DataParallel rows themselves.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from gradsync.bench.output import format_rows, write_json
from gradsync.bench.simulate_train import parse_list
from gradsync.bench.spread import check_repeat
from gradsync.bench.train import BENCH_MODELS, DDP_BUCKET_CAP_MB, MODEL_SEED, build_bench_model, make_batch, run_bench
from gradsync.sim import get_profile
from gradsync.sim.compute import scaled
from gradsync.sim.measure import measure_compute
from gradsync.sim.training import predict_step, topology_for
from gradsync.train.setup import threads_per_worker

VALIDATED = ("ring", "tree", "halving_doubling", "shm")


def predicted_rows(profile, world_sizes: list[int], algorithms: list[str], steps: int) -> tuple[list[dict], dict]:
    """Predicted step per model, world size and algorithm, compute timed here first; and the
    :class:`StepCompute` per (model, world size)."""
    cores = profile.cores_per_host or len(os.sched_getaffinity(0))
    rows, computes = [], {}
    for model in BENCH_MODELS:
        torch.manual_seed(MODEL_SEED)
        module = build_bench_model(model)
        inputs, labels = make_batch(model, 0)
        for world_size in world_sizes:
            threads = threads_per_worker(world_size)
            measured = measure_compute(module, inputs, labels, threads=threads, steps=steps)
            compute = computes[(model, world_size)] = scaled(measured, max(1.0, world_size * threads / cores))
            for algorithm in algorithms:
                row = predict_step(compute, profile, topology_for(world_size, world_size), algorithm,
                                   DDP_BUCKET_CAP_MB)
                rows.append({"model": model, "world_size": world_size, "algorithm": algorithm,
                             "predicted_ms": row["step_ms"], "predicted_exposed_ms": row["exposed_comm_ms"],
                             "predicted_comm_ms": row["comm_ms"], "predicted_compute_ms": compute.compute_s * 1e3,
                             "buckets": row["buckets"]})
    return rows, computes


def with_bench_compute(rows: list[dict], computes: dict, profile) -> None:
    """Add ``predicted_local_ms``: the same prediction with the compute scaled to the bench's own
    compute-only ("local") step of that world, measured in the same run, interleaved with the
    DataParallel rows (the same machine load); the per-parameter shape stays the one-process timing's."""
    for row in rows:
        compute = computes[(row["model"], row["world_size"])]
        local = scaled(compute, row["measured_local_ms"] / 1e3 / compute.compute_s)
        step = predict_step(local, profile, topology_for(row["world_size"], row["world_size"]), row["algorithm"],
                            DDP_BUCKET_CAP_MB)
        row["predicted_local_ms"] = step["step_ms"]
        row["error_local"] = step["step_ms"] / row["measured_ms"] - 1


def compare(predicted: list[dict], measured: list[dict]) -> list[dict]:
    """Join predicted rows with ``bench train`` throughput rows (gradsync impl) on model, ws, algorithm."""
    by_key = {(r["model"], r["world_size"], r["algorithm"]): r for r in measured
              if r.get("kind") == "throughput" and r["impl"] == "gradsync"}
    rows = []
    for row in predicted:
        bench = by_key.get((row["model"], row["world_size"], row["algorithm"]))
        if bench is None:
            continue
        measured_ms = bench["step_s"] * 1e3
        exposed = bench["exposed_comm_s_per_step"]
        rows.append({**row, "measured_ms": measured_ms, "error": row["predicted_ms"] / measured_ms - 1,
                     "measured_exposed_ms": None if exposed is None else exposed * 1e3,
                     "measured_comm_ms": None if bench["comm_s_per_step"] is None else bench["comm_s_per_step"] * 1e3,
                     "measured_local_ms": bench["compute_only_step_s"] * 1e3})
    return rows


def format_comparison(rows: list[dict]) -> str:
    lines = [format_rows(rows, [
        ("model", 5, "{model}"), ("ws", 3, "{world_size}"), ("algorithm", 16, "{algorithm}"),
        ("buckets", 7, "{buckets}"),
        ("pred_ms", 9, "{predicted_ms:.2f}"), ("meas_ms", 9, "{measured_ms:.2f}"),
        ("error", 7, lambda r: f"{100 * r['error']:.1f}%"), ("pred_local", 10, "{predicted_local_ms:.2f}"),
        ("error", 7, lambda r: f"{100 * r['error_local']:.1f}%"), ("pred_exposed", 12, "{predicted_exposed_ms:.2f}"),
        ("meas_exposed", 12, "{measured_exposed_ms:.2f}"), ("pred_comm", 9, "{predicted_comm_ms:.2f}"),
        ("meas_comm", 9, "{measured_comm_ms:.2f}"), ("pred_compute", 12, "{predicted_compute_ms:.2f}"),
        ("meas_local", 10, "{measured_local_ms:.2f}")])]
    for key, what in (("error", "compute timed on one process"), ("error_local", "compute = bench's local step")):
        errors = [abs(r[key]) for r in rows]
        if errors:
            lines.append(f"# {what}: median |error| {100 * statistics.median(errors):.1f}% (goal <= 10%), worst "
                         f"{100 * max(errors):.1f}% over {len(rows)} rows")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``gradsync simulate train --validate``."""
    profile = get_profile(args.profile or "this-machine")
    world_sizes = parse_list(args.nproc, int, "--nproc")
    algorithms = parse_list(args.algorithms, str, "--algorithms") if args.algorithms else list(VALIDATED)
    if min(world_sizes) < 2:
        raise ValueError(f"--nproc: validation needs world sizes >= 2, got {args.nproc!r}")
    check_repeat(args.repeat)
    print(f"# gradsync simulate train --validate: profile {profile.name} ({profile.description}); compute "
          f"timed on one process here, then gradsync bench train in the same run", flush=True)
    predicted, computes = predicted_rows(profile, world_sizes, algorithms, steps=max(5, args.steps // 3))
    measured = run_bench(nproc=",".join(map(str, world_sizes)), models=",".join(BENCH_MODELS),
                         algorithms=",".join(algorithms), steps=args.steps, warmup=3, repeat=args.repeat,
                         json_path=None, memory=False)
    rows = compare(predicted, measured)
    with_bench_compute(rows, computes, profile)
    print("\n# predicted (simulate train) against measured (bench train) step time, ms")
    print(format_comparison(rows))
    if args.json:
        write_json(args.json, rows)
    return 0
