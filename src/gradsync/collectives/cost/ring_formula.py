"""Closed-form α-β-γ time of the streamed ring (:mod:`gradsync.collectives.ring`), on the event simulation's model.

The ring's segments flow through its hops without waiting for a hop to end
(Patarasuk & Yuan 2009's pipelined ring, as Gloo's and NCCL's run), so its
time is the longest of three paths (:func:`ring_stream_s`): the pipeline fill
of 2(p-1) hops (one segment through every edge), then one segment per step
on the slowest edge, or the reduce-scatter at its inbox's pace. A step is a
:class:`Step` (α, β, γ, the ranks
sharing its port, a rank's transfers sharing its port); the profile's steps
are built in :mod:`gradsync.collectives.cost.formulas`, which prices the flat
ring (``ring_s``) and hierarchical's rings with these. Agrees with the event
simulation of the real code within 5% at the sizes ``tests/test_sim.py``
compares (``tests/test_ring_stream_cost.py``: hand sums at 2, 3, 8, 1024 ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradsync.collectives.ring import IN_FLIGHT as _IN_FLIGHT


@dataclass(frozen=True)
class Step:
    """Per-message latency, per-byte transfer and reduction time of one kind of step (seconds), how
    many ranks share the busiest port it crosses, and how many of a rank's own transfers share its
    port at once (``ports``: 2 where a rank's sends and receives go through its one core, and ``beta``
    is then that port's time per byte of a hop, both directions: a single transfer takes beta/ports)."""

    alpha: float
    beta: float
    gamma: float
    sharing: float = 1.0
    ports: float = 1.0

    def move_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` per rank of a ring while ``sharing`` rings use the same port: the
        latency hides the others' bytes until the port itself is the bound (the rings fall out of step
        after their first collision, as in the event simulation)."""
        return max(self.alpha + nbytes * self.beta, self.sharing * nbytes * self.beta)

    def exchange_s(self, nbytes: float) -> float:
        """Seconds of a lockstep exchange of ``nbytes`` (halving-doubling: every pair starts each step
        together, so the ``sharing`` ranks' bytes queue on the port every time)."""
        return self.alpha + self.sharing * nbytes * self.beta


def segment_cut(chunk_bytes: float, segment_bytes: int, itemsize: int) -> tuple[float, int]:
    """(segment bytes, segments) of a chunk, as ring and tree cut it."""
    s = min(segment_bytes - segment_bytes % itemsize or itemsize, max(chunk_bytes, itemsize))
    return s, max(1, math.ceil(chunk_bytes / s))


def ring_phases_s(p: int, n: float, step: Step, segment_bytes: int, itemsize: int, *,
                  fast: Step | None = None, period: int = 1) -> tuple[float, float]:
    """(reduce-scatter, all-gather) seconds of the streamed ring over p ranks, each phase on its own (as
    :func:`~gradsync.collectives.ring.reduce_scatter` and :func:`~gradsync.collectives.ring.all_gather`
    run them): :func:`ring_stream_s` of p-1 hops. ``step``: the ring's slowest edge; ``fast``: its other
    edges, one slow edge in every ``period`` (None: every edge is ``step``)."""
    return (ring_stream_s(p, n, step, segment_bytes, itemsize, reduce=True, gather=False, fast=fast, period=period),
            ring_stream_s(p, n, step, segment_bytes, itemsize, reduce=False, gather=True, fast=fast, period=period))


def ring_stream_s(p: int, n: float, step: Step, segment_bytes: int, itemsize: int, *, reduce: bool = True,
                  gather: bool = True, fast: Step | None = None, period: int = 1) -> float:
    """Seconds of the streamed ring (:mod:`gradsync.collectives.ring`): its reduce-scatter's p-1 hops,
    its all-gather's p-1 hops, or both as one stream (the AllReduce), over chunks of c = n/p bytes cut
    in k segments of s.

    Segments flow through the hops without waiting for a hop to end, so the time is the longest of
    three paths: the pipeline fill, one segment through all T hops (:func:`_fill_s`: each hop α + s·β
    of its edge and the add s·γ that precedes a forward; plus the k-1 segments before it on the
    slowest edge); the stream once full, one segment per step on the slowest edge (T·k segments back
    to back, in the reduce-scatter at least (α + s·β + s·γ) / ``IN_FLIGHT`` apart: a slot of the
    inbox is posted again only once its segment is added); and the reduce-scatter at that inbox's
    pace on the rank behind the slowest edge (every one of its messages crosses that edge), then the
    all-gather's fill. Latency-bound across hosts the segments reaching that inbox also wait on the
    other crossings of their way round the ring, which none of the three paths holds: the formula is
    up to 8% short there (h100-ib, 2 x 8 ranks, 4 KiB-1 MiB, against the event simulation).
    """
    if p == 1 or n == 0:
        return 0.0
    reduce_hops = p - 1 if reduce else 0
    gather_hops = p - 1 if gather else 0
    hops = reduce_hops + gather_hops
    c = math.ceil(n / itemsize / p) * itemsize
    s, k = segment_cut(c, segment_bytes, itemsize)
    last_add = (c - (k - 1) * s) * step.gamma if not gather else 0.0  # a reduce-scatter ends with an add
    port = step.sharing * step.beta  # the slowest edge's port, per byte
    window = (step.alpha + s * step.beta / step.ports + s * step.gamma) / _IN_FLIGHT  # per segment, an inbox slot
    arrive = step.alpha + s * step.beta  # the last segment's transfer, its rank's other one beside it
    paced = max(0, reduce_hops * k - _IN_FLIGHT)  # reduce-scatter segments whose receive waits for a free slot
    streamed = (hops * c - s) * port + paced * max(0.0, window - s * port) + arrive + last_add
    fill = (c - s) * max(port, window / s if reduce else port) + _fill_s(p, s, step, fast, period, reduce_hops, gather_hops)
    windowed = reduce_hops * k * window + _fill_s(p, s, step, fast, period, 0, gather_hops) + last_add
    return max(streamed, fill, windowed)


def _fill_s(p: int, s: float, step: Step, fast: Step | None, period: int, reduce_hops: int, gather_hops: int) -> float:
    """One segment of s bytes through ``reduce_hops`` then ``gather_hops`` consecutive edges of the ring
    (one ``step`` edge in every ``period``, the others ``fast``), added after every reduce-scatter hop.
    A hop takes α + s·β of its edge, or its port's time for the two transfers of a rank where they share
    one port and that is longer, and the add. Ranks that share a port with both neighbours (loopback
    TCP) fall out of step after their first collisions, which cost X transfers in all: at p = 2 both
    ranks exchange at once on every hop (each hop the port's time); beyond, X = min(3/4·hops,
    max(2, ⌈p/2⌉)) once the hop's latency is at least 0.9 of the port's time, falling linearly to 0 at
    0.75 (fitted to the event simulation of loopback rings of 3-12 ranks, 256 KiB-4 MiB chunks:
    within 10%, within 5% at the sizes ``tests/test_sim.py`` compares)."""
    hops = reduce_hops + gather_hops
    if hops == 0:
        return 0.0
    slow = hops if fast is None else math.ceil(hops / period)
    total = 0.0
    for edge, count in ((step, slow), (fast, hops - slow)):
        if not count:
            continue
        single = s * edge.beta / edge.ports if p > 2 else s * edge.beta  # p = 2: both directions at once
        adding = count * reduce_hops / hops  # the edge's part of the hops that add before they forward
        ported = edge.sharing * s * edge.beta
        chain = edge.alpha + single
        total += count * max(chain, ported) + adding * s * edge.gamma
        if edge.ports > 1 and p > 2:
            latency = (chain + s * edge.gamma * reduce_hops / hops) / ported
            collisions = min(0.75 * hops, max(2, math.ceil(p / 2)))
            total += collisions * min(1.0, max(0.0, (latency - 0.75) / 0.15)) * single * count / hops
    return total
