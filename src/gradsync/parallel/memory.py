"""The bytes a data-parallel rank holds, counted from its tensors: parameters, gradients, optimizer state, buffers.

What a rank holds is a dict of tensor lists, one per part (:data:`PARTS`):
``DataParallel.held_tensors(optimizer)`` gives gradsync's, :func:`torch_zero_bytes`
reads the same parts from torch's ``DistributedDataParallel`` with a
``ZeroRedundancyOptimizer``. :func:`count_bytes` turns them into bytes, each
storage counted once however many tensors view it: a ``.grad`` that is a view
of its bucket (``gradient_as_bucket_view``), or a parameter that is a view of
a flat shard, costs its bytes once. The counts are what the tensors hold, not
the allocator's view (no fragmentation, no activations, no Python objects);
the process's peak resident memory is the other half of the picture.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch

PARTS = ("parameters", "gradients", "optimizer_state", "buffers")  # the order a shared storage is counted in


def count_bytes(held: Mapping[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes per part of ``held``, each storage counted once across all parts.

    Each tensor is charged its whole storage's ``nbytes`` (a view of a
    larger storage costs the larger storage: that memory is held), found by
    ``tensor.untyped_storage().data_ptr()``; a storage already charged (by
    another tensor of this part or of an earlier one, in the order of
    :data:`PARTS`) costs nothing more. A missing part counts 0 and a None
    entry (a parameter without ``.grad``) is skipped.

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
    seen: set[int] = set()
    counts = {}
    for part in PARTS:
        nbytes = 0
        for tensor in held.get(part, ()):
            if tensor is None:
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"the held {part} must be tensors (or None), got {type(tensor).__name__}")
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            nbytes += storage.nbytes()
        counts[part] = nbytes
    return counts


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
