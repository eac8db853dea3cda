"""The bytes a data-parallel rank holds, counted from its tensors: parameters, gradients, optimizer state, buffers.

What a rank holds is a dict of tensor lists, one per part (:data:`PARTS`):
``DataParallel.held_tensors(optimizer)`` gives gradsync's, :func:`torch_zero_bytes`
reads the same parts from torch's ``DistributedDataParallel`` with a
``ZeroRedundancyOptimizer``. :func:`count_bytes` turns them into bytes, each
storage counted once however many tensors view it: a ``.grad`` that is a view
of its bucket (``gradient_as_bucket_view``), or a parameter that is a view of
a flat shard, costs its bytes once. The counts are what the tensors hold, not
the allocator's view (no fragmentation, no activations, no Python objects);
the process's peak resident memory is the other half of the picture (it also
counts every page of a shared-memory segment the process touched, peers'
slots included).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch

PARTS = ("parameters", "gradients", "optimizer_state", "buffers")  # the order a shared storage is counted in


def count_bytes(held: Mapping[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes per part of ``held``, each byte counted once across all parts.

    A tensor is charged its whole storage's ``nbytes`` when the storage owns
    its memory (an ordinary allocation: a view of a larger tensor keeps all
    of it alive); a storage already charged (found by
    ``tensor.untyped_storage().data_ptr()``, by another tensor of this part or
    of an earlier one in the order of :data:`PARTS`) costs nothing more.
    A storage that views memory owned elsewhere (``storage.resizable()`` is
    False: ``torch.frombuffer`` over a shared-memory mapping, as gradsync's
    shm arena, whose zero-copy buckets are one rank's slot of a segment every
    rank of the host maps whole) is charged only the bytes the held tensors
    view, each byte once: charging the whole segment to every rank would
    count the host's arena world-size times. A missing part counts 0 and a
    None entry (a parameter without ``.grad``) is skipped.

    Args:
        held: part name -> tensors (any dtype, dense, CPU or not).

    Returns:
        ``{part: bytes}`` for every part of :data:`PARTS` (ints >= 0).

    Raises:
        ValueError: a key that is not one of :data:`PARTS`.
        TypeError: an entry that is neither a tensor nor None (naming the part).

    >>> flat = torch.zeros(10)                      # 40 bytes
    >>> count_bytes({"parameters": [flat[:4], flat[4:]], "gradients": [torch.zeros(3, dtype=torch.float64)]})
    {'parameters': 40, 'gradients': 24, 'optimizer_state': 0, 'buffers': 0}
    """
    unknown = [key for key in held if key not in PARTS]
    if unknown:
        raise ValueError(f"unknown part {unknown[0]!r} of the held tensors; the parts are {', '.join(PARTS)}")
    owned: set[int] = set()
    viewed: dict[int, list[tuple[int, int]]] = {}  # foreign storage -> byte ranges charged so far
    counts = {}
    for part in PARTS:
        nbytes = 0
        for tensor in held.get(part, ()):
            if tensor is None:
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"the held {part} must be tensors (or None), got {type(tensor).__name__}")
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in owned:
                continue
            if storage.resizable():
                owned.add(storage.data_ptr())
                nbytes += storage.nbytes()
            else:
                nbytes += _charge_range(viewed.setdefault(storage.data_ptr(), []), _byte_range(tensor))
        counts[part] = nbytes
    return counts


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, stop) bytes of ``tensor``'s storage that it can reach (its extent, holes included)."""
    start = tensor.storage_offset() * tensor.element_size()
    if tensor.numel() == 0:
        return start, start
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + extent * tensor.element_size()


def _charge_range(charged: list[tuple[int, int]], new: tuple[int, int]) -> int:
    """Bytes of ``new`` not yet in ``charged`` (disjoint ranges), which then covers ``new`` too."""
    start, stop = new
    fresh = stop - start - sum(max(0, min(stop, high) - max(start, low)) for low, high in charged)
    merged = [(low, high) for low, high in charged if high < start or low > stop]
    merged.append((min([start] + [low for low, high in charged if not (high < start or low > stop)]),
                   max([stop] + [high for low, high in charged if not (high < start or low > stop)])))
    charged[:] = sorted(merged)
    return fresh


def total_bytes(counts: Mapping[str, int]) -> int:
    """The sum of the parts of ``counts`` (a :func:`count_bytes` result)."""
    return sum(counts[part] for part in PARTS)


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in ``optimizer.state`` (AdamW: ``exp_avg``, ``exp_avg_sq`` and the ``step`` scalar per
    parameter; SGD with momentum: ``momentum_buffer``), nested dicts and lists included."""
    found: list[torch.Tensor] = []

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(list(optimizer.state.values()))
    return found


def ddp_bucket_bytes(ddp) -> int:
    """Bytes of the flat gradient buckets torch's ``DistributedDataParallel`` holds.

    Read from ``ddp._get_ddp_logging_data()["bucket_sizes"]`` (DDP's own
    logging: the bytes of each bucket, comma-separated, updated when the
    buckets are rebuilt after the first backward), as the reducer's buckets
    are not reachable from Python. With ``gradient_as_bucket_view=False``
    (DDP's default) these bytes are a second copy of the gradients; with
    ``True`` the ``.grad`` tensors are views of them, and they must not be
    added to the gradients again (this function does not know: the caller
    does, see :func:`torch_zero_bytes`).

    Raises:
        ValueError: DDP's logging data has no bucket sizes (another torch version).
    """
    sizes = ddp._get_ddp_logging_data().get("bucket_sizes")
    if sizes is None:
        raise ValueError("torch DistributedDataParallel's logging data has no bucket_sizes: cannot count "
                         "its buckets with this torch version")
    return sum(int(text) for text in re.findall(r"\d+", str(sizes)))


def torch_zero_bytes(ddp, optimizer) -> dict[str, int]:
    """What a rank of torch ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer`` holds, as :func:`count_bytes`.

    * parameters: every parameter of ``ddp`` (each rank keeps the full model);
    * gradients: their ``.grad`` (full: DDP all-reduces every gradient);
    * optimizer state: the tensors of ``optimizer.optim.state``, the local
      optimizer that steps only this rank's parameters (whole parameters,
      assigned by ZeRO's sorted-greedy partition, so ranks may differ);
    * buffers: DDP's gradient buckets (:func:`ddp_bucket_bytes`; not counted
      when DDP runs with ``gradient_as_bucket_view``, whose ``.grad`` already
      are the buckets), plus ZeRO's parameter buckets when it was built with
      ``parameters_as_bucket_view=True`` (the parameters are then views of
      them, counted once under parameters). DDP's per-parameter "used" map
      (4 bytes a parameter) is left out.

    Args:
        ddp: a ``torch.nn.parallel.DistributedDataParallel``.
        optimizer: a ``torch.distributed.optim.ZeroRedundancyOptimizer`` (or any optimizer: its own state).
    """
    params = list(ddp.parameters())
    local = getattr(optimizer, "optim", optimizer)
    zero_buckets = [bucket for per_device in getattr(optimizer, "_buckets", []) for bucket in per_device]
    counts = count_bytes({"parameters": params, "gradients": [param.grad for param in params],
                          "optimizer_state": state_tensors(local), "buffers": zero_buckets})
    if not getattr(ddp, "gradient_as_bucket_view", False):
        counts["buffers"] += ddp_bucket_bytes(ddp)
    return counts
