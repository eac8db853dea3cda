"""Binomial-tree broadcast: ceil(log2 p) rounds, each rank receives once.

Ranks are renumbered relative to the source (v = (rank - src) mod p). In the
round with distance d = 1, 2, 4, ... every v < d that already holds the data
sends it to v + d, so after ceil(log2 p) rounds every rank has it. Cost
ceil(log2 p)·(α + n·β) (Thakur et al. 2005).
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall


def broadcast(flat: torch.Tensor, src: int, call: CollectiveCall) -> None:
    """Copy ``src``'s ``flat`` (``(numel,)``, contiguous) into every rank's ``flat``, in place.

    Collective: every rank must call this in the same order with equal ``numel`` and ``src``.
    """
    world_size = call.world_size
    relative = (call.rank - src) % world_size
    distance = 1
    while distance < world_size:
        if relative < distance and relative + distance < world_size:
            peer = (relative + distance + src) % world_size
            call.send(flat, peer, step=f"broadcast round {distance.bit_length() - 1}")
        elif distance <= relative < 2 * distance:
            peer = (relative - distance + src) % world_size
            call.recv(flat, peer, step=f"broadcast round {distance.bit_length() - 1}")
        distance *= 2
