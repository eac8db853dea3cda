"""Hierarchical (two-level) AllReduce: inside each node, then across nodes, then inside again.

Horovod's hierarchical allreduce and NCCL's intra/inter-node split: with
nodes of L ranks, (1) a ring reduce-scatter among the L ranks of a node
leaves local rank l with the node's sum of chunk l; (2) the ranks that share
local rank l (one per node) all-reduce that chunk with an inner algorithm;
(3) a ring all-gather inside each node spreads the result. Only 1/L of the
data crosses the slow links between nodes, from L ranks in parallel. With
``intra_node_algorithm="shm"`` the steps inside a node go through the node's
shared memory instead (node sum, then each chunk broadcast from its owner).

Nodes are consecutive rank blocks: node k holds ranks [k·L, (k+1)·L), with
L = ``call.ranks_per_node`` (the launcher's LOCAL_WORLD_SIZE, or a smaller
value so that one machine can pretend to be several nodes).
"""

from __future__ import annotations

import torch

from gradsync.collectives import halving_doubling, ring, shm, tree
from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import chunk_bounds

INTER_NODE_ALGORITHMS = {"ring": ring.all_reduce, "tree": tree.all_reduce,
                         "halving_doubling": halving_doubling.all_reduce}
INTRA_NODE_ALGORITHMS = ("ring", "shm")


def all_reduce(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over all ranks, in place.

    The algorithm among ranks of equal local rank is ``call.inter_node_algorithm``
    (a key of ``INTER_NODE_ALGORITHMS``).

    Raises:
        ValueError: the world size is not a multiple of ``call.ranks_per_node``.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    ranks_per_node, world_size, rank = call.ranks_per_node, call.world_size, call.rank
    if world_size % ranks_per_node:
        raise ValueError(f"hierarchical needs the world size {world_size} to be a multiple of "
                         f"ranks_per_node {ranks_per_node}")
    inter_node = call.inter_node_algorithm
    node, local_rank = divmod(rank, ranks_per_node)
    node_members = [node * ranks_per_node + local for local in range(ranks_per_node)]
    peer_members = [other * ranks_per_node + local_rank for other in range(world_size // ranks_per_node)]
    inter = call.sub(peer_members, f"{call.algorithm}/inter-node {inter_node}")
    if call.intra_node_algorithm == "shm" and ranks_per_node > 1:
        _all_reduce_with_shm_inside(flat, call, node_members, local_rank, inter)
        return
    intra = call.sub(node_members, f"{call.algorithm}/intra-node ring")
    start, stop = ring.reduce_scatter(flat, intra)
    INTER_NODE_ALGORITHMS[inter_node](flat[start:stop], inter)
    ring.all_gather(flat, intra)


def _all_reduce_with_shm_inside(flat: torch.Tensor, call: CollectiveCall, node_members: list[int],
                                local_rank: int, inter: CollectiveCall) -> None:
    """Node sum through the node's shared memory, chunk l across nodes by local rank l, then each
    chunk broadcast from its owner through shared memory."""
    state = call.node_shm_states.setdefault(tuple(node_members), shm.ShmState())
    intra = call.sub(node_members, f"{call.algorithm}/intra-node shm", shm_state=state)
    shm.all_reduce(flat, intra)
    chunks = chunk_bounds(flat.numel(), len(node_members))
    start, stop = chunks[local_rank]
    INTER_NODE_ALGORITHMS[call.inter_node_algorithm](flat[start:stop], inter)
    for owner, (a, b) in enumerate(chunks):
        if b > a:
            shm.broadcast(flat[a:b], owner, intra)
