"""The cost of ``--deterministic``: DeterministicDataParallel next to DataParallel on the same global batch.

For each world size one local world trains each model with DataParallel
("normal": rank r takes its ``B / world_size`` share of the global batch, one
forward and backward) and with DeterministicDataParallel for each ``M``
("deterministic M=12": rank r runs its micro-shards of the same global batch,
one forward and backward each, then the exact int64 sum), from the same
initial weights, with the same SGD, AllReduce algorithm and one torch thread
per rank (what ``--deterministic`` uses). The settings alternate inside every
one of ``--repeat`` repetitions; a repetition's time is the slowest rank's,
samples/s = steps · B / time, and ``ratio_to_normal`` is formed within each
repetition; every figure is the median with its min and max
(:mod:`gradsync.bench.spread`). Inputs and labels are a fixed seeded random
global batch. Peak memory: one fresh world per setting runs a few steps and
reports ``ru_maxrss`` (max over ranks) and the resident MiB after them.
"""

from __future__ import annotations

import copy
import gc
import resource
import time

import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.bench.output import claim_json_path, fmt_optional, format_rows, write_json
from gradsync.bench.spread import check_repeat, paired_ratios, scaled_cell, spread_cell, with_spread
from gradsync.bench.train import (BENCH_MODELS, CNN_INPUT_NUMEL, MLP_WIDTHS, NUM_CLASSES, build_bench_model,
                                  current_rss_mib, steps_for)
from gradsync.train.setup import DETERMINISTIC_THREADS

GLOBAL_BATCH = {"cnn": 256, "mlp": 128}  # samples per optimizer step over all ranks
NORMAL = 0                               # the mode key of DataParallel; M > 0 is DeterministicDataParallel(M)
LR = 0.01
DATA_SEED, MODEL_SEED = 1234, 0
MEMORY_STEPS = 3


def mode_name(micro_shards: int) -> str:
    return "normal" if micro_shards == NORMAL else f"deterministic M={micro_shards}"


def make_global_batch(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed global batch: inputs (B, features) float32 and labels (B,) int64, the same on every rank."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    features = CNN_INPUT_NUMEL if model == "cnn" else MLP_WIDTHS[0]
    inputs = torch.randn(GLOBAL_BATCH[model], features, generator=generator)
    return inputs, torch.randint(0, NUM_CLASSES, (GLOBAL_BATCH[model],), generator=generator)


def wrap(micro_shards: int, module: nn.Module, algorithm: str) -> nn.Module:
    if micro_shards == NORMAL:
        return gradsync.DataParallel(module, algorithm=algorithm)
    return gradsync.DeterministicDataParallel(module, micro_shards, algorithm=algorithm)


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, labels: torch.Tensor,
                steps: int) -> None:
    """``steps`` SGD steps on the global batch: this rank's share (normal) or its micro-shards (deterministic)."""
    share = torch.tensor_split(torch.arange(len(inputs)), gradsync.world_size())[gradsync.rank()]
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        if isinstance(model, gradsync.DeterministicDataParallel):
            bounds = model.shard_bounds(len(inputs))
            for index in model.local_shards():
                start, stop = bounds[index]
                with model.micro_shard(index) as shard:
                    shard.backward(F.cross_entropy(model(inputs[start:stop]), labels[start:stop], reduction="sum"))
            model.synchronize(len(inputs))
        else:
            F.cross_entropy(model(inputs[share]), labels[share]).backward()
        optimizer.step()


def measure(micro_shards: int, initial: nn.Module, inputs, labels, steps: int, warmup: int, algorithm: str) -> dict:
    """Seconds of ``steps`` steps (slowest rank) after ``warmup``, and communication seconds (mean over ranks).

    Collective: every rank calls it with the same arguments.
    """
    model = wrap(micro_shards, copy.deepcopy(initial), algorithm)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    train_steps(model, optimizer, inputs, labels, warmup)
    comm_before = model.comm_seconds
    gradsync.all_reduce(torch.zeros(1), algorithm="native")  # line the ranks up
    started = time.perf_counter()
    train_steps(model, optimizer, inputs, labels, steps)
    gradsync.all_reduce(torch.zeros(1), algorithm="native")
    mine = torch.tensor([time.perf_counter() - started, model.comm_seconds - comm_before], dtype=torch.float64)
    gathered = torch.stack(gradsync.all_gather(mine))  # (world_size, 2)
    del model, optimizer
    gc.collect()
    return {"elapsed_s": float(gathered[:, 0].max()), "comm_s": float(gathered[:, 1].mean())}


def throughput_worker(models: list[str], modes: list[int], steps: int, warmup: int, repeat: int,
                      algorithm: str) -> list[dict] | None:
    """Entry point of one throughput world; rank 0 returns one row per (model, mode)."""
    gradsync.init()
    try:
        torch.set_num_threads(DETERMINISTIC_THREADS)
        rows = []
        for model in models:
            torch.manual_seed(MODEL_SEED)
            initial, (inputs, labels) = build_bench_model(model), make_global_batch(model)
            timed = steps_for(model, steps)
            runs: dict[int, list[dict]] = {mode: [] for mode in modes}
            for repetition in range(repeat):
                shift = repetition % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    runs[mode].append(measure(mode, initial, inputs, labels, timed, warmup, algorithm))
            setting = {"model": model, "world_size": gradsync.world_size(), "algorithm": algorithm,
                       "threads_per_rank": torch.get_num_threads()}
            rows += throughput_rows(setting, runs, timed)
        return rows if gradsync.rank() == 0 else None
    finally:
        gradsync.shutdown()


def throughput_rows(setting: dict, runs: dict[int, list[dict]], steps: int) -> list[dict]:
    """One row per mode from its repetitions' measurements (``elapsed_s``, ``comm_s`` of ``steps`` steps).

    ``setting`` carries ``model``, ``world_size``, ``algorithm`` and ``threads_per_rank``. samples/s and
    comm seconds per step are the median over repetitions with their min and max; ``ratio_to_normal`` is
    the mode's samples/s over normal's in the same repetition, then summarised the same way.
    """
    samples = GLOBAL_BATCH[setting["model"]] * steps
    speeds = {mode: [samples / run["elapsed_s"] for run in found] for mode, found in runs.items()}
    return [{"kind": "throughput", **setting, "mode": mode_name(mode), "micro_shards": mode or None,
             "global_batch_size": GLOBAL_BATCH[setting["model"]], **with_spread("samples_per_s", speeds[mode]),
             **with_spread("ratio_to_normal", paired_ratios(speeds[mode], speeds[NORMAL])),
             **with_spread("comm_s_per_step", [run["comm_s"] / steps for run in found]), "steps": steps,
             "repeat": len(found)} for mode, found in runs.items()]


def memory_worker(model: str, micro_shards: int, algorithm: str) -> dict | None:
    """Entry point of one memory world: a few steps, then peak and current RSS; rank 0 returns the row."""
    gradsync.init()
    try:
        torch.set_num_threads(DETERMINISTIC_THREADS)
        torch.manual_seed(MODEL_SEED)
        wrapped = wrap(micro_shards, build_bench_model(model), algorithm)
        inputs, labels = make_global_batch(model)
        train_steps(wrapped, torch.optim.SGD(wrapped.parameters(), lr=LR), inputs, labels, MEMORY_STEPS)
        mine = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, current_rss_mib()],
                            dtype=torch.float64)  # ru_maxrss is KiB on Linux
        gathered = torch.stack(gradsync.all_gather(mine))  # (world_size, 2) MiB
        if gradsync.rank() != 0:
            return None
        return {"kind": "memory", "model": model, "world_size": gradsync.world_size(),
                "mode": mode_name(micro_shards), "micro_shards": micro_shards or None,
                "peak_rss_mib": float(gathered[:, 0].max()), "rss_after_mib": float(gathered[:, 1].max()),
                "steps": MEMORY_STEPS}
    finally:
        gradsync.shutdown()


def format_table(rows: list[dict]) -> str:
    """Throughput rows next to the memory rows of the same (model, world size, mode), as aligned text."""
    memory = {(r["model"], r["world_size"], r["mode"]): r for r in rows if r["kind"] == "memory"}
    throughput = [{**row, "memory": memory.get((row["model"], row["world_size"], row["mode"]), {})}
                  for row in rows if row["kind"] == "throughput"]
    return format_rows(throughput, [
        ("model", 5, "{model}"), ("world_size", 10, "{world_size}"), ("mode", 18, "{mode}"),
        ("samples/s", 19, spread_cell("samples_per_s", ".0f")),
        ("vs normal", 18, spread_cell("ratio_to_normal", ".2f", "x")),
        ("comm_ms/step", 23, scaled_cell("comm_s_per_step", 1e3, ".2f")),
        ("peak RSS [MiB/rank]", 19, lambda row: fmt_optional(row["memory"].get("peak_rss_mib"), ".0f")),
        ("RSS after [MiB/rank]", 20, lambda row: fmt_optional(row["memory"].get("rss_after_mib"), ".0f"))])


def _integers(text: str, option: str, low: int) -> list[int]:
    values = []
    for part in dict.fromkeys(item.strip() for item in text.split(",") if item.strip()):
        if not part.isdigit() or int(part) < low:
            raise ValueError(f"{option}: {part!r} is not an integer >= {low} (use a comma-separated list like 4,12)")
        values.append(int(part))
    if not values:
        raise ValueError(f"{option} needs at least one value")
    return values


def parse_options(nproc: str, models: str, micro_shards: str, algorithm: str, steps: int, warmup: int,
                  repeat: int) -> tuple[list[int], list[str], list[int]]:
    """Checked world sizes, models and micro-shard counts. Raises ValueError naming the bad option."""
    world_sizes = _integers(nproc, "--nproc", 1)
    names = list(dict.fromkeys(item.strip() for item in models.split(",")))
    for name in names:
        if name not in BENCH_MODELS:
            raise ValueError(f"unknown model {name!r} in --model; choose from {', '.join(BENCH_MODELS)}")
    counts = _integers(micro_shards, "--micro-shards", 1)
    for count in counts:
        for world_size in world_sizes:
            if count < world_size:
                raise ValueError(f"--micro-shards {count} is fewer than world size {world_size}")
        for name in names:
            if count > GLOBAL_BATCH[name]:
                raise ValueError(f"--micro-shards {count} is more than {name}'s global batch {GLOBAL_BATCH[name]}")
    if algorithm not in gradsync.ALGORITHMS:
        raise ValueError(f"unknown --algorithm {algorithm!r}; choose from {', '.join(gradsync.ALGORITHMS)}")
    for option, value, low in (("--steps", steps, 1), ("--warmup", warmup, 0)):
        if value < low:
            raise ValueError(f"{option} must be >= {low}, got {value}")
    check_repeat(repeat)
    return world_sizes, names, counts


def run_bench(*, nproc: str, models: str, micro_shards: str, algorithm: str, steps: int, warmup: int,
              repeat: int, json_path: str | None, memory: bool = True) -> list[dict]:
    """Validate, run a throughput world per world size and a memory world per setting, print, write JSON."""
    from gradsync.launch import launch_local

    world_sizes, names, counts = parse_options(nproc, models, micro_shards, algorithm, steps, warmup, repeat)
    claim_json_path(json_path)
    modes = [NORMAL] + counts
    print(f"# gradsync bench deterministic: global batch {', '.join(f'{m} {GLOBAL_BATCH[m]}' for m in names)}; "
          f"steps {', '.join(f'{m} {steps_for(m, steps)}' for m in names)} after {warmup} warm-up; median (min-max) "
          f"of {repeat} repetitions, the modes alternating in each; SGD lr {LR}; algorithm {algorithm}; "
          f"{DETERMINISTIC_THREADS} torch thread per rank; fixed random data", flush=True)
    rows: list[dict] = []
    for world_size in world_sizes:
        rows += launch_local(world_size, throughput_worker, names, modes, steps, warmup, repeat, algorithm)[0]
    if memory:
        for world_size in world_sizes:
            for name in names:
                rows += [launch_local(world_size, memory_worker, name, mode, algorithm)[0] for mode in modes]
    print(format_table(rows), flush=True)
    if json_path:
        write_json(json_path, rows)
    return rows
