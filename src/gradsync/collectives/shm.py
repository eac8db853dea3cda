"""Collectives through a shared-memory segment, for groups whose ranks all run on one machine.

The segment (:mod:`gradsync.transport.shm_segment`) holds two sets of one region per
rank. A message goes through in slices of one region; consecutive slices,
across calls too, alternate between the sets, so a rank may fill the next
slice while a slower rank still reads the previous one.

AllReduce of one slice (reduce-scatter then all-gather, as the ring, but
every "hop" is a memory copy): each rank copies its slice into its region;
barrier; rank r sums chunk r of every rank's region into its own region
(ranks in a fixed order, so the sum is deterministic); barrier; every rank
copies every chunk out of its owner's region. Each chunk is summed by one
rank only and copied by the others, so results are bitwise equal on every
rank. Cost per slice: 2 barriers, 2 copies and (p-1)/p of a reduction per
rank, against 2(p-1) messages through the kernel for a ring over TCP.
Broadcast is one copy in, one barrier, copies out; reduce-scatter and
all-gather of ``torch.tensor_split`` chunks are in
:mod:`~gradsync.collectives.shm_shards`.

The segment is set up at the first shm call of a group
(:mod:`~gradsync.collectives.shm_setup`, collective).
"""

from __future__ import annotations

import torch

from gradsync.collectives import shm_pipeline
from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import chunk_bounds, segment_bounds
from gradsync.collectives.shm_pipeline import next_set
from gradsync.collectives.shm_setup import (ShmState, barrier, create_segment, data_barrier, group_segment,
                                            layout_digest, usable)
from gradsync.errors import CollectiveMismatchError, ShmSetupError
from gradsync.transport.shm_segment import ShmSegment
IN_PLACE_DTYPES = (torch.float32, torch.float64)  # reduced in the arena without staging (see allocate_shared)
ARENA_MIN_BYTES = 2**20  # per rank: small buffers share an arena (tmpfs pages cost only once touched)
ARENA_ALIGN = 64         # every buffer starts on its own cache line
# words 2 and 4 of a rank's counter line: where its collective's data lies, by the parity of the barrier
# after which the peers read it (a rank one barrier ahead posts its next call's in the other word)
PLACEMENT_WORDS = (2, 4)
NOT_IN_ARENA = -1


def _slices(numel: int, segment: ShmSegment, dtype: torch.dtype) -> list[tuple[int, int]]:
    region_numel = segment.region_numel(dtype)
    return [(0, numel)] if 0 < numel <= region_numel else segment_bounds(0, numel, region_numel)


def all_reduce(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over all ranks, in place, through shared memory.

    A tensor that lies in the group's arena (:func:`allocate_shared`) is
    reduced in place (zero copy); anything else goes through the regions in
    cache-sized cells (:mod:`~gradsync.collectives.shm_pipeline`). Small
    public calls take the lean path before they get here
    (:mod:`~gradsync.collectives.shm_lean`).

    Collective: every rank must call this in the same order with equal ``numel``.

    Raises:
        ValueError: the ranks are not on one machine; CollectiveTimeoutError.
    """
    simulated = getattr(call.transport, "shared_memory_model", None)
    if simulated is not None:  # a simulated group (gradsync.sim): a formula, no segment
        simulated.all_reduce(flat, call)
        return
    segment = group_segment(call)
    state = call.options(ShmState)
    placement = state.find(flat) if state.arenas else None
    if placement is not None:
        _all_reduce_in_arena(flat, placement, call)
        return
    if state.arenas:  # the peers compare placements after the first barrier: say this one is not in it
        post_placement(segment, None)
    shm_pipeline.all_reduce(flat, call, segment, state.cell_bytes,
                            after_first_barrier=(lambda: check_placement(segment, call)) if state.arenas else None)


def allocate_shared(call: CollectiveCall, nbytes: int) -> torch.Tensor | None:
    """This rank's own ``(nbytes,)`` uint8 buffer in a shared arena, or None if the ranks are not on one machine.

    A float32/float64 tensor laid in it is all-reduced by :func:`all_reduce`
    without being copied in: every rank reads its peers' data where they
    wrote it (zero-copy buckets). Every call gets a range of the arena that
    no other call gets (64-byte aligned), at the same offset on every rank;
    when no arena has room, a new arena segment is created (at least
    ``ARENA_MIN_BYTES`` per rank) and the old ones stay mapped where they are.

    Lifetime: ranges are never reused while the group lives (a dropped
    model's buckets stay reserved, not freed, until the group is closed);
    after :meth:`ShmState.close` the memory stays mapped as long as any
    tensor views it.

    Collective: every rank calls it in the same order with the same
    ``nbytes``; the sizes and resulting offsets are compared first.

    Raises:
        ValueError: on every rank, naming each rank's request, when the ranks
        ask for different sizes or ``nbytes`` is not an int >= 0 on some rank.
    """
    if not usable(call):
        return None
    state = call.options(ShmState)
    valid = isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes >= 0
    size = -(-max(nbytes, 1) // ARENA_ALIGN) * ARENA_ALIGN if valid else 0
    index = next((i for i, arena in enumerate(state.arenas)
                  if state.arena_used[i] + size <= arena.region_bytes), len(state.arenas))
    offset = state.arena_used[index] if index < len(state.arenas) else 0
    _agree_allocation(call, nbytes if valid else -1, index, offset)
    if index == len(state.arenas):
        arena = create_segment(call, max(-(-size // 4096) * 4096, ARENA_MIN_BYTES), sets=1)
        if arena is None:
            raise RuntimeError("shared_buffer: the shared-memory arena could not be created")
        state.arenas.append(arena)
        state.arena_used.append(0)
    state.arena_used[index] = offset + size
    return state.arenas[index].at_offset(call.rank, offset, torch.uint8, nbytes)


def _agree_allocation(call: CollectiveCall, nbytes: int, index: int, offset: int) -> None:
    """Every rank's (``nbytes``, arena ``index``, ``offset``) through the segment; ValueError on every
    rank (the same gathered rows) unless they are equal and valid."""
    gathered = torch.zeros(3 * call.world_size, dtype=torch.int64)
    gathered[3 * call.rank:3 * call.rank + 3] = torch.tensor([nbytes, index, offset])
    _gather_rows(gathered, call)
    rows = [tuple(int(v) for v in gathered[3 * r:3 * r + 3]) for r in range(call.world_size)]
    if all(row == rows[0] for row in rows) and rows[0][0] >= 0:
        return
    asks = ", ".join(f"rank {r}: " + (f"{n} bytes at arena {i} offset {o}" if n >= 0 else "not an int >= 0")
                     for r, (n, i, o) in enumerate(rows))
    raise ValueError(f"rank {call.rank}: shared_buffer: every rank must ask for the same number of bytes "
                     f"(an int >= 0) in the same order; {asks}")


def post_placement(segment: ShmSegment, placement: tuple[int, int] | None) -> None:
    """Post where this rank's data of the call lies (``(arena, offset)``, None: not in an arena), for
    :func:`check_placement` right after the segment's next barrier."""
    segment.post(PLACEMENT_WORDS[segment.next_parity()],
                 NOT_IN_ARENA if placement is None else (placement[0] << 40) | placement[1])


def check_placement(segment: ShmSegment, call: CollectiveCall) -> None:
    """Right after the barrier :func:`post_placement` preceded: every rank posted the same placement of
    its data, else CollectiveMismatchError on every rank (each reads the same words)."""
    word = PLACEMENT_WORDS[segment.last_parity()]
    posted = [segment.posted(peer, word) for peer in range(call.world_size)]
    if all(word == posted[0] for word in posted):
        return
    where = ", ".join(f"rank {peer}: " + ("not in the arena" if word == NOT_IN_ARENA else
                                          f"arena {word >> 40} offset {word & (2**40 - 1)}")
                      for peer, word in enumerate(posted))
    raise CollectiveMismatchError(f"rank {call.rank}: shm {call.op_name}: the ranks' tensors do not lie at the "
                                  f"same place of the shared arena (shared_buffer); {where}")


def _all_reduce_in_arena(flat: torch.Tensor, placement: tuple[int, int], call: CollectiveCall) -> None:
    """In place, with no copy in: the same offset of every rank's region of arena ``placement[0]``
    holds its data (checked: the placements are compared after the first barrier).

    Barrier on the segment (all data written, placements posted); rank r sums
    chunk r of every region into its own; barrier; every rank copies the
    other chunks from their owners; barrier (no rank still reads a region
    that its owner may now overwrite).
    """
    segment = call.options(ShmState).segment
    arena = call.options(ShmState).arenas[placement[0]]
    rank, world_size, numel = call.rank, call.world_size, flat.numel()
    regions = [flat if peer == rank else arena.at_offset(peer, placement[1], flat.dtype, numel)
               for peer in range(world_size)]
    chunks = chunk_bounds(numel, world_size)
    next_set(segment)  # the copy-through path advances it here too: the sets stay paired across ranks
    post_placement(segment, placement)
    data_barrier(segment, call, "shm all_reduce in place (written)", layout_digest("all_reduce", numel,
                                                                                 str(flat.dtype)))
    check_placement(segment, call)
    a, b = chunks[rank]
    for step in range(1, world_size):
        flat[a:b] += regions[(rank + step) % world_size][a:b]
    barrier(arena, call, "shm all_reduce in place (reduced)")
    for peer, (a, b) in enumerate(chunks):
        if peer != rank:
            flat[a:b] = regions[peer][a:b]
    barrier(arena, call, "shm all_reduce in place (copied)")


def broadcast(flat: torch.Tensor, src: int, call: CollectiveCall) -> None:
    """Copy rank ``src``'s ``flat`` into every rank's ``flat`` through shared memory."""
    simulated = getattr(call.transport, "shared_memory_model", None)
    if simulated is not None:
        simulated.broadcast(flat, src, call)
        return
    segment = group_segment(call)
    digest = layout_digest("broadcast", flat.numel(), str(flat.dtype), src)
    for start, stop in _slices(flat.numel(), segment, flat.dtype):
        region = segment.region(next_set(segment), src, flat.dtype, stop - start)
        if call.rank == src:
            region.copy_(flat[start:stop])
        data_barrier(segment, call, "shm broadcast", digest)
        if call.rank != src:
            flat[start:stop] = region


def _gather_rows(gathered: torch.Tensor, call: CollectiveCall) -> None:
    """Fill ``gathered`` (``(world_size * n,)``, rank r's own part at ``[r*n, (r+1)*n)``) from every rank
    (the arena's agreement; the public all-gather is :func:`gradsync.collectives.shm_shards.all_gather`)."""
    segment = group_segment(call)
    rank, world_size = call.rank, call.world_size
    numel = gathered.numel() // world_size
    parts = gathered.view(world_size, numel) if numel else None
    digest = layout_digest("all_gather", numel, str(gathered.dtype))
    for start, stop in _slices(numel, segment, gathered.dtype):
        set_index = next_set(segment)
        regions = [segment.region(set_index, peer, gathered.dtype, stop - start) for peer in range(world_size)]
        regions[rank].copy_(parts[rank, start:stop])
        data_barrier(segment, call, "shm all_gather", digest)
        for peer in range(world_size):
            if peer != rank:
                parts[peer, start:stop] = regions[peer]


__all__ = ["IN_PLACE_DTYPES", "NOT_IN_ARENA", "PLACEMENT_WORDS", "ShmSetupError", "ShmState", "all_reduce",
           "allocate_shared", "broadcast", "check_placement", "post_placement", "usable"]
