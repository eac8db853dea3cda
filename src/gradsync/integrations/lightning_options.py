"""GradsyncStrategy's options, checked when the strategy is built (before Lightning starts any process).

The strategy takes gradsync's DataParallel options (``algorithm``, ``compression``, ``bucket_cap_mb``,
``shard``, ``broadcast_buffers``, ``gradient_as_bucket_view``, ``debug``) and the options Lightning's
``DDPStrategy`` takes that do not depend on torch's DDP (the accelerator, devices, cluster environment,
checkpoint IO, precision plugin, process group backend, timeout, start method). DDP's own options are
refused in one line that says why; any other name in one line that lists what is accepted.
"""

from __future__ import annotations

from gradsync import compression as compressions
from gradsync.collectives import ops as collectives
from gradsync.parallel.bucketing import bucket_cap_bytes
from gradsync.parallel.debug_checks import resolve_debug
from gradsync.parallel.shard_layout import check_sharding
from gradsync.process_group import BACKENDS

GRADSYNC_OPTIONS = ("algorithm", "compression", "bucket_cap_mb", "shard", "broadcast_buffers",
                    "gradient_as_bucket_view", "debug")
"""DataParallel's options the strategy passes on."""

LIGHTNING_OPTIONS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                     "process_group_backend", "timeout", "start_method")
"""DDPStrategy's options the strategy honours as DDPStrategy does."""

FABRIC_OPTIONS = tuple("precision" if name == "precision_plugin" else name for name in LIGHTNING_OPTIONS)
"""The same for Fabric's DDPStrategy (its precision plugin is ``precision``)."""

START_METHODS = ("popen", "spawn", "fork", "forkserver")

PROCESS_GROUP_BACKENDS = tuple(name for name in BACKENDS if name != "auto")
"""The torch.distributed backends gradsync runs over (``gradsync.init``'s, less "auto": None lets Lightning pick)."""

DDP_ONLY = {
    "find_unused_parameters": "gradsync always handles parameters without a gradient (they count as zero in "
                              "the average), drop it",
    "static_graph": "gradsync's buckets are laid out after the first backward whatever the graph, drop it",
    "ddp_comm_hook": "gradsync reduces its buckets itself; choose algorithm= and compression= instead",
    "ddp_comm_state": "gradsync reduces its buckets itself; choose algorithm= and compression= instead",
    "ddp_comm_wrapper": "gradsync reduces its buckets itself; choose compression='fp16' or 'bf16' instead",
    "model_averaging_period": "post-local SGD is torch DDP's; gradsync's local SGD is gradsync.LocalSGD, not a "
                              "Lightning strategy",
    "device_ids": "Lightning chooses the device per process",
    "output_device": "Lightning chooses the device per process",
    "process_group": "gradsync adopts the group Lightning initialises",
    "dim": "gradsync does not scatter inputs: each process loads its own batch",
    "mixed_precision": "use Trainer(precision=...)",
    "init_sync": "gradsync always broadcasts rank 0's parameters at wrapping",
    "delay_all_reduce_named_params": "gradsync starts each bucket as soon as its gradients are ready",
    "param_to_hook_all_reduce": "gradsync starts each bucket as soon as its gradients are ready",
    "skip_all_reduce_unused_params": "gradsync always handles parameters without a gradient",
}
"""torch DDP's keyword arguments (DDPStrategy passes them to DistributedDataParallel) and why they are refused."""

UNSERVED_SHARD = {
    "parameters": "ZeRO-3 leaves every parameter a 1-D shard outside a forward, and Lightning reads the "
                  "LightningModule's parameters whole (model summary, checkpoint loading before wrapping, the "
                  "module after fit); use shard='optimizer' or 'gradients'",
}
"""Shard levels GradsyncStrategy refuses, and why."""


def accepted(lightning_options: tuple[str, ...] = LIGHTNING_OPTIONS) -> str:
    """The accepted option names, for error messages."""
    return ", ".join(GRADSYNC_OPTIONS + lightning_options)


def check_extra_options(options: dict, lightning_options: tuple[str, ...] = LIGHTNING_OPTIONS) -> None:
    """Refuse options the strategy does not take, in one line (``lightning_options``: the Lightning ones it takes).

    Raises:
        ValueError: a torch DDP option (named, with why gradsync cannot honour it).
        TypeError: any other unknown name (listing the accepted ones).
    """
    for name in options:
        if name in DDP_ONLY:
            raise ValueError(f"GradsyncStrategy: option {name!r} is torch DDP's and cannot be honoured: "
                             f"{DDP_ONLY[name]} (accepted: {accepted(lightning_options)})")
    if options:
        name = next(iter(options))
        raise TypeError(f"GradsyncStrategy got an unexpected option {name!r}; accepted: {accepted(lightning_options)}")


def check_values(algorithm, compression, bucket_cap_mb, shard, broadcast_buffers, gradient_as_bucket_view, debug,
                 start_method, process_group_backend) -> None:
    """Check gradsync's values as DataParallel would, before any process starts, each in one line.

    ``compression`` is resolved to learn its capabilities only (a name makes a throwaway compressor; an
    instance is not attached here).

    Raises:
        ValueError: unknown algorithm, compression name, shard level or start method; a process group
            backend gradsync cannot run over (:data:`PROCESS_GROUP_BACKENDS`, or None); a bad
            ``bucket_cap_mb``; a shard level the strategy does not serve (:data:`UNSERVED_SHARD`) or
            that cannot combine with the compression or the algorithm.
        TypeError: ``compression`` of another type, non-bool flags.
    """
    collectives.validate_algorithm(algorithm)
    bucket_cap_bytes(bucket_cap_mb)
    resolved = compressions.resolve(compression)
    for name, value in (("broadcast_buffers", broadcast_buffers), ("gradient_as_bucket_view", gradient_as_bucket_view)):
        if not isinstance(value, bool):
            raise TypeError(f"GradsyncStrategy: {name} must be True or False, got {value!r}")
    resolve_debug(debug)
    check_sharding(shard, resolved, gradient_as_bucket_view, algorithm)
    if shard in UNSERVED_SHARD:
        raise ValueError(f"GradsyncStrategy: shard={shard!r} is not served under Lightning: {UNSERVED_SHARD[shard]}")
    if start_method not in START_METHODS:
        raise ValueError(f"GradsyncStrategy: unknown start_method {start_method!r}; choose one of "
                         f"{', '.join(START_METHODS)}")
    if process_group_backend is not None and process_group_backend not in PROCESS_GROUP_BACKENDS:
        raise ValueError(f"GradsyncStrategy: process_group_backend {process_group_backend!r} is not one gradsync "
                         f"runs over; choose 'gloo' (CPU), 'nccl' (CUDA) or None (Lightning picks by accelerator)")
