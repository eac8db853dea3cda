"""Training throughput side by side: compute-only, gradsync DataParallel and torch DistributedDataParallel.

For each world size, one local world trains each model with every
implementation on the same initial weights, data, batch and thread count
(docs/benchmarks.md): ``compute-only`` (the plain module: every rank runs its
forward, backward and optimizer step at the same time as the others, with
the gradient synchronisation skipped, so the CPU contention is the same;
the limit), gradsync ``DataParallel`` once per AllReduce algorithm, and torch
DDP (the default group's backend, Gloo; ``bucket_cap_mb=25`` as gradsync's
default), measured again with ``gradient_as_bucket_view=True`` when a gradsync
row uses bucket views (``shm_zero_copy``), as a DDP user would set it for that
comparison. Every repetition (``--repeat R``) measures each implementation
once, in an order rotated by one each repetition, so all see the same machine
noise; a measurement's time is the slowest rank's (ranks lined up before and
after the clock), samples = steps · batch · world_size. Inputs and labels are
fixed seeded random tensors, one batch per rank: the speed of a step does not
depend on the values. Rows, ratios and tables: :mod:`gradsync.bench.train_rows`.

With ``--hosts H`` one world of H test hosts x ``--nproc`` ranks runs under
torchrun (:mod:`gradsync.bench.across_hosts`); rows gain ``hosts`` and ``nproc_per_host``.
"""

from __future__ import annotations

import copy
import gc
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync.bench.across_hosts import check_host_options, print_rank0_rows, run_bench_on_hosts, world_layout
from gradsync.bench.output import claim_json_path, write_json
from gradsync.bench.spread import check_repeat
from gradsync.bench.train_rows import (COMPUTE_ONLY, ZERO_COPY, Key, add_goal, format_memory_table,  # noqa: F401
                                       format_table, measured_keys, throughput_rows)
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


def ddp_settings(gradient_as_bucket_view: bool) -> dict:
    """The settings the bench gives torch DDP (its constructor's arguments, and the group's backend)."""
    return {"backend": dist.get_backend() if dist.is_initialized() else None, "bucket_cap_mb": DDP_BUCKET_CAP_MB,
            "gradient_as_bucket_view": gradient_as_bucket_view, "static_graph": False,
            "find_unused_parameters": False}


def wrap(impl: str, algorithm: str, module: nn.Module, gradient_as_bucket_view: bool = False) -> nn.Module:
    """Wrap ``module`` for ``impl``: "compute-only" (unwrapped), "gradsync" (DataParallel) or "ddp"."""
    if impl == "gradsync" and algorithm == ZERO_COPY:  # buckets in shared memory, reduced in place
        return gradsync.DataParallel(module, algorithm="shm", gradient_as_bucket_view=True)
    if impl == "gradsync":
        return gradsync.DataParallel(module, algorithm=algorithm,
                                     gradient_as_bucket_view=gradient_as_bucket_view)
    if impl == "ddp":
        settings = ddp_settings(gradient_as_bucket_view)
        return DistributedDataParallel(module, bucket_cap_mb=settings["bucket_cap_mb"],
                                       gradient_as_bucket_view=gradient_as_bucket_view,
                                       static_graph=settings["static_graph"],
                                       find_unused_parameters=settings["find_unused_parameters"])
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


def measure(key: Key, initial: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
            steps: int, warmup: int) -> dict:
    """Time ``steps`` steps of a fresh copy of ``initial`` wrapped as ``key`` (impl, algorithm,
    gradient_as_bucket_view) after ``warmup`` untimed ones.

    Collective: every rank calls it with the same arguments (except its batch).

    Returns:
        ``elapsed_s``: seconds of the timed steps, slowest rank; ``cpu_s``: CPU seconds this
        process spent in them (every thread: compute, communication, Gloo's), mean over ranks;
        ``comm_s`` and ``exposed_comm_s``: gradsync communication seconds over the timed steps,
        mean over ranks (0 for compute-only and ddp).
    """
    impl, algorithm, gradient_as_bucket_view = key
    model = wrap(impl, algorithm, copy.deepcopy(initial), gradient_as_bucket_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    train_steps(model, optimizer, inputs, labels, warmup)
    comm_before, exposed_before = _comm_seconds(model)
    _line_up()
    started, cpu_started = time.perf_counter(), time.process_time()
    train_steps(model, optimizer, inputs, labels, steps)
    cpu_s = time.process_time() - cpu_started
    _line_up()
    elapsed_s = time.perf_counter() - started
    comm_after, exposed_after = _comm_seconds(model)
    mine = torch.tensor([elapsed_s, comm_after - comm_before, exposed_after - exposed_before, cpu_s],
                        dtype=torch.float64)
    gathered = torch.stack(gradsync.all_gather(mine))  # (world_size, 4)
    del model, optimizer
    gc.collect()  # the wrappers hold hooks in reference cycles: free this copy before the next
    return {"elapsed_s": float(gathered[:, 0].max()), "comm_s": float(gathered[:, 1].mean()),
            "exposed_comm_s": float(gathered[:, 2].mean()), "cpu_s": float(gathered[:, 3].mean())}


def bench_model(model: str, algorithms: list[str], steps: int, warmup: int, repeat: int) -> list[dict]:
    """Measure every key of :func:`~gradsync.bench.train_rows.measured_keys` on ``model`` ``repeat`` times,
    rotating their order by one each repetition; one row per key.

    Collective: every rank calls it with the same arguments.
    """
    torch.manual_seed(MODEL_SEED)
    initial = build_bench_model(model)
    inputs, labels = make_batch(model, gradsync.rank())
    keys = measured_keys(algorithms)
    results: dict[Key, list[dict]] = {key: [] for key in keys}
    for repetition in range(repeat):
        shift = repetition % len(keys)
        for key in keys[shift:] + keys[:shift]:
            results[key].append(measure(key, initial, inputs, labels, steps, warmup))
    world_size = gradsync.world_size()
    base = {"model": model, "world_size": world_size, "batch_per_rank": BATCH_PER_RANK[model], "steps": steps,
            "threads_per_rank": torch.get_num_threads()}
    return throughput_rows(results, steps, BATCH_PER_RANK[model] * world_size, base,
                           {view: ddp_settings(view) for view in (False, True)})


def run_worker(models: list[str], algorithms: list[str], steps: int, warmup: int,
               repeat: int, layout: tuple[int, int] | None = None) -> list[dict] | None:
    """Entry point of one throughput process; rank 0 returns the rows.

    ``layout``: (hosts, ranks per host), default one host of every rank.
    """
    gradsync.init()
    try:
        torch.set_num_threads(threads_per_worker(gradsync.world_size()))  # test hosts share these cores
        hosts, per_host = layout or (1, gradsync.world_size())
        rows = []
        for model in models:
            rows += bench_model(model, algorithms, steps_for(model, steps), warmup, repeat)
        for row in rows:
            row.update(hosts=hosts, nproc_per_host=per_host)
        add_goal(rows)
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


def _split(text: str) -> list[str]:
    return list(dict.fromkeys(item.strip() for item in text.split(",")))  # unique, in order


def _parse_options(nproc: str, models: str, algorithms: str, steps: int, warmup: int, repeat: int,
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
    for option, value, low in (("--steps", steps, 1), ("--warmup", warmup, 0)):
        if value < low:
            raise ValueError(f"{option} must be >= {low}, got {value}")
    check_repeat(repeat)
    return world_sizes, model_names, names


def run_memory(models: list[str], algorithm: str) -> list[dict]:
    """Peak RSS of gradsync with gradient_as_bucket_view False and True, largest model, world size 2."""
    from gradsync.launch import launch_local

    model = "mlp" if "mlp" in models else models[0]
    return [launch_local(2, memory_worker, model, algorithm, view)[0] for view in (False, True)]


def run_bench(*, nproc: str, models: str, algorithms: str, steps: int, warmup: int, repeat: int,
              json_path: str | None, memory: bool = True, hosts: int | None = None,
              inter_host_gbit: float | None = None, join_timeout_s: float = 30.0) -> list[dict]:
    """Validate the options, run one world per world size, print the tables, write JSON; returns all rows.

    ``hosts``: one world of ``hosts`` test hosts x ``nproc`` ranks, under torchrun (no memory
    table). Under torchrun: this process is one rank of that world; rank 0 prints and writes.
    """
    from gradsync.launch import launch_local

    if under_torchrun():
        return _run_as_torchrun_worker(models, algorithms, steps, warmup, repeat, json_path, hosts)
    check_host_options(hosts, inter_host_gbit, join_timeout_s)
    world_sizes, model_names, names = _parse_options(nproc, models, algorithms, steps, warmup, repeat, hosts)
    claim_json_path(json_path)
    if hosts:  # no --nproc in argv: torchrun's parser takes it for its --nproc-per-node
        argv = ["bench", "train", "--model", ",".join(model_names), "--algorithms", ",".join(names),
                "--steps", str(steps), "--warmup", str(warmup), "--repeat", str(repeat)]
        return run_bench_on_hosts(hosts, world_sizes[0], argv, inter_host_gbit=inter_host_gbit,
                                  join_timeout_s=join_timeout_s, json_path=json_path)
    print(f"# gradsync bench train: models {', '.join(model_names)}; steps "
          f"{', '.join(f'{m} {steps_for(m, steps)}' for m in model_names)} after {warmup} warm-up; "
          f"{repeat} repetitions, the implementations alternating in each; median (min-max); SGD lr {LR}, "
          f"fixed random data", flush=True)
    rows: list[dict] = []
    for world_size in world_sizes:
        rows += launch_local(world_size, run_worker, model_names, names, steps, warmup, repeat)[0]
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


def _run_as_torchrun_worker(models: str, algorithms: str, steps: int, warmup: int, repeat: int,
                            json_path: str | None, hosts: int | None) -> list[dict]:
    """One rank started by torchrun: one world, hosts and ranks per host from its environment."""
    if hosts:
        raise ValueError("--hosts starts torchrun on test hosts; this process already runs under torchrun")
    layout = world_layout()
    _, model_names, names = _parse_options(str(layout[1]), models, algorithms, steps, warmup, repeat,
                                           layout[0])
    rows = run_worker(model_names, names, steps, warmup, repeat, layout)
    if rows is not None:
        print_rank0_rows(f"# gradsync bench train: {layout[0]} hosts x {layout[1]} ranks; {repeat} repetitions, "
                         f"median (min-max)", format_table(rows), rows, json_path)
    return rows or []
