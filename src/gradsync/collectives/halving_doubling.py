"""Recursive halving-doubling AllReduce (Rabenseifner; Thakur, Rabenseifner & Gropp 2005).

Long messages: a reduce-scatter by recursive vector halving (at distance
d = p'/2, p'/4, ..., 1 each rank swaps half of its current range with rank
XOR d and adds what it receives) and an all-gather by recursive doubling
(the same exchanges in reverse); cost 2·log2(p')·α + 2(p'-1)/p'·n·β +
(p'-1)/p'·n·γ, the ring's bandwidth in log2 p' instead of p-1 steps.

Short messages (at most ``SHORT_MESSAGE_BYTES``, or fewer elements than
ranks): recursive doubling of the whole vector, log2(p') exchanges, as MPICH
does. Both ends add in the order (own + partner's), and IEEE addition is
commutative, so every rank ends with bitwise the same sum.

World sizes that are not a power of two (p = p' + extra, p' the largest
power of two below p): the first 2·extra ranks pair up; each even one sends
its vector to the odd one after it, which adds it and takes part in the
power-of-two core while the even one waits and finally receives the result
(Thakur et al. 2005, §4). With p = 6: ranks 0→1 and 2→3 fold, and the core
is ranks 1, 3, 4, 5.

:func:`reduce_scatter` and :func:`all_gather` are the two halves on
``torch.tensor_split``'s chunks over all p ranks: core rank c of a folded
pair holds both ranks' adjacent chunks, and hands the even rank its own at
the end (or receives it first).
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import chunk_bounds

SHORT_MESSAGE_BYTES = 1 * 2**20


def _core_layout(world_size: int) -> tuple[int, int]:
    """Return (p', extra): the power-of-two core size and how many ranks fold into it."""
    core_size = 1 << (world_size.bit_length() - 1)
    return core_size, world_size - core_size


def _core_member(core_rank: int, extra: int) -> int:
    """The real rank that plays core rank ``core_rank``."""
    return 2 * core_rank + 1 if core_rank < extra else core_rank + extra


def _scratch(call: CollectiveCall, flat: torch.Tensor, numel: int) -> torch.Tensor:
    return call.workspace.get(numel, flat.dtype, flat.device)


def _recursive_doubling(flat: torch.Tensor, call: CollectiveCall, core_rank: int, core_size: int,
                        extra: int) -> None:
    inbox = _scratch(call, flat, flat.numel())
    distance = 1
    while distance < core_size:
        partner = _core_member(core_rank ^ distance, extra)
        call.send_recv(flat, partner, inbox, partner, step=f"recursive doubling distance {distance}")
        flat += inbox
        distance *= 2


def _levels(core_rank: int, core_size: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """The recursive halving of core chunk indices ``[0, core_size)`` seen from ``core_rank``: per level,
    outermost first, ``(distance, kept range, given range)``; the last kept range is ``(core_rank, core_rank + 1)``."""
    levels, low, high, distance = [], 0, core_size, core_size // 2
    while distance >= 1:
        middle = (low + high) // 2
        keep, give = ((low, middle), (middle, high)) if core_rank & distance == 0 else ((middle, high), (low, middle))
        levels.append((distance, keep, give))
        low, high = keep
        distance //= 2
    return levels


def _span(chunks, indices: tuple[int, int]) -> tuple[int, int]:
    """``(start, stop)`` of the chunks ``indices[0] .. indices[1] - 1`` (adjacent, so one range)."""
    return chunks[indices[0]][0], chunks[indices[1] - 1][1]


def _halve(flat: torch.Tensor, call: CollectiveCall, core_rank: int, core_size: int, extra: int, chunks) -> None:
    """Reduce-scatter by recursive halving over the core: afterwards core chunk ``core_rank`` of ``flat``
    (``chunks``: one ``(start, stop)`` per core rank, adjacent in order) holds the core's sum."""
    levels = _levels(core_rank, core_size)
    inbox = _scratch(call, flat, max((_span(chunks, keep)[1] - _span(chunks, keep)[0] for _, keep, _ in levels),
                                     default=0))
    for distance, keep, give in levels:
        keep_a, keep_b = _span(chunks, keep)
        give_a, give_b = _span(chunks, give)
        partner = _core_member(core_rank ^ distance, extra)
        received = inbox[: keep_b - keep_a]
        call.send_recv(flat[give_a:give_b], partner, received, partner, step=f"halving distance {distance}")
        flat[keep_a:keep_b] += received


def _double(flat: torch.Tensor, call: CollectiveCall, core_rank: int, core_size: int, extra: int, chunks) -> None:
    """All-gather by recursive doubling over the core: undo :func:`_halve`'s splits, innermost first, so
    that every core chunk of ``flat`` comes from the core rank that holds it."""
    for distance, keep, give in reversed(_levels(core_rank, core_size)):
        mine_a, mine_b = _span(chunks, keep)
        theirs_a, theirs_b = _span(chunks, give)
        partner = _core_member(core_rank ^ distance, extra)
        call.send_recv(flat[mine_a:mine_b], partner, flat[theirs_a:theirs_b], partner,
                       step=f"doubling distance {distance}")


def _halving_then_doubling(flat: torch.Tensor, call: CollectiveCall, core_rank: int, core_size: int,
                           extra: int) -> None:
    chunks = chunk_bounds(flat.numel(), core_size)
    _halve(flat, call, core_rank, core_size, extra, chunks)
    _double(flat, call, core_rank, core_size, extra, chunks)


def all_reduce(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over all ranks, in place.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    rank, world_size = call.rank, call.world_size
    if world_size == 1:
        return
    core_size, extra = _core_layout(world_size)
    if rank < 2 * extra and rank % 2 == 0:  # folds into rank + 1, then waits for the result
        call.send(flat, rank + 1, step="fold")
        call.recv(flat, rank + 1, step="unfold")
        return
    if rank < 2 * extra:
        inbox = _scratch(call, flat, flat.numel())
        call.recv(inbox, rank - 1, step="fold")
        flat += inbox
        core_rank = rank // 2
    else:
        core_rank = rank - extra
    short = flat.numel() * flat.element_size() <= SHORT_MESSAGE_BYTES or flat.numel() < core_size
    if short:
        _recursive_doubling(flat, call, core_rank, core_size, extra)
    else:
        _halving_then_doubling(flat, call, core_rank, core_size, extra)
    if rank < 2 * extra:
        call.send(flat, rank - 1, step="unfold")


def _core_chunks(chunks, core_size: int, extra: int) -> list[tuple[int, int]]:
    """One range per core rank: core rank c < extra stands for real ranks 2c and 2c+1 and owns both their
    (adjacent) chunks; the others own their real rank's chunk."""
    return [(chunks[2 * c][0], chunks[2 * c + 1][1]) if c < extra else chunks[c + extra] for c in range(core_size)]


def reduce_scatter(flat: torch.Tensor, call: CollectiveCall,
                   chunks: list[tuple[int, int]] | None = None) -> tuple[int, int]:
    """Sum ``flat`` over all ranks so that this rank's chunk holds the full sum (recursive halving).

    Args:
        flat: ``(numel,)`` contiguous tensor, modified in place; only chunk ``rank`` is meaningful afterwards.
        chunks: each rank's ``(start, stop)``, adjacent in rank order (None: ``torch.tensor_split``'s).

    Returns:
        ``(start, stop)`` of this rank's chunk.

    log2(p') exchanges of n/2, n/4, ..., (p'-1)/p'·n bytes in all; a world size that is not a power of
    two first folds (rank 2c sends its whole vector to 2c+1, which adds it and plays core rank c with
    both ranks' chunks), and at the end 2c+1 hands rank 2c its chunk. Every element is added in the
    same butterfly order as the long path of :func:`all_reduce` (IEEE addition commutes), so a chunk is
    bitwise what that path gives, whatever the chunk layout.

    Collective: every rank must call this in the same order with equal ``numel`` and ``chunks``.
    """
    rank, world_size = call.rank, call.world_size
    chunks = chunks if chunks is not None else chunk_bounds(flat.numel(), world_size)
    if world_size == 1:
        return chunks[0]
    core_size, extra = _core_layout(world_size)
    start, stop = chunks[rank]
    if rank < 2 * extra and rank % 2 == 0:  # folds into rank + 1, then gets its own chunk back
        call.send(flat, rank + 1, step="fold")
        call.recv(flat[start:stop], rank + 1, step="unfold")
        return start, stop
    if rank < 2 * extra:
        inbox = _scratch(call, flat, flat.numel())
        call.recv(inbox, rank - 1, step="fold")
        flat += inbox
    core_rank = rank // 2 if rank < 2 * extra else rank - extra
    _halve(flat, call, core_rank, core_size, extra, _core_chunks(chunks, core_size, extra))
    if rank < 2 * extra:
        a, b = chunks[rank - 1]
        call.send(flat[a:b], rank - 1, step="unfold")
    return start, stop


def all_gather(flat: torch.Tensor, call: CollectiveCall, chunks: list[tuple[int, int]] | None = None) -> None:
    """Fill every chunk of ``flat`` from the rank that owns it (recursive doubling).

    ``flat``: ``(numel,)`` contiguous, chunk ``rank`` valid; ``chunks`` as :func:`reduce_scatter`'s.
    log2(p') exchanges of (p'-1)/p'·n bytes in all; a world size that is not a power of two folds the
    pairs first (rank 2c sends its chunk to 2c+1) and finally 2c+1 sends rank 2c the whole vector.

    Collective: every rank must call this in the same order with equal ``numel`` and ``chunks``.
    """
    rank, world_size = call.rank, call.world_size
    if world_size == 1:
        return
    chunks = chunks if chunks is not None else chunk_bounds(flat.numel(), world_size)
    core_size, extra = _core_layout(world_size)
    if rank < 2 * extra and rank % 2 == 0:
        a, b = chunks[rank]
        call.send(flat[a:b], rank + 1, step="fold")
        call.recv(flat, rank + 1, step="unfold")
        return
    if rank < 2 * extra:
        a, b = chunks[rank - 1]
        call.recv(flat[a:b], rank - 1, step="fold")
    core_rank = rank // 2 if rank < 2 * extra else rank - extra
    _double(flat, call, core_rank, core_size, extra, _core_chunks(chunks, core_size, extra))
    if rank < 2 * extra:
        call.send(flat, rank - 1, step="unfold")
