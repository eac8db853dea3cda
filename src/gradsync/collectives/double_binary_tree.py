"""Double binary tree AllReduce: two complementary binary trees, each reducing and broadcasting half the data.

A single binary tree (:mod:`~gradsync.collectives.tree`) leaves half of
every link idle: leaves only send once up and receive once down, while inner
ranks send and receive twice. Sanders, Speck & Träff (2009, "Two-tree
algorithms for full bandwidth broadcast, reduction and scan") and NCCL 2.4
build a second tree in which the inner ranks of the first are leaves and the
leaves inner ranks, and let each tree carry half of the message, so every
rank sends and receives about n in all, near the ring's bandwidth with a
tree's log-depth latency.

The trees (positions 1..p, in-order, NCCL's bit trick): the node at position
q with lowest set bit b (q even) has children q - b/2 and the largest
q + b/2^k ≤ p (k ≥ 1); odd positions are leaves; the root is the largest power
of two ≤ p. Equivalently, the root of any contiguous range of positions is
the one with the most trailing zero bits. Rank r sits at

* tree 1: position r + 1 (inner ranks: the odd ranks);
* tree 2: p even: position p - r, the mirror; p odd: position (r + 1) mod p + 1,
  the shift by one (inner ranks: even ranks below p - 1 in both cases),

as NCCL mirrors for even and shifts for odd world sizes; so every rank is an
inner node in at most one tree (``inner_ranks`` returns both sets).

Schedule: ``flat`` is split in two halves (``chunk_bounds(numel, 2)``): tree 1
carries the first, tree 2 the second, each cut into segments of
``SegmentOptions.segment_bytes``. Every rank is a leaf in at least one tree;
in it, it posts all its segments to its parent at once (reduce) or just
receives them (broadcast), so the two trees never wait for each other (a
rank that walked both trees' segments in turn would chain tree 1's depth to
tree 2's on every segment). In the tree it is an inner node of, reduce:
segment k arrives from both children (two segments per child received
ahead), is added to its own (own + left child's subtree + right child's
subtree, left = the lower position) and sent to its parent; broadcast: the
roots' results flow back down segment by segment. Each result element is
summed once, at its tree's root, in that fixed order, then copied: bitwise
equal on every rank. A rank is a parent of another in at most one tree
(parents are inner nodes, odd ranks in tree 1 and even ranks in tree 2), so
the messages between two ranks in one direction follow one tree per phase
and the transport's in-order matching needs no tags.

Cost (segment size s, depth d ≈ log2 p, α-β model): in each phase a rank
moves at most n bytes each way (an inner rank of tree t takes two halves
in from its children and sends one half up in tree t and one in the other
tree), where a single tree's inner rank takes 2n in, so
≈ 2·(d·(α + s·β) + (n/s)·(α + s·β)) when the links are full duplex.
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import SegmentOptions, chunk_bounds, segment_bounds

_IN_FLIGHT = 2  # segments per child received ahead of the one being reduced


def _children_of_position(position: int, world_size: int) -> list[int]:
    """Children (positions 1..world_size, lower first) of ``position`` in the in-order bit tree."""
    low = (position & -position) >> 1
    if low == 0:
        return []
    children = [position - low]
    while low and position + low > world_size:
        low >>= 1
    if low:
        children.append(position + low)
    return children


def _position(rank: int, world_size: int, tree: int) -> int:
    if tree == 0:
        return rank + 1
    if world_size % 2 == 0:
        return world_size - rank  # mirror
    return (rank + 1) % world_size + 1  # shift by one


def _rank_at(position: int, world_size: int, tree: int) -> int:
    if tree == 0:
        return position - 1
    if world_size % 2 == 0:
        return world_size - position
    return (position - 2) % world_size


def links(rank: int, world_size: int, tree: int) -> tuple[int | None, list[int]]:
    """``(parent, children)`` of ``rank`` in ``tree`` (0 or 1): parent None at the root, children lower
    position first (at most two).

    Raises:
        ValueError: ``rank`` not in ``[0, world_size)`` or ``tree`` not 0 or 1.
    """
    if not 0 <= rank < world_size or tree not in (0, 1):
        raise ValueError(f"need 0 <= rank < world_size and tree 0 or 1, got {rank}, {world_size}, {tree}")
    position = _position(rank, world_size, tree)
    children = [_rank_at(child, world_size, tree) for child in _children_of_position(position, world_size)]
    root = 1 << (world_size.bit_length() - 1)
    if position == root:
        return None, children
    bit = position & -position
    parent = (position ^ bit) | (bit << 1)  # the parent has the next larger lowest bit, left or right
    if parent > world_size or position not in _children_of_position(parent, world_size):
        parent = position ^ bit
    return _rank_at(parent, world_size, tree), children


def inner_ranks(world_size: int) -> tuple[set[int], set[int]]:
    """The ranks with at least one child in tree 1 and in tree 2 (disjoint)."""
    first, second = ({rank for rank in range(world_size) if links(rank, world_size, tree)[1]} for tree in (0, 1))
    return first, second


def _halves(flat: torch.Tensor, segment_numel: int) -> list[list[torch.Tensor]]:
    return [[flat[a:b] for a, b in segment_bounds(start, stop, segment_numel)]
            for start, stop in chunk_bounds(flat.numel(), 2)]


def _inner_tree(trees) -> int | None:
    """The tree (0 or 1) in which this rank has children, None for a leaf of both."""
    return next((tree for tree in (0, 1) if trees[tree][1]), None)


def _send_all(call: CollectiveCall, views: list[torch.Tensor], peer: int | None) -> list:
    return [call.isend(view, peer) for view in views] if peer is not None else []


def reduce(call: CollectiveCall, halves: list[list[torch.Tensor]], trees) -> None:
    """Sum every rank's ``halves[t]`` (views of its ``flat``) into tree t's root, in place, both trees at once.

    ``trees``: this rank's ``links`` in tree 0 and tree 1. A rank is a leaf in at least one tree: it
    posts all of that tree's segments to its parent at once (they wait for nothing), and walks the
    segments of the tree it is an inner node of in order, so neither tree waits for the other.
    Collective: equal cuts on every rank.
    """
    inner = _inner_tree(trees)
    sends = []
    for tree in (0, 1):
        if tree != inner:
            sends += _send_all(call, halves[tree], trees[tree][0])
    if inner is not None and halves[inner]:
        sends += _reduce_inner(call, halves[inner], trees[inner], inner)
    call.wait_all(sends, "double_binary_tree reduce")


def _reduce_inner(call: CollectiveCall, segments: list[torch.Tensor], links_: tuple, tree: int) -> list:
    """Add the children's segments to this rank's (own + left subtree + right subtree), each sum sent up
    as soon as it is made, ``_IN_FLIGHT`` segments per child received ahead; returns the sends."""
    parent, children = links_
    longest = max((view.numel() for view in segments), default=0)
    inbox = call.workspace.get(_IN_FLIGHT * len(children) * longest, segments[0].dtype, segments[0].device)
    inbox = inbox.view(_IN_FLIGHT, len(children), longest)

    def post(index):
        boxes = [inbox[index % _IN_FLIGHT, slot, :segments[index].numel()] for slot in range(len(children))]
        return [(call.irecv(box, child), box) for box, child in zip(boxes, children)]

    receives = [post(index) for index in range(min(_IN_FLIGHT, len(segments)))]
    sends = []
    for index, view in enumerate(segments):
        for pending, box in receives[index]:
            call.wait_on(pending, f"double_binary_tree reduce tree {tree + 1} segment {index}")
            view += box
        if index + _IN_FLIGHT < len(segments):
            receives.append(post(index + _IN_FLIGHT))
        if parent is not None:
            sends.append(call.isend(view, parent))
    return sends


def broadcast_down(call: CollectiveCall, halves: list[list[torch.Tensor]], trees) -> None:
    """Copy each tree's root's ``halves[t]`` to every rank's down that tree, in place, both trees at once
    (a rank forwards only in the tree it is an inner node of; the other tree's segments it just receives)."""
    receives = {(tree, index): call.irecv(view, trees[tree][0])
                for tree in (0, 1) if trees[tree][0] is not None for index, view in enumerate(halves[tree])}
    sends = []
    inner = _inner_tree(trees)
    if inner is not None:
        for index, view in enumerate(halves[inner]):
            if (inner, index) in receives:
                call.wait_on(receives.pop((inner, index)),
                             f"double_binary_tree broadcast tree {inner + 1} segment {index}")
            sends.extend(call.isend(view, child) for child in trees[inner][1])
    for (tree, index), pending in receives.items():
        call.wait_on(pending, f"double_binary_tree broadcast tree {tree + 1} segment {index}")
    call.wait_all(sends, "double_binary_tree broadcast")


def all_reduce(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous, any dtype the caller passes) over all ranks, in place.

    Collective: every rank must call this in the same order with equal ``numel`` and
    ``SegmentOptions.segment_bytes``.
    """
    if call.world_size == 1 or flat.numel() == 0:
        return
    segment_numel = call.options(SegmentOptions).segment_numel(flat.element_size())
    halves = _halves(flat, segment_numel)
    trees = [links(call.rank, call.world_size, tree) for tree in (0, 1)]
    reduce(call, halves, trees)
    broadcast_down(call, halves, trees)
