"""Hierarchical reduce-scatter and all-gather: inside each node first, then across nodes among equal local ranks.

Nodes and inner algorithms are those of the hierarchical AllReduce
(:class:`~gradsync.collectives.hierarchical.HierarchicalOptions`: real hosts,
or pretend nodes of ``ranks_per_node`` ranks). The result's chunks are
``torch.tensor_split``'s over all p ranks. With L the smallest node's rank
count, the chunk of the rank of local rank i belongs to *lane* i mod L, and
the message is laid out lane by lane (inside a lane node by node, inside a
node by local rank) in a staging buffer: the identity, with no copy, for one
node or nodes of one rank.

Reduce-scatter:

1. inside each node, a reduce-scatter of the lanes: local rank j < L gets
   the node's sum of lane j (a ring over the transport, or the node's shared
   memory as the AllReduce's ``intra_node_algorithm`` says; local ranks >= L
   own no lane);
2. the ranks of local rank j on every node reduce-scatter lane j across the
   nodes: node k's rank gets the sum over nodes of its node's part of the
   lane (ring or halving_doubling as the AllReduce's ``inter_node_algorithm``
   says, ``tree`` being a reduction to one root runs a ring here, "native" the
   backend's reduce-scatter over the same subgroups);
3. it keeps its own chunk and sends the chunks of its node's ranks of local
   rank >= L (i mod L = j) to them.

All-gather, the reverse: a rank of local rank >= L first sends its chunk to
local rank i mod L of its node; lane j is all-gathered across nodes among the
ranks of local rank j; then the lanes inside each node (every rank gets every lane).

Bytes, H nodes of L ranks and n bytes: inside, (L-1)/L·n per rank; across,
(H-1)/H·n/L per rank, so (H-1)/H·n over each node's link: half the
AllReduce's in both. Every chunk is summed in one fixed order (the ring's or
the butterfly's), so a rerun gives the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradsync.collectives import halving_doubling, native, ring, shm_shards
from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import chunk_bounds
from gradsync.collectives.hierarchical import NATIVE, BackendSubgroups, HierarchicalOptions, NodeShmStates

Bounds = list[tuple[int, int]]
_ACROSS = {"ring": ring, "halving_doubling": halving_doubling, "tree": ring}  # tree has no reduce-scatter


@dataclass(frozen=True)
class Layout:
    """Where every rank's chunk lies in the lane-by-lane order of one message.

    ``chunks[r]``: rank r's chunk in the message (``torch.tensor_split``); ``staged[r]``: the same chunk
    in the staging order; ``lanes[j]``: lane j's ``(start, stop)`` there; ``parts[j][k]``: node k's part
    of lane j, relative to the lane's start; ``identity``: the staging order is the message's own.
    """

    chunks: Bounds
    staged: Bounds
    lanes: Bounds
    parts: list[Bounds]
    identity: bool


def layout(numel: int, nodes) -> Layout:
    """The :class:`Layout` of a ``numel``-element message over ``nodes`` (each a tuple of ranks)."""
    world_size = sum(len(members) for members in nodes)
    chunks = chunk_bounds(numel, world_size)
    lane_count = min(len(members) for members in nodes)
    staged: list = [None] * world_size
    lanes, parts, offset = [], [], 0
    for lane in range(lane_count):
        lane_start, node_parts = offset, []
        for members in nodes:
            part_start = offset
            for local_rank in range(lane, len(members), lane_count):
                a, b = chunks[members[local_rank]]
                staged[members[local_rank]] = (offset, offset + b - a)
                offset += b - a
            node_parts.append((part_start - lane_start, offset - lane_start))
        lanes.append((lane_start, offset))
        parts.append(node_parts)
    return Layout(chunks, staged, lanes, parts, staged == chunks)


@dataclass
class _Plan:
    """One call's node, layout and inner steps (see the module docstring)."""

    call: CollectiveCall
    node: tuple[int, ...]
    local_rank: int
    layout: Layout
    inside: object      # module with reduce_scatter / all_gather (chunks=), or None for a node of one rank
    intra: CollectiveCall | None
    across: object      # (region, parts, collective) -> None, or None: this rank crosses no node boundary

    @property
    def owner(self) -> bool:
        return self.local_rank < len(self.layout.lanes)

    def intra_chunks(self) -> Bounds:
        lanes = self.layout.lanes
        return [lanes[index] if index < len(lanes) else (0, 0) for index in range(len(self.node))]

    def lane_mates(self) -> list[int]:
        """The ranks of this node whose chunks lie in this rank's lane (local rank >= L, i mod L = j)."""
        lanes = len(self.layout.lanes)
        return [self.node[index] for index in range(self.local_rank + lanes, len(self.node), lanes)]

    def lane_owner(self) -> int:
        return self.node[self.local_rank % len(self.layout.lanes)]


def _plan(flat: torch.Tensor, call: CollectiveCall) -> _Plan:
    options = call.options(HierarchicalOptions)
    nodes = options.nodes(call.world_size, call.locality)
    node = next(members for members in nodes if call.rank in members)
    local_rank, shape = node.index(call.rank), layout(flat.numel(), nodes)
    inside, intra = None, None
    if len(node) > 1:
        if options.intra_for(max(len(members) for members in nodes), flat.device.type) == "shm":
            state = call.options(NodeShmStates).for_members(node)
            inside, intra = shm_shards, call.sub(list(node), f"{call.algorithm}/intra-node shm", options=[state])
        else:
            inside, intra = ring, call.sub(list(node), f"{call.algorithm}/intra-node ring")
    peer_lists = [[members[lane] for members in nodes] for lane in range(len(shape.lanes))]
    return _Plan(call, node, local_rank, shape, inside, intra,
                 _across(call, options.inter_for(len(nodes)), peer_lists, local_rank))


def _across(call: CollectiveCall, algorithm: str, peer_lists: list[list[int]], local_rank: int):
    """``f(region, parts, collective)`` running ``collective`` on lane ``local_rank`` among the ranks of that
    local rank on every node, or None (one node, or a rank that owns no lane). For "native" every rank
    takes part in making the backend subgroups (the AllReduce's, made once)."""
    if len(peer_lists[0]) == 1:
        return None
    subgroups = call.options(BackendSubgroups).for_layout(call, peer_lists) if algorithm == NATIVE else None
    if local_rank >= len(peer_lists):
        return None
    peers = peer_lists[local_rank]
    label = f"{call.algorithm}/inter-node {algorithm}"
    if subgroups is not None:
        def backend(region, parts, collective):
            run = native.reduce_scatter_over if collective == "reduce_scatter" else native.all_gather_over
            run(region, subgroups[local_rank], parts, call, peers, label)
        return backend
    inter, module = call.sub(peers, label), _ACROSS[algorithm]
    return lambda region, parts, collective: getattr(module, collective)(region, inter, parts)


def _staging(flat: torch.Tensor, call: CollectiveCall, plan: _Plan) -> torch.Tensor:
    if plan.layout.identity:
        return flat
    return call.workspace.get(flat.numel(), flat.dtype, flat.device, purpose="hierarchical lanes")


def _lane(work: torch.Tensor, plan: _Plan) -> torch.Tensor:
    a, b = plan.layout.lanes[plan.local_rank]
    return work[a:b]


def reduce_scatter(flat: torch.Tensor, call: CollectiveCall) -> tuple[int, int]:
    """Sum ``flat`` (``(numel,)``, contiguous, modified) over all ranks so that this rank's chunk
    (``torch.tensor_split`` order) holds the sum; return its ``(start, stop)``. Node layout and inner
    algorithms: ``call.options(HierarchicalOptions)``.

    Raises:
        ValueError: the world size is not a multiple of ``ranks_per_node``; "native" across nodes over a
        transport that cannot make backend subgroups.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    plan = _plan(flat, call)
    shape = plan.layout
    work = _staging(flat, call, plan)
    if not shape.identity:
        for (a, b), (x, y) in zip(shape.chunks, shape.staged):
            work[x:y] = flat[a:b]
    if plan.inside is not None:
        plan.inside.reduce_scatter(work, plan.intra, plan.intra_chunks())
    if plan.owner and plan.across is not None:
        plan.across(_lane(work, plan), shape.parts[plan.local_rank], "reduce_scatter")
    step = "hierarchical chunks to the node's ranks beyond the smallest node"
    if plan.owner:
        call.wait_all([call.isend(work[slice(*shape.staged[mate])], mate, step) for mate in plan.lane_mates()], step)
    else:
        call.recv(work[slice(*shape.staged[call.rank])], plan.lane_owner(), step)
    start, stop = shape.chunks[call.rank]
    if not shape.identity:
        flat[start:stop] = work[slice(*shape.staged[call.rank])]
    return start, stop


def all_gather(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Fill every chunk of ``flat`` (``(numel,)``, contiguous; chunk ``rank`` of ``torch.tensor_split``
    valid) from the rank that owns it: the reverse of :func:`reduce_scatter`.

    Raises:
        as :func:`reduce_scatter`.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    plan = _plan(flat, call)
    shape = plan.layout
    work = _staging(flat, call, plan)
    if not shape.identity:
        (a, b), (x, y) = shape.chunks[call.rank], shape.staged[call.rank]
        work[x:y] = flat[a:b]
    step = "hierarchical chunks from the node's ranks beyond the smallest node"
    if plan.owner:
        call.wait_all([call.irecv(work[slice(*shape.staged[mate])], mate, step) for mate in plan.lane_mates()], step)
    else:
        call.send(work[slice(*shape.staged[call.rank])], plan.lane_owner(), step)
    if plan.owner and plan.across is not None:
        plan.across(_lane(work, plan), shape.parts[plan.local_rank], "all_gather")
    if plan.inside is not None:
        plan.inside.all_gather(work, plan.intra, plan.intra_chunks())
    if not shape.identity:
        for (a, b), (x, y) in zip(shape.chunks, shape.staged):
            flat[a:b] = work[x:y]
