"""Memory per rank at every sharding level (ZeRO-1, ZeRO-2, ZeRO-3), and what it costs in samples/s, against
torch's ZeRO and FSDP2.

``gradsync bench memory --model gpt,mlp --optimizer adamw --nproc 1,2,4``:
for each model and world size, gradsync ``DataParallel`` at every
``shard`` level (``none``, the baseline; ``optimizer``; ``gradients``; ``parameters``) and
torch's ``ZeroRedundancyOptimizer`` (ZeRO stage 1, Rajbhandari et al. 2020,
arXiv 1910.02054) over ``DistributedDataParallel`` on Gloo, built as its
docs show (``ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=...,
lr=...)``, the defaults ``parameters_as_bucket_view=False``,
``overlap_with_ddp=False``; DDP with the same ``bucket_cap_mb``), and
PyTorch's FSDP2 (``fully_shard`` on each block, then the root, AdamW built
after sharding: :mod:`gradsync.bench.shard_memory_fsdp2`).

* Bytes (one run per setting, a fresh world each, so its peak RSS is its
  own): after a warm-up step (buckets rebuilt, optimizer state created),
  one step is sampled inside the pass at every block's forward, at
  backward's entry into every block and as each of its gradients is
  accumulated, and after forward, after backward and after the optimizer
  step, the same points for every row, and apart from the timed run
  (:mod:`gradsync.bench.shard_memory_points`); at each point the
  tensors the rank holds are counted (:mod:`gradsync.parallel.memory`:
  ``DataParallel.held_tensors`` for gradsync,
  :func:`~gradsync.parallel.memory.torch_zero_bytes` and
  :func:`~gradsync.bench.shard_memory_fsdp2.fsdp2_bytes` for the peers),
  the point with the largest total is the step's peak and its parts
  are reported, for the rank whose peak is largest. Peak RSS is each
  rank's ``getrusage(RUSAGE_SELF).ru_maxrss`` at the end (max over ranks).
* Samples/s (one world per model and world size): first every setting
  trains ``CHECK_STEPS`` steps from the same weights on the same batches,
  in float64 (see :func:`check_equal`), and its parameters are compared
  with the baseline's (allclose, rtol 1e-5, atol 1e-6, on every rank; ZeRO-3's
  and FSDP2's gathered whole), and FSDP2's float32 reduced gradient with the ranks' mean
  (:func:`~gradsync.bench.shard_memory_fsdp2.gradient_check`); a setting that
  differs is not timed.
  Then ``--repeat`` repetitions, each timing every setting once (order
  rotated by one each repetition) on a fresh copy: ``--warmup`` untimed
  steps, then ``--steps`` timed ones, the slowest rank's time.

Rows, ratios, goals and the table: :mod:`gradsync.bench.shard_memory_rows`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import resource
import time
from typing import NamedTuple

import torch
from torch import nn

import gradsync
from gradsync.bench.output import claim_json_path, write_json
from gradsync.bench.shard_memory_fsdp2 import fsdp2_bytes, full_tensors, fully_shard_model, gradient_check, units
from gradsync.bench.shard_memory_models import BENCH_MODELS, MODELS, BenchModel, build, loss_of, make_batch
from gradsync.bench.shard_memory_points import PassSampler, point_names
from gradsync.bench.shard_memory_rows import BASELINE, IMPL_SHARDS, Setting, memory_rows, settings_for, tables
from gradsync.bench.shard_memory_texts import DEEPSPEED_NOTE
from gradsync.bench.spread import check_repeat
from gradsync.bench.train import _line_up
from gradsync.parallel.memory import PARTS, count_bytes, torch_zero_bytes
from gradsync.train.setup import threads_per_worker

OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-3}), "sgd": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9})}
CHECK_STEPS = 3                            # identical steps before the parameters are compared
CHECK_RTOL, CHECK_ATOL = 1e-5, 1e-6
CHECK_DTYPE = torch.float64               # the check compares computations, not float32 rounding
MODEL_SEED = 0


class Options(NamedTuple):
    """The settings every measured implementation shares (the command line's)."""

    optimizer: str = "adamw"
    algorithm: str = "shm"
    bucket_cap_mb: float = 25.0
    steps: int = 3
    warmup: int = 1
    repeat: int = 5


# ---------------------------------------------------------------- implementations

def _wrap_gradsync(module: nn.Module, shard: str, options: Options):
    optimizer_class, hyper = OPTIMIZERS[options.optimizer]
    model = gradsync.DataParallel(module, algorithm=options.algorithm, bucket_cap_mb=options.bucket_cap_mb,
                                  shard=shard)
    return model, model.shard_optimizer(optimizer_class(model.parameters(), **hyper))


def _gradsync_bytes(model, optimizer) -> dict[str, int]:
    return count_bytes(model.held_tensors(optimizer))


def _wrap_torch_zero(module: nn.Module, shard: str, options: Options):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    optimizer_class, hyper = OPTIMIZERS[options.optimizer]
    ddp = DistributedDataParallel(module, bucket_cap_mb=options.bucket_cap_mb)
    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=optimizer_class, **hyper)


def _wrap_torch_fsdp2(module: nn.Module, shard: str, options: Options):
    optimizer_class, hyper = OPTIMIZERS[options.optimizer]
    model = fully_shard_model(module)  # its units are the blocks: --bucket-cap-mb and --algorithm do not apply
    return model, optimizer_class(model.parameters(), **hyper)


IMPLS = {"gradsync": (_wrap_gradsync, _gradsync_bytes), "torch-zero": (_wrap_torch_zero, torch_zero_bytes),
         "torch-fsdp2": (_wrap_torch_fsdp2, fsdp2_bytes)}
GRADIENT_CHECKED = ("torch-fsdp2",)  # reduces float32 otherwise than float64: its float32 gradients checked too


def wrap(setting: Setting, module: nn.Module, options: Options):
    """(model, optimizer) of ``setting`` around ``module``. Collective: every rank, same arguments."""
    return IMPLS[setting.impl][0](module, setting.shard, options)


def settle(model) -> None:
    """Wait for the parameter all-gathers a sharded DataParallel's last step left in flight (they overlap the
    next forward; nothing else waits for them), so that a clock stopped now or a parameter read now sees
    the step whole. A no-op for other models. (Private: DataParallel has no public call that only waits.)"""
    zero = getattr(model, "_zero", None)
    if zero is not None:
        zero.flat.wait_all()


def train_step(model, optimizer, inputs, targets, sample=None) -> None:
    """zero_grad, forward, loss, backward, optimizer step; ``sample(point)`` after each of
    :data:`~gradsync.bench.shard_memory_points.POINTS`."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_of(model(inputs), targets)
    if sample:
        sample("forward")
    loss.backward()
    if sample:
        sample("backward")
    optimizer.step()
    if sample:
        sample("step")


# ---------------------------------------------------------------- measurements (collective)

def measure_bytes(spec: BenchModel, setting: Setting, options: Options) -> dict:
    """Count what every rank holds over one step (after a warm-up step); the rank with the largest peak's parts.

    Returns (on every rank): ``parts`` ({part: bytes}), ``peak_at`` (a point of
    :func:`~gradsync.bench.shard_memory_points.point_names`),
    ``total_bytes_per_rank`` and ``optimizer_state_bytes_per_rank`` (at each rank's own peak),
    ``peak_rss_mib_per_rank`` (ru_maxrss, MiB) and ``parameters`` (elements).
    """
    torch.manual_seed(MODEL_SEED)
    module = build(spec)
    model, optimizer = wrap(setting, module, options)
    inputs, targets = make_batch(spec, gradsync.rank())
    train_step(model, optimizer, inputs, targets)
    blocks = units(module)
    with PassSampler(blocks, lambda: IMPLS[setting.impl][1](model, optimizer)) as sampler:
        train_step(model, optimizer, inputs, targets, sample=sampler.sample)
    peak_at, names = sampler.peak(), point_names(len(blocks))
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    mine = torch.tensor([sampler.counts[peak_at][part] for part in PARTS] + [names.index(peak_at), rss_mib],
                        dtype=torch.float64)
    gathered = torch.stack(gradsync.all_gather(mine))  # (world_size, parts + 2)
    totals = gathered[:, :len(PARTS)].sum(dim=1)
    top = int(totals.argmax())
    return {"parts": {part: int(gathered[top, index]) for index, part in enumerate(PARTS)},
            "peak_at": names[int(gathered[top, len(PARTS)])], "total_bytes_per_rank": [int(x) for x in totals],
            "optimizer_state_bytes_per_rank": [int(x) for x in gathered[:, PARTS.index("optimizer_state")]],
            "peak_rss_mib_per_rank": gathered[:, -1].tolist(),
            "parameters": sum(param.numel() for param in module.parameters())}


def _trained(spec: BenchModel, initial: nn.Module, setting: Setting, options: Options, steps: int,
             dtype: torch.dtype = torch.float32):
    """A fresh copy of ``initial`` in ``dtype`` wrapped as ``setting``, after ``steps`` steps on this rank's
    batch (floating inputs cast to ``dtype``), its parameters settled."""
    module = copy.deepcopy(initial).to(dtype)
    model, optimizer = wrap(setting, module, options)
    inputs, targets = make_batch(spec, gradsync.rank())
    inputs = inputs.to(dtype) if inputs.is_floating_point() else inputs
    for _ in range(steps):
        train_step(model, optimizer, inputs, targets)
    settle(model)
    return module, model, optimizer


def whole_parameters(module: nn.Module, model) -> list[torch.Tensor]:
    """Copies of ``module``'s parameters, each whole: gradsync's ZeRO-3 units gathered
    (``model.full_parameters()``), FSDP2's ``DTensor`` with ``full_tensor()``. Collective: every rank."""
    with getattr(model, "full_parameters", contextlib.nullcontext)():
        return [tensor.detach().clone() for tensor in full_tensors(module.parameters())]


def check_equal(spec: BenchModel, initial: nn.Module, settings: list[Setting], options: Options) -> dict:
    """Per setting: ``equal_to_none`` (its parameters allclose to the baseline's after :data:`CHECK_STEPS`
    identical steps in :data:`CHECK_DTYPE`, on every rank; a sharded peer's gathered whole) and
    ``max_abs_diff`` (the largest difference over ranks). An impl of :data:`GRADIENT_CHECKED` also gets
    ``gradient_check`` (:func:`~gradsync.bench.shard_memory_fsdp2.gradient_check`, float32), and is
    ``equal_to_none`` only when both hold.

    In float64, so that what is compared is the computation (the average of the gradients, the optimizer
    and its hyperparameters, each rank's shard), not float32 rounding: the implementations sum the ranks'
    gradients in different orders, and AdamW divides a gradient by its own magnitude, which turns a
    rounding difference in a gradient that nearly cancels across ranks into a parameter difference of up
    to a few 1e-6 after 3 steps of the 25M-parameter gpt (more than rtol 1e-5 of its ~0.02 weights).
    """
    reference = [param.detach().clone() for param in
                 _trained(spec, initial, BASELINE, options, CHECK_STEPS, CHECK_DTYPE)[0].parameters()]
    checks = {BASELINE: {"equal_to_none": True, "max_abs_diff": 0.0}}
    for setting in settings:
        if setting == BASELINE:
            continue
        gc.collect()  # the copy before (its wrapper's hooks hold it in reference cycles)
        params = whole_parameters(*_trained(spec, initial, setting, options, CHECK_STEPS, CHECK_DTYPE)[:2])
        equal = all(torch.allclose(mine, theirs, rtol=CHECK_RTOL, atol=CHECK_ATOL)
                    for mine, theirs in zip(params, reference))
        diff = max(float((mine.detach() - theirs).abs().max()) for mine, theirs in zip(params, reference))
        gathered = torch.stack(gradsync.all_gather(torch.tensor([float(equal), diff], dtype=torch.float64)))
        checks[setting] = {"equal_to_none": bool(gathered[:, 0].min() > 0), "max_abs_diff": float(gathered[:, 1].max())}
        del params
        if setting.impl in GRADIENT_CHECKED:
            gc.collect()
            gradients = checks[setting]["gradient_check"] = gradient_check(spec, initial)
            checks[setting]["equal_to_none"] &= gradients["equal"]
    gc.collect()
    return checks


def time_steps(spec: BenchModel, initial: nn.Module, setting: Setting, options: Options) -> float:
    """Seconds of ``options.steps`` steps of a fresh copy after ``options.warmup`` untimed ones, slowest rank."""
    module, model, optimizer = _trained(spec, initial, setting, options, options.warmup)
    inputs, targets = make_batch(spec, gradsync.rank())
    _line_up()
    started = time.perf_counter()
    for _ in range(options.steps):
        train_step(model, optimizer, inputs, targets)
    settle(model)  # the last step's all-gather belongs to the timed steps
    _line_up()
    mine = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    del module, model, optimizer
    gc.collect()  # the wrappers hold hooks in reference cycles: free this copy before the next
    return float(torch.stack(gradsync.all_gather(mine)).max())


def check_and_time(spec: BenchModel, settings: list[Setting], options: Options) -> dict:
    """:func:`check_equal`, then ``options.repeat`` repetitions timing every setting that passed once each
    (order rotated by one per repetition); per setting its check and ``elapsed_s`` (None: not timed)."""
    gc.freeze()  # what this process holds by now is never garbage: each gc.collect below then scans only the new
    torch.manual_seed(MODEL_SEED)
    initial = build(spec)
    results = check_equal(spec, initial, settings, options)
    timed = [setting for setting in settings if results[setting]["equal_to_none"]]
    elapsed: dict[Setting, list[float]] = {setting: [] for setting in timed}
    for repetition in range(options.repeat):
        shift = repetition % len(timed)
        for setting in timed[shift:] + timed[:shift]:
            elapsed[setting].append(time_steps(spec, initial, setting, options))
    for setting in settings:
        results[setting]["elapsed_s"] = elapsed.get(setting)
    return results


# ---------------------------------------------------------------- worker entry points

def rank_worker(measure, *args) -> dict | None:
    """Entry point of one world running ``measure(*args)`` (:func:`measure_bytes` or :func:`check_and_time`)
    on every rank; rank 0 returns its result."""
    gradsync.init()
    try:
        torch.set_num_threads(threads_per_worker(gradsync.world_size()))
        result = measure(*args)
        return result if gradsync.rank() == 0 else None
    finally:
        gradsync.shutdown()


# ---------------------------------------------------------------- the command

def _once(values: list, option: str) -> list:
    repeated = [value for index, value in enumerate(values) if value in values[:index]]
    if repeated:
        raise ValueError(f"{option}: {repeated[0]} given more than once")
    return values


def _names(text: str, option: str, choices) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in choices]
    if unknown or not names:
        raise ValueError(f"{option}: unknown {','.join(unknown) or repr(text)}; choose from {', '.join(choices)}")
    return _once(names, option)


def parse_options(models: str, optimizer: str, nproc: str, impls: str, shards: str, options: Options
                  ) -> tuple[list[str], list[int], list[Setting]]:
    """Checked models, world sizes and settings (baseline first).

    Raises:
        ValueError: one line naming the option: an unknown model, optimizer, impl or level, a world size
        that is not an integer >= 1, --steps or --repeat < 1, --warmup < 0, --bucket-cap-mb <= 0, or an
        unknown --algorithm.
    """
    model_names = _names(models, "--model", MODELS)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer: unknown {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    world_sizes = []
    for text in nproc.split(","):
        if not text.strip().isdigit() or int(text) < 1:
            raise ValueError(f"--nproc: {text.strip()!r} is not a world size (comma-separated integers >= 1, e.g. 1,2,4)")
        world_sizes.append(int(text))
    levels = _names(shards, "--shards", IMPL_SHARDS["gradsync"])
    settings = settings_for(_names(impls, "--impls", tuple(IMPL_SHARDS)), levels)
    for option, value, low in (("--steps", options.steps, 1), ("--warmup", options.warmup, 0)):
        if value < low:
            raise ValueError(f"{option} must be >= {low}, got {value}")
    check_repeat(options.repeat)
    if not options.bucket_cap_mb > 0:
        raise ValueError(f"--bucket-cap-mb must be > 0, got {options.bucket_cap_mb}")
    if options.algorithm not in gradsync.ALGORITHMS:
        raise ValueError(f"--algorithm: unknown {options.algorithm!r}; choose from {', '.join(gradsync.ALGORITHMS)}")
    return model_names, _once(world_sizes, "--nproc"), settings


def measure_world(spec: BenchModel, world_size: int, settings: list[Setting], options: Options,
                  throughput: bool = True) -> list[dict]:
    """The rows of one model at one world size: a bytes world per setting, then one samples/s world."""
    from gradsync.launch import launch_local

    started = time.perf_counter()
    counted = {setting: launch_local(world_size, rank_worker, measure_bytes, spec, setting, options)[0] for setting in settings}
    bytes_s = time.perf_counter() - started
    timed = launch_local(world_size, rank_worker, check_and_time, spec, settings, options)[0] if throughput else None
    print(f"# {spec.name} at world size {world_size}: bytes {bytes_s:.0f} s, check and samples/s "
          f"{time.perf_counter() - started - bytes_s:.0f} s", flush=True)
    for setting, check in (timed or {}).items():
        if not check["equal_to_none"]:
            print(f"# {spec.name} at world size {world_size}: {setting.impl} shard={setting.shard} computes something "
                  f"else than shard=none (parameters differ by {check['max_abs_diff']:.1e}, gradients "
                  f"{check.get('gradient_check', {}).get('max_abs_diff', 0.0):.1e}): not timed", flush=True)
    base = {"model": spec.name, "world_size": world_size, "optimizer": options.optimizer,
            "algorithm": options.algorithm, "bucket_cap_mb": options.bucket_cap_mb,
            "parameters": counted[BASELINE]["parameters"], "batch_per_rank": spec.batch_per_rank,
            "samples_per_step": spec.batch_per_rank * world_size, "steps": options.steps, "warmup": options.warmup,
            "repeat": options.repeat if throughput else None, "check_steps": CHECK_STEPS,
            "check_dtype": str(CHECK_DTYPE).removeprefix("torch."),
            "threads_per_rank": threads_per_worker(world_size), "model_sizes": list(spec.sizes)}
    return memory_rows(base, counted, timed)


def run_bench(*, models: str, optimizer: str, nproc: str, impls: str, shards: str, algorithm: str,
              bucket_cap_mb: float, steps: int, warmup: int, repeat: int, json_path: str | None,
              throughput: bool = True) -> list[dict]:
    """Validate the options, measure every model and world size, print the table, write JSON; returns the rows."""
    options = Options(optimizer, algorithm, bucket_cap_mb, steps, warmup, repeat)
    model_names, world_sizes, settings = parse_options(models, optimizer, nproc, impls, shards, options)
    claim_json_path(json_path)
    print(f"# gradsync bench memory: {', '.join(model_names)}; {optimizer}; DataParallel({algorithm}, "
          f"bucket_cap_mb {bucket_cap_mb:g}) at shard {', '.join(s.shard for s in settings if s.impl == 'gradsync')}"
          f" and {', '.join(s.impl for s in settings if s.impl != 'gradsync') or 'no peer'}; bytes from one step "
          f"after a warm-up step; samples/s: {steps} steps after {warmup} warm-up, median (min-max) of {repeat} "
          f"repetitions, interleaved", flush=True)
    rows: list[dict] = []
    for name in model_names:
        for world_size in world_sizes:
            rows += measure_world(BENCH_MODELS[name], world_size, settings, options, throughput)
    print("\n\n".join(tables(rows)), flush=True)
    print("# " + DEEPSPEED_NOTE.replace("\n", " "), flush=True)
    if json_path:
        write_json(json_path, rows)
    return rows
