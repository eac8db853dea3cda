"""Before step 1, what one rank will hold: ``gradsync.preflight(model, optimizer, sample_batch, world_size)``.

Per rank and in bytes, from what gradsync's own engine keeps at each shard level
(:mod:`~gradsync.parallel.zero`; docs/sharding.md's table):

* parameters: the model's (every level up to ZeRO-2 keeps them whole);
* gradients: ``.grad`` unsharded; this rank's chunk under ZeRO-1/2 (each ``.grad`` is released once
  copied into its bucket);
* optimizer state: the optimizer's per-element slots, found by stepping a copy of it on a one-element
  tensor (Adam's two moments, SGD's momentum buffer), times the elements this rank steps;
* buffers: the gradient buckets (whole unsharded and under ZeRO-1; two slabs of the largest bucket under
  ZeRO-2);
* activations: what autograd saves for backward in one forward of ``sample_batch``, measured
  (``torch.autograd.graph.saved_tensors_hooks``), each storage once.

DeepSpeed's ``estimate_zero2_model_states_mem_needs`` and Accelerate's ``estimate-memory`` give the model
states only; this adds activations and communication buffers and compares them with the memory available.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from gradsync.errors import MemoryPreflightError
from gradsync.parallel.bucketing import DEFAULT_FIRST_BUCKET_CAP_BYTES, assign_buckets, bucket_cap_bytes
from gradsync.parallel.shard_layout import IMPLEMENTED_LEVELS, check_shard
from gradsync.parallel.zero import ZERO2_SLABS

PARTS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "buffer_bytes", "activation_bytes")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at its peak, by part (``total_bytes`` = their sum)."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, part) for part in PARTS)

    def largest_part(self) -> str:
        return max(PARTS, key=lambda part: getattr(self, part))


def state_slots(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of per-element optimizer state per parameter byte (2 for Adam/AdamW, 1 for SGD with momentum,
    0 for plain SGD), measured by stepping a copy of ``optimizer``'s class and first group on one element."""
    probe = torch.zeros(1, requires_grad=True)
    group = {key: value for key, value in optimizer.param_groups[0].items() if key != "params"}
    try:
        twin = type(optimizer)([probe], **group)
    except TypeError:
        twin = copy.deepcopy(optimizer)
        twin.param_groups = [{**group, "params": [probe]}]
        twin.state.clear()
    probe.grad = torch.ones(1)
    twin.step()
    return sum(value.numel() * value.element_size() // probe.element_size()
               for value in twin.state[probe].values() if isinstance(value, torch.Tensor) and value.dim() > 0)


def activation_bytes(module: nn.Module, sample_batch, loss_fn=None) -> int:
    """Bytes autograd saves for backward in one forward of ``sample_batch`` (each storage once; parameters,
    which are counted as parameters, excluded)."""
    parameters = {param.untyped_storage().data_ptr() for param in module.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    inputs = sample_batch if isinstance(sample_batch, (tuple, list)) else (sample_batch,)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = module(*inputs)
    if loss_fn is not None:
        output = loss_fn(output)
    del output
    return sum(seen.values())


def estimate(module: nn.Module, optimizer: torch.optim.Optimizer, sample_batch, world_size: int,
             shard: str = "none", *, bucket_cap_mb: float = 25.0, loss_fn=None) -> MemoryEstimate:
    """One rank's :class:`MemoryEstimate` for ``module`` trained with ``optimizer`` on batches like
    ``sample_batch`` (one rank's micro-batch: a tensor or a tuple of the forward's arguments).

    Raises:
        ValueError: ``world_size`` < 1, a bad ``shard`` or ``bucket_cap_mb``.
    """
    check_shard(shard)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    params = [param for param in module.parameters() if param.requires_grad]
    param_bytes = sum(param.numel() * param.element_size() for param in module.parameters())
    trainable = sum(param.numel() * param.element_size() for param in params)
    buckets = assign_buckets(params, bucket_cap_bytes(bucket_cap_mb), DEFAULT_FIRST_BUCKET_CAP_BYTES) if params else []
    bucket_bytes = [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in buckets]
    sharded = shard != "none"
    share = -(-trainable // world_size) if sharded else trainable
    slabs = min(ZERO2_SLABS, len(bucket_bytes)) * max(bucket_bytes, default=0)
    buffers = {"none": trainable, "optimizer": trainable, "gradients": slabs, "parameters": slabs}[shard]
    if shard == "parameters":  # this rank's shard and two whole units (the running one, the prefetched one)
        param_bytes += share + 2 * max(bucket_bytes, default=0) - trainable
    return MemoryEstimate(parameter_bytes=param_bytes, gradient_bytes=share,
                          optimizer_state_bytes=state_slots(optimizer) * share, buffer_bytes=buffers,
                          activation_bytes=activation_bytes(module, sample_batch, loss_fn))


def preflight(module: nn.Module, optimizer: torch.optim.Optimizer, sample_batch, world_size: int,
              shard: str = "none", *, available_bytes: int, bucket_cap_mb: float = 25.0,
              loss_fn=None) -> MemoryEstimate:
    """:func:`estimate`, checked against ``available_bytes`` per rank.

    Raises:
        MemoryPreflightError: the estimate exceeds ``available_bytes``; the message names the largest part
            and the first shard level, then the first world size up to 64, that fits, or says that none does.
    """
    found = estimate(module, optimizer, sample_batch, world_size, shard, bucket_cap_mb=bucket_cap_mb,
                     loss_fn=loss_fn)
    if found.total_bytes <= available_bytes:
        return found
    raise MemoryPreflightError(_refusal(found, module, optimizer, sample_batch, world_size, shard,
                                        available_bytes, bucket_cap_mb, loss_fn), estimate=found)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _refusal(found, module, optimizer, sample_batch, world_size, shard, available, bucket_cap_mb, loss_fn) -> str:
    part = found.largest_part()
    words = (f"gradsync preflight: one rank needs {_mib(found.total_bytes)} at world size {world_size} with "
             f"shard={shard!r}, {_mib(available)} available; the largest part is "
             f"{part.replace('_bytes', '').replace('_', ' ')} ({_mib(getattr(found, part))})")
    for level in IMPLEMENTED_LEVELS[IMPLEMENTED_LEVELS.index(shard) + 1:]:
        other = estimate(module, optimizer, sample_batch, world_size, level, bucket_cap_mb=bucket_cap_mb,
                         loss_fn=loss_fn)
        if other.total_bytes <= available:
            return f"{words}; shard={level!r} would need {_mib(other.total_bytes)}"
    size = world_size * 2
    while size <= 64:
        other = estimate(module, optimizer, sample_batch, size, IMPLEMENTED_LEVELS[-1], bucket_cap_mb=bucket_cap_mb,
                         loss_fn=loss_fn)
        if other.total_bytes <= available:
            return f"{words}; shard={IMPLEMENTED_LEVELS[-1]!r} at world size {size} would need " \
                   f"{_mib(other.total_bytes)}"
        size *= 2
    return (f"{words}; no shard level up to {IMPLEMENTED_LEVELS[-1]!r} nor world size up to 64 fits: the "
            f"parameters alone need {_mib(found.parameter_bytes)} per rank (sharding the parameters, or tensor "
            f"or pipeline parallelism beyond gradsync, would be needed)")
