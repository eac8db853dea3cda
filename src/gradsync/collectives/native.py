"""The backend's own AllReduce (NCCL on GPU, Gloo on CPU), behind the same contract.

The transport makes the call (``backend_all_reduce``), so this module never
imports torch.distributed; the public layer upcasts fp16/bf16 around it.
``hierarchical`` also runs it among the ranks of equal local rank, over a
backend subgroup (:func:`all_reduce_over`).
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.transport.base import PeerFailure

# Gloo's own all_reduce lacks some narrow integer types; integer sums wrap the
# same way in int64 followed by a narrowing cast, so native upcasts them.
UPCAST = {torch.int8: torch.int64, torch.uint8: torch.int64, torch.int16: torch.int64}


def all_reduce(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over all ranks, in place, with the backend's call.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    if flat.numel() == 0:
        return
    try:
        call.transport.backend_all_reduce(flat, call.remaining_s())
    except PeerFailure as failure:
        raise call.failure(failure, "backend all_reduce") from failure


def all_reduce_over(flat: torch.Tensor, transport, members: list[int], call: CollectiveCall, step: str) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over ``transport``'s backend group, in place.

    ``members[i]``: the rank of ``call`` that is rank i of ``transport``'s group
    (errors name that rank); the call's deadline bounds the wait. Dtypes in
    ``UPCAST`` are summed in int64 and narrowed back (the same wrap-around).

    Collective: every member must call this in the same order with equal ``numel``.
    """
    if flat.numel() == 0:
        return
    wide = UPCAST.get(flat.dtype)
    work = flat.to(wide) if wide is not None else flat
    try:
        transport.backend_all_reduce(work, call.remaining_s())
    except PeerFailure as failure:
        peer = members[failure.peer] if 0 <= failure.peer < len(members) else -1
        raise call.failure(PeerFailure(peer, failure.reason, failure.timed_out), step) from failure
    if wide is not None:
        flat.copy_(work)
