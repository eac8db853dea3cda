"""Training throughput side by side: gradsync DataParallel and torch DistributedDataParallel.

For each world size, one local world trains each model with every
implementation on the same initial weights, data, batch and thread count
(docs/benchmarks.md): gradsync ``DataParallel`` once per AllReduce algorithm, torch
DDP (Gloo, ``bucket_cap_mb=25`` as gradsync's default), and a "local"
compute-only baseline (the plain module, no communication). Implementations
alternate inside every round so they see the same machine noise; a round's
time is the slowest rank's (ranks lined up before and after the clock), and
samples/s is the median over rounds, samples = steps · batch · world_size.
Inputs and labels are fixed seeded random tensors, one batch per rank: the
speed of a step does not depend on the values. ``step_overhead_fraction`` =
1 - local step time / step time is the share of a step spent waiting for
communication, comparable across implementations; ``exposed_comm_fraction``
= exposed / total communication seconds is gradsync's own measurement (DDP
does not expose its communication time, so it is None there).

With ``--hosts H`` one world of H test hosts x ``--nproc`` ranks runs under
torchrun (:mod:`gradsync.bench.across_hosts`); rows gain ``hosts`` and ``nproc_per_host``.
"""

from __future__ import annotations

import copy
import gc
import resource
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync.bench.across_hosts import check_host_options, print_rank0_rows, run_bench_on_hosts, world_layout
from gradsync.bench.output import claim_json_path, fmt_optional, format_rows, host_layout, optional, write_json
from gradsync.jobs.job import under_torchrun
from gradsync.train.models import build_model
from gradsync.train.setup import threads_per_worker

BENCH_MODELS = ("cnn", "mlp")
BATCH_PER_RANK = {"cnn": 128, "mlp": 64}      # samples per rank per step
STEPS_DIVISOR = {"cnn": 1, "mlp": 5}          # mlp runs --steps // 5 steps (its steps are ~50x slower)
MLP_WIDTHS = (1024, 4096, 4096, 1024, 10)     # ~25.2M parameters, ~96 MiB of float32 gradients
CNN_INPUT_NUMEL = 40                          # MNIST-1D samples have 40 features
NUM_CLASSES = 10
DDP_BUCKET_CAP_MB = 25.0                      # torch's default, equal to gradsync's
LR = 0.01
DATA_SEED = 1234                              # rank r draws its batch from DATA_SEED + r
MODEL_SEED = 0
MEMORY_STEPS = 3
ZERO_COPY = "shm_zero_copy"  # DataParallel(algorithm="shm", gradient_as_bucket_view=True)


def build_bench_model(name: str) -> nn.Module:
    """The benchmark model: "cnn" (MNIST-1D CNN, ~5.2k parameters) or "mlp" (1024-4096-4096-1024-10, ReLU)."""
    if name == "cnn":
        return build_model("cnn")
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(MLP_WIDTHS[:-1], MLP_WIDTHS[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def steps_for(model: str, steps: int) -> int:
    """Timed steps for ``model``: ``steps`` for cnn, ``steps // 5`` (at least 1) for mlp."""
    return max(1, steps // STEPS_DIVISOR[model])


def make_batch(model: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed batch: inputs (B, features) float32 and labels (B,) int64 in [0, 10)."""
    generator = torch.Generator().manual_seed(DATA_SEED + rank)
    features = CNN_INPUT_NUMEL if model == "cnn" else MLP_WIDTHS[0]
    inputs = torch.randn(BATCH_PER_RANK[model], features, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (BATCH_PER_RANK[model],), generator=generator)
    return inputs, labels


def wrap(impl: str, algorithm: str, module: nn.Module, gradient_as_bucket_view: bool = False) -> nn.Module:
    """Wrap ``module`` for ``impl``: "local" (unwrapped), "gradsync" (DataParallel) or "ddp"."""
    if impl == "gradsync" and algorithm == ZERO_COPY:  # buckets in shared memory, reduced in place
        return gradsync.DataParallel(module, algorithm="shm", gradient_as_bucket_view=True)
    if impl == "gradsync":
        return gradsync.DataParallel(module, algorithm=algorithm,
                                     gradient_as_bucket_view=gradient_as_bucket_view)
    if impl == "ddp":
        return DistributedDataParallel(module, bucket_cap_mb=DDP_BUCKET_CAP_MB)
    return module


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                labels: torch.Tensor, steps: int) -> None:
    """Run ``steps`` SGD steps on the same batch: zero_grad, forward, cross-entropy, backward, step."""
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()


def _line_up() -> None:
    """Wait until every rank got here (a one-element native AllReduce)."""
    gradsync.all_reduce(torch.zeros(1), algorithm="native")


def _comm_seconds(model: nn.Module) -> tuple[float, float]:
    if isinstance(model, gradsync.DataParallel):
        return model.comm_seconds, model.exposed_comm_seconds
    return 0.0, 0.0


def measure(impl: str, algorithm: str, initial: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
            steps: int, warmup: int) -> dict:
    """Time ``steps`` steps of a fresh copy of ``initial`` after ``warmup`` untimed ones.

    Collective: every rank calls it with the same arguments (except its batch).

    Returns:
        ``elapsed_s``: seconds of the timed steps, slowest rank; ``comm_s`` and
        ``exposed_comm_s``: gradsync communication seconds over the timed steps,
        mean over ranks (0 for local and ddp).
    """
    model = wrap(impl, algorithm, copy.deepcopy(initial))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    train_steps(model, optimizer, inputs, labels, warmup)
    comm_before, exposed_before = _comm_seconds(model)
    _line_up()
    started = time.perf_counter()
    train_steps(model, optimizer, inputs, labels, steps)
    _line_up()
    elapsed_s = time.perf_counter() - started
    comm_after, exposed_after = _comm_seconds(model)
    mine = torch.tensor([elapsed_s, comm_after - comm_before, exposed_after - exposed_before],
                        dtype=torch.float64)
    gathered = torch.stack(gradsync.all_gather(mine))  # (world_size, 3)
    del model, optimizer
    gc.collect()  # the wrappers hold hooks in reference cycles: free this copy before the next
    return {"elapsed_s": float(gathered[:, 0].max()), "comm_s": float(gathered[:, 1].mean()),
            "exposed_comm_s": float(gathered[:, 2].mean())}


def bench_model(model: str, algorithms: list[str], steps: int, warmup: int, rounds: int) -> list[dict]:
    """Measure local, gradsync (each algorithm) and ddp on ``model``, alternating; one row per impl.

    Collective: every rank calls it with the same arguments.
    """
    torch.manual_seed(MODEL_SEED)
    initial = build_bench_model(model)
    inputs, labels = make_batch(model, gradsync.rank())
    keys = [("local", "none")] + [("gradsync", name) for name in algorithms] + [("ddp", "native")]
    results: dict[tuple[str, str], list[dict]] = {key: [] for key in keys}
    for round_index in range(rounds):
        shift = round_index % len(keys)
        for impl, algorithm in keys[shift:] + keys[:shift]:
            results[(impl, algorithm)].append(measure(impl, algorithm, initial, inputs, labels, steps, warmup))
    return summarize(model, results, steps, gradsync.world_size())


def summarize(model: str, results: dict[tuple[str, str], list[dict]], steps: int, world_size: int) -> list[dict]:
    """Turn per-round measurements into throughput rows (medians over rounds; times in seconds)."""
    samples_per_step = BATCH_PER_RANK[model] * world_size
    throughput = {key: statistics.median(samples_per_step * steps / r["elapsed_s"] for r in runs)
                  for key, runs in results.items()}
    local_step_s = samples_per_step / throughput[("local", "none")]
    ddp = throughput[("ddp", "native")]
    rows = []
    for (impl, algorithm), runs in results.items():
        if impl == "local":
            continue
        step_s = samples_per_step / throughput[(impl, algorithm)]
        comm = exposed = fraction = None
        if impl == "gradsync":
            comm = statistics.median(r["comm_s"] for r in runs) / steps
            exposed = statistics.median(r["exposed_comm_s"] for r in runs) / steps
            fraction = exposed / comm if comm > 0 else None
        rows.append({"kind": "throughput", "model": model, "world_size": world_size, "impl": impl,
                     "algorithm": algorithm, "samples_per_s": throughput[(impl, algorithm)],
                     "ratio_to_ddp": throughput[(impl, algorithm)] / ddp, "step_s": step_s,
                     "local_step_s": local_step_s, "step_overhead_fraction": 1 - local_step_s / step_s,
                     "comm_s_per_step": comm, "exposed_comm_s_per_step": exposed,
                     "exposed_comm_fraction": fraction, "batch_per_rank": BATCH_PER_RANK[model],
                     "steps": steps, "rounds": len(runs), "threads_per_rank": torch.get_num_threads()})
    return rows


def run_worker(models: list[str], algorithms: list[str], steps: int, warmup: int,
               rounds: int, layout: tuple[int, int] | None = None) -> list[dict] | None:
    """Entry point of one throughput process; rank 0 returns the rows.

    ``layout``: (hosts, ranks per host), default one host of every rank.
    """
    gradsync.init()
    try:
        torch.set_num_threads(threads_per_worker(gradsync.world_size()))  # test hosts share these cores
        hosts, per_host = layout or (1, gradsync.world_size())
        rows = []
        for model in models:
            rows += bench_model(model, algorithms, steps_for(model, steps), warmup, rounds)
        for row in rows:
            row.update(hosts=hosts, nproc_per_host=per_host)
        return rows if gradsync.rank() == 0 else None
    finally:
        gradsync.shutdown()


def memory_worker(model: str, algorithm: str, gradient_as_bucket_view: bool) -> dict | None:
    """Entry point of one memory process: a few gradsync steps, then the peak RSS; rank 0 returns the row."""
    gradsync.init()
    try:
        torch.set_num_threads(threads_per_worker(gradsync.world_size()))
        torch.manual_seed(MODEL_SEED)
        wrapped = wrap("gradsync", algorithm, build_bench_model(model), gradient_as_bucket_view)
        inputs, labels = make_batch(model, gradsync.rank())
        train_steps(wrapped, torch.optim.SGD(wrapped.parameters(), lr=LR), inputs, labels, MEMORY_STEPS)
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is KiB on Linux
        mine = torch.tensor([peak_mib, current_rss_mib()], dtype=torch.float64)
        gathered = torch.stack(gradsync.all_gather(mine))  # (world_size, 2) MiB
        if gradsync.rank() != 0:
            return None
        return {"kind": "memory", "model": model, "world_size": gradsync.world_size(), "impl": "gradsync",
                "algorithm": algorithm, "gradient_as_bucket_view": gradient_as_bucket_view,
                "peak_rss_mib": float(gathered[:, 0].max()), "peak_rss_mib_per_rank": gathered[:, 0].tolist(),
                "rss_after_mib": float(gathered[:, 1].max()), "steps": MEMORY_STEPS}
    finally:
        gradsync.shutdown()


def current_rss_mib() -> float:
    """Resident MiB of this process now (Linux /proc; NaN elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as file:
            return int(file.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return float("nan")



def format_table(rows: list[dict]) -> str:
    """Render throughput rows as an aligned text table (times per step in ms)."""
    multi = any(row.get("hosts", 1) > 1 for row in rows)
    columns = [("hosts", 6, host_layout)] if multi else []
    columns += [("model", 6, "{model}"), ("world_size", 10, "{world_size}"), ("impl", 9, "{impl}"),
                ("algorithm", 17, "{algorithm}"), ("samples/s", 10, "{samples_per_s:.0f}"),
                ("ratio_to_ddp", 12, "{ratio_to_ddp:.2f}x"), ("comm_ms/step", 12, _milliseconds("comm_s_per_step")),
                ("exposed_ms/step", 15, _milliseconds("exposed_comm_s_per_step")),
                ("exposed/comm", 12, optional("exposed_comm_fraction", ".2f")),
                ("step overhead %", 15, lambda row: f"{100 * row['step_overhead_fraction']:.1f}")]
    lines = [format_rows(rows, columns)]
    baselines = {(row["model"], row["world_size"]): row["local_step_s"] for row in rows}
    lines += [f"# local compute-only step ({model}, world_size {ws}): {seconds * 1e3:.2f} ms"
              for (model, ws), seconds in baselines.items()]
    return "\n".join(lines)


def format_memory_table(rows: list[dict]) -> str:
    """Render memory rows: peak RSS per rank (max over ranks), the saving against the False row, and the
    resident MiB after the steps (the steady state, without the transient peaks of the first steps)."""
    base = {(r["model"], r["world_size"]): r["peak_rss_mib"] for r in rows if not r["gradient_as_bucket_view"]}

    def saving(row: dict) -> str:
        peak = base.get((row["model"], row["world_size"]))
        return fmt_optional(None if peak is None else peak - row["peak_rss_mib"], ".1f")

    return format_rows(rows, [
        ("model", 6, "{model}"), ("world_size", 10, "{world_size}"), ("impl", 9, "{impl}"),
        ("gradient_as_bucket_view", 23, "{gradient_as_bucket_view!s}"),
        ("peak RSS [MiB/rank]", 19, "{peak_rss_mib:.1f}"), ("saving vs False [MiB]", 21, saving),
        ("RSS after [MiB/rank]", 20, "{rss_after_mib:.1f}")])


def _milliseconds(key: str):
    return lambda row: fmt_optional(None if row[key] is None else row[key] * 1e3, ".2f")


def _split(text: str) -> list[str]:
    return list(dict.fromkeys(item.strip() for item in text.split(",")))  # unique, in order


def _parse_options(nproc: str, models: str, algorithms: str, steps: int, warmup: int, rounds: int,
                   hosts: int | None = None) -> tuple[list[int], list[str], list[str]]:
    """Checked world sizes (ranks per host with ``hosts``), models and algorithms.

    Raises:
        ValueError: a bad option; with ``hosts``, more than one --nproc; with ``hosts`` > 1,
        shm or shm_zero_copy (shared memory cannot cross hosts).
    """
    world_sizes = []
    for text in _split(nproc):
        if not text.lstrip("-").isdigit():
            raise ValueError(f"--nproc: {text!r} is not an integer (use a comma-separated list like 2,4)")
        if int(text) < 1:
            raise ValueError(f"--nproc must be >= 1, got {int(text)}")
        world_sizes.append(int(text))
    model_names = _split(models)
    for name in model_names:
        if name not in BENCH_MODELS:
            raise ValueError(f"unknown model {name!r} in --model; choose from {', '.join(BENCH_MODELS)}")
    names = _split(algorithms)
    for name in names:
        if name not in gradsync.ALGORITHMS + (ZERO_COPY,):
            raise ValueError(f"unknown algorithm {name!r} in --algorithms; choose from "
                             f"{', '.join(gradsync.ALGORITHMS + (ZERO_COPY,))}")
        if hosts and hosts > 1 and name in ("shm", ZERO_COPY):
            raise ValueError(f"--algorithms {name}: shared memory cannot cross hosts (--hosts {hosts}); "
                             f"use hierarchical (shm inside each host)")
    if hosts and len(world_sizes) != 1:
        raise ValueError(f"with --hosts, --nproc is the ranks per host: one integer, got {nproc!r}")
    for option, value, low in (("--steps", steps, 1), ("--warmup", warmup, 0), ("--rounds", rounds, 1)):
        if value < low:
            raise ValueError(f"{option} must be >= {low}, got {value}")
    return world_sizes, model_names, names


def run_memory(models: list[str], algorithm: str) -> list[dict]:
    """Peak RSS of gradsync with gradient_as_bucket_view False and True, largest model, world size 2."""
    from gradsync.launch import launch_local

    model = "mlp" if "mlp" in models else models[0]
    return [launch_local(2, memory_worker, model, algorithm, view)[0] for view in (False, True)]


def run_bench(*, nproc: str, models: str, algorithms: str, steps: int, warmup: int, rounds: int,
              json_path: str | None, memory: bool = True, hosts: int | None = None,
              inter_host_gbit: float | None = None, join_timeout_s: float = 30.0) -> list[dict]:
    """Validate the options, run one world per world size, print the tables, write JSON; returns all rows.

    ``hosts``: one world of ``hosts`` test hosts x ``nproc`` ranks, under torchrun (no memory
    table). Under torchrun: this process is one rank of that world; rank 0 prints and writes.
    """
    from gradsync.launch import launch_local

    if under_torchrun():
        return _run_as_torchrun_worker(models, algorithms, steps, warmup, rounds, json_path, hosts)
    check_host_options(hosts, inter_host_gbit, join_timeout_s)
    world_sizes, model_names, names = _parse_options(nproc, models, algorithms, steps, warmup, rounds, hosts)
    claim_json_path(json_path)
    if hosts:  # no --nproc in argv: torchrun's parser takes it for its --nproc-per-node
        argv = ["bench", "train", "--model", ",".join(model_names), "--algorithms", ",".join(names),
                "--steps", str(steps), "--warmup", str(warmup), "--rounds", str(rounds)]
        return run_bench_on_hosts(hosts, world_sizes[0], argv, inter_host_gbit=inter_host_gbit,
                                  join_timeout_s=join_timeout_s, json_path=json_path)
    print(f"# gradsync bench train: models {', '.join(model_names)}; steps "
          f"{', '.join(f'{m} {steps_for(m, steps)}' for m in model_names)} after {warmup} warm-up; "
          f"median of {rounds} alternating rounds; SGD lr {LR}, fixed random data", flush=True)
    rows: list[dict] = []
    for world_size in world_sizes:
        rows += launch_local(world_size, run_worker, model_names, names, steps, warmup, rounds)[0]
    print(format_table(rows), flush=True)
    if memory:
        memory_rows = run_memory(model_names, names[0])
        print(f"\n# resident memory over {MEMORY_STEPS} steps, gradsync {names[0]}, one fresh world per "
              f"setting (peak = ru_maxrss, max over ranks)", flush=True)
        print(format_memory_table(memory_rows))
        rows += memory_rows
    if json_path:
        write_json(json_path, rows)
    return rows


def _run_as_torchrun_worker(models: str, algorithms: str, steps: int, warmup: int, rounds: int,
                            json_path: str | None, hosts: int | None) -> list[dict]:
    """One rank started by torchrun: one world, hosts and ranks per host from its environment."""
    if hosts:
        raise ValueError("--hosts starts torchrun on test hosts; this process already runs under torchrun")
    layout = world_layout()
    _, model_names, names = _parse_options(str(layout[1]), models, algorithms, steps, warmup, rounds,
                                           layout[0])
    rows = run_worker(model_names, names, steps, warmup, rounds, layout)
    if rows is not None:
        print_rank0_rows(f"# gradsync bench train: {layout[0]} hosts x {layout[1]} ranks; median of {rounds} "
                         f"alternating rounds", format_table(rows), rows, json_path)
    return rows or []
