"""Ray Train: ``prepare_model`` wraps a model in gradsync.DataParallel inside a ``TorchTrainer`` worker.

The analogue of ``ray.train.torch.prepare_model`` (which wraps in torch's
DistributedDataParallel): inside the ``train_loop_per_worker`` of a
``ray.train.torch.TorchTrainer``, Ray has already set up torch.distributed
(its ``TorchConfig``: Gloo on CPU, NCCL on GPU, one rank per worker);
:func:`prepare_model` adopts that group (``gradsync.init()`` adopts an
initialised default group), moves the model to Ray's device and returns
``gradsync.DataParallel`` around it::

    import ray.train, torch
    from ray.train.torch import TorchTrainer
    import gradsync.integrations.ray as gray

    def train_loop(config):
        model = gray.prepare_model(MyModel(), algorithm="auto", compression="fp16")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        extra = gray.load_checkpoint(model, optimizer)          # None on a fresh start
        for step in range(extra["step"] if extra else 0, config["steps"]):
            ...  # forward, backward, optimizer.step()
            gray.report_checkpoint({"loss": loss.item()}, model, optimizer, step=step + 1,
                                   extra={"step": step + 1})

    TorchTrainer(train_loop, scaling_config=ray.train.ScalingConfig(num_workers=2)).fit()

Checkpoints (:mod:`~gradsync.integrations.ray_checkpoint`) hold every rank's
own part (compressor error feedback, a ZeRO optimizer's shard), so a run that
Ray restarts after a worker failure (``FailureConfig(max_failures=...)``)
continues where the last report left it. See docs/ray.md.

Needs the ``ray`` extra (``pip install 'gradsync[ray]'``); without it any use
raises :class:`~gradsync.errors.MissingExtraError` in one line.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import gradsync
from gradsync import compression as compressions
from gradsync.collectives.ops import validate_algorithm
from gradsync.errors import import_extra
from gradsync.integrations.adopt import adopt_torch_group, agree_on_timeout  # noqa: F401 (re-exported)
from gradsync.integrations.ray_checkpoint import load_checkpoint, report_checkpoint, save_checkpoint
from gradsync.parallel.bucketing import bucket_cap_bytes
from gradsync.parallel.shard_layout import check_sharding

FEATURE = "gradsync.integrations.ray"
# ray.train.torch.prepare_model's own options: gradsync's prepare_model always wraps in its DataParallel
RAY_ONLY_OPTIONS = ("parallel_strategy", "parallel_strategy_kwargs")
# models prepare_model refuses to wrap again (their state_dict keys would become module.module.*)
WRAPPERS = (gradsync.DataParallel, nn.parallel.DistributedDataParallel, nn.DataParallel)
OUTSIDE_WORKER = ("gradsync.integrations.ray.prepare_model must be called inside a Ray Train worker (the "
                  "train_loop_per_worker of a ray.train.torch.TorchTrainer), not in the driver or another process")


def ray_train():
    """The ``ray.train`` module, or :class:`~gradsync.errors.MissingExtraError` naming the ``ray`` extra."""
    return import_extra("ray.train", "ray", FEATURE)


def prepare_model(model: nn.Module, algorithm: str = "auto", compression=None, bucket_cap_mb: float = 25.0,
                  shard: str = "none", *, broadcast_buffers: bool = True, gradient_as_bucket_view: bool = False,
                  move_to_device: bool | torch.device = True, timeout_s: float | None = None,
                  **ray_options) -> gradsync.DataParallel:
    """Wrap ``model`` in :class:`gradsync.DataParallel` over the process group Ray Train set up.

    Call it inside a ``TorchTrainer``'s training function, on every worker (it is collective: the
    replicas start from rank 0's parameters and buffers, as with ``ray.train.torch.prepare_model``).
    The options are checked before anything else, so a bad one is refused in one line on every worker.

    Args:
        model: the module to train (its parameters float tensors of any shape).
        algorithm: the AllReduce algorithm (``gradsync.ALGORITHMS``; ``"auto"`` picks per bucket).
        compression: None, a name (``"fp16"``, ``"bf16"``, ``"onebit"``, ``"topk"``, ``"powersgd"``)
            or a :class:`gradsync.compression.Compressor`.
        bucket_cap_mb: bucket size in MiB (> 0).
        shard: ``"none"``, ``"optimizer"``, ``"gradients"`` or ``"parameters"`` (ZeRO-1/2/3; pass the
            optimizer through ``model.shard_optimizer``).
        broadcast_buffers, gradient_as_bucket_view: as :class:`gradsync.DataParallel`'s.
        move_to_device: True: move the model to ``ray.train.torch.get_device()``; a ``torch.device``:
            to that one; False: leave it where it is.
        timeout_s: seconds any of gradsync's collectives may take (> 0) before it raises
            :class:`gradsync.CollectiveTimeoutError` naming the peer; None: gradsync's default (300 s) for
            the call that initialises gradsync, the initialised group's timeout after it. The group's timeout
            is set once per worker: a later call (or one after ``gradsync.init``) that asks for another is
            refused rather than ignored.

    Returns:
        The wrapped model (``.module`` is ``model``, moved).

    Raises:
        TypeError / ValueError: a bad option, in one line naming it (Ray's own ``parallel_strategy``
            and ``parallel_strategy_kwargs`` included: gradsync always wraps in its DataParallel); a model
            already wrapped (a gradsync.DataParallel, torch's DistributedDataParallel or DataParallel);
            a ``timeout_s`` other than the one gradsync was initialised with (ValueError here,
            CollectiveMismatchError on the workers that asked for the initialised one).
        RuntimeError: called outside a Ray Train worker, or in one without a torch.distributed group
            (a trainer other than ``TorchTrainer``).
        MissingExtraError: Ray is not installed (the ``ray`` extra).
    """
    compression = check_options(model, algorithm, compression, bucket_cap_mb, shard, gradient_as_bucket_view,
                                move_to_device, timeout_s, ray_options)
    train = ray_train()
    world_size = worker_world_size(train)
    adopt_process_group(world_size, timeout_s)
    if move_to_device is not False:
        device = move_to_device if isinstance(move_to_device, torch.device) else ray_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = model.to(device)
    return gradsync.DataParallel(model, bucket_cap_mb=bucket_cap_mb, algorithm=algorithm, compression=compression,
                                 broadcast_buffers=broadcast_buffers, shard=shard,
                                 gradient_as_bucket_view=gradient_as_bucket_view)


def check_options(model, algorithm, compression, bucket_cap_mb, shard, gradient_as_bucket_view, move_to_device,
                  timeout_s, ray_options: dict):
    """Refuse a bad :func:`prepare_model` option in one line naming it; returns the resolved compressor."""
    if ray_options:
        name = sorted(ray_options)[0]
        why = (" (ray.train.torch.prepare_model's option: gradsync's always wraps in gradsync.DataParallel)"
               if name in RAY_ONLY_OPTIONS else "")
        raise TypeError(f"prepare_model has no option {name!r}{why}; its options: algorithm, compression, "
                        f"bucket_cap_mb, shard, broadcast_buffers, gradient_as_bucket_view, move_to_device, timeout_s")
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_model wraps a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, WRAPPERS):
        owner = "gradsync" if isinstance(model, gradsync.DataParallel) else "torch.nn"
        raise TypeError(f"prepare_model got a model already wrapped in {owner}.{type(model).__name__}: pass the "
                        f"module itself (its .module), or use the model prepare_model returned")
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a string, one of {', '.join(gradsync.ALGORITHMS)}; "
                        f"got {type(algorithm).__name__}")
    validate_algorithm(algorithm)
    bucket_cap_bytes(bucket_cap_mb)
    resolved = compressions.resolve(compression)
    check_sharding(shard, resolved, gradient_as_bucket_view, algorithm)
    if not isinstance(move_to_device, (bool, torch.device)):
        raise TypeError(f"move_to_device must be True, False or a torch.device, got {type(move_to_device).__name__}")
    ok = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
    if timeout_s is not None and not (ok and 0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    return resolved


def worker_world_size(train) -> int:
    """The number of Ray Train workers, asked of this worker's context; one line if this is no worker."""
    try:
        world_size = int(train.get_context().get_world_size())
    except Exception:  # Ray Train v2 raises RuntimeError outside a worker
        raise RuntimeError(OUTSIDE_WORKER) from None
    if not in_ray_actor():  # Ray Train v1 answers a world of 1 in the driver too
        raise RuntimeError(OUTSIDE_WORKER)
    return world_size


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor (Ray Train's workers are; a driver is not)."""
    ray = import_extra("ray", "ray", FEATURE)
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def adopt_process_group(world_size: int, timeout_s: float | None) -> None:
    """Make gradsync's default group over the torch.distributed group Ray set up (once per worker, with its
    backend), then check on every worker that ``timeout_s`` (None: any) is the group's timeout
    (:func:`~gradsync.integrations.adopt.agree_on_timeout`).

    Raises:
        RuntimeError: no torch.distributed group. ValueError / CollectiveMismatchError: another timeout.
    """
    import torch.distributed as dist

    if not gradsync.is_initialized() and not dist.is_initialized():
        raise RuntimeError(f"this Ray Train worker (1 of {world_size}) has no torch.distributed process "
                           f"group: use ray.train.torch.TorchTrainer, whose TorchConfig sets it up")
    adopt_torch_group(timeout_s, "prepare_model", "timeout_s",
                      "pass it to the first prepare_model call or to gradsync.init(timeout=...)")


def ray_device() -> torch.device:
    """This worker's device as Ray Train assigned it (``ray.train.torch.get_device()``; its first if several)."""
    device = import_extra("ray.train.torch", "ray", FEATURE).get_device()
    return device[0] if isinstance(device, list) else device


__all__ = ["load_checkpoint", "prepare_model", "report_checkpoint", "save_checkpoint"]
