"""The cost model of reduce-scatter and all-gather: formulas against the event simulation, and ``auto``.

The event simulation runs the algorithms' own reduce-scatter and all-gather
code on simulated ranks (:func:`gradsync.sim.engine.simulate_all_reduce` with
``collective=``); the closed forms ``auto`` decides with must agree within
5%, as the AllReduce's do. For ring and a power-of-two halving_doubling the
two phases add up to the AllReduce exactly; ``auto`` never picks ``tree``
(it has neither) and picks the fastest predicted candidate.
"""

from __future__ import annotations

import pytest

from gradsync.collectives import auto
from gradsync.collectives.cost.formulas import call_overhead_s, hierarchical_s, predict_s
from gradsync.collectives.cost.profiles import get_profile
from gradsync.collectives.cost.topology import Topology
from gradsync.collectives.hierarchical import HierarchicalOptions
from gradsync.sim.engine import simulate_all_reduce

H100 = get_profile("h100-ib")
HERE = get_profile("this-machine")
COLLECTIVES = ("reduce_scatter", "all_gather")


def _formula(algorithm, profile, topology, nbytes, collective):
    if algorithm == "hierarchical":  # the simulation runs the ring inside (it models shm's AllReduce only)
        return (call_overhead_s(profile, algorithm, topology, nbytes, collective)
                + hierarchical_s(profile, topology, nbytes, shm_inside=False, collective=collective))
    return predict_s(algorithm, profile, topology, nbytes, collective=collective)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("profile,layouts", [(H100, [(1, 8), (3, 8), (4, 2), (1, 6)]), (HERE, [(1, 3), (1, 4)])],
                         ids=["h100", "here"])
@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "hierarchical"])
def test_formula_agrees_with_the_event_simulation_within_5_percent(algorithm, profile, layouts, collective):
    """Folds (p = 3, 6, 24), hosts (3 x 8, 4 x 2), latency- and bandwidth-bound sizes."""
    for hosts, per_host in layouts:
        if algorithm == "hierarchical" and hosts == 1 and profile is HERE:
            continue  # one host: the same ring as the flat one
        topology = Topology.uniform(hosts, per_host)
        for nbytes in (4096, 2**20, 64 * 2**20):
            event = simulate_all_reduce(algorithm, nbytes, profile, topology, collective=collective,
                                        options=[HierarchicalOptions(intra_node_algorithm="ring")]).time_s
            formula = _formula(algorithm, profile, topology, nbytes, collective)
            assert abs(formula - event) <= 0.05 * event, (topology, nbytes, event, formula)


@pytest.mark.parametrize("algorithm,layout", [("ring", (1, 5)), ("ring", (3, 4)), ("halving_doubling", (1, 8)),
                                              ("halving_doubling", (4, 2))])
def test_the_two_phases_add_up_to_the_all_reduce(algorithm, layout):
    """Ring at any p and halving_doubling at a power of two (its long path): reduce-scatter + all-gather
    = AllReduce, the call overheads apart; the ring's AllReduce streams its all-gather behind its
    reduce-scatter, so at 64 MiB (bandwidth-bound) it saves at most a few percent, never costs more."""
    topology, nbytes = Topology.uniform(*layout), 64 * 2**20
    overhead = call_overhead_s(H100, algorithm, topology, nbytes)
    phases = sum(predict_s(algorithm, H100, topology, nbytes, collective=c) - overhead for c in COLLECTIVES)
    whole = predict_s(algorithm, H100, topology, nbytes) - overhead
    if algorithm == "ring":
        assert whole <= phases <= 1.05 * whole
    else:
        assert phases == pytest.approx(whole, rel=1e-9)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_auto_picks_the_fastest_predicted_candidate_and_never_tree(collective):
    """Across sizes and layouts (one host with shm, pretend nodes, real hosts of unequal sizes)."""
    for nbytes in (64, 4096, 2**20, 2**26):
        for world_size, ranks_per_node, hosts in ((8, 8, None), (8, 2, None), (5, 1, (3, 2))):
            pick = auto.choose(nbytes, world_size, ranks_per_node, shm_available=False, host_sizes=hosts,
                               profile=H100, collective=collective)
            assert pick != "tree"
            if hosts is not None:
                times = auto.predicted_times(nbytes, world_size, hosts, profile=H100, collective=collective)
                assert "tree" not in times and pick == min(times, key=times.__getitem__), (nbytes, times)
    times = auto.predicted_times(2**20, 4, profile=HERE, collective=collective)
    assert set(times) == {"ring", "halving_doubling", "shm"}
    assert auto.choose(2**20, 4, 4, shm_available=True, profile=HERE, collective=collective) == \
        min(times, key=times.__getitem__)


def test_tree_has_no_formula_for_either_phase():
    with pytest.raises(ValueError, match="no reduce_scatter formula for 'tree'"):
        predict_s("tree", H100, Topology.uniform(1, 4), 4096, collective="reduce_scatter")
    with pytest.raises(ValueError, match="no all_gather of 'tree'|runs no all_gather of 'tree'"):
        simulate_all_reduce("tree", 4096, H100, Topology.uniform(1, 4), collective="all_gather")
