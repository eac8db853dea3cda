"""What a replica check costs, against one training step of the same model.

``gradsync bench replicas``: for each world size and model (the benchmark
models of ``bench train``: the MNIST-1D CNN, ~5.2k parameters, and the
1024-4096-4096-1024-10 MLP, ~25.2M), one local world trains with
``DataParallel(algorithm="auto")`` and SGD with momentum (so there is
optimizer state to compare), then times, alternating in every one of
``--repeat`` repetitions, ``steps`` training steps, ``checks`` calls of
``check_replicas()`` (parameters only) and ``checks`` calls of
``check_replicas(optimizer)`` (parameters and momentum). Each time is the
slowest rank's, ranks lined up before and after; the check's cost as a share
of one step, and what checking every N = 100 steps adds to training
(check / (100 x step)), are formed within each repetition; the table shows
every figure's median and min-max. Goal (issue 18): one check at most 20% of
a step, met when the median is (a row whose range contains 20% says so).
"""

from __future__ import annotations

import time

import torch

import gradsync
from gradsync.bench.output import claim_json_path, format_rows, write_json
from gradsync.bench.spread import check_repeat, paired_ratios, scaled_cell, spread_cell, verdict, with_spread
from gradsync.bench.train import (BENCH_MODELS, BATCH_PER_RANK, LR, MODEL_SEED, _line_up, build_bench_model,
                                  make_batch, steps_for, train_steps)
from gradsync.train.setup import threads_per_worker

CHECK_EVERY = 100  # the table's "every N steps" column
GOAL_FRACTION = 0.20  # issue 18: one check at most this share of one training step


def _timed(action, repeat: int) -> float:
    """Seconds per ``action()`` over ``repeat`` calls, the slowest rank's."""
    _line_up()
    started = time.perf_counter()
    for _ in range(repeat):
        action()
    _line_up()
    mine = torch.tensor([(time.perf_counter() - started) / repeat], dtype=torch.float64)
    return float(torch.stack(gradsync.all_gather(mine)).max())


def bench_model(model_name: str, steps: int, checks: int, repeat: int) -> dict:
    """One row: seconds of a step, a parameter check and a parameter + optimizer check, per repetition."""
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
    for repetition in range(repeat):
        keys = list(actions)
        keys = keys[repetition % len(keys):] + keys[:repetition % len(keys)]
        for key in keys:
            times[key].append(_timed(*actions[key]))
    nbytes = sum(param.numel() * param.element_size() for param in model.parameters())
    return {"kind": "replica_check", "model": model_name, "world_size": gradsync.world_size(),
            "parameters": sum(param.numel() for param in model.parameters()), "parameter_bytes": nbytes,
            "batch_per_rank": BATCH_PER_RANK[model_name], **check_figures(times, nbytes),
            "threads_per_rank": torch.get_num_threads()}


def check_figures(times: dict[str, list[float]], nbytes: int) -> dict:
    """The row's figures from the seconds of ``step_s``, ``check_s`` and ``check_optimizer_s`` per repetition.

    Each time, each share of a step (the check over the step of the same repetition) and the checksum
    rate (``2 * nbytes`` parameter and momentum bytes per second of the optimizer check, GB/s) is the
    median over the repetitions with its min and max (:func:`gradsync.bench.spread.with_spread`).
    """
    step, check, check_optimizer = times["step_s"], times["check_s"], times["check_optimizer_s"]
    optimizer_share = paired_ratios(check_optimizer, step)
    return {**with_spread("step_s", step), **with_spread("check_s", check),
            **with_spread("check_optimizer_s", check_optimizer),
            **with_spread("check_fraction_of_step", paired_ratios(check, step)),
            **with_spread("check_optimizer_fraction_of_step", optimizer_share),
            **with_spread("overhead_every_100", optimizer_share, scale=1 / CHECK_EVERY),
            **with_spread("checksum_gb_per_s", [2 * nbytes / seconds / 1e9 for seconds in check_optimizer]),
            "repeat": len(step)}


def run_worker(models: list[str], steps: int, checks: int, repeat: int) -> list[dict] | None:
    """Entry point of one benchmark process; rank 0 returns the rows."""
    gradsync.init()
    try:
        torch.set_num_threads(threads_per_worker(gradsync.world_size()))
        rows = [bench_model(model, steps_for(model, steps), checks, repeat) for model in models]
        return rows if gradsync.rank() == 0 else None
    finally:
        gradsync.shutdown()


def format_table(rows: list[dict]) -> str:
    """The rows as aligned text: every figure's median (min-max), and the goal's verdict for both checks."""
    goal = f"<={100 * GOAL_FRACTION:.0f}%"
    return format_rows(rows, [
        ("model", 5, "{model}"), ("world_size", 10, "{world_size}"), ("parameters", 10, "{parameters}"),
        ("step_ms", 22, scaled_cell("step_s", 1e3, ".1f")), ("check_ms", 22, scaled_cell("check_s", 1e3, ".2f")),
        ("+optimizer_ms", 22, scaled_cell("check_optimizer_s", 1e3, ".2f")),
        ("check/step", 17, scaled_cell("check_fraction_of_step", 100, ".1f", "%")),
        (f"check {goal}", 18, lambda row: verdict(row, "check_fraction_of_step", GOAL_FRACTION)),
        ("+opt/step", 17, scaled_cell("check_optimizer_fraction_of_step", 100, ".1f", "%")),
        (f"+opt {goal}", 18, lambda row: verdict(row, "check_optimizer_fraction_of_step", GOAL_FRACTION)),
        ("every_100", 17, scaled_cell("overhead_every_100", 100, ".2f", "%")),
        ("GB/s", 17, spread_cell("checksum_gb_per_s", ".2f"))])


def run_bench(*, nproc: str, models: str, steps: int, checks: int, repeat: int,
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
    for flag, value in (("--steps", steps), ("--checks", checks)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    check_repeat(repeat)
    claim_json_path(json_path)
    print(f"# gradsync bench replicas: DataParallel(auto) + SGD momentum; per repetition {steps} cnn steps "
          f"(mlp {steps_for('mlp', steps)}), {checks} checks of each kind, alternating; median (min-max) of "
          f"{repeat} repetitions; every_100 = a parameter + optimizer check every {CHECK_EVERY} steps; goal: one "
          f"check <= {100 * GOAL_FRACTION:.0f}% of a step", flush=True)
    rows: list[dict] = []
    for world_size in world_sizes:
        rows += launch_local(world_size, run_worker, model_names, steps, checks, repeat)[0]
    print(format_table(rows), flush=True)
    if json_path:
        write_json(json_path, rows)
    return rows
