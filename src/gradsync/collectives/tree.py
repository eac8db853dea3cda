"""Tree AllReduce: reduce up a binary tree to rank 0, broadcast back down, pipelined by segments.

Ranks form a heap-ordered binary tree: rank i's parent is (i-1)//2 and its
children are 2i+1 and 2i+2. Each segment flows up (every rank adds its
children's segment to its own and sends the sum to its parent) and then
down (the root's result is copied to the children). Depth is
ceil(log2(p+1)) - 1, so a small message crosses 2·depth hops instead of the
ring's 2(p-1): cost ≈ 2·depth·(α + s·β) + (n/s)·(α + s·β) with segment size
s, latency-friendly but with half the ring's bandwidth because inner ranks
send and receive twice (NCCL's trees, Sanders, Speck & Träff 2009; NCCL 2.4
adds a second, complementary tree to use both directions of every link).

Results are bitwise equal on every rank: every element is summed once, at
the root, in a fixed order (own + left subtree + right subtree at each rank),
and then copied.
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import SegmentOptions, segment_bounds

_IN_FLIGHT = 2


def _children(rank: int, world_size: int) -> list[int]:
    return [child for child in (2 * rank + 1, 2 * rank + 2) if child < world_size]


def reduce(call: CollectiveCall, segments: list[torch.Tensor]) -> None:
    """Sum every rank's ``segments`` (views of its ``flat``, in order) into rank 0's, in place.

    Collective: every rank must call this in the same order with equally cut segments.
    """
    rank = call.rank
    children = _children(rank, call.world_size) if segments else []
    parent = (rank - 1) // 2
    if children:
        longest = max((view.numel() for view in segments), default=0)
        inbox = call.workspace.get(_IN_FLIGHT * len(children) * longest, segments[0].dtype, segments[0].device)
        inbox = inbox.view(_IN_FLIGHT, len(children), longest)
        slots = [[inbox[index, slot] for slot in range(len(children))] for index in range(_IN_FLIGHT)]

        def post(index):
            numel, boxes = segments[index].numel(), slots[index % _IN_FLIGHT]
            boxes = boxes if numel == longest else [box[:numel] for box in boxes]
            return [(call.irecv(box, child), box) for box, child in zip(boxes, children)]

        receives = [post(index) for index in range(min(_IN_FLIGHT, len(segments)))]
    sends = []
    for index, view in enumerate(segments):
        if children:
            step = f"tree reduce segment {index}"
            for pending, box in receives[index]:  # own + left subtree + right subtree
                call.wait_on(pending, step)
                view += box
            if index + _IN_FLIGHT < len(segments):
                receives.append(post(index + _IN_FLIGHT))
        if rank != 0:
            sends.append(call.isend(view, parent))
    call.wait_all(sends, "tree reduce")


def broadcast_down(call: CollectiveCall, segments: list[torch.Tensor]) -> None:
    """Copy rank 0's ``segments`` (views of its ``flat``) to every rank's down the tree, in place."""
    rank = call.rank
    children = _children(rank, call.world_size)
    receives = [call.irecv(view, (rank - 1) // 2) for view in segments] if rank else []
    sends = []
    for index, view in enumerate(segments):
        if rank:
            call.wait_on(receives[index], f"tree broadcast segment {index}")
        sends.extend(call.isend(view, child) for child in children)
    call.wait_all(sends, "tree broadcast")


def all_reduce(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over all ranks, in place.

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    if call.world_size == 1:
        return
    segment_numel = call.options(SegmentOptions).segment_numel(flat.element_size())
    segments = [flat[a:b] for a, b in segment_bounds(0, flat.numel(), segment_numel)]  # one view each
    reduce(call, segments)
    broadcast_down(call, segments)
