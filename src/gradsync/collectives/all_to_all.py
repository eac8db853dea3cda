"""All-to-all personalised exchange: rank r sends ``sends[p]`` to every rank p (MPI_Alltoall).

All receives and sends are posted at once, pairwise: at distance k = 1..p-1
rank r sends to (r + k) mod p and receives from (r - k) mod p, so every link
carries one message each way and no rank waits for a neighbour's neighbour.
Each rank sends (p-1)/p of its data: the first phase of a two-phase
compressed AllReduce (each rank owns one chunk, as after a reduce-scatter).
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall


def all_to_all(sends: list[torch.Tensor], receives: list[torch.Tensor], call: CollectiveCall) -> None:
    """Deliver ``sends[p]`` of this rank into ``receives[rank]`` of rank p, for every p.

    Args:
        sends: ``world_size`` contiguous tensors; ``sends[p]`` goes to rank p.
        receives: ``world_size`` contiguous tensors; ``receives[p]`` gets rank
            p's ``sends[rank]`` (same numel and dtype as that send).
        call: the collective call.

    Collective: every rank calls it with matching sizes.
    """
    rank, world_size = call.rank, call.world_size
    receives[rank].copy_(sends[rank])
    pending = []
    for distance in range(1, world_size):
        src = (rank - distance) % world_size
        pending.append(call.irecv(receives[src], src, step=f"all_to_all receive from {src}"))
    for distance in range(1, world_size):
        dst = (rank + distance) % world_size
        pending.append(call.isend(sends[dst], dst, step=f"all_to_all send to {dst}"))
    call.wait_all(pending, "all_to_all")
