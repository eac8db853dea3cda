"""A fixed Ray Train run to compare and time: the same seeded MLP loop under gradsync's or Ray's prepare_model.

:func:`train_loop` is a ``TorchTrainer`` training function: a small MLP on
fixed random data (the same on every worker, drawn from ``seed``), plain SGD
with momentum, ``steps`` optimizer steps of ``batch_size`` samples per worker
(worker ``r`` takes rows ``r*B .. r*B+B-1`` of each global batch, as one
process with the whole batch would). ``impl`` picks the wrapper:
``"gradsync"`` (:func:`gradsync.integrations.ray.prepare_model`) or ``"ddp"``
(``ray.train.torch.prepare_model``: torch's DistributedDataParallel). With
``checkpoint_every`` the gradsync loop reports a checkpoint every that many
steps and starts from ``ray.train.get_checkpoint()``; ``fail_at`` =
``"RANK:STEP"`` ends worker RANK with ``os._exit(1)`` before step STEP on the
first attempt only (a marker file in ``marker_dir`` remembers it), so
``FailureConfig(max_failures=1)`` restarts the group from the last checkpoint.

Samples/s are measured inside the workers' loop, from the end of the first
``warmup_steps`` steps to the end of the run (Ray's start-up, the process
group and the wrapper's construction excluded): what a bench times.
:func:`run` starts the trainer from a driver; ``python -m
gradsync.integrations.ray_run --address HOST:PORT ...`` does it from a shell
and prints the result as JSON (the two-host test runs it inside a test host).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from gradsync.errors import import_extra

FEATURE = "gradsync.integrations.ray"
IMPLS = ("gradsync", "ddp")
INPUT_NUMEL, NUM_CLASSES = 40, 10
FAIL_EXIT_CODE = 1
FINAL_FILE = "parameters.pt"  # in the run's last checkpoint: rank 0's final state_dict


@dataclass
class LoopConfig:
    """What :func:`train_loop` runs (``TorchTrainer(train_loop_config=asdict(config))``)."""

    impl: str = "gradsync"  # gradsync | ddp
    steps: int = 8  # optimizer steps in all
    batch_size: int = 16  # samples per worker per step
    num_samples: int = 256  # the fixed data set; a step's rows wrap around it
    hidden: int = 64  # the MLP's hidden width
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    algorithm: str = "auto"
    compression: str | None = None
    bucket_cap_mb: float = 25.0
    shard: str = "none"
    checkpoint_every: int = 0  # 0: no checkpoints
    fail_at: str | None = None  # "RANK:STEP": that worker exits before step STEP (from 1), once
    marker_dir: str | None = None  # where the failure's marker file goes (shared by the workers)
    warmup_steps: int = 2  # steps before the samples/s clock starts

    def check(self) -> "LoopConfig":
        """Refuse a bad field in one line naming it; returns itself."""
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {self.impl!r}")
        for name in ("steps", "batch_size", "num_samples", "hidden"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every!r}")
        if self.impl == "ddp" and (self.checkpoint_every or self.compression or self.shard != "none"):
            raise ValueError("checkpoint_every, compression and shard are gradsync's: impl 'ddp' takes none")
        if self.fail_at is not None:
            fail_point(self.fail_at)
            if self.marker_dir is None:
                raise ValueError("fail_at needs marker_dir, a folder every worker sees (it marks the first attempt)")
        return self


def fail_point(text: str) -> tuple[int, int]:
    """``"RANK:STEP"`` -> (rank, step); ValueError naming ``fail_at`` otherwise."""
    try:
        rank, step = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"fail_at must be RANK:STEP (integers), got {text!r}") from None
    if rank < 0 or step < 1:
        raise ValueError(f"fail_at must be RANK:STEP with RANK >= 0 and STEP >= 1, got {text!r}")
    return rank, step


def make_model(hidden: int, seed: int) -> nn.Module:
    """The MLP, initialised from ``seed``: (B, 40) float32 -> (B, 10) logits."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(INPUT_NUMEL, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, NUM_CLASSES))


def make_data(num_samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random data: inputs (N, 40) float32 and labels (N,) int64, the same on every worker."""
    generator = torch.Generator().manual_seed(seed + 1)
    inputs = torch.randn(num_samples, INPUT_NUMEL, generator=generator)
    return inputs, torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator)


def worker_batch(data, step: int, rank: int, world_size: int, batch_size: int):
    """Worker ``rank``'s rows of global batch ``step`` (from 0): (B, 40) inputs and (B,) labels."""
    inputs, labels = data
    first = step * batch_size * world_size + rank * batch_size
    rows = torch.arange(first, first + batch_size) % inputs.shape[0]
    return inputs[rows], labels[rows]


def train_loop(config: dict) -> None:
    """A ``TorchTrainer`` training function (see the module's docstring); ``config``: :class:`LoopConfig`'s fields.

    At the end rank 0 reports ``{"step", "loss", "samples_per_s", "timed_steps", "timed_s", "world_size",
    "local_world_size", "impl", "resumed_from"}`` (``local_world_size``: workers on rank 0's node) with a
    checkpoint holding the final parameters (:data:`FINAL_FILE`).
    """
    settings = LoopConfig(**config).check()
    train = import_extra("ray.train", "ray", FEATURE)
    context = train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    model, optimizer, start = _prepare(settings)
    data, loss = make_data(settings.num_samples, settings.seed), torch.zeros(())
    timed_from = time.perf_counter() if start >= settings.warmup_steps else None
    for step in range(start, settings.steps):
        _maybe_fail(settings, rank, step + 1)
        inputs, labels = worker_batch(data, step, rank, world_size, settings.batch_size)
        loss = nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step + 1 == settings.warmup_steps:
            timed_from = time.perf_counter()
        if settings.checkpoint_every and (step + 1) % settings.checkpoint_every == 0 and step + 1 < settings.steps:
            from gradsync.integrations.ray_checkpoint import report_checkpoint
            report_checkpoint({"step": step + 1, "loss": loss.item()}, model, optimizer, step=step + 1,
                              extra={"step": step + 1})
    timed_steps = settings.steps - max(start, settings.warmup_steps)
    timed_s = time.perf_counter() - timed_from if timed_from is not None else 0.0
    metrics = {"step": settings.steps, "loss": loss.item(), "world_size": world_size, "impl": settings.impl,
               "local_world_size": context.get_local_world_size(),
               "resumed_from": start, "timed_steps": timed_steps, "timed_s": timed_s,
               "samples_per_s": timed_steps * settings.batch_size * world_size / timed_s if timed_s else 0.0}
    _report_final(train, metrics, _module(model) if rank == 0 else None)


def _report_final(train, metrics: dict, module: nn.Module | None) -> None:
    """The last report: rank 0's with a checkpoint of the final parameters (Ray's ``Result`` keeps the metrics
    of the latest checkpoint only), the others' without."""
    if module is None:
        train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="gradsync-ray-final-") as folder:
        torch.save({name: tensor.detach().cpu() for name, tensor in module.state_dict().items()},
                   Path(folder) / FINAL_FILE)
        train.report(metrics, checkpoint=train.Checkpoint.from_directory(folder), checkpoint_dir_name="final")


def _prepare(settings: LoopConfig):
    """(wrapped model, optimizer, the step to start from): gradsync's or Ray's prepare_model."""
    model = make_model(settings.hidden, settings.seed)
    if settings.impl == "ddp":
        model = import_extra("ray.train.torch", "ray", FEATURE).prepare_model(model)
        return model, torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=settings.momentum), 0
    from gradsync.integrations.ray import load_checkpoint, prepare_model
    model = prepare_model(model, algorithm=settings.algorithm, compression=settings.compression,
                          bucket_cap_mb=settings.bucket_cap_mb, shard=settings.shard)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=settings.momentum)
    if settings.shard != "none":
        optimizer = model.shard_optimizer(optimizer)
    extra = load_checkpoint(model, optimizer) if settings.checkpoint_every else None
    return model, optimizer, int(extra["step"]) if extra else 0


def _module(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def _maybe_fail(settings: LoopConfig, rank: int, step: int) -> None:
    """End this worker at once (no clean-up: a crash) at ``fail_at``, the first time only."""
    if settings.fail_at is None or fail_point(settings.fail_at) != (rank, step):
        return
    marker = Path(settings.marker_dir) / f"failed-rank{rank}-step{step}"
    if marker.exists():
        return
    marker.write_text(f"{os.getpid()}\n")
    # Ray registers a reported checkpoint when its controller gets round to it: wait for that, so the restart
    # resumes from the last report (without this it may resume from the one before: also right, not fixed)
    wait = getattr(import_extra("ray.train", "ray", FEATURE), "get_all_reported_checkpoints", None)
    if wait is not None:
        wait(timeout_s=60)
    print(f"gradsync ray_run: injected failure of rank {rank} before step {step}", file=sys.stderr, flush=True)
    os._exit(FAIL_EXIT_CODE)


def run(config: LoopConfig, *, num_workers: int = 2, storage_path: str, name: str | None = None,
        max_failures: int = 0, placement_strategy: str = "PACK", cpus_per_worker: float = 1.0) -> dict:
    """Run :func:`train_loop` with ``TorchTrainer`` on the Ray cluster this driver is connected to.

    Args:
        config: the loop's settings.
        num_workers: Ray Train workers (CPU only; ``cpus_per_worker`` each).
        storage_path: the run's storage (a folder every node sees: checkpoints go there).
        name: the run's folder under ``storage_path`` (None: a fresh one; Ray Train resumes a run whose
            folder already holds checkpoints).
        max_failures: worker-group restarts Ray may make (``FailureConfig``).
        placement_strategy: ``ScalingConfig``'s (``"STRICT_SPREAD"``: one worker per node).

    Returns:
        Rank 0's last metrics (see :func:`train_loop`) plus ``"fit_s"``, the driver's wall time of ``fit()``,
        and ``"parameters"``, the final ``state_dict`` (CPU tensors).

    Raises:
        ValueError: a bad config field. Ray's ``TrainingFailedError``: the run failed more often than allowed.
    """
    config.check()
    name = name if name is not None else f"gradsync-ray-{uuid.uuid4().hex[:8]}"
    train = import_extra("ray.train", "ray", FEATURE)
    trainer_class = import_extra("ray.train.torch", "ray", FEATURE).TorchTrainer
    trainer = trainer_class(
        train_loop, train_loop_config=asdict(config),
        scaling_config=train.ScalingConfig(num_workers=num_workers, use_gpu=False,
                                           resources_per_worker={"CPU": cpus_per_worker},
                                           placement_strategy=placement_strategy),
        run_config=train.RunConfig(storage_path=str(storage_path), name=name,
                                   failure_config=train.FailureConfig(max_failures=max_failures),
                                   checkpoint_config=train.CheckpointConfig(num_to_keep=2)))
    started = time.perf_counter()
    result = trainer.fit()
    fit_s = time.perf_counter() - started
    with result.checkpoint.as_directory() as folder:
        parameters = torch.load(Path(folder) / FINAL_FILE, weights_only=True)
    return {**dict(result.metrics or {}), "fit_s": fit_s, "parameters": parameters}


def main(argv: list[str] | None = None) -> int:
    """``python -m gradsync.integrations.ray_run``: connect to a Ray cluster, run, print the metrics as JSON."""
    parser = argparse.ArgumentParser(prog="python -m gradsync.integrations.ray_run", description=__doc__.split("\n")[0])
    parser.add_argument("--address", required=True, help="the Ray cluster (HOST:PORT of its head)")
    parser.add_argument("--node-ip-address", default=None, help="this driver's node address (inside a test host)")
    parser.add_argument("--storage", required=True, help="storage folder every node sees")
    parser.add_argument("--name", default=None, help="the run's folder in the storage (default: a fresh one)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-failures", type=int, default=0)
    parser.add_argument("--placement-strategy", default="PACK")
    parser.add_argument("--out", default=None, help="write the final parameters here (torch.save)")
    for field, default in asdict(LoopConfig()).items():
        kind = type(default) if default is not None else str
        parser.add_argument(f"--{field.replace('_', '-')}", type=kind, default=default)
    args = vars(parser.parse_args(argv))
    ray = import_extra("ray", "ray", FEATURE)
    options = {"address": args.pop("address"), "log_to_driver": True}
    node_ip = args.pop("node_ip_address")
    if node_ip:
        options["_node_ip_address"] = node_ip
    ray.init(**options)
    out = args.pop("out")
    try:
        driver = {name: args.pop(name) for name in ("storage", "name", "num_workers", "max_failures",
                                                     "placement_strategy")}
        metrics = run(LoopConfig(**args), num_workers=driver["num_workers"], storage_path=driver["storage"],
                      name=driver["name"], max_failures=driver["max_failures"],
                      placement_strategy=driver["placement_strategy"])
    finally:
        ray.shutdown()
    parameters = metrics.pop("parameters")
    if out:
        torch.save(parameters, out)
    print(json.dumps(metrics, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
