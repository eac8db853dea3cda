"""The streamed ring's closed form (``formulas.ring_stream_s``) against hand-computed α-β-γ sums at 2, 3, 8 and
1024 ranks, and against the event simulation of the real ring code where the inbox sets the pace."""

from __future__ import annotations

import dataclasses

import pytest

from gradsync.collectives.cost.formulas import Step, predict_s, ring_stream_s
from gradsync.collectives.cost.profile import Link
from gradsync.collectives.cost.profiles import get_profile
from gradsync.collectives.cost.topology import Topology
from gradsync.sim.engine import simulate_all_reduce

ALPHA, BETA, GAMMA = 10e-6, 1e-10, 1e-11  # 10 us a message, 10 GB/s, 100 GB/s adds
MIB = 2**20


@pytest.mark.parametrize("p", (2, 3, 8, 1024))
def test_latency_bound_ring_is_its_fill_of_2p_minus_2_hops(p):
    """One segment per chunk (c = 4 KiB): every hop waits for the one before, 2(p-1) hops of α + c·β and the
    p-1 adds of the reduce-scatter; the reduce-scatter alone p-1 hops and p-1 adds."""
    c = 4096
    step = Step(ALPHA, BETA, GAMMA)
    expected = 2 * (p - 1) * (ALPHA + c * BETA) + (p - 1) * c * GAMMA
    assert ring_stream_s(p, p * c, step, 4 * MIB, 4) == pytest.approx(expected, rel=1e-9)
    scatter = (p - 1) * (ALPHA + c * BETA) + (p - 1) * c * GAMMA
    assert ring_stream_s(p, p * c, step, 4 * MIB, 4, gather=False) == pytest.approx(scatter, rel=1e-9)


@pytest.mark.parametrize("p", (2, 3, 8, 1024))
def test_bandwidth_bound_ring_is_one_segment_per_step(p):
    """64 segments of 1 MiB per chunk: the link carries the 2(p-1) chunks back to back, and the last segment
    arrives one α after its bytes (the lockstep ring would pay 2(p-1) α)."""
    c = 64 * MIB
    expected = 2 * (p - 1) * c * BETA + ALPHA
    assert ring_stream_s(p, p * c, Step(ALPHA, BETA, GAMMA), MIB, 4) == pytest.approx(expected, rel=1e-9)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collective", ("all_reduce", "reduce_scatter", "all_gather"))
@pytest.mark.parametrize("p", (3, 4))
def test_inbox_paced_ring_agrees_with_the_event_simulation(p, collective):
    """A 1 ms link moving 4 KiB segments in 40 ns: the reduce-scatter receives only ``ring.IN_FLIGHT`` segments
    ahead, so it moves that many per round trip (the all-gather, straight into the tensor, is not paced); the
    closed form within 5% of the real code's simulation."""
    profile = dataclasses.replace(get_profile("h100-ib"), name="slow-alpha", intra=Link(1e-3, 1e11))
    topology, nbytes = Topology.uniform(1, p), p * 256 * 1024
    event = simulate_all_reduce("ring", nbytes, profile, topology, segment_bytes=4096, collective=collective).time_s
    formula = predict_s("ring", profile, topology, nbytes, segment_bytes=4096, collective=collective)
    assert formula == pytest.approx(event, rel=0.05)
