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
Across several nodes with shm inside, a message of more than one
``PIPELINE_PIECE_BYTES`` piece is pipelined: piece k crosses the nodes on a
helper thread while this thread broadcasts piece k-1 and sums piece k+1, so
the shared-memory steps hide behind the slow link (2 test hosts x 2 ranks,
1 Gbit/s, 16 MiB: 159 ms serial, 139 ms pipelined; the link alone 134 ms).
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

import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from gradsync.collectives import halving_doubling, native, ring, shm, tree
from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import SegmentOptions, chunk_bounds
from gradsync.collectives.options import AlgorithmOptions, check_count
from gradsync.transport.base import PeerFailure

INTER_NODE_ALGORITHMS = {"ring": ring.all_reduce, "tree": tree.all_reduce,
                         "halving_doubling": halving_doubling.all_reduce}
NATIVE = "native"  # the backend's own all_reduce over a subgroup per local rank
INTER_NODE_CHOICES = ("auto",) + tuple(INTER_NODE_ALGORITHMS) + (NATIVE,)
INTRA_NODE_ALGORITHMS = ("auto", "ring", "shm")
# shm inside, several nodes: pieces of at least this much overlap the phases (2 x 2 test hosts, 16 MiB,
# 1 Gbit/s: 1 piece 160 ms, 2 146, 4 140, 8 139; at 10 Gbit/s, where one core per host bounds, more
# pieces cost more than they hide: 1 MiB pieces took 30 ms at 4 MiB against 18 unpipelined)
PIPELINE_PIECE_BYTES = 2 * 2**20
PIPELINE_MAX_PIECES = 4

Nodes = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class HierarchicalOptions(AlgorithmOptions):
    """Node layout and inner algorithms of ``hierarchical``.

    Args:
        ranks_per_node: ranks per pretend node: ranks ``[k*ranks_per_node,
            (k+1)*ranks_per_node)`` form node k (one machine pretending to be
            several). None: the nodes are the real hosts of the group's locality
            (any number of ranks each, interleaved or not; no locality: one node).
        inter_node_algorithm: what runs across nodes: "auto" (the default:
            ``halving_doubling`` over a power-of-two number of nodes, whose one
            exchange per doubling halves the ring's latency there and sends the
            same bytes at 2 nodes; else ``ring``), a key of
            ``INTER_NODE_ALGORITHMS``, or "native" (the backend's all_reduce over
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
    inter_node_algorithm: str = "auto"
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

    def inter_for(self, node_count: int) -> str:
        """The algorithm across ``node_count`` nodes ("auto" resolved: the same on every rank)."""
        if self.inter_node_algorithm != "auto":
            return self.inter_node_algorithm
        return "halving_doubling" if node_count & (node_count - 1) == 0 else "ring"

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


def group_problem(comm) -> ValueError | None:
    """Why the group of ``comm`` (a Communicator) cannot run this algorithm with its options, or None."""
    options = comm.options(HierarchicalOptions)
    try:
        options.nodes(comm.world_size, comm.locality)
    except ValueError as exc:
        return exc
    if options.inter_node_algorithm == NATIVE:
        return native_problem(comm.transport)
    return None


def options_compared(comm) -> tuple:
    """What every rank's options must agree on: segment bytes, the nodes (crc32) and both algorithms."""
    options = comm.options(HierarchicalOptions)
    try:
        nodes = zlib.crc32(repr(options.nodes(comm.world_size, comm.locality)).encode())
    except ValueError:
        nodes = None
    return (comm.options(SegmentOptions).segment_bytes, nodes, options.inter_node_algorithm,
            options.intra_node_algorithm)


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
    inter = _inter_node(call, options.inter_for(len(nodes)), peer_lists, local_rank)
    # decided by the largest node, so that every rank cuts the message into the same pieces
    if options.intra_for(max(len(members) for members in nodes), flat.device.type) == "shm":
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
    chunk broadcast from its owner through shared memory (skipped for a single node).

    A message of several pieces (:func:`pipeline_pieces`) is pipelined: while piece k crosses the
    nodes on a helper thread, this thread broadcasts piece k-1 and sums piece k+1 inside the node,
    so the shared-memory steps hide behind the slow link instead of adding to it.
    """
    alone = len(node) == 1  # nothing moves inside, but this rank cuts the same pieces as the others
    if not alone:
        state = call.options(NodeShmStates).for_members(node)
        intra = call.sub(list(node), f"{call.algorithm}/intra-node shm", options=[state])

    def node_sum(piece: torch.Tensor) -> None:
        if not alone:
            shm.all_reduce(piece, intra)

    if not several_nodes:
        node_sum(flat)
        return
    local_rank = node.index(call.rank)

    def owned(piece: torch.Tensor) -> torch.Tensor | None:
        if local_rank >= owners:
            return None
        start, stop = chunk_bounds(piece.numel(), owners)[local_rank]
        return piece[start:stop]

    def spread(piece: torch.Tensor) -> None:
        for owner, (a, b) in enumerate(chunk_bounds(piece.numel(), owners)):
            if b > a and not alone:
                shm.broadcast(piece[a:b], owner, intra)

    pieces = [flat[a:b] for a, b in pipeline_pieces(flat.numel(), flat.element_size())]
    if len(pieces) == 1 or getattr(call.transport, "shared_memory_model", None) is not None:
        # one piece, or a simulated group (gradsync.sim's ranks share one thread: no helper thread)
        node_sum(flat)
        if owned(flat) is not None:
            inter(owned(flat))
        spread(flat)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradsync-inter-node") as crossing:
        pending = []
        try:
            for index, piece in enumerate(pieces):
                node_sum(piece)
                chunk = owned(piece)
                pending.append(crossing.submit(inter, chunk) if chunk is not None else None)
                if index:
                    _finish(pending[index - 1], pieces[index - 1], spread)
            _finish(pending[-1], pieces[-1], spread)
        except BaseException:
            for future in pending:
                if future is not None:
                    future.cancel()
            raise


def _finish(future, piece: torch.Tensor, spread) -> None:
    """Wait for ``piece``'s crossing (re-raising its error here), then broadcast its chunks."""
    if future is not None:
        future.result()
    spread(piece)


def pipeline_pieces(numel: int, element_size: int) -> list[tuple[int, int]]:
    """The pieces of a shm-inside message: at least ``PIPELINE_PIECE_BYTES`` each, at most
    ``PIPELINE_MAX_PIECES`` (one piece: no pipeline, no helper thread)."""
    count = min(PIPELINE_MAX_PIECES, max(1, numel * element_size // PIPELINE_PIECE_BYTES))
    return [(a, b) for a, b in chunk_bounds(numel, count) if b > a] or [(0, numel)]
