"""Before step 1, what one rank will hold: ``gradsync.preflight(model, optimizer, sample_batch, world_size)``.

Per rank and in bytes, at the step's peak, from what gradsync's own engine
keeps at each shard level (:mod:`~gradsync.parallel.zero`; docs/sharding.md's table):

* parameters: the model's, whole up to ZeRO-2; under ZeRO-3 (``"parameters"``)
  this rank's shard of every unit (each unit padded to a multiple of the
  world size), the root unit gathered for the whole step and at most two
  other units gathered at once (the one running and the one prefetched);
* gradients: ``.grad`` whole without sharding (none with
  ``gradient_as_bucket_view``: the buckets hold them); this rank's chunk of
  every bucket under ZeRO-1/2, and under ZeRO-3 also the whole ``.grad`` of
  the two units in flight;
* optimizer state: the optimizer's per-element slots, found by stepping a
  copy of it on a one-element tensor (Adam's two moments, SGD's momentum
  buffer), times the elements this rank steps;
* buffers: the gradient buckets or slabs and what the collectives keep
  (:mod:`~gradsync.parallel.comm_buffers`: the shm segment and arena, the
  ring's receive segments);
* activations: from one measured forward and backward of ``sample_batch``
  (:mod:`~gradsync.parallel.pass_memory`): the most the pass holds (saved
  activations, the backward's temporaries, and the gradients each level keeps
  at that point of the backward) less the gradients counted above, so that
  the parts add up to the peak, plus what the allocator kept resident beyond
  the pass's tensors (measured on the same pass); an evaluation pass
  (``evaluated``) is counted the same way and the larger of the two taken.

DeepSpeed's ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_...`` and Accelerate's
``estimate-memory`` give the model states only; this adds activations and communication buffers and
compares them with the memory available (:mod:`~gradsync.parallel.preflight_fit`, where
``gradsync.preflight`` lives).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from gradsync.collectives.registry import DEFAULT_ALGORITHM
from gradsync.parallel import comm_buffers
from gradsync.parallel.bucketing import DEFAULT_FIRST_BUCKET_CAP_BYTES, assign_buckets, bucket_cap_bytes
from gradsync.parallel.pass_memory import PassMemory, measure_pass
from gradsync.parallel.shard_layout import check_shard
from gradsync.parallel.zero import zero_units

PARTS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "buffer_bytes", "activation_bytes",
         "copied_bytes")
ZERO3_UNITS_IN_FLIGHT = 2  # ZeRO-3: the unit running and the one prefetched, gathered besides the root unit


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at its peak, by part (``total_bytes`` = their sum).

    ``copied_bytes`` is 0 but for a rank alone in a memory cgroup (``gradsync train --memory-limit-mib``):
    the pages the kernel charges it beyond its own growth, mostly copy-on-write copies of the pages it
    shares with the forkserver it was forked from (torch's imported modules), measured after the
    preflight's passes (:func:`gradsync.train.process_memory.copied_bytes`).
    """

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    activation_bytes: int
    copied_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, part) for part in PARTS)

    def largest_part(self) -> str:
        return max(PARTS, key=lambda part: getattr(self, part))


def state_slots(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of per-element optimizer state per parameter byte (2 for Adam/AdamW, 1 for SGD with momentum,
    0 for plain SGD), measured by stepping a copy of ``optimizer``'s class and first group on one element.
    A :class:`~gradsync.ShardedOptimizer` is measured by the torch optimizer it wraps."""
    optimizer = getattr(optimizer, "optimizer", optimizer)
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


def _unit_numels(module: nn.Module, bucket_cap_mb: float) -> tuple[int, list[int]]:
    """ZeRO-3's units: ``(root unit numel, other units' numels)`` over the trainable parameters, split as
    ``DataParallel(shard="parameters", bucket_cap_mb=...)`` splits them by size (:mod:`~gradsync.parallel.units`)."""
    units = zero_units(module, "parameters", None, bucket_cap_mb)
    return units[-1].numel, [unit.numel for unit in units[:-1]]


@dataclass(frozen=True)
class _Layout:
    """What the estimate needs of a module at one world size: its trainable parameters' buckets and units."""

    itemsize: int
    frozen_bytes: int
    trainable_bytes: int
    assignment: list[list[int]]
    bucket_numels: list[int]
    root_numel: int
    unit_numels: list[int]


def _layout(module: nn.Module, bucket_cap_mb: float) -> _Layout:
    params = [param for param in module.parameters() if param.requires_grad]
    frozen = sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)
    assignment = assign_buckets(params, bucket_cap_bytes(bucket_cap_mb), DEFAULT_FIRST_BUCKET_CAP_BYTES) \
        if params else []
    root, units = _unit_numels(module, bucket_cap_mb)
    return _Layout(params[0].element_size() if params else 4, frozen,
                   sum(p.numel() * p.element_size() for p in params), assignment,
                   [sum(params[i].numel() for i in bucket) for bucket in assignment], root, units)


def _chunk(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


def _held_gradients(shard: str, layout: _Layout, passed: PassMemory, world_size: int, as_view: bool):
    """``held(k)``: bytes of gradients this level holds once ``k`` parameters' ``.grad`` were set
    (buckets launch in order, each once all its gradients and the buckets before it are ready)."""
    grads, order = passed.grad_bytes, passed.ready_order
    if shard == "none":
        if as_view:  # each .grad is copied into its bucket view at once: the buckets hold it
            return lambda ready: 0
        prefix = [0]
        for index in order:
            prefix.append(prefix[-1] + grads[index])
        return lambda ready: prefix[min(ready, len(prefix) - 1)]
    position = {index: at for at, index in enumerate(order)}
    launched_at, running = [], 0
    for bucket in layout.assignment:  # a bucket launches once it and every bucket before it is ready
        running = max([running] + [position.get(index, len(grads)) + 1 for index in bucket])
        launched_at.append(running)
    chunks = [_chunk(numel, world_size) * layout.itemsize for numel in layout.bucket_numels]
    bucket_of = {index: b for b, bucket in enumerate(layout.assignment) for index in bucket}
    deferred = shard != "optimizer"  # ZeRO-1 copies each .grad into its bucket at once and releases it

    def held(ready: int) -> int:
        done = sum(chunk for chunk, at in zip(chunks, launched_at) if at <= ready)
        waiting = sum(grads[index] for index in order[:ready] if launched_at[bucket_of[index]] > ready)
        return done + (waiting if deferred else 0)
    return held


def estimate_from(module: nn.Module, slots: int, passed: PassMemory, world_size: int, shard: str = "none", *,
                  bucket_cap_mb: float = 25.0, algorithm: str = DEFAULT_ALGORITHM, one_host: bool = True,
                  gradient_as_bucket_view: bool = False, evaluated: PassMemory | None = None) -> MemoryEstimate:
    """:func:`estimate` from a measured pass (``passed``) and the optimizer's ``slots`` (:func:`state_slots`),
    so that levels and world sizes can be compared without measuring again.

    ``evaluated``: a measured forward without gradients the run also makes (``gradsync train``'s
    evaluation of its piece of the test split, between steps: no gradients held then); the activations
    are the larger of the training pass's and its."""
    layout = _layout(module, bucket_cap_mb)
    item = layout.itemsize
    chunks = sum(_chunk(numel, world_size) for numel in layout.bucket_numels) * item
    params = layout.frozen_bytes + layout.trainable_bytes
    grads = {"none": 0 if gradient_as_bucket_view else layout.trainable_bytes, "optimizer": chunks,
             "gradients": chunks}.get(shard)
    stepped = layout.trainable_bytes if shard == "none" else chunks
    largest_unit = max([layout.root_numel, *layout.unit_numels]) * item
    if shard == "parameters":
        units = [layout.root_numel, *layout.unit_numels]
        stepped = sum(_chunk(numel, world_size) for numel in units) * item
        in_flight = ZERO3_UNITS_IN_FLIGHT * max(layout.unit_numels, default=0) * item
        params = layout.frozen_bytes + stepped + layout.root_numel * item + in_flight
        grads = stepped + max(layout.unit_numels, default=0) * item  # shards, one unit's .grad before its slab
    buckets = comm_buffers.bucket_bytes(layout.bucket_numels, item, world_size, shard != "none",
                                        sum(len(bucket) for bucket in layout.assignment))
    on_cpu = next((p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64)
                   for p in module.parameters() if p.requires_grad), False)
    buffers = comm_buffers.buffer_bytes(shard, buckets, largest_unit, world_size, algorithm, one_host, on_cpu)
    held = _held_gradients(shard, layout, passed, world_size, gradient_as_bucket_view)
    activations = max(passed.peak(held) - grads, 0) + passed.allocator_bytes()
    if evaluated is not None:
        activations = max(activations, evaluated.peak() + evaluated.allocator_bytes() - grads)
    return MemoryEstimate(parameter_bytes=params, gradient_bytes=grads, optimizer_state_bytes=slots * stepped,
                          buffer_bytes=buffers, activation_bytes=activations)


def check_level(shard) -> str:
    """``shard`` if it names a level the estimate knows (every :data:`~gradsync.parallel.shard_layout.SHARD_LEVELS`, ZeRO-3 included).

    Raises:
        TypeError: not a string; ValueError: unknown.
    """
    return check_shard(shard)


def check_world_size(world_size) -> int:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    return world_size


def estimate(module: nn.Module, optimizer: torch.optim.Optimizer, sample_batch, world_size: int,
             shard: str = "none", *, bucket_cap_mb: float = 25.0, loss_fn=None, algorithm: str = DEFAULT_ALGORITHM,
             one_host: bool = True, gradient_as_bucket_view: bool = False) -> MemoryEstimate:
    """One rank's :class:`MemoryEstimate` for ``module`` trained with ``optimizer`` on micro-batches like
    ``sample_batch`` (one rank's: a tensor or a tuple of the forward's arguments), ``loss_fn(output)``
    the scalar loss (None: the sum of the floating-point outputs). Runs one forward and backward.

    ``algorithm``: the buckets' AllReduce (DataParallel's ``algorithm``; ``auto`` as it resolves per
    bucket), ``one_host``: whether every rank runs on this machine (shared memory), as DataParallel's
    ``gradient_as_bucket_view``.

    Raises:
        ValueError: ``world_size`` < 1, a bad ``shard`` or ``bucket_cap_mb``; TypeError: ``shard`` not a str.
    """
    check_level(shard)
    check_world_size(world_size)
    bucket_cap_bytes(bucket_cap_mb)
    return estimate_from(module, state_slots(optimizer), measure_pass(module, sample_batch, loss_fn), world_size,
                         shard, bucket_cap_mb=bucket_cap_mb, algorithm=algorithm, one_host=one_host,
                         gradient_as_bucket_view=gradient_as_bucket_view)
