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


def _halving_then_doubling(flat: torch.Tensor, call: CollectiveCall, core_rank: int, core_size: int,
                           extra: int) -> None:
    chunks = chunk_bounds(flat.numel(), core_size)
    inbox = _scratch(call, flat, chunks[core_size // 2][0])  # the lower half is the larger one
    ranges = [(0, core_size)]  # chunk-index ranges this rank held, outermost first
    distance = core_size // 2
    while distance >= 1:  # reduce-scatter by recursive halving
        low, high = ranges[-1]
        middle = (low + high) // 2
        keep, give = ((low, middle), (middle, high)) if core_rank & distance == 0 else \
            ((middle, high), (low, middle))
        keep_a, keep_b = chunks[keep[0]][0], chunks[keep[1] - 1][1]
        give_a, give_b = chunks[give[0]][0], chunks[give[1] - 1][1]
        partner = _core_member(core_rank ^ distance, extra)
        received = inbox[: keep_b - keep_a]
        call.send_recv(flat[give_a:give_b], partner, received, partner, step=f"halving distance {distance}")
        flat[keep_a:keep_b] += received
        ranges.append(keep)
        distance //= 2
    distance = 1
    while len(ranges) > 1:  # all-gather by recursive doubling: undo each split
        mine, parent = ranges.pop(), ranges[-1]
        theirs = (parent[0], mine[0]) if mine[0] > parent[0] else (mine[1], parent[1])
        mine_a, mine_b = chunks[mine[0]][0], chunks[mine[1] - 1][1]
        theirs_a, theirs_b = chunks[theirs[0]][0], chunks[theirs[1] - 1][1]
        partner = _core_member(core_rank ^ distance, extra)
        call.send_recv(flat[mine_a:mine_b], partner, flat[theirs_a:theirs_b], partner,
                       step=f"doubling distance {distance}")
        distance *= 2


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
