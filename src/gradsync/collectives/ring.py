"""Ring AllReduce = reduce-scatter then all-gather (Patarasuk & Yuan 2009).

Each rank sends 2(p-1) messages of one chunk each to its right neighbour and
receives as many from its left one; cost 2(p-1)·α + 2(p-1)/p·n·β +
(p-1)/p·n·γ (Thakur et al. 2005), bandwidth-optimal for large messages.

How it works (p = 4 ranks, chunks 0..3, rank r's right is r+1 mod p):

* reduce-scatter, hop k = 0..p-2: rank r sends chunk (r-k-1) mod p to the
  right and receives chunk (r-k-2) mod p from the left, adding it to its own
  copy. After p-1 hops rank r holds the full sum of chunk r, so the result
  matches ``torch.tensor_split`` order (rank r owns chunk r).
* all-gather, hop k = 0..p-2: rank r sends chunk (r-k) mod p, which it
  already holds in full, and receives chunk (r-k-1) mod p, overwriting it.

Chunks follow :func:`~gradsync.collectives.chunking.chunk_bounds`: with
numel = 10 and p = 4 they hold 3, 3, 2, 2 elements; with numel = 2 two
chunks are empty and their messages are skipped on both sides.
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import chunk_bounds


def reduce_scatter(flat: torch.Tensor, call: CollectiveCall) -> tuple[int, int]:
    """Sum ``flat`` over all ranks so that this rank's chunk holds the full sum.

    Args:
        flat: ``(numel,)`` contiguous tensor, modified in place; only chunk
            ``rank`` is meaningful afterwards.
        call: the collective call (transport, deadline, workspace).

    Returns:
        ``(start, stop)`` of this rank's chunk.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    rank, world_size = call.rank, call.world_size
    chunks = chunk_bounds(flat.numel(), world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    inbox = call.workspace.get(chunks[0][1] - chunks[0][0], flat.dtype, flat.device)
    for hop in range(world_size - 1):
        send_start, send_stop = chunks[(rank - hop - 1) % world_size]
        recv_start, recv_stop = chunks[(rank - hop - 2) % world_size]
        received = inbox[: recv_stop - recv_start]
        call.send_recv(flat[send_start:send_stop], right, received, left,
                       step=f"reduce_scatter hop {hop}")
        flat[recv_start:recv_stop] += received
    return chunks[rank]


def all_gather(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Fill every chunk of ``flat`` from the rank that owns it (rank r owns chunk r).

    Args:
        flat: ``(numel,)`` contiguous tensor whose chunk ``rank`` is valid; the
            other chunks are overwritten in place.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    rank, world_size = call.rank, call.world_size
    chunks = chunk_bounds(flat.numel(), world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for hop in range(world_size - 1):
        send_start, send_stop = chunks[(rank - hop) % world_size]
        recv_start, recv_stop = chunks[(rank - hop - 1) % world_size]
        call.send_recv(flat[send_start:send_stop], right, flat[recv_start:recv_stop], left,
                       step=f"all_gather hop {hop}")


def all_reduce(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over all ranks, in place.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    reduce_scatter(flat, call)
    all_gather(flat, call)
