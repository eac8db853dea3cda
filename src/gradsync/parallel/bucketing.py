"""Assign parameters to gradient buckets: a pure function, kept apart from the reducer.

Buckets are filled in reverse registration order, the order in which
backward usually produces gradients (PyTorch DDP's
``compute_bucket_assignment_by_size``). A bucket holds parameters of one
dtype and device and at most ``bucket_cap_bytes`` of them, unless a single
parameter is larger, which then gets a bucket of its own.

>>> import torch
>>> params = [torch.zeros(100), torch.zeros(100), torch.zeros(300)]
>>> assign_buckets(params, bucket_cap_bytes=800)
[[2], [1, 0]]
"""

from __future__ import annotations

from typing import Sequence

import torch

DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20


def assign_buckets(params: Sequence[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_cap_bytes``.

    Args:
        params: tensors in registration order.
        bucket_cap_bytes: cap per bucket in bytes (> 0).

    Returns:
        Lists of indices into ``params``; every index appears exactly once,
        in reverse registration order within each (dtype, device) kind.

    Raises:
        ValueError: ``bucket_cap_bytes`` is not positive.
    """
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be > 0, got {bucket_cap_bytes}")
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, tuple[list[int], int]] = {}
    for index in reversed(range(len(params))):
        param = params[index]
        kind = (param.dtype, param.device)
        nbytes = param.numel() * param.element_size()
        members, filled = open_bucket.get(kind, (None, 0))
        if members is None or (filled + nbytes > bucket_cap_bytes and members):
            members, filled = [], 0
            buckets.append(members)
        members.append(index)
        open_bucket[kind] = (members, filled + nbytes)
    return buckets
