"""The cost model's terms against α-β-γ sums computed by hand from each algorithm's schedule.

A hand-built profile: α = 10 µs and 1 GB/s inside a host (separate egress
and ingress ports per rank), α = 50 µs and 0.25 GB/s across hosts (one NIC
per host), γ = 0.1 ns per byte added, a 5 µs call overhead, no cores limit.
n = 768 KiB of float32, one segment per chunk or half (segment_bytes = 1 GiB),
so every step is one message: a sum below is (messages on the critical path) × α
+ (bytes through the busiest port on it) × β + (bytes added on it) × γ.

Each sum is checked against the closed form (``formulas.predict_s``) and the
event simulation (``engine.simulate_all_reduce``) where it is affordable (the
event simulation of a 1024-rank ring takes over a minute here: closed form
only; the 1024-rank trees take a fraction of a second).

The ring is the one-segment-per-chunk ring: on one host the streamed schedule
(segments sent on as they arrive) takes as long as a lockstep one, each hop one
message per rank; across hosts the link between them sets the pace.
"""

from __future__ import annotations

import pytest

from gradsync.collectives.cost.formulas import predict_s
from gradsync.collectives.cost.profile import Link, Profile
from gradsync.collectives.cost.profiles import get_profile
from gradsync.collectives.cost.topology import Topology
from gradsync.sim.engine import simulate_all_reduce
from gradsync.collectives.ring import IN_FLIGHT

A, B = 10e-6, 1e-9  # inside a host: s per message, s per byte
AE, BE = 50e-6, 4e-9  # across hosts
G = 1e-10  # s per byte added
O = 5e-6  # s per call
N = 786432  # bytes: a multiple of 4·2, 4·3, 4·8 and 4·1024
ONE_SEGMENT = 2**30
PROFILE = Profile("hand", "α-β-γ by hand", Link(A, 1 / B), Link(AE, 1 / BE), G, 0.0, ranks_per_host=8,
                  nics_per_host=1, call_overhead_s=O)
EVENT_LIMIT = 64  # ring sizes the event simulation runs in this test (1024 ranks: over a minute)


def ring_hand(p: int, alpha: float, beta: float) -> float:
    """2(p-1) hops of one chunk c = n/p each (p-1 reduce-scatter hops add it: (p-1)·c·γ)."""
    c = N / p
    return O + 2 * (p - 1) * (alpha + c * beta) + (p - 1) * c * G


def tree_hand(p: int) -> float:
    """Heap tree, one segment of n: a parent's two children share its ingress port (the second arrives
    after 2·n·β), it waits its left child first, then adds both."""
    n = N
    return {
        2: O + 2 * A + 2 * n * B + n * G,  # up: α + nβ + nγ; down: α + nβ
        # up: 2 -> 0 first on 0's port, 1 second (α + 2nβ), 0 waits 1 then adds both; down: 0 -> 1, 0 -> 2
        3: O + 2 * A + 4 * n * B + 2 * n * G,
        # up: 7 -> 3 (α + nβ + nγ); 3 -> 1 queues behind 4 -> 1; 2 -> 0 (ready α + 2nβ + nγ) before 1 -> 0,
        # which arrives 2α + 4nβ + nγ, then two adds; down: the last child of the last child, 2(α + 2nβ)
        8: O + 4 * A + 8 * n * B + 3 * n * G,
        # levels 0..8 full, rank 1023 below 511: up, 9 levels of α + 2nβ + nγ plus the left path's one add
        # (511's extra hop is hidden behind its sibling's transfer from level 7 up); down, 9 right hops of α + 2nβ
        1024: O + 18 * A + 36 * n * B + 10 * n * G,
    }[p]


def double_binary_tree_hand(p: int) -> float:
    """Two trees, each one segment of h = n/2, at once; an inner rank's two children share its ingress port
    (egress down), and a rank's sends in its leaf tree use its egress while its inner tree uses its
    ingress, so the trees do not meet on a port."""
    h = N / 2
    return {
        2: O + 2 * A + 2 * h * B + h * G,  # 0 -> 1 and 1 -> 0 at once, up and down
        # each root takes two halves in (α + 2hβ), adds the second after it arrives; down: two halves out
        3: O + 2 * A + 4 * h * B + h * G,
        # root (one child) over 2 levels of two children: up 2(α + 2hβ + hγ) + α + hβ + hγ; down alike
        8: O + 6 * A + 10 * h * B + 3 * h * G,
        # root (one child) over 9 levels of two children
        1024: O + 20 * A + 38 * h * B + 10 * h * G,
    }[p]


def _check(algorithm: str, topology: Topology, hand: float, event: bool = True) -> None:
    formula = predict_s(algorithm, PROFILE, topology, N, segment_bytes=ONE_SEGMENT)
    assert formula == pytest.approx(hand, rel=0.03), (algorithm, topology, formula, hand)
    if event:
        simulated = simulate_all_reduce(algorithm, N, PROFILE, topology, segment_bytes=ONE_SEGMENT).time_s
        assert simulated == pytest.approx(hand, rel=1e-9), (algorithm, topology, simulated, hand)


@pytest.mark.parametrize("p", [2, 3, 8, 1024])
def test_ring_on_one_host(p):
    formula = predict_s("ring", PROFILE, Topology.uniform(1, p), N, segment_bytes=ONE_SEGMENT)
    assert formula == pytest.approx(ring_hand(p, A, B), rel=1e-12)  # the closed form is the textbook sum
    _check("ring", Topology.uniform(1, p), ring_hand(p, A, B), event=p <= EVENT_LIMIT)


def ring_across_hand(per_host: int) -> float:
    """The streamed ring over 2 hosts (one edge each way between them), c = n/p, whichever path is longest:
    2 x 1: each hop waits for the other (both edges cross), 2(α_e + c·β_e) and one add; 2 x 4: the NIC carries
    the 2(p-1) chunks back to back, then the last one's α_e; 2 x 512 (c = 768 B, latency-bound): the rank
    behind an edge between hosts receives ``ring.IN_FLIGHT`` ahead, so its reduce-scatter moves that many
    chunks per α_e + c·β_e + c·γ, then the all-gather's fill: 2 crossings and p-3 hops inside."""
    p = 2 * per_host
    c = N / p
    if per_host == 1:
        return ring_hand(p, AE, BE)
    if per_host == 4:
        return O + 2 * (p - 1) * c * BE + AE
    return O + (p - 1) * (AE + c * BE + c * G) / IN_FLIGHT + 2 * (AE + c * BE) + (p - 3) * (A + c * B)


@pytest.mark.parametrize("hosts,per_host", [(2, 1), (2, 4), (2, 512)])
def test_ring_across_two_hosts_runs_at_the_slow_links_pace(hosts, per_host):
    """The slow link sets the pace: the ring's hops stream (a hop does not wait for the last one's end), so
    the link between hosts is busy back to back, or the inbox behind it waits its α_e (see ring_across_hand)."""
    p = hosts * per_host
    _check("ring", Topology.uniform(hosts, per_host), ring_across_hand(per_host), event=p <= EVENT_LIMIT)


@pytest.mark.parametrize("p", [2, 3, 8, 1024])
def test_tree_on_one_host(p):
    _check("tree", Topology.uniform(1, p), tree_hand(p))


@pytest.mark.parametrize("p", [2, 3, 8, 1024])
def test_double_binary_tree_on_one_host(p):
    _check("double_binary_tree", Topology.uniform(1, p), double_binary_tree_hand(p))


def test_trees_across_two_hosts_of_one_rank():
    """2 hosts x 1 rank: the tree's one edge crosses (up then down, n each); the double binary tree's two
    trees cross in opposite directions at once (h = n/2 each way)."""
    topology = Topology.uniform(2, 1)
    _check("tree", topology, O + 2 * AE + 2 * N * BE + N * G)
    _check("double_binary_tree", topology, O + 2 * AE + N * BE + N / 2 * G)


@pytest.mark.parametrize("algorithm", ["tree", "double_binary_tree"])
def test_trees_across_two_hosts_of_four_ranks_formula_matches_the_event_simulation(algorithm):
    """2 hosts x 4 ranks, where the NIC is shared by the edges that cross: closed form within 5%."""
    topology = Topology.uniform(2, 4)
    formula = predict_s(algorithm, PROFILE, topology, N, segment_bytes=ONE_SEGMENT)
    simulated = simulate_all_reduce(algorithm, N, PROFILE, topology, segment_bytes=ONE_SEGMENT).time_s
    assert formula == pytest.approx(simulated, rel=0.05)


def test_double_binary_tree_moves_about_half_the_trees_bytes_per_port():
    """Pipelined (many segments), a single tree's inner rank takes 2n in per phase, a double binary tree's
    rank n: at 64 MiB in 1 MiB segments the double binary tree is close to twice as fast, by the formula
    and the event simulation alike (the bound: 2·n·β against 4·n·β, plus the pipeline's fill)."""
    topology, n = Topology.uniform(1, 8), 64 * 2**20
    for predict in (lambda alg: predict_s(alg, PROFILE, topology, n, segment_bytes=2**20),
                    lambda alg: simulate_all_reduce(alg, n, PROFILE, topology, segment_bytes=2**20).time_s):
        tree, dbt = predict("tree"), predict("double_binary_tree")
        assert 2 * n * B < dbt < 1.15 * 2 * n * B
        assert 4 * n * B < tree < 1.15 * 4 * n * B


@pytest.mark.parametrize("profile_name,layouts", [
    ("h100-ib", [(1, 8), (2, 8), (3, 8), (4, 2), (8, 1)]),
    ("this-machine", [(1, 2), (1, 3), (1, 4), (1, 8)]),
])
def test_double_binary_tree_formula_agrees_with_the_event_simulation(profile_name, layouts):
    """Shipped profiles, latency- to bandwidth-bound sizes: within 8% (the first segments' port order
    across hosts is where they part most, 3 hosts x 8 at 1 MiB: 6.7%)."""
    profile = get_profile(profile_name)
    for hosts, per_host in layouts:
        topology = Topology.uniform(hosts, per_host)
        for nbytes in (4096, 2**20, 64 * 2**20):
            event = simulate_all_reduce("double_binary_tree", nbytes, profile, topology).time_s
            formula = predict_s("double_binary_tree", profile, topology, nbytes)
            assert formula == pytest.approx(event, rel=0.08), (topology, nbytes)
