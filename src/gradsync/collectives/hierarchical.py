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
L = ``HierarchicalOptions.ranks_per_node`` when given (a smaller value lets
one machine pretend to be several nodes), else learnt from the group's host
identities (:mod:`gradsync.transport.locality`; never from a launcher
variable such as LOCAL_WORLD_SIZE, which each rank may see differently).
Hosts that do not hold equal contiguous blocks (ranks 0-1 on one host, rank
2 on another) have no such L: ``hierarchical`` then raises ValueError on
every rank before any data moves (set ``ranks_per_node`` or use "auto",
which runs a flat algorithm there).
"""

from __future__ import annotations

import torch

from dataclasses import dataclass, field

from gradsync.collectives import halving_doubling, ring, shm, tree
from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import chunk_bounds
from gradsync.collectives.options import AlgorithmOptions, check_count

INTER_NODE_ALGORITHMS = {"ring": ring.all_reduce, "tree": tree.all_reduce,
                         "halving_doubling": halving_doubling.all_reduce}
INTRA_NODE_ALGORITHMS = ("ring", "shm")


@dataclass(frozen=True)
class HierarchicalOptions(AlgorithmOptions):
    """Node layout and inner algorithms of ``hierarchical``.

    Args:
        ranks_per_node: ranks per node (None: from the hosts the ranks run on). Ranks
            ``[k*ranks_per_node, (k+1)*ranks_per_node)`` form node k; a
            smaller value lets one machine pretend to be several nodes.
        inter_node_algorithm: what runs across nodes: a key of ``INTER_NODE_ALGORITHMS``.
        intra_node_algorithm: what runs inside a node: "ring" (over the
            transport) or "shm" (the node's shared memory; its ranks must share a machine).

    Raises:
        TypeError: ``ranks_per_node`` is not an int (or None); ValueError: it is < 1
        or (at :meth:`check`) not a divisor of the world size; an unknown inner algorithm.
    """

    ranks_per_node: int | None = None
    inter_node_algorithm: str = "ring"
    intra_node_algorithm: str = "ring"

    def __post_init__(self):
        if self.ranks_per_node is not None:
            check_count("ranks_per_node", self.ranks_per_node, minimum=1)
        if self.inter_node_algorithm not in INTER_NODE_ALGORITHMS:
            raise ValueError(f"unknown inter_node_algorithm {self.inter_node_algorithm!r}; choose one of "
                             f"{', '.join(INTER_NODE_ALGORITHMS)}")
        if self.intra_node_algorithm not in INTRA_NODE_ALGORITHMS:
            raise ValueError(f"unknown intra_node_algorithm {self.intra_node_algorithm!r}; choose one of "
                             f"{', '.join(INTRA_NODE_ALGORITHMS)}")

    def check(self, world_size: int) -> None:
        if self.ranks_per_node is not None and world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be >= 1 and divide the "
                             f"world size {world_size}")

    def node_size(self, world_size: int, locality=None) -> int:
        """Ranks per node in a group of ``world_size``: ``ranks_per_node`` when set (it wins over
        detection), else the hosts' block size from ``locality`` (a
        :class:`~gradsync.transport.locality.Locality`; None: not known, all ranks on one node).

        Raises:
            ValueError: the hosts hold unequal or non-contiguous blocks of ranks.
        """
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        if locality is None:
            return world_size
        if locality.ranks_per_node is None:
            raise ValueError(f"hierarchical needs hosts holding equal contiguous blocks of ranks; this "
                             f"group has {locality.describe()} (set HierarchicalOptions(ranks_per_node=...) "
                             f"or use algorithm='auto')")
        return locality.ranks_per_node


@dataclass
class NodeShmStates(AlgorithmOptions):
    """The shared-memory state of each node (``intra_node_algorithm="shm"``), kept across calls."""

    by_members: dict[tuple[int, ...], shm.ShmState] = field(default_factory=dict)

    def for_members(self, members: list[int]) -> shm.ShmState:
        return self.by_members.setdefault(tuple(members), shm.ShmState())

    def close(self) -> None:
        for state in self.by_members.values():
            state.close()


def all_reduce(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over all ranks, in place.

    Node layout and inner algorithms come from ``call.options(HierarchicalOptions)``.

    Raises:
        ValueError: the world size is not a multiple of ``ranks_per_node``.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    options = call.options(HierarchicalOptions)
    world_size, rank = call.world_size, call.rank
    ranks_per_node = options.node_size(world_size, call.locality)
    if world_size % ranks_per_node:
        raise ValueError(f"hierarchical needs the world size {world_size} to be a multiple of "
                         f"ranks_per_node {ranks_per_node}")
    inter_node = options.inter_node_algorithm
    node, local_rank = divmod(rank, ranks_per_node)
    node_members = [node * ranks_per_node + local for local in range(ranks_per_node)]
    peer_members = [other * ranks_per_node + local_rank for other in range(world_size // ranks_per_node)]
    inter = call.sub(peer_members, f"{call.algorithm}/inter-node {inter_node}")
    if options.intra_node_algorithm == "shm" and ranks_per_node > 1:
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
    state = call.options(NodeShmStates).for_members(node_members)
    intra = call.sub(node_members, f"{call.algorithm}/intra-node shm", options=[state])
    shm.all_reduce(flat, intra)
    chunks = chunk_bounds(flat.numel(), len(node_members))
    start, stop = chunks[local_rank]
    INTER_NODE_ALGORITHMS[call.options(HierarchicalOptions).inter_node_algorithm](flat[start:stop], inter)
    for owner, (a, b) in enumerate(chunks):
        if b > a:
            shm.broadcast(flat[a:b], owner, intra)
