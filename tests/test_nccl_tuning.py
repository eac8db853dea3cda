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
from gradsync.collectives.cost.nccl_pipeline import btree_depth, nvls_chunk_bytes
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
    """NVLS: 8 channels x min(40, 60) GB/s x 5/6, latency 25 us. The fill: 1 GiB is not < 64 x 128 x 128 KiB, so
    the chunk stays 128 KiB and a loop is 16 channels x 8 heads x 128 KiB = 16 MiB; its scatter (7/8 of it at
    266.7 GB/s) and its gather (a copy at 2 B / 3.35 TB/s per byte) come before the steady state."""
    choice = nccl_choice(H100, NODE, 2 ** 30)
    assert (choice.algorithm, choice.protocol) == ("nvls", "Simple")
    assert choice.time_s * 1e6 == pytest.approx(25 + 2 ** 30 / (1000 * 8 * 40 * 5 / 6), rel=1e-6)
    loop = 16 * 8 * 128 * 1024
    fill = loop * 7 / 8 / (1000 * 8 * 40 * 5 / 6) + loop * 2 / 3.35e12 * 1e6
    assert choice.fill_us == pytest.approx(fill, rel=1e-6)
    assert choice.run_time_s == pytest.approx(choice.time_s + fill * 1e-6, rel=1e-9)


def test_nvls_chunks_and_the_fill_across_nodes():
    """enqueue.cc calcCollChunking with 128 concurrent ops (16 channels x 8 heads): NVLS 64 MiB: < 64 x 128 x
    128 KiB -> 64 KiB, not < 8 x 128 x 64 KiB; 2 MiB: -> 64, 32, 16 KiB. NVLSTree on 4 nodes: at most 64 KiB,
    8 MiB is not < 128 x 64 KiB, 4 MiB is (-> 32 KiB). ncclGetBtree over 4 nodes: 1 -> 2 -> 0 and 3 -> 2 -> 0, two
    levels. NVLSTree 8 MiB on 4 x 8 H100: one 8 MiB loop: scatter 7/8 x 8 MiB at 266.7 GB/s, gather at HBM copy,
    2 x 2 network hops of a head's 1 MiB at the graph's 48 GB/s per NIC."""
    assert nvls_chunk_bytes("nvls", 64 * 2 ** 20, 128, 1) == 65536
    assert nvls_chunk_bytes("nvls", 2 * 2 ** 20, 128, 1) == 16384
    assert nvls_chunk_bytes("nvls_tree", 8 * 2 ** 20, 128, 4) == 65536
    assert nvls_chunk_bytes("nvls_tree", 4 * 2 ** 20, 128, 4) == 32768
    assert [btree_depth(n) for n in (1, 2, 3, 4, 8)] == [0, 1, 2, 2, 3]
    choice = nccl_choice(H100, FOUR_NODES, 8 * 2 ** 20)
    assert choice.algorithm == "nvls_tree"
    loop = 8 * 2 ** 20
    fill = loop * 7 / 8 / (1000 * 8 * 40 * 5 / 6) + loop * 2 / 3.35e12 * 1e6 + 4 * (loop / 8) / (1000 * 48)
    assert choice.fill_us == pytest.approx(fill, rel=1e-6)
    assert nccl_choice(H100, FOUR_NODES, 2 ** 33).fill_us == 0.0      # the ring: no fill


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
    seconds = choice.run_time_s           # -g 8, but the call (> 4 ms) hides the thread's 33.7 us issue
    assert row.candidate == choice.pick and row.predicted_us == pytest.approx(seconds * 1e6)
    assert row.harness_us == 0.0 and row.fill_us == pytest.approx(choice.fill_us)
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
    """nccl-tests#123 (DGX A100, -g 8, 8-128 B): one thread issues a call to 8 GPUs in 33.7 us. nccl-tests issues
    its iterations back to back, so an iteration takes max(issue, call): at 4 KiB NCCL's ring/LL call (6.6 + 14
    x 0.6 us + 4 KiB / 80.6 GB/s ~ 15.05 us) is hidden and the row is 33.7 us; one GPU per thread adds nothing."""
    assert reproduce.issue_us(8) == pytest.approx(33.7) and reproduce.issue_us(1) == 0.0
    assert reproduce.harness_us(8, 15.0) == pytest.approx(18.7) and reproduce.harness_us(8, 40.0) == 0.0
    with pytest.raises(ValueError, match="one-thread"):
        reproduce.harness_us(16, 10.0)
    row, = reproduce.compare(H100_NODE, sizes={4096})
    choice = nccl_choice(H100, NODE, 4096)
    assert choice.time_s * 1e6 == pytest.approx(15.0 + 4096 / (1000 * 141 * 8 / 14), rel=1e-6)
    assert row.predicted_us == pytest.approx(33.7) and row.harness_us == pytest.approx(33.7 - choice.time_s * 1e6)
    assert reproduce.compare(H100_4NODES, sizes={4096})[0].harness_us == 0.0
