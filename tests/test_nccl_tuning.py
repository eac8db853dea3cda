"""NCCL's own model (collectives/cost/nccl_tuning.py) against its formulas worked by hand, and
``--reproduce``'s goal arithmetic (all fast: closed forms only).

The hand values follow NCCL 2.24.3's tuning.cc: algorithm bandwidth = channels x GB/s per channel, times the
protocol's factors, times nRanks / (2 (nRanks - 1)) for the ring (1/2 for the tree, 5/6 for NVLS); latency =
baseLat + steps x hwLat; time = latency + bytes / (1000 x bandwidth) microseconds.
"""

from __future__ import annotations

import dataclasses

import pytest

from gradsync.bench import reproduce
from gradsync.bench.published import A100_NODE, H100_4NODES, H100_NODE
from gradsync.collectives.cost.nccl_tuning import Graph, nccl_choice, search_graphs
from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.cost.profiles import get_profile
from gradsync.collectives.cost.topology import Topology

H100, A100 = get_profile("h100-ib"), get_profile("a100-ib")
NODE, FOUR_NODES = Topology.uniform(1, 8), Topology.uniform(4, 8)


def test_search_graphs_on_nvswitch_nodes():
    """H100: 18 x 20.6 = 370.8 GB/s; speed 60 fits 6 ring channels (360), duplicated to 12 x 30; NVLS needs
    (8 + 1) x speed <= 370.8 for 8 heads: 40. A100: 12 x 20 = 240 = 6 x 40, duplicated to 12 x 20. Across
    nodes a 400 Gb/s NIC (50 GB/s, PCIe Gen5 48) takes one channel of 45 (8 x 45 = 360 <= 370.8)."""
    assert search_graphs(H100.nccl, NODE)["ring"] == Graph(12, 30.0, 30.0)
    assert search_graphs(H100.nccl, NODE)["nvls"] == Graph(8, 40.0, 60.0)
    assert search_graphs(A100.nccl, NODE) == {"ring": Graph(12, 20.0, 20.0), "tree": Graph(12, 20.0, 20.0)}
    assert search_graphs(H100.nccl, FOUR_NODES)["ring"] == Graph(8, 45.0, 45.0)


def test_h100_node_4k_is_ring_ll():
    """Ring LL: min(llMaxBw 141, 12 x 30 x 1/2) x 8/14 GB/s, 6.6 + 14 x 0.6 us; the tree LL (15.2 us) and
    NVLS (25 us) are slower; 4 KiB is below one LL channel's threshold (512 threads x 8 x 8 ranks)."""
    choice = nccl_choice(H100, NODE, 4096)
    assert (choice.algorithm, choice.protocol, choice.channels) == ("ring", "LL", 1)
    assert choice.time_s * 1e6 == pytest.approx(6.6 + 14 * 0.6 + 4096 / (1000 * 141 * 8 / 14), rel=1e-6)


def test_h100_node_1g_is_nvls():
    """NVLS: 8 channels x min(40, 60) GB/s x 5/6, latency 25 us."""
    choice = nccl_choice(H100, NODE, 2 ** 30)
    assert (choice.algorithm, choice.protocol) == ("nvls", "Simple")
    assert choice.time_s * 1e6 == pytest.approx(25 + 2 ** 30 / (1000 * 8 * 40 * 5 / 6), rel=1e-6)


def test_a100_node_1g_is_ring_simple():
    """Ring Simple on 8 ranks: 12 x 20 GB/s x 8/14, 8.4 + 14 x 3.4 us (the tree: 220.8 x 1/2 GB/s, slower)."""
    choice = nccl_choice(A100, NODE, 2 ** 30)
    assert (choice.algorithm, choice.protocol, choice.channels) == ("ring", "Simple", 24)
    assert choice.time_s * 1e6 == pytest.approx(8.4 + 14 * 3.4 + 2 ** 30 / (1000 * 240 * 8 / 14), rel=1e-6)


def test_four_nodes_8g_is_ring_simple_with_the_plateau():
    """32 ranks on 4 nodes: 62 steps, 6 across the network (14 us), 56 over NVLink (max(3.4, 3 x 1 us net
    overhead)), base 8.4 us, x 1.4 (the ring's plateau); 8 x 45 GB/s x 32/62."""
    choice = nccl_choice(H100, FOUR_NODES, 2 ** 33)
    latency = (8.4 + 56 * 3.4 + 6 * 14) * 1.4
    assert (choice.algorithm, choice.protocol) == ("ring", "Simple")
    assert choice.time_s * 1e6 == pytest.approx(latency + 2 ** 33 / (1000 * 8 * 45 * 32 / 62), rel=1e-6)


def test_nccl_choice_refuses_profiles_without_nccl_constants():
    with pytest.raises(ValueError, match="no NCCL constants"):
        nccl_choice(get_profile("this-machine"), NODE, 4096)
    with pytest.raises(ValueError, match="collective"):
        nccl_choice(H100, NODE, 4096, collective="broadcast")


def test_profile_json_round_trip_keeps_nccl_constants_and_old_files_load():
    assert Profile.from_dict(H100.as_dict()) == H100
    old = {key: value for key, value in H100.as_dict().items() if key != "nccl"}
    assert Profile.from_dict(old).nccl is None


def test_published_busbw_is_recomputed_from_the_time():
    """nccl-tests: busbw = bytes / time x 2 (p - 1) / p; the logs print these to two decimals."""
    assert A100_NODE.busbw_gbps(2 ** 30, 8109.1) == pytest.approx(231.72, abs=0.01)
    assert H100_4NODES.busbw_gbps(2 ** 33, 50291.8) == pytest.approx(330.93, abs=0.01)
    assert H100_NODE.busbw_gbps(2 ** 30, 4010.54) == pytest.approx(468.53, abs=0.01)


def test_reproduce_row_is_nccl_choice_and_goal_arithmetic():
    row, = reproduce.compare(H100_NODE, sizes={2 ** 30})
    choice = nccl_choice(H100, NODE, 2 ** 30)
    seconds = choice.time_s + 18.7e-6     # the curve ran -g 8: the harness (test below)
    assert row.candidate == choice.pick and row.predicted_us == pytest.approx(seconds * 1e6)
    assert row.predicted_busbw_gbps == pytest.approx(2 ** 30 / seconds / 1e9 * 2 * 7 / 8)
    rows = [dataclasses.replace(row, nbytes=n, error_pct=e) for n, e in ((4096, -19.0), (2 ** 26, 9.0), (2 ** 30, -11.0))]
    assert reproduce.goal_verdicts(rows) == [(">= 4K", 3, 19.0, 20.0, True), (">= 64M", 2, 11.0, 10.0, False)]
    assert reproduce.goal_verdicts(rows[:1])[1] == (">= 64M", 0, None, 10.0, None)
    text = reproduce.format_curve(rows)
    assert "goal 20%: met" in text and "goal 10%: MISSED" in text and "NCCL's model 25.0 us + n / 266.7 GB/s" in text


def test_diagnosis_fit_recovers_a_line():
    """The diagnosis' least squares: points on 10 us + n / 100 GB/s give back (10, 100)."""
    points = [(n, 10 + n / (1000 * 100)) for n in (2 ** 20, 2 ** 24, 2 ** 28)]
    latency, bandwidth = reproduce._fit(points)
    assert latency == pytest.approx(10) and bandwidth == pytest.approx(100)
    assert reproduce._fit(points[:1]) is None


def test_harness_of_one_thread_driving_8_gpus():
    """nccl-tests#123 (DGX A100, -g 8, one ring channel, 8-128 B): 33.7 us, less NCCL's ring/LL latency for 8
    ranks (6.6 + 14 x 0.6 = 15.0 us); one GPU per thread adds nothing. The -g 8 H100 curve's rows carry it."""
    assert reproduce.harness_us(8) == pytest.approx(33.7 - 15.0)
    assert reproduce.harness_us(1) == 0.0
    with pytest.raises(ValueError, match="one-thread"):
        reproduce.harness_us(16)
    row, = reproduce.compare(H100_NODE, sizes={4096})
    choice = nccl_choice(H100, NODE, 4096)
    assert row.predicted_us == pytest.approx(choice.time_s * 1e6 + 18.7) and row.harness_us == pytest.approx(18.7)
    assert reproduce.compare(H100_4NODES, sizes={4096})[0].harness_us == 0.0
