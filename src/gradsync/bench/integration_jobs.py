"""One timed job per implementation for ``gradsync bench train --integrations``: the same loop five ways.

Every job trains ``bench train``'s model (:func:`~gradsync.bench.train.build_bench_model`, seed
``MODEL_SEED``) with SGD on each rank's fixed batch (:func:`~gradsync.bench.train.make_batch`) at one
thread per rank, runs ``warmup`` untimed steps, then times ``steps`` steps in :data:`WINDOWS` consecutive
windows, each between two barriers, and returns the seconds per step of the median window (the slowest
rank's seconds of each window): a burst of other load on the machine moves one window, not the job's
figure. What differs is only who runs the loop:

* ``gradsync`` / ``ddp``: the plain loop (:func:`gradsync.bench.train.measure`) in a fresh local world;
* ``lightning-gradsync`` / ``lightning-ddp``: Lightning's ``Trainer`` (automatic optimisation, no logger,
  checkpointing or progress bar, as a timing run would set it) with ``GradsyncStrategy`` or Lightning's
  ``DDPStrategy``, launched by Lightning's own subprocess launcher
  (``python -m gradsync.bench.lightning_job``);
* ``ray-gradsync`` / ``ray-ddp``: a Ray Train ``TorchTrainer`` on a local Ray cluster, the model wrapped by
  ``gradsync.integrations.ray.prepare_model`` or ``ray.train.torch.prepare_model``; Ray's start-up and
  the workers' creation are outside the timed steps.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

IMPLS = ("gradsync", "ddp", "lightning-gradsync", "lightning-ddp", "ray-gradsync", "ray-ddp")
INTEGRATIONS = {"lightning": ("lightning-gradsync", "lightning-ddp"), "ray": ("ray-gradsync", "ray-ddp")}
JOB_TIMEOUT_S = 900
WINDOWS = 5  # timed windows per job


def window_sizes(steps: int, windows: int = WINDOWS) -> list[int]:
    """``steps`` split into at most ``windows`` consecutive windows whose sizes differ by at most one.

    >>> window_sizes(20), window_sizes(7), window_sizes(2)
    ([4, 4, 4, 4, 4], [2, 2, 1, 1, 1], [1, 1])
    """
    count = max(1, min(windows, steps))
    return [steps // count + (1 if index < steps % count else 0) for index in range(count)]


def step_seconds(window_seconds: list[float], sizes: list[int]) -> float:
    """Seconds per step of the median window (``window_seconds[k]``: the slowest rank's seconds of window k).

    >>> step_seconds([4.0, 1.0, 9.0], [2, 1, 3])
    2.0
    """
    per_step = sorted(seconds / size for seconds, size in zip(window_seconds, sizes))
    middle = len(per_step) // 2
    return per_step[middle] if len(per_step) % 2 else (per_step[middle - 1] + per_step[middle]) / 2


def slowest_rank(window_seconds: list[float]) -> list[float]:
    """Each window's seconds, the maximum over the ranks (collective over torch's default group)."""
    tensor = torch.tensor(window_seconds, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def timed_windows(train, steps: int) -> float:
    """Run ``train(count)`` over the windows of ``steps``, each between barriers; the median window's
    seconds per step, slowest rank (collective)."""
    sizes, seconds = window_sizes(steps), []
    for size in sizes:
        dist.barrier()
        started = time.perf_counter()
        train(size)
        dist.barrier()
        seconds.append(time.perf_counter() - started)
    return step_seconds(slowest_rank(seconds), sizes)


def _sgd_steps(model, inputs, labels):
    """``train(count)``: ``bench train``'s SGD steps (:func:`~gradsync.bench.train.train_steps`) on this batch."""
    from gradsync.bench.train import LR, train_steps

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return lambda count: train_steps(model, optimizer, inputs, labels, count)


def _plain_worker(impl: str, algorithm: str, model: str, steps: int, warmup: int) -> float | None:
    import gradsync
    from gradsync.bench.train import MODEL_SEED, build_bench_model, make_batch, wrap
    from gradsync.train.setup import threads_per_worker

    gradsync.init()
    try:
        torch.set_num_threads(threads_per_worker(gradsync.world_size()))
        torch.manual_seed(MODEL_SEED)
        module = build_bench_model(model)
        inputs, labels = make_batch(model, gradsync.rank())
        wrapped = wrap("gradsync", algorithm, module) if impl == "gradsync" else wrap("ddp", "native", module)
        train = _sgd_steps(wrapped, inputs, labels)
        train(warmup)
        step_s = timed_windows(train, steps)
        # free the wrapper while its group lives: a DDP Reducer that is the last owner of the group
        # destroys it holding the GIL while Gloo's thread waits for the GIL (a deadlock seen here)
        del wrapped, train
        gc.collect()
        return step_s if gradsync.rank() == 0 else None
    finally:
        gradsync.shutdown()


def run_plain(impl: str, algorithm: str, model: str, world_size: int, steps: int, warmup: int) -> float:
    """Seconds per step (median window, slowest rank) of the plain gradsync (or DDP) loop, in a fresh world."""
    from gradsync.launch import launch_local

    return float(launch_local(world_size, _plain_worker, impl, algorithm, model, steps, warmup)[0])


def run_lightning(impl: str, algorithm: str, model: str, world_size: int, steps: int, warmup: int) -> float:
    """Seconds per step (median window, slowest rank) of Lightning's loop (a ``python -m`` job of its own)."""
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-lightning-") as folder:
        result = Path(folder) / "result.json"
        spec = {"impl": impl, "algorithm": algorithm, "model": model, "world_size": world_size, "steps": steps,
                "warmup": warmup, "result": str(result), "root": folder}
        done = subprocess.run([sys.executable, "-m", "gradsync.bench.lightning_job", json.dumps(spec)],
                              capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=folder)
        if done.returncode != 0 or not result.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"the {impl} job failed (exit {done.returncode}): {' | '.join(tail)}")
        return float(json.loads(result.read_text())["step_s"])


def _ray_loop(config: dict) -> None:
    import ray.train

    from gradsync.bench.train import MODEL_SEED, build_bench_model, make_batch
    from gradsync.train.setup import threads_per_worker

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(threads_per_worker(world_size))
    torch.manual_seed(MODEL_SEED)
    module = build_bench_model(config["model"])
    if config["impl"] == "ray-gradsync":
        from gradsync.integrations.ray import prepare_model

        wrapped = prepare_model(module, algorithm=config["algorithm"])
    else:
        from ray.train.torch import prepare_model as ray_prepare_model

        wrapped = ray_prepare_model(module)
    inputs, labels = make_batch(config["model"], rank)
    train = _sgd_steps(wrapped, inputs, labels)
    train(config["warmup"])
    step_s = timed_windows(train, config["steps"])
    if rank == 0:  # Ray Train keeps reported metrics only with a checkpoint: the driver reads a file
        Path(config["result"]).write_text(json.dumps({"step_s": step_s}), encoding="utf-8")


class RayCluster:
    """A local Ray cluster for the bench's runs (a context): ``world_size`` CPUs, no dashboard, no usage
    reports, a small object store; ``run`` times one ``TorchTrainer``."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.storage = None

    def __enter__(self) -> "RayCluster":
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray

        self.storage = tempfile.TemporaryDirectory(prefix="gradsync-bench-ray-")
        ray.init(address="local", num_cpus=self.world_size, include_dashboard=False,
                 object_store_memory=100 * 2**20, log_to_driver=False, configure_logging=False)
        return self

    def __exit__(self, *exc) -> None:
        import ray

        ray.shutdown()
        self.storage.cleanup()

    def run(self, impl: str, algorithm: str, model: str, steps: int, warmup: int) -> float:
        """Seconds per step (median window, slowest rank) in a ``TorchTrainer`` of ``world_size`` workers."""
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        result = Path(self.storage.name) / "result.json"
        result.unlink(missing_ok=True)
        trainer = TorchTrainer(_ray_loop, train_loop_config={"impl": impl, "algorithm": algorithm, "model": model,
                                                             "steps": steps, "warmup": warmup, "result": str(result)},
                               scaling_config=ScalingConfig(num_workers=self.world_size, use_gpu=False,
                                                            resources_per_worker={"CPU": 1}),
                               run_config=RunConfig(storage_path=self.storage.name))
        trainer.fit()
        return float(json.loads(result.read_text(encoding="utf-8"))["step_s"])
