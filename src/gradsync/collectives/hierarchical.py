"""Hierarchical (two-level) AllReduce: inside each node, then across nodes, then inside again.

Horovod's hierarchical allreduce and NCCL's intra/inter-node split (its 2D
ring). Nodes are the group's real hosts (:attr:`Locality.members
<gradsync.transport.locality.Locality.members>`: the ranks of each host,
sorted; local rank = index there; hosts may interleave, ranks (0, 1, 0, 1)),
or with ``HierarchicalOptions.ranks_per_node = L`` pretend nodes of
consecutive blocks [k·L, (k+1)·L) (one machine acting as several).

How it works, with L_min = the smallest node's rank count and the message cut
into L_min chunks (:func:`~gradsync.collectives.chunking.chunk_bounds`):

1. inside each node, chunk j is summed over the node's ranks onto local rank j
   (j < L_min): a ring reduce-scatter among local ranks 0..L_min-1, after local
   ranks >= L_min ("extra" ranks, only on nodes larger than the smallest) have
   handed each chunk to its owner, which adds them in local-rank order;
2. the ranks of local rank j on every node all-reduce chunk j with the
   inter-node algorithm (ring, tree, halving_doubling, or "native": the
   backend's own call over a subgroup made once);
3. inside each node, a ring all-gather among the owners, then each owner sends
   its chunk to the extra ranks.

With ``intra_node_algorithm="shm"`` steps 1 and 3 go through the node's shared
memory instead (the node's sum, then chunk j broadcast from local rank j).
Every chunk is summed across nodes once and copied, so the result is bitwise
equal on every rank. Equal nodes have no extra ranks: steps 1 and 3 are then
the plain ring reduce-scatter and all-gather.

Bytes across hosts (H hosts, n bytes): the L_min ranks of each host each
send their ring share 2(H-1)/H · n/L_min, so a host sends 2(H-1)/H · n over
its link, whatever its size. A flat ring over p ranks placed host by host
crosses each host's link on one edge, carrying 2(p-1)/p · n. At 2 hosts x 2
ranks: n per host against 1.5·n, the 1.5x bound on the slow link; with
unequal hosts (2 + 1) the whole inter-host phase rides on L_min ranks per host,
and each extra rank moves n in and n out inside its host (ring; none with shm).
"native" subgroups live until the default group is destroyed (``gradsync.shutdown``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gradsync.collectives import halving_doubling, native, ring, shm, tree
from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import chunk_bounds
from gradsync.collectives.options import AlgorithmOptions, check_count
from gradsync.transport.base import PeerFailure

INTER_NODE_ALGORITHMS = {"ring": ring.all_reduce, "tree": tree.all_reduce,
                         "halving_doubling": halving_doubling.all_reduce}
NATIVE = "native"  # the backend's own all_reduce over a subgroup per local rank
INTER_NODE_CHOICES = tuple(INTER_NODE_ALGORITHMS) + (NATIVE,)
INTRA_NODE_ALGORITHMS = ("auto", "ring", "shm")

Nodes = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class HierarchicalOptions(AlgorithmOptions):
    """Node layout and inner algorithms of ``hierarchical``.

    Args:
        ranks_per_node: ranks per pretend node: ranks ``[k*ranks_per_node,
            (k+1)*ranks_per_node)`` form node k (one machine pretending to be
            several). None: the nodes are the real hosts of the group's locality
            (any number of ranks each, interleaved or not; no locality: one node).
        inter_node_algorithm: what runs across nodes: a key of
            ``INTER_NODE_ALGORITHMS`` or "native" (the backend's all_reduce over
            a subgroup per local rank; needs a TorchP2PTransport whose group holds
            every rank of the default group).
        intra_node_algorithm: what runs inside a node: "ring" (over the
            transport), "shm" (the node's shared memory; its ranks must share a
            machine) or "auto" (the default): "shm" inside a real host of more
            than one rank with CPU tensors (the ranks of one host share
            ``/dev/shm`` by the definition of host identity), else "ring" (so
            pretend nodes keep the ring, as before "auto" existed).

    Raises:
        TypeError: ``ranks_per_node`` is not an int (or None); ValueError: it is < 1
        or (at :meth:`check`) not a divisor of the world size; an unknown inner algorithm.
    """

    ranks_per_node: int | None = None
    inter_node_algorithm: str = "ring"
    intra_node_algorithm: str = "auto"

    def __post_init__(self):
        if self.ranks_per_node is not None:
            check_count("ranks_per_node", self.ranks_per_node, minimum=1)
        if self.inter_node_algorithm not in INTER_NODE_CHOICES:
            raise ValueError(f"unknown inter_node_algorithm {self.inter_node_algorithm!r}; choose one of "
                             f"{', '.join(INTER_NODE_CHOICES)}")
        if self.intra_node_algorithm not in INTRA_NODE_ALGORITHMS:
            raise ValueError(f"unknown intra_node_algorithm {self.intra_node_algorithm!r}; choose one of "
                             f"{', '.join(INTRA_NODE_ALGORITHMS)}")

    def check(self, world_size: int) -> None:
        if self.ranks_per_node is not None and world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be >= 1 and divide the "
                             f"world size {world_size}")

    def nodes(self, world_size: int, locality=None) -> Nodes:
        """The ranks of each node, each tuple sorted: pretend blocks when ``ranks_per_node`` is set
        (it wins over detection), else the hosts of ``locality`` (a
        :class:`~gradsync.transport.locality.Locality`; None: not known, one node).

        Raises:
            ValueError: ``ranks_per_node`` does not divide ``world_size``.
        """
        if self.ranks_per_node is not None:
            self.check(world_size)
            size = self.ranks_per_node
            return tuple(tuple(range(start, start + size)) for start in range(0, world_size, size))
        if locality is None:
            return (tuple(range(world_size)),)
        return locality.members

    def intra_for(self, node_ranks: int, device_type: str) -> str:
        """The algorithm inside a node of ``node_ranks`` ranks ("ring" for one rank: nothing moves)."""
        if node_ranks == 1 or self.intra_node_algorithm == "ring":
            return "ring"
        if self.intra_node_algorithm == "shm":
            return "shm"
        return "shm" if self.ranks_per_node is None and device_type == "cpu" else "ring"


@dataclass
class NodeShmStates(AlgorithmOptions):
    """The shared-memory state of each node (``intra_node_algorithm="shm"``), kept across calls."""

    by_members: dict[tuple[int, ...], shm.ShmState] = field(default_factory=dict)

    def for_members(self, members) -> shm.ShmState:
        return self.by_members.setdefault(tuple(members), shm.ShmState())

    def close(self) -> None:
        for state in self.by_members.values():
            state.close()


def native_problem(transport) -> ValueError | None:
    """Why ``inter_node_algorithm="native"`` cannot run over ``transport`` (None: it can)."""
    if getattr(transport, "can_make_subgroups", False):
        return None
    return ValueError(f"hierarchical with inter_node_algorithm='native' needs backend subgroups: a "
                      f"TorchP2PTransport whose group holds every rank of the default group (gradsync.init's "
                      f"group); this group runs over {type(transport).__name__} (choose ring, tree or "
                      f"halving_doubling across nodes)")


@dataclass
class BackendSubgroups(AlgorithmOptions):
    """The backend groups of ``inter_node_algorithm="native"``, made once per node layout.

    ``by_layout[peer lists]``: per local rank j, this rank's transport over the
    subgroup of the ranks of local rank j (None where it is not one of them).
    """

    by_layout: dict[Nodes, list] = field(default_factory=dict)

    def for_layout(self, call: CollectiveCall, peer_lists: list[list[int]]) -> list:
        """The subgroups of ``peer_lists``, made at the first call (collective over the default group:
        ``dist.new_group`` for every list, in order, on every rank).

        Raises:
            ValueError: the call's transport cannot make them (:func:`native_problem`).
        """
        key = tuple(tuple(peers) for peers in peer_lists)
        if key not in self.by_layout:
            problem = native_problem(call.transport)
            if problem is not None:
                raise problem
            try:
                self.by_layout[key] = call.transport.backend_subgroups(peer_lists, call.remaining_s())
            except PeerFailure as failure:
                raise call.failure(failure, "hierarchical backend subgroup creation") from failure
        return self.by_layout[key]


def all_reduce(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over all ranks, in place.

    Node layout and inner algorithms come from ``call.options(HierarchicalOptions)``.

    Raises:
        ValueError: the world size is not a multiple of ``ranks_per_node``; "native" across
        nodes over a transport that cannot make backend subgroups.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    options = call.options(HierarchicalOptions)
    nodes = options.nodes(call.world_size, call.locality)
    node = next(members for members in nodes if call.rank in members)
    local_rank, owners = node.index(call.rank), min(len(members) for members in nodes)
    peer_lists = [[members[j] for members in nodes] for j in range(owners)]  # one list per local rank < L_min
    inter = _inter_node(call, options.inter_node_algorithm, peer_lists, local_rank)
    if options.intra_for(len(node), flat.device.type) == "shm":
        _all_reduce_with_shm_inside(flat, call, node, owners, inter, several_nodes=len(nodes) > 1)
    else:
        _all_reduce_with_ring_inside(flat, call, node, owners, inter)


def _inter_node(call: CollectiveCall, algorithm: str, peer_lists: list[list[int]], local_rank: int):
    """``f(chunk)`` that all-reduces chunk ``local_rank`` among the ranks of equal local rank (a no-op
    for an extra rank or a single node). For "native" every rank takes part in making the subgroups."""
    if len(peer_lists[0]) == 1:
        return lambda chunk: None
    subgroups = call.options(BackendSubgroups).for_layout(call, peer_lists) if algorithm == NATIVE else None
    if local_rank >= len(peer_lists):
        return lambda chunk: None
    peers = peer_lists[local_rank]
    label = f"{call.algorithm}/inter-node {algorithm}"
    if subgroups is not None:
        return lambda chunk: native.all_reduce_over(chunk, subgroups[local_rank], peers, call, label)
    inter = call.sub(peers, label)
    return lambda chunk: INTER_NODE_ALGORITHMS[algorithm](chunk, inter)


def _all_reduce_with_ring_inside(flat: torch.Tensor, call: CollectiveCall, node: tuple[int, ...], owners: int,
                                 inter) -> None:
    """Steps 1-3 of the module docstring over the transport: extra ranks hand their chunks to the
    owners, ring reduce-scatter among the owners, chunk across nodes, ring all-gather, results back."""
    chunks = chunk_bounds(flat.numel(), owners)
    local_rank, extras = node.index(call.rank), node[owners:]
    if local_rank >= owners:
        _hand_over_and_take_back(flat, call, node[:owners], chunks)
        return
    start, stop = chunks[local_rank]
    _add_from_extras(flat[start:stop], call, extras)
    intra = call.sub(list(node[:owners]), f"{call.algorithm}/intra-node ring")
    start, stop = ring.reduce_scatter(flat, intra)
    inter(flat[start:stop])
    ring.all_gather(flat, intra)
    step = "hierarchical result to the node's extra ranks"
    call.wait_all([call.isend(flat[start:stop], extra, step) for extra in extras], step)


def _hand_over_and_take_back(flat: torch.Tensor, call: CollectiveCall, owners: tuple[int, ...],
                             chunks: list[tuple[int, int]]) -> None:
    """An extra rank: send chunk j to local rank j, then receive chunk j's result back from it."""
    step = "hierarchical hand-over to the chunk owners"
    call.wait_all([call.isend(flat[a:b], owner, step) for owner, (a, b) in zip(owners, chunks)], step)
    step = "hierarchical result from the chunk owners"
    call.wait_all([call.irecv(flat[a:b], owner, step) for owner, (a, b) in zip(owners, chunks)], step)


def _add_from_extras(chunk: torch.Tensor, call: CollectiveCall, extras: tuple[int, ...]) -> None:
    """Receive the extra ranks' copies of ``chunk`` (all in flight) and add them in local-rank order."""
    if not extras or not chunk.numel():
        return
    numel = chunk.numel()
    inbox = call.workspace.get(len(extras) * numel, chunk.dtype, chunk.device, purpose="hierarchical")
    inbox = inbox.view(len(extras), numel)
    step = "hierarchical hand-over from the node's extra ranks"
    receives = [call.irecv(inbox[index], extra, step) for index, extra in enumerate(extras)]
    for pending, row in zip(receives, inbox):
        call.wait_on(pending, step)
        chunk += row


def _all_reduce_with_shm_inside(flat: torch.Tensor, call: CollectiveCall, node: tuple[int, ...], owners: int,
                                inter, several_nodes: bool) -> None:
    """The node's sum through its shared memory, chunk j across nodes by local rank j, then each
    chunk broadcast from its owner through shared memory (skipped for a single node)."""
    state = call.options(NodeShmStates).for_members(node)
    intra = call.sub(list(node), f"{call.algorithm}/intra-node shm", options=[state])
    shm.all_reduce(flat, intra)
    if not several_nodes:
        return
    chunks = chunk_bounds(flat.numel(), owners)
    local_rank = node.index(call.rank)
    if local_rank < owners:
        start, stop = chunks[local_rank]
        inter(flat[start:stop])
    for owner, (a, b) in enumerate(chunks):
        if b > a:
            shm.broadcast(flat[a:b], owner, intra)
