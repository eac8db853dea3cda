"""What a replica check costs, against one training step of the same model.

``gradsync bench replicas``: for each world size and model (the benchmark
models of ``bench train``: the MNIST-1D CNN, ~5.2k parameters, and the
1024-4096-4096-1024-10 MLP, ~25.2M), one local world trains with
``DataParallel(algorithm="auto")`` and SGD with momentum (so there is
optimizer state to compare), then times, alternating in every round,
``steps`` training steps, ``checks`` calls of ``check_replicas()``
(parameters only) and ``checks`` calls of ``check_replicas(optimizer)``
(parameters and momentum). Each time is the slowest rank's, ranks lined up
before and after; the table shows medians over rounds, the check's cost as
a share of one step, and what checking every N = 100 steps adds to training
(check / (100 x step)). Goal (issue 18): one check at most 20% of a step.
"""

from __future__ import annotations

import statistics
import time

import torch

import gradsync
from gradsync.bench.output import claim_json_path, format_rows, write_json
from gradsync.bench.train import (BENCH_MODELS, BATCH_PER_RANK, LR, MODEL_SEED, _line_up, build_bench_model,
                                  make_batch, steps_for, train_steps)
from gradsync.train.setup import threads_per_worker

CHECK_EVERY = 100  # the table's "every N steps" column


def _timed(action, repeat: int) -> float:
    """Seconds per ``action()`` over ``repeat`` calls, the slowest rank's."""
    _line_up()
    started = time.perf_counter()
    for _ in range(repeat):
        action()
    _line_up()
    mine = torch.tensor([(time.perf_counter() - started) / repeat], dtype=torch.float64)
    return float(torch.stack(gradsync.all_gather(mine)).max())


def bench_model(model_name: str, steps: int, checks: int, rounds: int) -> dict:
    """One row: median seconds of a step, a parameter check and a parameter + optimizer check."""
    torch.manual_seed(MODEL_SEED)
    model = gradsync.DataParallel(build_bench_model(model_name), algorithm="auto")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    inputs, labels = make_batch(model_name, gradsync.rank())
    train_steps(model, optimizer, inputs, labels, 3)  # warm-up: buckets rebuilt, momentum exists
    model.check_replicas(optimizer)
    actions = {"step_s": (lambda: train_steps(model, optimizer, inputs, labels, 1), steps),
               "check_s": (model.check_replicas, checks),
               "check_optimizer_s": (lambda: model.check_replicas(optimizer), checks)}
    times: dict[str, list[float]] = {key: [] for key in actions}
    for round_index in range(rounds):
        keys = list(actions)
        keys = keys[round_index % len(keys):] + keys[:round_index % len(keys)]
        for key in keys:
            times[key].append(_timed(*actions[key]))
    row = {key: statistics.median(values) for key, values in times.items()}
    nbytes = sum(param.numel() * param.element_size() for param in model.parameters())
    return {"kind": "replica_check", "model": model_name, "world_size": gradsync.world_size(),
            "parameters": sum(param.numel() for param in model.parameters()), "parameter_bytes": nbytes,
            "batch_per_rank": BATCH_PER_RANK[model_name], **row,
            "check_fraction_of_step": row["check_s"] / row["step_s"],
            "check_optimizer_fraction_of_step": row["check_optimizer_s"] / row["step_s"],
            "overhead_every_100": row["check_optimizer_s"] / (CHECK_EVERY * row["step_s"]),
            "checksum_gb_per_s": 2 * nbytes / row["check_optimizer_s"] / 1e9,
            "rounds": rounds, "threads_per_rank": torch.get_num_threads()}


def run_worker(models: list[str], steps: int, checks: int, rounds: int) -> list[dict] | None:
    """Entry point of one benchmark process; rank 0 returns the rows."""
    gradsync.init()
    try:
        torch.set_num_threads(threads_per_worker(gradsync.world_size()))
        rows = [bench_model(model, steps_for(model, steps), checks, rounds) for model in models]
        return rows if gradsync.rank() == 0 else None
    finally:
        gradsync.shutdown()


def format_table(rows: list[dict]) -> str:
    return format_rows(rows, [
        ("model", 6, "{model}"), ("world_size", 10, "{world_size}"), ("parameters", 11, "{parameters}"),
        ("step_ms", 9, lambda r: f"{1e3 * r['step_s']:.2f}"), ("check_ms", 9, lambda r: f"{1e3 * r['check_s']:.3f}"),
        ("+optimizer_ms", 13, lambda r: f"{1e3 * r['check_optimizer_s']:.3f}"),
        ("check/step", 10, lambda r: f"{100 * r['check_fraction_of_step']:.1f}%"),
        ("+opt/step", 9, lambda r: f"{100 * r['check_optimizer_fraction_of_step']:.1f}%"),
        ("every_100", 9, lambda r: f"{100 * r['overhead_every_100']:.2f}%"), ("GB/s", 6, "{checksum_gb_per_s:.2f}")])


def run_bench(*, nproc: str, models: str, steps: int, checks: int, rounds: int,
              json_path: str | None) -> list[dict]:
    """Validate the options, run one local world per world size, print the table, write JSON."""
    from gradsync.launch import launch_local

    try:
        world_sizes = [int(part) for part in nproc.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--nproc must list world sizes (integers >= 2), got {nproc!r}") from None
    model_names = list(dict.fromkeys(part.strip() for part in models.split(",") if part.strip()))
    if not world_sizes or any(size < 2 for size in world_sizes):
        raise ValueError(f"--nproc must list world sizes >= 2 (a check compares ranks), got {nproc!r}")
    unknown = [name for name in model_names if name not in BENCH_MODELS]
    if unknown or not model_names:
        raise ValueError(f"unknown --model {','.join(unknown) or models!r}; choose from {', '.join(BENCH_MODELS)}")
    for flag, value in (("--steps", steps), ("--checks", checks), ("--rounds", rounds)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    claim_json_path(json_path)
    print(f"# gradsync bench replicas: DataParallel(auto) + SGD momentum; per round {steps} cnn steps "
          f"(mlp {steps_for('mlp', steps)}), {checks} checks of each kind; median of {rounds} alternating rounds; "
          f"every_100 = a parameter + optimizer check every {CHECK_EVERY} steps", flush=True)
    rows: list[dict] = []
    for world_size in world_sizes:
        rows += launch_local(world_size, run_worker, model_names, steps, checks, rounds)[0]
    print(format_table(rows), flush=True)
    if json_path:
        write_json(json_path, rows)
    return rows
