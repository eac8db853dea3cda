"""``gradsync explain`` without an algorithm: the seed's claims, each number checked against a computation here."""

from __future__ import annotations

import math

import pytest

from gradsync.bench import claims
from gradsync.collectives.cost.formulas import predict_s
from gradsync.collectives.cost.profiles import get_profile
from gradsync.collectives.cost.topology import Topology
from gradsync.sim.training import predict_step
from gradsync.collectives.ring import IN_FLIGHT

H100 = get_profile("h100-ib")


@pytest.fixture(scope="module")
def text():
    return claims.render()


@pytest.fixture(scope="module")
def levers():
    return claims.step_levers(H100)


def test_ring_growth_is_the_flat_rings_closed_form_and_its_latency_term():
    for row in claims.ring_growth(H100):
        p = row["gpus"]
        topology = Topology((p,)) if p <= 8 else Topology.uniform(p // 8, 8)
        assert row["time_s"] == predict_s("ring", H100, topology, row["nbytes"])
        a, e = H100.intra.alpha_s, H100.inter.alpha_s
        crossings = -(-2 * (p - 1) // 8)  # hosts of 8: one hop in 8 crosses
        fill = 2 * (p - 1) * a if p <= 8 else crossings * e + (2 * (p - 1) - crossings) * a
        gather = -(-(p - 1) // 8)  # the reduce-scatter paced by IN_FLIGHT receives per round trip across, then the gather
        paced = (p - 1) * e / IN_FLIGHT + gather * e + (p - 1 - gather) * a if p > 8 else 0.0
        assert row["latency_s"] == pytest.approx(max(fill, paced))
        assert row["latency_s"] < row["time_s"]
    small = {row["gpus"]: row["time_s"] for row in claims.ring_growth(H100) if row["nbytes"] == 4096}
    # the claim: latency piles up past 64 GPUs, about p times the inter-host alpha
    assert small[4096] / small[64] == pytest.approx((4095 * H100.inter.alpha_s) / (63 * H100.inter.alpha_s), rel=0.05)


def test_overtakes_winner_is_the_least_of_the_columns():
    rows = claims.overtakes(H100)
    assert {row["gpus"] for row in rows} == set(claims.OVERTAKE_GPUS)
    for row in rows:
        assert row["fastest"] == min(row["times"], key=row["times"].get)
    sample = next(row for row in rows if (row["gpus"], row["nbytes"]) == (4096, 4096))
    topology = Topology.uniform(512, 8)
    for name in ("ring", "hierarchical", "double_binary_tree"):
        assert sample["times"][name] == predict_s(name, H100, topology, 4096)
    assert sample["times"]["double_binary_tree"] < sample["times"]["ring"] / 100  # log depth against 2(p-1) hops


def test_spans_name_runs_of_sizes():
    sizes = [4096, 16384, 65536, 262144]
    assert claims._spans(sizes, [True, True, False, True]) == "4K-16K, 256K"
    assert claims._spans(sizes, [False] * 4) == "none"


def test_compute_is_six_n_t_over_the_datasheet_peak_at_the_mfu(levers):
    compute, _ = levers
    expected = 6 * 10**10 * claims.TOKENS_PER_GPU / (989e12 * claims.MFU)
    assert compute.forward_s + compute.backward_s == pytest.approx(expected, rel=1e-6)
    assert compute.num_params == 10**10
    assert compute.optimizer_s == pytest.approx(28 * 10**10 * H100.copy_s_per_byte / 2)


def test_shares_follow_from_comm_and_compute(levers):
    compute, rows = levers
    by_name = {lever.name: lever for lever in rows}
    plain = by_name["ring, 25 MiB buckets, nothing overlapped"]
    assert plain.share == pytest.approx(plain.comm_s / (plain.comm_s + compute.compute_s))
    overlapped = by_name["hierarchical, 25 MiB buckets, overlapped with backward"]
    row = predict_step(compute, H100, Topology.uniform(512, 8), "hierarchical", 25.0, event_max_ranks=0)
    assert overlapped.share == pytest.approx(row["exposed_comm_ms"] / row["step_ms"])
    assert overlapped.comm_s == pytest.approx(row["comm_ms"] / 1e3)
    assert by_name["hierarchical, 25 MiB buckets, fp16 gradients, overlapped with backward"].comm_s < overlapped.comm_s


def test_zero_volumes_are_reduce_scatter_and_all_gathers_of_the_gradients(levers):
    compute, rows = levers
    by_name = {lever.name: lever for lever in rows}
    topology, grads, call = Topology.uniform(512, 8), 4 * 10**10, 2**30
    calls, rest = divmod(grads, call)

    def bucketed(collective):
        return calls * predict_s("hierarchical", H100, topology, call, collective=collective) + \
            predict_s("hierarchical", H100, topology, rest - rest % (4 * 4096), collective=collective)

    scatter, gather = bucketed("reduce_scatter"), bucketed("all_gather")
    zero12 = by_name["ZeRO-1/2, hierarchical: reduce-scatter + all-gather, nothing overlapped"]
    zero3 = by_name["ZeRO-3, hierarchical: reduce-scatter + 2 all-gathers, nothing overlapped"]
    assert zero12.comm_s == pytest.approx(scatter + gather)
    assert zero3.comm_s == pytest.approx(scatter + 2 * gather)
    assert zero3.share == pytest.approx(zero3.comm_s / (zero3.comm_s + compute.compute_s))
    best3 = by_name["ZeRO-3, gathers behind forward / backward at best"]
    assert best3.exposed_s == pytest.approx(max(0, gather - compute.forward_s)
                                            + max(0, gather + scatter - compute.backward_s))


def test_powersgd_sends_m_plus_n_times_r_per_matrix():
    d = math.isqrt(10**10 // (12 * 48))
    p_bytes, q_bytes = claims.powersgd_bytes(10**10, 48, 4)
    # per block: qkv (3d x d), out (d x d), up (4d x d), down (d x 4d)
    assert p_bytes == 4 * (48 * (3 + 1 + 4 + 1) * d * 4 + (10**10 - 12 * d * d * 48))
    assert q_bytes == 4 * 48 * (1 + 1 + 1 + 4) * d * 4


def test_rendered_claims_carry_the_computed_numbers(text, levers):
    assert "4096 GPUs (512 hosts x 8)" in text and "989 TFLOP/s" in text
    _, rows = levers
    for lever in rows:
        assert f"{lever.share:.1%}" in text.split(lever.name, 1)[1].splitlines()[0]
    growth = [row for row in claims.ring_growth(H100) if row["nbytes"] == 4096]
    assert f"{growth[2]['time_s'] * 1e6:.1f} us" in text


def test_nccl_lever_sums_nccls_pick_over_dataparallels_buckets(levers):
    from gradsync.collectives.cost.nccl_tuning import nccl_choice
    from gradsync.sim.step import plan_step

    compute, rows = levers
    lever = next(lever for lever in rows if lever.name.startswith("NCCL's choice"))
    topology = Topology.uniform(512, 8)
    plan = plan_step(compute, 25.0, 4096, H100.copy_s_per_byte)
    expected = sum(nccl_choice(H100, topology, 4 * numel).run_time_s for numel in plan.numels)
    assert lever.comm_s == pytest.approx(expected) and lever.calls == len(plan.numels)
    assert lever.share == pytest.approx(expected / (expected + compute.compute_s))


def test_explain_without_alg_refuses_an_algorithms_options():
    import argparse

    from gradsync.bench.sim_commands import explain
    args = argparse.Namespace(algorithm=None, nproc=8, hosts=1, size="1M", segment_bytes=None, profile=None)
    with pytest.raises(ValueError, match="--nproc: options of one algorithm's run; give ALG"):
        explain(args)
