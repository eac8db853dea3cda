"""One timed job per implementation for ``gradsync bench train --integrations``: the same loop five ways.

Every job trains ``bench train``'s model (:func:`~gradsync.bench.train.build_bench_model`, seed
``MODEL_SEED``) with SGD on each rank's fixed batch (:func:`~gradsync.bench.train.make_batch`) at one
thread per rank, runs ``warmup`` untimed steps, lines the ranks up, times ``steps`` steps, lines them up
again and returns the slowest rank's seconds. What differs is only who runs the loop:

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

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

IMPLS = ("gradsync", "ddp", "lightning-gradsync", "lightning-ddp", "ray-gradsync", "ray-ddp")
INTEGRATIONS = {"lightning": ("lightning-gradsync", "lightning-ddp"), "ray": ("ray-gradsync", "ray-ddp")}
JOB_TIMEOUT_S = 900


def _plain_worker(impl: str, algorithm: str, model: str, steps: int, warmup: int) -> float | None:
    import gradsync
    from gradsync.bench.train import MODEL_SEED, build_bench_model, make_batch, measure
    from gradsync.train.setup import threads_per_worker

    gradsync.init()
    try:
        torch.set_num_threads(threads_per_worker(gradsync.world_size()))
        torch.manual_seed(MODEL_SEED)
        initial = build_bench_model(model)
        inputs, labels = make_batch(model, gradsync.rank())
        key = ("gradsync", algorithm, False) if impl == "gradsync" else ("ddp", "native", False)
        elapsed = measure(key, initial, inputs, labels, steps, warmup)["elapsed_s"]
        return elapsed if gradsync.rank() == 0 else None
    finally:
        gradsync.shutdown()


def run_plain(impl: str, algorithm: str, model: str, world_size: int, steps: int, warmup: int) -> float:
    """Seconds of ``steps`` steps of the plain gradsync (or DDP) loop, slowest rank, in a fresh world."""
    from gradsync.launch import launch_local

    return float(launch_local(world_size, _plain_worker, impl, algorithm, model, steps, warmup)[0])


def run_lightning(impl: str, algorithm: str, model: str, world_size: int, steps: int, warmup: int) -> float:
    """Seconds of ``steps`` Lightning training steps, slowest rank (a ``python -m`` job of its own)."""
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-lightning-") as folder:
        result = Path(folder) / "result.json"
        spec = {"impl": impl, "algorithm": algorithm, "model": model, "world_size": world_size, "steps": steps,
                "warmup": warmup, "result": str(result), "root": folder}
        done = subprocess.run([sys.executable, "-m", "gradsync.bench.lightning_job", json.dumps(spec)],
                              capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=folder)
        if done.returncode != 0 or not result.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"the {impl} job failed (exit {done.returncode}): {' | '.join(tail)}")
        return float(json.loads(result.read_text())["elapsed_s"])


def _ray_loop(config: dict) -> None:
    import time

    import ray.train
    import torch.distributed as dist

    from gradsync.bench.train import LR, MODEL_SEED, build_bench_model, make_batch
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
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)

    def steps(count: int) -> None:
        for _ in range(count):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(wrapped(inputs), labels).backward()
            optimizer.step()

    steps(config["warmup"])
    dist.barrier()
    started = time.perf_counter()
    steps(config["steps"])
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    if rank == 0:  # Ray Train keeps reported metrics only with a checkpoint: the driver reads a file
        Path(config["result"]).write_text(json.dumps({"elapsed_s": float(elapsed.item())}), encoding="utf-8")


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
        """Seconds of ``steps`` steps in a ``TorchTrainer`` of ``world_size`` workers, slowest rank."""
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
        return float(json.loads(result.read_text(encoding="utf-8"))["elapsed_s"])
