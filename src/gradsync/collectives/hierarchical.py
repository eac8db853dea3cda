"""Hierarchical (two-level) AllReduce: inside each node, then across nodes, then inside again.

Horovod's hierarchical allreduce and NCCL's intra/inter-node split: with
nodes of L ranks, (1) a ring reduce-scatter among the L ranks of a node
leaves local rank l with the node's sum of chunk l; (2) the ranks that share
local rank l (one per node) all-reduce that chunk with an inner algorithm;
(3) a ring all-gather inside each node spreads the result. Only 1/L of the
data crosses the slow links between nodes, from L ranks in parallel.

Nodes are consecutive rank blocks: node k holds ranks [k·L, (k+1)·L), with
L = ``call.ranks_per_node`` (the launcher's LOCAL_WORLD_SIZE, or a smaller
value so that one machine can pretend to be several nodes).
"""

from __future__ import annotations

import torch

from gradsync.collectives import halving_doubling, ring, tree
from gradsync.collectives.call import CollectiveCall

INTER_NODE_ALGORITHMS = {"ring": ring.all_reduce, "tree": tree.all_reduce,
                         "halving_doubling": halving_doubling.all_reduce}


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
    intra = call.sub(node_members, f"{call.algorithm}/intra-node ring")
    inter = call.sub(peer_members, f"{call.algorithm}/inter-node {inter_node}")
    start, stop = ring.reduce_scatter(flat, intra)
    INTER_NODE_ALGORITHMS[inter_node](flat[start:stop], inter)
    ring.all_gather(flat, intra)
