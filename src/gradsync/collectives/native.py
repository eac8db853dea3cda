"""The backend's own collectives (NCCL on GPU, Gloo on CPU), behind the same contract.

The transport makes the call (``backend_all_reduce``, ``backend_reduce_scatter``,
``backend_all_gather``), so this module never imports torch.distributed; the
public layer upcasts fp16/bf16 around it. ``hierarchical`` also runs these
among the ranks of equal local rank, over a backend subgroup
(:func:`all_reduce_over`, :func:`reduce_scatter_over`, :func:`all_gather_over`).

What the backend does with a reduce-scatter or an all-gather of
``torch.tensor_split`` chunks (chunk sizes differ by one) is the transport's
to say (:meth:`TorchP2PTransport.backend_reduce_scatter
<gradsync.transport.torch_p2p.TorchP2PTransport.backend_reduce_scatter>`):
Gloo in torch 2.13 reduce-scatters by all-reducing a copy of the whole
input, so over Gloo ``native``'s reduce-scatter costs its AllReduce.
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import chunk_bounds
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


def _over(backend_call, what: str, call: CollectiveCall, members: list[int] | None, step: str) -> None:
    """Run ``backend_call(timeout_s)``; a failure names the peer as a rank of ``call`` (``members[i]``: the
    rank of ``call`` that is rank i of the backend group; None: the same numbering)."""
    try:
        backend_call(call.remaining_s())
    except PeerFailure as failure:
        peer = failure.peer if members is None else members[failure.peer] if 0 <= failure.peer < len(members) else -1
        raise call.failure(PeerFailure(peer, failure.reason, failure.timed_out), step or f"backend {what}") from failure


def reduce_scatter_over(flat: torch.Tensor, transport, chunks: list[tuple[int, int]], call: CollectiveCall,
                        members: list[int] | None = None, step: str = "") -> tuple[int, int]:
    """Sum ``flat`` over ``transport``'s backend group so that chunk ``transport.rank`` holds the sum.

    ``chunks``: each group rank's ``(start, stop)`` of ``flat``; dtypes in ``UPCAST`` are summed in int64
    (a copy) and narrowed back. Returns this rank's ``(start, stop)``.

    Collective: every member must call this in the same order with equal ``numel`` and ``chunks``.
    """
    start, stop = chunks[transport.rank]
    if flat.numel() == 0:
        return start, stop
    wide = UPCAST.get(flat.dtype)
    work = flat.to(wide) if wide is not None else flat
    _over(lambda timeout_s: transport.backend_reduce_scatter(work, chunks, timeout_s), "reduce_scatter", call,
          members, step)
    if wide is not None:
        flat[start:stop] = work[start:stop]
    return start, stop


def all_gather_over(flat: torch.Tensor, transport, chunks: list[tuple[int, int]], call: CollectiveCall,
                    members: list[int] | None = None, step: str = "") -> None:
    """Fill every chunk of ``flat`` from the group rank that owns it, with the backend's all-gather.

    Dtypes the backend may lack (``UPCAST``'s: Gloo has no int16) travel as their bytes.

    Collective: every member must call this in the same order with equal ``numel`` and ``chunks``.
    """
    if flat.numel() == 0:
        return
    if flat.dtype in UPCAST:  # a copy needs no arithmetic: move the bytes
        size = flat.element_size()
        flat, chunks = flat.view(torch.uint8), [(a * size, b * size) for a, b in chunks]
    _over(lambda timeout_s: transport.backend_all_gather(flat, chunks, timeout_s), "all_gather", call, members,
          step)


def reduce_scatter(flat: torch.Tensor, call: CollectiveCall,
                   chunks: list[tuple[int, int]] | None = None) -> tuple[int, int]:
    """Sum ``flat`` (``(numel,)``, contiguous) over all ranks so that this rank's chunk holds the sum, with the
    backend's call; returns the chunk's ``(start, stop)`` (``chunks``: None, ``torch.tensor_split``'s).

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    chunks = chunks if chunks is not None else chunk_bounds(flat.numel(), call.world_size)
    return reduce_scatter_over(flat, call.transport, chunks, call)


def all_gather(flat: torch.Tensor, call: CollectiveCall, chunks: list[tuple[int, int]] | None = None) -> None:
    """Fill every chunk of ``flat`` (``(numel,)``, contiguous; chunk ``rank`` valid) from its owner, with the
    backend's call (``chunks``: None, ``torch.tensor_split``'s).

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    chunks = chunks if chunks is not None else chunk_bounds(flat.numel(), call.world_size)
    all_gather_over(flat, call.transport, chunks, call)
