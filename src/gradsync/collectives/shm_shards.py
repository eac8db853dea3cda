"""Shared-memory reduce-scatter and all-gather of ``torch.tensor_split`` chunks (``algorithm="shm"``).

For groups whose ranks share one machine, through the group segment of
:mod:`~gradsync.collectives.shm` in rounds that alternate between its two
region sets, as the AllReduce's cells (:mod:`~gradsync.collectives.shm_pipeline`):

* reduce-scatter, round k: every rank copies piece k of each peer's chunk
  into its region, at the slot of that chunk's owner (its own chunk stays
  where it is); one barrier; every rank adds the peers' copies of piece k of
  its chunk to its own tensor, in rank order. Each chunk is summed by its
  owner alone, in one fixed order.
* all-gather, round k: every rank copies piece k of its own chunk into its
  region; one barrier; every rank copies piece k of every peer's chunk out.

One barrier per round is enough: a rank a round ahead writes the other
region set, and it passes that round's barrier only once every rank has
finished reading the round before. Per payload byte and rank: the
reduce-scatter copies (p-1)/p in and adds (p-1)/p; the all-gather copies
1/p in and (p-1)/p out: one phase each of the shm AllReduce's two.

A buffer that lies in the group's arena (``shared_buffer``, DataParallel's
zero-copy buckets) moves without a copy in: one barrier (every rank's data
written, placements compared), every rank adds, or copies, its peers' chunks
straight from where they lie, one barrier (no rank changes its buffer while a
peer still reads it). Both paths add in the same order, so their sums are
bitwise equal.
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import chunk_bounds
from gradsync.collectives.shm import check_placement, post_placement
from gradsync.collectives.shm_pipeline import next_set
from gradsync.collectives.shm_setup import ShmState, barrier, data_barrier, group_segment, layout_digest

Chunks = list[tuple[int, int]]


def _piece(chunk: tuple[int, int], index: int, size: int) -> tuple[int, int]:
    """``(start, stop)`` of piece ``index`` (``size`` elements) of ``chunk``; empty past its end."""
    start = min(chunk[0] + index * size, chunk[1])
    return start, min(start + size, chunk[1])


def _prepare(flat: torch.Tensor, call: CollectiveCall, what: str):
    """(segment, arena placement of ``flat`` or None): the group's segment, and this rank's placement
    posted for the peers to compare after the first barrier (when the group has arenas)."""
    if getattr(call.transport, "shared_memory_model", None) is not None:
        raise ValueError(f"the simulator models shm's all_reduce and broadcast, not its {what}")
    segment = group_segment(call)
    state = call.options(ShmState)
    placement = state.find(flat) if state.arenas else None
    if state.arenas:
        post_placement(segment, placement)
    return segment, placement


def _round_digest(digest: int, index: int) -> int:
    """Round ``index``'s barrier word: the first is the in-place path's too, so that a rank whose buffer lies
    in the arena and one whose buffer does not meet there and raise the placement mismatch."""
    return digest if index == 0 else layout_digest(digest, index)


def _rounds(chunks: Chunks, size: int) -> int:
    longest = max(b - a for a, b in chunks)
    return -(-longest // size)


def _peers_in_arena(flat: torch.Tensor, placement: tuple[int, int], call: CollectiveCall) -> list[torch.Tensor]:
    """Every rank's buffer of this call, as ``flat``'s numel and dtype, in rank order (this rank's: ``flat``)."""
    arena = call.options(ShmState).arenas[placement[0]]
    return [flat if peer == call.rank else arena.at_offset(peer, placement[1], flat.dtype, flat.numel())
            for peer in range(call.world_size)]


def _add_peers(mine: torch.Tensor, copies, rank: int) -> None:
    """``mine += copies[peer]`` for every other peer, in rank order."""
    for peer, copy in enumerate(copies):
        if peer != rank:
            mine += copy


def reduce_scatter(flat: torch.Tensor, call: CollectiveCall, chunks: Chunks | None = None) -> tuple[int, int]:
    """Sum ``flat`` over the ranks so that this rank's chunk holds the sum, through shared memory.

    Args:
        flat: ``(numel,)`` contiguous tensor, modified in place; only chunk ``rank`` is meaningful afterwards.
        chunks: each rank's ``(start, stop)``, disjoint (None: ``torch.tensor_split``'s); a rank may own none.

    Returns:
        ``(start, stop)`` of this rank's chunk.

    Raises:
        ValueError: the ranks are not on one machine; CollectiveMismatchError: the ranks' buffers do not
        lie at the same place of the arena, or their rounds are out of step; CollectiveTimeoutError.

    Collective: every rank must call this in the same order with equal ``numel``, dtype and ``chunks``.
    """
    rank, world_size, numel = call.rank, call.world_size, flat.numel()
    chunks = chunks if chunks is not None else chunk_bounds(numel, world_size)
    segment, placement = _prepare(flat, call, "reduce_scatter")
    digest = layout_digest("reduce_scatter", numel, str(flat.dtype), tuple(chunks))
    start, stop = chunks[rank]
    if placement is not None:
        regions = _peers_in_arena(flat, placement, call)
        next_set(segment)  # as the copy-through path: the sets stay paired across ranks
        data_barrier(segment, call, "shm reduce_scatter in place (written)", digest)
        check_placement(segment, call)
        _add_peers(flat[start:stop], [region[start:stop] for region in regions], rank)
        barrier(call.options(ShmState).arenas[placement[0]], call, "shm reduce_scatter in place (read)")
        return start, stop
    size = max(1, min(call.options(ShmState).cell_bytes, segment.region_bytes) // flat.element_size() // world_size)
    for index in range(_rounds(chunks, size)):
        every_rank = segment.regions(next_set(segment), flat.dtype)
        for owner, chunk in enumerate(chunks):
            a, b = _piece(chunk, index, size)
            if owner != rank and b > a:
                every_rank[rank, owner * size:owner * size + b - a].copy_(flat[a:b])
        data_barrier(segment, call, "shm reduce_scatter (copied in)", _round_digest(digest, index))
        if index == 0 and call.options(ShmState).arenas:
            check_placement(segment, call)
        a, b = _piece((start, stop), index, size)
        if b > a:
            _add_peers(flat[a:b], every_rank[:, rank * size:rank * size + b - a], rank)
    return start, stop


def all_gather(flat: torch.Tensor, call: CollectiveCall, chunks: Chunks | None = None) -> None:
    """Fill every chunk of ``flat`` from the rank that owns it, through shared memory.

    ``flat``: ``(numel,)`` contiguous, chunk ``rank`` valid, the others overwritten; ``chunks`` as
    :func:`reduce_scatter`'s (``torch.tensor_split``'s by default: sizes may differ by one).

    Raises:
        as :func:`reduce_scatter`.

    Collective: every rank must call this in the same order with equal ``numel``, dtype and ``chunks``.
    """
    rank, world_size, numel = call.rank, call.world_size, flat.numel()
    chunks = chunks if chunks is not None else chunk_bounds(numel, world_size)
    segment, placement = _prepare(flat, call, "all_gather")
    digest = layout_digest("all_gather", numel, str(flat.dtype), tuple(chunks))
    if placement is not None:
        regions = _peers_in_arena(flat, placement, call)
        next_set(segment)
        data_barrier(segment, call, "shm all_gather in place (written)", digest)
        check_placement(segment, call)
        for peer, (a, b) in enumerate(chunks):
            if peer != rank:
                flat[a:b] = regions[peer][a:b]
        barrier(call.options(ShmState).arenas[placement[0]], call, "shm all_gather in place (read)")
        return
    size = max(1, min(call.options(ShmState).cell_bytes, segment.region_bytes) // flat.element_size())
    for index in range(_rounds(chunks, size)):
        every_rank = segment.regions(next_set(segment), flat.dtype)
        a, b = _piece(chunks[rank], index, size)
        if b > a:
            every_rank[rank, :b - a].copy_(flat[a:b])
        data_barrier(segment, call, "shm all_gather (copied in)", _round_digest(digest, index))
        if index == 0 and call.options(ShmState).arenas:
            check_placement(segment, call)
        for peer, chunk in enumerate(chunks):
            a, b = _piece(chunk, index, size)
            if peer != rank and b > a:
                flat[a:b] = every_rank[peer, :b - a]


__all__ = ["all_gather", "reduce_scatter"]
