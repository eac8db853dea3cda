"""gradsync simulate train: DataParallel's real buckets, the overlap arithmetic, the compute formula and
the compressors' bytes (all fast: no process is started)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync.bench.simulate_train import parse_count
from gradsync.collectives.cost.profiles import get_profile
from gradsync.sim.cluster import Topology
from gradsync.sim.compute import flops_compute, layered_params, memory_per_gpu_bytes
from gradsync.sim.engine import simulate_all_reduce
from gradsync.sim.exchange import BucketPricer, encoded_row_nbytes, simulate_two_phase
from gradsync.sim.step import dataparallel_buckets, flag_count, overlap, plan_step
from gradsync.sim.training import predict_step, topology_for
from gradsync.train.models import MLP

CAP_MB = 0.02  # ~20 KiB: the MLP's 4000-, 10000- and 1000-element weights land in different buckets


def test_buckets_equal_dataparallels_at_construction_and_after_rebuild(single_process):
    torch.manual_seed(0)
    model = gradsync.DataParallel(MLP(), bucket_cap_mb=CAP_MB)
    params = [p for p in model.module.parameters()]
    initial = dataparallel_buckets(params, CAP_MB)
    assert initial == model._reducer.assignment and len(initial) > 2
    x, y = torch.randn(8, 40), torch.randint(0, 10, (8,))
    F.cross_entropy(model(x), y).backward()
    # backward makes the gradients in reverse registration order; 60 KB never reaches a 1 MiB pause split
    ready = [(len(params) - i) * 1e-6 for i in range(len(params))]  # last parameter first
    assert dataparallel_buckets(params, CAP_MB, ready) == model._reducer.assignment
    flags = flag_count(len(params), 1)
    last = model._reducer.assignment[-1]
    assert model._reducer.bucket_nbytes[-1] == (sum(params[i].numel() for i in last) + flags) * 4


def test_overlap_two_buckets_by_hand():
    # bucket 0 ready at 1 s, 3 s of exchange: 1 -> 4; backward ends at 2 s, the main thread waits 2 s,
    # then runs the last bucket 4 -> 5 itself: exposed 2 + 1 = 3 s, end 5 s
    sync = overlap([1.0, 2.0], [3.0, 1.0], 2.0)
    assert sync.end_s == pytest.approx(5.0) and sync.exposed_s == pytest.approx(3.0)
    assert sync.spans == ((1.0, 4.0), (4.0, 5.0))
    # copies out: 4 + 0.5, last bucket 4.5 -> 5.5, + 0.25; copies are not communication
    sync = overlap([1.0, 2.0], [3.0, 1.0], 2.0, [0.5, 0.25])
    assert sync.end_s == pytest.approx(5.75) and sync.exposed_s == pytest.approx(3.0)
    # bucket 0 (0.5 -> 1.5) hides under backward; only the last bucket's 0.2 s shows
    sync = overlap([0.5, 3.0], [1.0, 0.2], 3.0)
    assert sync.end_s == pytest.approx(3.2) and sync.exposed_s == pytest.approx(0.2)
    with pytest.raises(ValueError, match="after backward"):
        overlap([1.0, 4.0], [1.0, 1.0], 3.0)


def test_flops_compute_is_6pt_over_f_mfu():
    profile = get_profile("h100-ib")
    params = layered_params(10**9, 4)
    assert sum(p.numel() for p in params) == 10**9 and len(params) == 16
    compute = flops_compute(params, 1000, 1e15, 0.5, profile)  # 6e12 / 5e14 = 12 ms
    assert compute.forward_s == pytest.approx(0.004) and compute.backward_s == pytest.approx(0.008)
    assert compute.ready_s[0] == pytest.approx(0.008) and compute.ready_s[-1] < compute.ready_s[0]
    assert compute.optimizer_s == pytest.approx(28e9 / 3.35e12)
    with pytest.raises(ValueError, match="mfu"):
        flops_compute(params, 1000, 1e15, 1.5, profile)
    assert memory_per_gpu_bytes(10**10, bucket_copy=False)["total"] == 160e9  # >= 160 GB: not in 80 GB


def test_compression_shrinks_bytes_by_the_codecs_payload():
    profile, topology = get_profile("h100-ib"), Topology.uniform(2, 2)
    numel, p = 2**20, 4
    chunk = numel // p
    onebit = 4 + -(-(chunk // 32) // 2) + chunk // 8  # float32 ref, 4-bit code per 32, 1 sign bit each
    assert encoded_row_nbytes("onebit", numel, p) == -(-onebit // 4) * 4
    assert encoded_row_nbytes("fp16", numel, p) == 4 + 2 * chunk
    assert encoded_row_nbytes("bf16", numel, p) == 2 * chunk
    stats = []
    row = encoded_row_nbytes("onebit", numel, p)
    simulate_two_phase(row, profile, topology, stats=stats)
    assert all(s.bytes_sent == 2 * (p - 1) * row for s in stats)  # all_to_all + ring all_gather
    plain = simulate_all_reduce("ring", numel * 4, profile, topology).stats
    assert all(s.bytes_sent == 2 * (p - 1) * chunk * 4 for s in plain)
    none = BucketPricer(profile, topology, "ring", "none").bucket_s(numel)
    packed = BucketPricer(profile, topology, "ring", "onebit").bucket_s(numel)
    assert packed < none


def test_predict_step_rows_and_bad_input():
    profile = get_profile("h100-ib")
    compute = flops_compute(layered_params(10**8, 2), 2048, 989e12, 0.4, profile)
    row = predict_step(compute, profile, topology_for(16, 8), "ring", 25.0)
    plan = plan_step(compute, 25.0, 16, profile.copy_s_per_byte)
    assert row["buckets"] == len(plan.assignment) and row["gpus"] == 16 and row["hosts"] == 2
    assert row["step_ms"] == pytest.approx(row["compute_ms"] + row["exposed_comm_ms"] + row["copy_ms"], rel=0.05)
    assert parse_count("10B") == 10**10 and parse_count("350M") == 350 * 10**6
    with pytest.raises(ValueError, match="--params"):
        parse_count("ten")
    with pytest.raises(ValueError, match="multiple of 8"):
        topology_for(12, 8)
    with pytest.raises(ValueError, match="compression"):
        BucketPricer(profile, topology_for(8, 8), "ring", "topk")


def test_docstring_examples():
    import doctest

    from gradsync.sim import training
    result = doctest.testmod(training, verbose=False)
    assert result.attempted > 0 and result.failed == 0
