"""The cost model's fixed costs: a hop inside a schedule (``Link.hop_alpha_s``, crowded or not) and a call per
algorithm (``Profile.call_overheads_s``), charged by the virtual clock and the closed forms alike, against
hand-computed sums; old profile files and GPU profiles keep their behaviour (fast: no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from gradsync.collectives.cost import formulas
from gradsync.collectives.cost.profile import Link, Profile
from gradsync.collectives.cost.profiles import get_profile
from gradsync.sim import Topology, simulate_all_reduce

HOP, CROWDED, PING = 1e-4, 3e-4, 1e-5
RING_CALL, TREE_CALL, DEFAULT_CALL = 5e-5, 7e-5, 2e-5


def _profile(cores: int | None = None) -> Profile:
    """Bytes, adds and copies all but free (1e15 B/s, 1e-15 s/B): only the fixed costs count."""
    return Profile(name="fixed", description="", gamma_s_per_byte=1e-15, copy_s_per_byte=1e-15,
                   intra=Link(PING, 1e15, cpu_bound=True, hop_alpha_s=HOP, oversubscribed_hop_alpha_s=CROWDED),
                   inter=None, ranks_per_host=4, cores_per_host=cores, call_overhead_s=DEFAULT_CALL,
                   call_overheads_s=(("ring", RING_CALL), ("tree", TREE_CALL)))


@pytest.mark.parametrize("world_size, cores, hop, crowd", [
    (2, None, HOP, 1.0),       # 2(p-1) = 2 hops at the hop's latency, one call
    (3, None, HOP, 1.0),       # 4 hops
    (4, 2, CROWDED, 2.0),      # 4 ranks on 2 cores: 6 crowded hops (as measured, not slowed) and a call x 2
    (3, 2, (HOP + CROWDED) / 2, 1.5),  # 3 on 2 cores: half-way to the crowded hop (measured at 2 a core)
])
def test_ring_costs_its_call_and_a_hop_per_step(world_size, cores, hop, crowd):
    profile = _profile(cores)
    topology = Topology((world_size,))
    expected = RING_CALL * crowd + 2 * (world_size - 1) * hop
    nbytes = 4 * world_size  # one float a chunk
    assert simulate_all_reduce("ring", nbytes, profile, topology).time_s == pytest.approx(expected, rel=1e-6)
    assert formulas.predict_s("ring", profile, topology, nbytes) == pytest.approx(expected, rel=1e-6)


def test_tree_and_halving_doubling_count_their_hops_and_own_calls():
    profile, topology = _profile(), Topology((4,))
    # heap tree of 4: depth 2 up (rank 3 -> 1 -> 0), 2 down; halving_doubling's short path: log2(4) = 2 exchanges
    assert simulate_all_reduce("tree", 16, profile, topology).time_s == pytest.approx(TREE_CALL + 4 * HOP, rel=1e-6)
    assert formulas.predict_s("tree", profile, topology, 16) == pytest.approx(TREE_CALL + 4 * HOP, rel=1e-6)
    hd = DEFAULT_CALL + 2 * HOP  # no figure of its own: call_overhead_s
    assert simulate_all_reduce("halving_doubling", 16, profile, topology).time_s == pytest.approx(hd, rel=1e-6)
    assert formulas.predict_s("halving_doubling", profile, topology, 16) == pytest.approx(hd, rel=1e-6)


def test_without_the_new_terms_a_profile_charges_alpha_and_one_call_overhead():
    old = _profile(2)
    old = dataclasses.replace(old, intra=Link(PING, 1e15, cpu_bound=True), call_overheads_s=())
    data = old.as_dict()
    for key in ("call_overheads_s",):
        data.pop(key)
    for key in ("hop_alpha_s", "oversubscribed_hop_alpha_s"):
        data["intra"].pop(key)
    again = Profile.from_dict(data)  # a profile file written before these fields existed
    assert again == old and again.intra.hop_s == PING and again.call_overhead("ring") == DEFAULT_CALL
    # ws 4 on 2 cores: the old rule, alpha and the call slowed by ranks/cores (2)
    assert simulate_all_reduce("ring", 16, again, Topology((4,))).time_s == pytest.approx(
        2 * DEFAULT_CALL + 6 * 2 * PING, rel=1e-6)
    assert Link(1e-6, 1e9).hop_at(4.0) == 1e-6 and Link(1e-6, 1e9, cpu_bound=True).hop_at(4.0) == 4e-6


def test_gpu_profiles_have_no_fixed_cost_terms():
    for name in ("h100-ib", "a100-ib"):
        profile = get_profile(name)
        assert profile.call_overheads_s == () and profile.intra.hop_alpha_s is None
        assert profile.intra.hop_s == profile.intra.alpha_s and profile.intra.hop_at(1.0) == profile.intra.alpha_s


def test_bad_hop_and_call_overheads_round_trip():
    with pytest.raises(ValueError, match="hop_alpha_s"):
        Link(1e-6, 1e9, hop_alpha_s=-1.0)
    profile = _profile(2)
    data = profile.as_dict()
    assert data["call_overheads_s"] == {"ring": RING_CALL, "tree": TREE_CALL}
    assert Profile.from_dict(data) == profile and Profile.from_dict(data).digest() == profile.digest()


def test_one_way_messages_cost_the_one_way_hop_and_exchanges_the_exchange_hop():
    one = 4e-5
    profile = _profile()
    profile = dataclasses.replace(profile, intra=dataclasses.replace(profile.intra, one_way_hop_alpha_s=one))
    topology = Topology((4,))
    # the tree's 4 edges are one-way (no receiver sends meanwhile); the ring's 6 steps are exchanges
    for seconds in (simulate_all_reduce("tree", 16, profile, topology).time_s,
                    formulas.predict_s("tree", profile, topology, 16)):
        assert seconds == pytest.approx(TREE_CALL + 4 * one, rel=1e-6)
    assert simulate_all_reduce("ring", 16, profile, topology).time_s == pytest.approx(RING_CALL + 6 * HOP, rel=1e-6)
    # halving_doubling of 3: the fold in (one-way), one exchange of the power-of-two core, the fold back (one-way)
    three = Topology((3,))
    for seconds in (simulate_all_reduce("halving_doubling", 12, profile, three).time_s,
                    formulas.predict_s("halving_doubling", profile, three, 12)):
        assert seconds == pytest.approx(DEFAULT_CALL + 2 * one + HOP, rel=1e-6)
