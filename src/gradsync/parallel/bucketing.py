"""Gradient buckets: which parameters go together (a pure function) and the flat buffer they share.

Buckets are filled in the order gradients are expected to become ready:
reverse registration order before the first iteration, the observed order
after it (PyTorch DDP's ``compute_bucket_assignment_by_size`` and bucket
rebuild). A bucket holds parameters of one dtype and device and at most
``bucket_cap_bytes`` of them, unless a single parameter is larger, which then
gets a bucket of its own. The first bucket is capped at
``first_bucket_cap_bytes`` so that communication starts early in backward.

>>> import torch
>>> params = [torch.zeros(100), torch.zeros(100), torch.zeros(300)]
>>> assign_buckets(params, bucket_cap_bytes=800)
[[2], [1, 0]]
>>> assign_buckets(params, bucket_cap_bytes=800, order=[0, 1, 2])
[[0, 1], [2]]
>>> assign_buckets(params, bucket_cap_bytes=2000, first_bucket_cap_bytes=400)
[[2], [1, 0]]
>>> assign_buckets(params, bucket_cap_bytes=2000, breaks_before=[0])
[[2, 1], [0]]
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

DEFAULT_FIRST_BUCKET_CAP_BYTES = 2**20  # DDP's _DEFAULT_FIRST_BUCKET_BYTES


def default_order(num_params: int) -> list[int]:
    """Reverse registration order: the order backward usually produces gradients."""
    return list(reversed(range(num_params)))


def assign_buckets(params: Sequence[torch.Tensor], bucket_cap_bytes: int,
                   first_bucket_cap_bytes: int | None = None,
                   order: Sequence[int] | None = None,
                   breaks_before: Sequence[int] = ()) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_cap_bytes``.

    Args:
        params: tensors in registration order.
        bucket_cap_bytes: cap per bucket in bytes (> 0).
        first_bucket_cap_bytes: cap of the first bucket (None:
            ``bucket_cap_bytes``); the smaller of the two applies.
        order: the expected ready order, a permutation of ``range(len(params))``
            (None: reverse registration order).
        breaks_before: parameter indices that start a new bucket even if the
            open one has room (where backward pauses between two gradients).

    Returns:
        Lists of indices into ``params``; every index appears exactly once,
        in ``order`` within each (dtype, device) kind.

    Raises:
        ValueError: a cap is not positive or ``order`` is not a permutation.
    """
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be > 0, got {bucket_cap_bytes}")
    if first_bucket_cap_bytes is not None and first_bucket_cap_bytes <= 0:
        raise ValueError(f"first_bucket_cap_bytes must be > 0, got {first_bucket_cap_bytes}")
    order = default_order(len(params)) if order is None else list(order)
    if sorted(order) != list(range(len(params))):
        raise ValueError(f"order must be a permutation of range({len(params)}), got {order}")
    first_cap = min(bucket_cap_bytes, first_bucket_cap_bytes or bucket_cap_bytes)
    breaks = set(breaks_before)
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, tuple[list[int], int]] = {}
    for index in order:
        param = params[index]
        kind = (param.dtype, param.device)
        nbytes = param.numel() * param.element_size()
        members, filled = open_bucket.get(kind, (None, 0))
        cap = first_cap if members is None or _is_first(buckets, members) else bucket_cap_bytes
        if members is None or (members and (filled + nbytes > cap or index in breaks)):
            members, filled = [], 0
            buckets.append(members)
        members.append(index)
        open_bucket[kind] = (members, filled + nbytes)
    return buckets


def check_assignment(params: Sequence[torch.Tensor], assignment: list[list[int]]) -> None:
    """Raise ValueError unless ``assignment`` splits the indices of ``params`` into non-empty buckets of one
    dtype and device each."""
    flat = [index for bucket in assignment for index in bucket]
    if sorted(flat) != list(range(len(params))) or not all(assignment):
        raise ValueError(f"a bucket layout must split the indices 0..{len(params) - 1} into "
                         f"non-empty buckets, got {assignment}")
    if any(len({(params[i].dtype, params[i].device) for i in bucket}) > 1 for bucket in assignment):
        raise ValueError("a bucket layout must not mix parameter dtypes or devices in one bucket")


def pause_breaks(params: Sequence[torch.Tensor], observed: Sequence[int], ready_s: Sequence[float],
                 pause_s: float, min_split_bytes: int) -> list[int]:
    """Per position of ``observed``: 1 where a bucket should start because backward paused there.

    A pause is more than ``pause_s`` seconds between two gradients (``ready_s``,
    perf_counter times) once the open bucket holds ``min_split_bytes``.
    """
    breaks, filled = [0] * len(observed), 0
    for position in range(1, len(observed)):
        previous = params[observed[position - 1]]
        filled += previous.numel() * previous.element_size()
        if ready_s[position] - ready_s[position - 1] > pause_s and filled >= min_split_bytes:
            breaks[position], filled = 1, 0
    return breaks


def bucket_cap_bytes(bucket_cap_mb) -> int:
    """``bucket_cap_mb`` (MiB, DataParallel's argument) in bytes.

    Raises:
        ValueError: not a finite number of MiB holding at least one byte.

    >>> bucket_cap_bytes(25.0) == 25 * 2**20
    True
    """
    ok = isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
    if not (ok and 0 < bucket_cap_mb < math.inf and int(bucket_cap_mb * 2**20) >= 1):
        raise ValueError(f"bucket_cap_mb must be a finite number of MiB, at least one byte "
                         f"(> {1 / 2**20:.1e}), got {bucket_cap_mb!r}")
    return int(bucket_cap_mb * 2**20)


def padded_numel(numel: int, multiple: int) -> int:
    """``numel`` rounded up to a multiple of ``multiple`` (a sharded bucket: of the world size)."""
    return -(-numel // multiple) * multiple


def _is_first(buckets: list[list[int]], members: list[int]) -> bool:
    return bool(buckets) and buckets[0] is members


class Bucket:
    """One flat buffer: the gradients of ``params`` back to back, zero padding, then optional per-parameter flags.

    ``flat`` has shape ``(grad_numel + pad_numel + num_flags,)`` and the parameters' dtype;
    ``views[k]`` is ``params[k]``'s slice shaped like the parameter. ``pad_to`` > 1 (sharded buckets:
    the world size) pads the gradients to a multiple of it, so that every rank's chunk is equally long.
    """

    def __init__(self, index: int, param_indices: list[int], params: list[torch.Tensor], num_flags: int,
                 storage: torch.Tensor | None = None, pad_to: int = 1):
        self.index = index
        self.param_indices = param_indices
        self.grad_numel = sum(param.numel() for param in params)
        self.padded_numel = padded_numel(self.grad_numel, pad_to)
        numel, dtype = self.padded_numel + num_flags, params[0].dtype
        self.shared = storage is not None
        if storage is None:
            self.flat = torch.zeros(numel, dtype=dtype, device=params[0].device)
        else:  # uint8 bytes in shared memory (zero-copy buckets)
            self.flat = storage[:numel * dtype.itemsize].view(dtype)
            self.flat.zero_()
        self.flags = self.flat[self.padded_numel:]
        self.views, offset = [], 0
        for param in params:
            self.views.append(self.flat[offset:offset + param.numel()].view_as(param))
            offset += param.numel()
