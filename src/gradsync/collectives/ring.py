"""Ring AllReduce = reduce-scatter then all-gather, streamed by segments (Patarasuk & Yuan 2009).

Each rank sends 2(p-1) chunks to its right neighbour and receives as many
from its left one; cost 2(p-1)·α + 2(p-1)/p·n·β + (p-1)/p·n·γ (Thakur et
al. 2005), bandwidth-optimal for large messages.

How it works (p = 4 ranks, chunks 0..3, rank r's right is r+1 mod p):

* reduce-scatter, hop k = 0..p-2: rank r sends chunk (r-k-1) mod p to the
  right and receives chunk (r-k-2) mod p from the left, adding it to its own
  copy. After p-1 hops rank r holds the full sum of chunk r, so the result
  matches ``torch.tensor_split`` order (rank r owns chunk r).
* all-gather, hop k = 0..p-2: rank r sends chunk (r-k) mod p, which it
  already holds in full, and receives chunk (r-k-1) mod p, overwriting it.

The stream (as Gloo's and NCCL's rings run): every chunk is cut into segments
of ``SegmentOptions.segment_bytes``, and a rank's receives from its left form
one sequence over all its hops, the AllReduce's two phases included. What a
hop sends is what the hop before received, so a segment is forwarded to the
right as soon as it is added (or, in the all-gather, received), and the last
reduce-scatter hop's sums go out at once as the all-gather's first hop: no
hop waits for the one before to end. The reduce-scatter receives into an
inbox of ``IN_FLIGHT`` segments; a slot's next receive is posted as soon as
its segment is added, whatever hop comes next. The all-gather receives
straight into the tensor, into a segment the reduce-scatter sent p-1 hops
before: that send is awaited just before the receive is posted (the one
buffer a rank reuses), and only once the rank has received its own segment
of that earlier hop, so a rank that waits for a send waits for a neighbour
further behind than itself and the ranks cannot wait in a circle. Every other
send is awaited at the end. Both ends cut a chunk the same way, and messages
between a pair are matched in order, so segments need no tags. The first
receives are posted before the first sends: Gloo moves a payload only into a
posted receive, and a send posted first waits for the peer's notice, which on
a busy link queues behind the peer's own data (59% of a shaped 1 Gbit/s link
between 2 test hosts send-first, 99% receive-first).

Why the result is unchanged (bitwise, ``tests/test_ring_stream.py``): each
element is still added once per reduce-scatter hop, on the same rank, as
``own + incoming``, in hop order (chunk c starts at rank c+1 and each next
rank adds its own); the stream only changes when the messages are posted and
awaited, never which bytes travel or where they are added.

The two phases are also the registry's ring reduce-scatter and all-gather
(:func:`reduce_scatter`, :func:`all_gather`), so a reduce-scattered chunk is
bitwise the AllReduce's.

Chunks follow :func:`~gradsync.collectives.chunking.chunk_bounds`: with
numel = 10 and p = 4 they hold 3, 3, 2, 2 elements; with numel = 2 two
chunks are empty and have no segments, so nothing is sent for them.
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import SegmentOptions, chunk_bounds, segment_bounds

# reduce-scatter receives posted ahead of the segment being added (the inbox's slots). 4, not 2: at ws = 4
# on this machine, 16 MiB / 64 MiB, busbw over native's went 0.81 / 0.88 and 0.82 / 0.85 with 2 against
# 0.90 / 0.92 and 0.98 / 1.15 with 4 (two interleaved pairs of 7 repetitions), for 2 more segments of memory.
IN_FLIGHT = 4


def _segments(chunks, index: int, segment_numel: int) -> list[tuple[int, int]]:
    start, stop = chunks[index % len(chunks)]
    return segment_bounds(start, stop, segment_numel)


class _Plan:
    """One rank's stream: the hops' names and its receives from the left in order.

    ``items[i]``: (hop, start, stop) of the i-th receive; hops ``< reduce_hops`` add into the tensor
    (``reduce_scatter hop k``), the others overwrite it (``all_gather hop k``). ``gates[i]``: how
    many receives must be done before receive i may be posted (an all-gather receive after a
    reduce-scatter: the rank's own receives up to the segment whose send it awaits).
    """

    def __init__(self, chunks, rank: int, world_size: int, segment_numel: int, reduce: bool, gather: bool):
        self.reduce_hops = world_size - 1 if reduce else 0
        hops = self.reduce_hops + (world_size - 1 if gather else 0)
        self.names = [f"reduce_scatter hop {hop}" if hop < self.reduce_hops else
                      f"all_gather hop {hop - self.reduce_hops}" for hop in range(hops)]
        base = rank - 1 if reduce else rank  # hop t sends chunk base - t and receives chunk base - t - 1
        self.first_send = _segments(chunks, base, segment_numel)
        self.items, self.gates, done_before = [], [], []
        for hop in range(hops):
            done_before.append(len(self.items))
            for index, (start, stop) in enumerate(_segments(chunks, base - hop - 1, segment_numel)):
                self.items.append((hop, start, stop))
                self.gates.append(self._gate(hop, index, done_before, world_size) if reduce else 0)

    def _gate(self, hop: int, index: int, done_before: list[int], world_size: int) -> int:
        """Receives to finish before all-gather receive ``index`` of ``hop`` may be posted: every one up to
        segment ``index`` of hop ``hop - (p - 1)``, whose send reads the segment this receive writes."""
        if hop < self.reduce_hops:
            return 0
        earlier = hop + 1 - world_size
        return min(done_before[earlier] + index + 1, done_before[earlier + 1])


def _stream(flat: torch.Tensor, call: CollectiveCall, chunks, reduce: bool, gather: bool) -> None:
    """Run this rank's reduce-scatter hops (``reduce``), all-gather hops (``gather``) or both as one stream."""
    rank, world_size = call.rank, call.world_size
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    segment_numel = call.options(SegmentOptions).segment_numel(flat.element_size())
    plan = _Plan(chunks, rank, world_size, segment_numel, reduce, gather)
    items, gates, names, reduce_hops = plan.items, plan.gates, plan.names, plan.reduce_hops
    last_hop = len(names) - 1
    inbox = None
    if reduce_hops:
        slot_numel = min(segment_numel, max(max(b - a for a, b in chunks), 1))
        inbox = call.workspace.get(IN_FLIGHT * slot_numel, flat.dtype, flat.device).view(IN_FLIGHT, -1)
    receives = [None] * len(items)
    sending: dict[int, tuple] = {}  # segment start -> (send, its hop's name) not awaited yet
    posted = 0

    def post(done: int, gathers: bool) -> None:
        """Post, in order, the receives the inbox allows (and, with ``gathers``, the gates) after ``done``."""
        nonlocal posted
        while posted < len(items):
            hop, start, stop = items[posted]
            if hop < reduce_hops:
                if posted >= done + IN_FLIGHT:
                    break
                receives[posted] = call.irecv(inbox[posted % IN_FLIGHT, : stop - start], left)
            else:
                if not gathers or done < gates[posted]:
                    break
                pending = sending.pop(start, None)
                if pending is not None:  # the reduce-scatter's send still reading this segment
                    call.wait_on(*pending)
                receives[posted] = call.irecv(flat[start:stop], left)
            posted += 1

    post(0, True)  # receives first (see the module docstring)
    for start, stop in plan.first_send:
        sending[start] = (call.isend(flat[start:stop], right), names[0])
    finished = []
    for index, (hop, start, stop) in enumerate(items):
        step = names[hop]
        call.wait_on(receives[index], step)
        receives[index] = None
        if hop < reduce_hops:
            flat[start:stop] += inbox[index % IN_FLIGHT, : stop - start]
            post(index + 1, False)  # the freed slot's next receive, before this segment goes on
        if hop < last_hop:  # this segment is the next hop's message
            forward = (call.isend(flat[start:stop], right), names[hop + 1])
            previous = sending.pop(start, None)
            if previous is not None:  # never, by the gates; kept so that no send goes unawaited
                finished.append(previous)
            sending[start] = forward
        post(index + 1, True)
    for pending in finished + list(sending.values()):
        call.wait_on(*pending)


def reduce_scatter(flat: torch.Tensor, call: CollectiveCall,
                   chunks: list[tuple[int, int]] | None = None) -> tuple[int, int]:
    """Sum ``flat`` over all ranks so that this rank's chunk holds the full sum.

    Args:
        flat: ``(numel,)`` contiguous tensor, modified in place; only chunk
            ``rank`` is meaningful afterwards.
        call: the collective call (transport, deadline, workspace; segments of ``SegmentOptions``).
        chunks: each rank's ``(start, stop)``, disjoint (None: ``chunk_bounds(numel, world_size)``,
            ``torch.tensor_split`` order; ``hierarchical`` passes its own, some possibly empty).

    Returns:
        ``(start, stop)`` of this rank's chunk.

    Collective: every rank must call this in the same order with equal ``numel`` and ``chunks``.
    """
    chunks = chunks if chunks is not None else chunk_bounds(flat.numel(), call.world_size)
    if call.world_size > 1:
        _stream(flat, call, chunks, reduce=True, gather=False)
    return chunks[call.rank]


def all_gather(flat: torch.Tensor, call: CollectiveCall, chunks: list[tuple[int, int]] | None = None) -> None:
    """Fill every chunk of ``flat`` from the rank that owns it (rank r owns chunk r).

    Args:
        flat: ``(numel,)`` contiguous tensor whose chunk ``rank`` is valid; the
            other chunks are overwritten in place.
        chunks: as :func:`reduce_scatter`'s (None: ``torch.tensor_split`` order).

    Collective: every rank must call this in the same order with equal ``numel`` and ``chunks``.
    """
    if call.world_size > 1:
        chunks = chunks if chunks is not None else chunk_bounds(flat.numel(), call.world_size)
        _stream(flat, call, chunks, reduce=False, gather=True)


def all_reduce(flat: torch.Tensor, call: CollectiveCall) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over all ranks, in place: the reduce-scatter and the
    all-gather as one stream (the same messages and additions as :func:`reduce_scatter` then
    :func:`all_gather`).

    Collective: every rank must call this in the same order with equal ``numel``.
    """
    if call.world_size > 1:
        _stream(flat, call, chunk_bounds(flat.numel(), call.world_size), reduce=True, gather=True)
