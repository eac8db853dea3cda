"""Ring AllReduce = reduce-scatter then all-gather, pipelined by segments (Patarasuk & Yuan 2009).

Each rank sends 2(p-1) chunks to its right neighbour and receives as many
from its left one; cost 2(p-1)·α + 2(p-1)/p·n·β + (p-1)/p·n·γ (Thakur et
al. 2005), bandwidth-optimal for large messages.

How it works (p = 4 ranks, chunks 0..3, rank r's right is r+1 mod p):

* reduce-scatter, hop k = 0..p-2: rank r sends chunk (r-k-1) mod p to the
  right and receives chunk (r-k-2) mod p from the left, adding it to its own
  copy. After p-1 hops rank r holds the full sum of chunk r, so the result
  matches ``torch.tensor_split`` order (rank r owns chunk r).
* all-gather, hop k = 0..p-2: rank r sends chunk (r-k) mod p, which it
  already holds in full, and receives chunk (r-k-1) mod p, overwriting it.

Pipelining (as Gloo and NCCL do): every chunk is cut into segments of
``SegmentOptions.segment_bytes``. Two segments are received ahead into a double-buffered
inbox while the current one is reduced, and a segment is forwarded to the
right as soon as it is reduced (or, in the all-gather, received), so the next
hop starts before this one ends. Both ends cut a chunk the same way, and
messages between a pair are matched in order, so segments need no tags.
Each phase posts its first receives before its first sends: Gloo moves a
payload only into a posted receive, and a send posted first waits for the
peer's notice, which on a busy link queues behind the peer's own data (59%
of a shaped 1 Gbit/s link between 2 test hosts send-first, 99% receive-first).

The two phases are also the registry's ring reduce-scatter and all-gather
(:func:`reduce_scatter`, :func:`all_gather`), so a reduce-scattered chunk is
bitwise the AllReduce's.

Chunks follow :func:`~gradsync.collectives.chunking.chunk_bounds`: with
numel = 10 and p = 4 they hold 3, 3, 2, 2 elements; with numel = 2 two
chunks are empty and have no segments, so nothing is sent for them.
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import SegmentOptions, chunk_bounds, segment_bounds

_IN_FLIGHT = 2  # receives posted ahead of the segment being reduced


def _segments(chunks, index: int, segment_numel: int) -> list[tuple[int, int]]:
    start, stop = chunks[index % len(chunks)]
    return segment_bounds(start, stop, segment_numel)


def reduce_scatter(flat: torch.Tensor, call: CollectiveCall,
                   chunks: list[tuple[int, int]] | None = None) -> tuple[int, int]:
    """Sum ``flat`` over all ranks so that this rank's chunk holds the full sum.

    Args:
        flat: ``(numel,)`` contiguous tensor, modified in place; only chunk
            ``rank`` is meaningful afterwards.
        call: the collective call (transport, deadline, workspace; segments of ``SegmentOptions``).
        chunks: each rank's ``(start, stop)``, disjoint (None: ``chunk_bounds(numel, world_size)``,
            ``torch.tensor_split`` order; ``hierarchical`` passes its own, some possibly empty).

    Returns:
        ``(start, stop)`` of this rank's chunk.

    Collective: every rank must call this in the same order with equal ``numel`` and ``chunks``.
    """
    rank, world_size = call.rank, call.world_size
    chunks = chunks if chunks is not None else chunk_bounds(flat.numel(), world_size)
    if world_size == 1:
        return chunks[0]
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    segment_numel = call.options(SegmentOptions).segment_numel(flat.element_size())
    segment_numel = min(segment_numel, max(max(b - a for a, b in chunks), 1))
    inbox = call.workspace.get(_IN_FLIGHT * segment_numel, flat.dtype, flat.device).view(_IN_FLIGHT, -1)
    sends = None
    for hop in range(world_size - 1):
        step = f"reduce_scatter hop {hop}"
        segments = _segments(chunks, rank - hop - 2, segment_numel)
        forwards = []

        def post(index):
            a, b = segments[index]
            return call.irecv(inbox[index % _IN_FLIGHT, : b - a], left)

        receives = [post(i) for i in range(min(_IN_FLIGHT, len(segments)))]
        if sends is None:  # after the first receives (see the module docstring)
            sends = [call.isend(flat[a:b], right) for a, b in _segments(chunks, rank - 1, segment_numel)]
        for index, (a, b) in enumerate(segments):
            call.wait_on(receives[index], step)
            flat[a:b] += inbox[index % _IN_FLIGHT, : b - a]
            if index + _IN_FLIGHT < len(segments):
                receives.append(post(index + _IN_FLIGHT))
            if hop < world_size - 2:  # this segment is the next hop's message
                forwards.append(call.isend(flat[a:b], right))
        call.wait_all(sends, step)
        sends = forwards
    return chunks[rank]


def all_gather(flat: torch.Tensor, call: CollectiveCall, chunks: list[tuple[int, int]] | None = None) -> None:
    """Fill every chunk of ``flat`` from the rank that owns it (rank r owns chunk r).

    Args:
        flat: ``(numel,)`` contiguous tensor whose chunk ``rank`` is valid; the
            other chunks are overwritten in place.
        chunks: as :func:`reduce_scatter`'s (None: ``torch.tensor_split`` order).

    Collective: every rank must call this in the same order with equal ``numel`` and ``chunks``.
    """
    rank, world_size = call.rank, call.world_size
    if world_size == 1:
        return
    chunks = chunks if chunks is not None else chunk_bounds(flat.numel(), world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    segment_numel = call.options(SegmentOptions).segment_numel(flat.element_size())
    sends = None
    for hop in range(world_size - 1):
        step = f"all_gather hop {hop}"
        segments = _segments(chunks, rank - hop - 1, segment_numel)
        receives = [call.irecv(flat[a:b], left) for a, b in segments]
        if sends is None:
            sends = [call.isend(flat[a:b], right) for a, b in _segments(chunks, rank, segment_numel)]
        forwards = []
        for pending, (a, b) in zip(receives, segments):
            call.wait_on(pending, step)
            if hop < world_size - 2:
                forwards.append(call.isend(flat[a:b], right))
        call.wait_all(sends, step)
        sends = forwards


def all_reduce(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over all ranks, in place.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    reduce_scatter(flat, call)
    all_gather(flat, call)
