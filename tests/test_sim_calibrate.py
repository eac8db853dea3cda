"""gradsync calibrate and simulate --validate: the calibration gives a usable profile, the validation
table's arithmetic, and the CPU-bound link's shared port (fast: thread ranks, tiny settings)."""

from __future__ import annotations

import statistics

import pytest

from _dist import run_threads
from gradsync.bench.calibrate import TINY, calibrate_comm
from gradsync.bench.fixed_costs import fit_line
from gradsync.bench.sim_validation import LARGE_BYTES, ValidationRow, format_rows, relative_error, summarize
from gradsync.bench.sim_validation_picks import auto_picks, format_picks
from gradsync.bench.sim_validation_points import predict
from gradsync.collectives.cost.profile import Link, Profile, ShmModel, load, save
from gradsync.sim.cluster import Topology, VirtualCluster
from gradsync.sim.engine import simulate_all_reduce


def _profile(cpu_bound: bool = True) -> Profile:
    return Profile(name="t", description="", intra=Link(1e-5, 1e9, cpu_bound),
                   inter=Link(2e-5, 1.25e8), gamma_s_per_byte=1e-10, copy_s_per_byte=1e-10,
                   ranks_per_host=2, cores_per_host=2, call_overhead_s=1e-5,
                   shm=ShmModel(barrier_s=1e-6, memory_bandwidth_bytes_per_s=2e10))


def test_tiny_calibration_gives_a_usable_profile(tmp_path):
    profiles = run_threads(2, lambda comm: calibrate_comm(comm, TINY, name="tiny"), timeout_s=30)
    profile = profiles[0]
    assert profiles[1] is None
    assert profile.intra.alpha_s > 0 and profile.intra.bandwidth_bytes_per_s > 0 and profile.intra.cpu_bound
    assert profile.inter is None
    assert profile.intra.hop_alpha_s >= 0 and profile.intra.one_way_hop_alpha_s >= 0
    assert dict(profile.call_overheads_s).keys() >= {"ring", "tree", "halving_doubling", "hierarchical", "shm"}
    assert profile.gamma_s_per_byte > 0 and profile.copy_s_per_byte > 0
    assert profile.cores_per_host >= 1 and profile.call_overhead_s >= 0
    assert profile.shm is not None and profile.shm.barrier_s > 0 and profile.shm.memory_bandwidth_bytes_per_s > 0
    assert profile.shm.cell_overhead_s >= 0 and profile.shm.lean_call_overhead_s is not None
    assert profile.shm.lean_call_overhead_s >= 0 and any("lean" in source for source in profile.sources)
    assert profile.shm.cache_copy_s_per_byte > 0 and profile.shm.cache_gamma_s_per_byte > 0
    assert any("measured by" in source for source in profile.sources)
    again = load(save(profile, tmp_path / "p.json"))
    assert again == profile and again.digest() == profile.digest()
    n = 2**20
    for algorithm in ("ring", "tree", "halving_doubling", "hierarchical", "shm"):
        time_s = simulate_all_reduce(algorithm, n, again, Topology((4,))).time_s
        assert time_s > again.call_overhead_s
    # a ring of 4 ranks sends at least 2(p-1)/p n bytes over a link of the measured bandwidth
    ring = simulate_all_reduce("ring", n, again, Topology((4,))).time_s
    assert ring >= 1.5 * n / again.intra.bandwidth_bytes_per_s


def test_fit_line_recovers_alpha_and_beta():
    sizes = [2**20, 4 * 2**20, 16 * 2**20]
    intercept, slope = fit_line(sizes, [3e-5 + n / 1.5e9 for n in sizes])
    assert intercept == pytest.approx(3e-5, rel=1e-6)
    assert 1 / slope == pytest.approx(1.5e9, rel=1e-9)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_line([4, 4], [1.0, 2.0])


def test_cpu_bound_link_serializes_a_ranks_send_and_receive():
    n = 10**6
    for cpu_bound, expected in ((True, 2 * n / 1e9 + 1e-5), (False, n / 1e9 + 1e-5)):
        cluster = VirtualCluster(_profile(cpu_bound), Topology((2,)))
        cluster.transfer(0, 1, n, 0.0)
        assert cluster.transfer(1, 0, n, 0.0) == pytest.approx(expected)


def test_validation_errors_median_and_failing_rows():
    rows = [ValidationRow("ring", 4096, 2, 1, 120.0, 100.0),           # +20%, small: bound 40%
            ValidationRow("tree", LARGE_BYTES, 2, 1, 95.0, 100.0),       # -5%
            ValidationRow("shm", 2**20, 4, 1, 90.0, 100.0),              # -10%
            ValidationRow("hierarchical", 2**24, 4, 2, 260.0, 200.0)]    # +30%: over 25%, one run (no spread)
    assert [round(row.error, 6) for row in rows] == [0.2, -0.05, -0.1, 0.3]
    summary = summarize(rows)
    assert summary.median_abs_error == pytest.approx(statistics.median([0.2, 0.05, 0.1, 0.3]))
    assert [row.algorithm for row in summary.failing] == ["hierarchical"] and not summary.meets_goal
    assert summary.failing[0].excess == pytest.approx(0.05)
    assert "+30.0%" in format_rows(rows) and "2x2" in format_rows(rows) and "FAIL" in format_rows(rows)
    assert rows[0].as_dict()["error"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="measured time"):
        relative_error(1.0, 0.0)
    with pytest.raises(ValueError, match="no validation rows"):
        summarize([])


def test_predict_uses_each_rows_topology_and_skips_unsimulated():
    profile = _profile()
    bench_rows = [dict(algorithm="ring", nbytes=2**20, world_size=4, hosts=2, time_us=1000.0),
                  dict(algorithm="native", nbytes=2**20, world_size=4, hosts=2, time_us=900.0),
                  dict(algorithm="shm", nbytes=2**16, world_size=3, time_us=50.0)]
    rows = predict(bench_rows, profile)
    assert [(row.algorithm, row.hosts) for row in rows] == [("ring", 2), ("shm", 1)]
    across = simulate_all_reduce("ring", 2**20, profile, Topology.uniform(2, 2)).time_s
    assert rows[0].predicted_us == pytest.approx(across * 1e6)
    # the inter-host link (1 Gbit/s) bounds the 2x2 ring: slower than the same ring on one host
    assert across > simulate_all_reduce("ring", 2**20, profile, Topology((4,))).time_s


def test_auto_picks_compare_the_models_fastest_with_the_measured_fastest():
    rows = [ValidationRow("ring", 2**20, 2, 1, 300.0, 900.0), ValidationRow("shm", 2**20, 2, 1, 100.0, 250.0),
            ValidationRow("hierarchical", 2**20, 2, 1, 50.0, 10.0),      # not a candidate on one host
            ValidationRow("tree", 4096, 4, 1, 50.0, 120.0), ValidationRow("shm", 4096, 4, 1, 60.0, 100.0),
            ValidationRow("shm", 64, 2, 1, 1.0, 1.0),                     # a point with one candidate: skipped
            ValidationRow("ring", 2**20, 4, 2, 900.0, 1000.0),
            ValidationRow("hierarchical", 2**20, 4, 2, 950.0, 1050.0)]
    picks = auto_picks(rows)
    assert [(p.hosts, p.world_size, p.nbytes, p.predicted, p.measured) for p in picks] == [
        (1, 2, 2**20, "shm", "shm"), (1, 4, 4096, "tree", "shm"), (2, 4, 2**20, "ring", "ring")]
    assert [p.slowdown for p in picks] == pytest.approx([1.0, 1.2, 1.0])
    assert [p.right for p in picks] == [True, False, True]
    assert "at 2 of 3 points; worst pick 1.20x" in format_picks(picks)


def test_calibration_measures_no_point_the_validation_scores():
    """calibration_points (here and on 2 x 2 test hosts) shares no message size with the validated sizes, so
    no validated (size, world size) point, at any world size or in any collective, feeds the calibration."""
    from gradsync.bench.allreduce import parse_nbytes
    from gradsync.bench.calibrate import FULL, QUICK, calibration_points
    from gradsync.bench.sim_validation import DEFAULT_SIZES, HOSTS, ONE_HOST_WORLD_SIZES, RANKS_PER_HOST

    validated_sizes = {parse_nbytes(text) for text in DEFAULT_SIZES.split(",")}
    assert validated_sizes == {4096, 65536, 2**20, 2**24, 2**26}  # what the harness scores (an independent list)
    validated = {(n, ws, 1) for n in validated_sizes for ws in ONE_HOST_WORLD_SIZES}
    validated |= {(n, HOSTS * RANKS_PER_HOST, HOSTS) for n in validated_sizes}
    for hosts in (False, True):
        for settings in (FULL, QUICK):
            points = calibration_points(hosts, settings)
            assert {"pingpong", "hop_chain", "ring", "tree", "halving_doubling"} <= {p["algorithm"] for p in points}
            assert all(set(p) == {"collective", "algorithm", "nbytes", "world_size", "hosts"} for p in points)
            assert not {(p["nbytes"], p["world_size"], p["hosts"]) for p in points} & validated
            assert not {p["nbytes"] for p in points} & validated_sizes  # not even at another world size
    spans = {p["hosts"] for p in calibration_points(True)}
    assert spans == {1, 2}
