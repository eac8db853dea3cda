"""``gradsync simulate`` at scale and ``--reproduce``: rows, sizes, the ring's crossover, the PNG, the
published comparison (all fast: small topologies only)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from types import SimpleNamespace

import pytest

from gradsync.bench import reproduce, scale, scale_report
from gradsync.bench.published import CURVES, H100_NODE
from gradsync.collectives.cost.profiles import get_profile
from gradsync.collectives.cost.formulas import predict_s
from gradsync.sim.cluster import Topology
from gradsync.sim.engine import simulate_all_reduce

H100 = get_profile("h100-ib")


def _args(tmp_path, **overrides):
    values = dict(profile="h100-ib", gpus="8,16", sizes="4K,1M", algorithms="ring,tree", json=str(tmp_path / "r.json"),
                  plot=str(tmp_path / "t.png"), event_budget_s=60.0, event_total_s=120.0)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_parse_sizes_range_and_list():
    assert scale.parse_sizes("4K-1G") == [4096 * 4 ** i for i in range(10)]
    assert scale.parse_sizes("4K-1G")[-1] == 2 ** 30
    assert scale.parse_sizes("4K-32K") == [4096, 16384, 32768]  # the last size is always included
    assert scale.parse_sizes("4K, 2M,1G") == [4096, 2 * 2 ** 20, 2 ** 30]
    for bad in ("1G-4K", "6", "abc", "4X"):
        with pytest.raises(ValueError, match="--sizes"):
            scale.parse_sizes(bad)


def test_parse_gpus_needs_whole_hosts():
    assert scale.parse_gpus("8,64", H100) == [8, 64]
    with pytest.raises(ValueError, match="multiple of 8"):
        scale.parse_gpus("12", H100)
    with pytest.raises(ValueError, match="--algorithms"):
        scale.parse_algorithms("ring,fast")


def test_row_bandwidths_follow_from_time():
    row = scale.make_row(8, "ring", 2 ** 20, 1e-3, "event", 0.0)
    assert row.algbw_gbps == pytest.approx(2 ** 20 / 1e-3 / 1e9)
    assert row.busbw_gbps == pytest.approx(row.algbw_gbps * 2 * 7 / 8)


def test_run_writes_table_rows_and_png(tmp_path, capsys):
    assert scale.run(_args(tmp_path)) == 0
    rows = json.loads((tmp_path / "r.json").read_text())
    assert len(rows) == 2 * 2 * 2 and {r["method"] for r in rows} == {"event"}
    for r in rows:
        p = r["gpus"]
        algbw = r["nbytes"] / (r["time_us"] * 1e-6) / 1e9
        assert r["algbw_gbps"] == pytest.approx(algbw)
        assert r["busbw_gbps"] == pytest.approx(algbw * 2 * (p - 1) / p)
    ring16 = next(r for r in rows if (r["gpus"], r["algorithm"], r["nbytes"]) == (16, "ring", 4096))
    # the streamed ring: some segment crosses 30 hops across 2 hosts of 8 (in host order), 4 of them between hosts
    # at the network's per-message latency and 26 at NVLink's, plus the call
    assert ring16["time_us"] >= (4 * H100.inter.alpha_s + 26 * H100.intra.alpha_s + H100.call_overhead_s) * 1e6
    png = (tmp_path / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "ring is" in capsys.readouterr().out


def test_formula_beyond_the_event_limit():
    row = scale.predict_row("ring", 1024, 4096, H100, event=False)
    assert row.method == "formula" and row.time_us > 0
    points = [(1024, "ring", 4096), (8, "ring", 4096), (8, "ring", 2 ** 20), (4096, "tree", 4096)]
    assert scale.plan_events(points, H100) == {(8, "ring", 4096), (8, "ring", 2 ** 20), (4096, "tree", 4096)}
    # beyond the total budget only the cheapest size of each (gpus, algorithm) runs
    assert scale.plan_events(points, H100, total_s=0.0) == {(8, "ring", 4096), (4096, "tree", 4096)}
    assert scale.plan_events(points, H100, budget_s=0.1) == {(8, "ring", 4096), (8, "ring", 2 ** 20)}
    assert "512-rank limit" in scale.formula_reason(row, H100, 60.0)


def _row(gpus, algorithm, nbytes, time_us):
    return SimpleNamespace(gpus=gpus, algorithm=algorithm, nbytes=nbytes, time_us=time_us, method="event")


def test_ring_overtaken_on_a_synthetic_table():
    rows = [_row(8, "ring", 1, 10), _row(8, "tree", 1, 20), _row(64, "ring", 1, 80), _row(64, "tree", 1, 40),
            _row(512, "ring", 1, 900), _row(512, "tree", 1, 60),
            _row(8, "ring", 2, 10), _row(8, "tree", 2, 20), _row(64, "ring", 2, 30), _row(64, "tree", 2, 40),
            _row(512, "ring", 2, 50), _row(512, "tree", 2, 60),
            # ring wins at 8, loses at 64, wins again at 512: it is never overtaken "for good"
            _row(8, "ring", 3, 1), _row(8, "tree", 3, 2), _row(64, "ring", 3, 3), _row(64, "tree", 3, 2),
            _row(512, "ring", 3, 1), _row(512, "tree", 3, 2)]
    result = {nbytes: (count, winner.algorithm if winner else None)
              for nbytes, count, _, winner in scale_report.ring_overtaken(rows)}
    assert result == {1: (64, "tree"), 2: (None, None), 3: (None, None)}
    assert scale_report.win_ranges(rows, "tree") == {64: [1, 3], 512: [1]}


def test_ring_latency_crossover_is_p_alpha_bandwidth():
    assert scale_report.ring_latency_crossover_bytes(H100, 64) == pytest.approx(64 * 14e-6 * 50e9)
    assert scale_report.ring_latency_crossover_bytes(H100, 8) == pytest.approx(8 * 3.4e-6 * 370.8e9)


def test_reproduce_one_curve():
    rows = reproduce.compare(H100_NODE, sizes={4096, 2 ** 30})
    assert [r.nbytes for r in rows] == [4096, 2 ** 30]
    assert rows[0].published_busbw_gbps == pytest.approx(0.22, abs=0.005)    # as printed in the log
    assert rows[1].published_busbw_gbps == pytest.approx(468.53, abs=0.01)
    big = rows[1]
    # NCCL's pick at 1 GiB: NVLS, 25 us + n / (8 channels x 40 GB/s x 5/6) (tests/test_nccl_tuning.py), plus
    # the fill of one 16 MiB loop (scatter 7/8 of it at that bandwidth, gather at 2 B / 3.35 TB/s); the -g 8
    # issue (nccl-tests#123: 33.7 us) hides behind a 4 ms call
    loop = 16 * 8 * 128 * 1024
    seconds = 25e-6 + (2 ** 30 + loop * 7 / 8) / (8 * 40e9 * 5 / 6) + loop * 2 / 3.35e12
    assert big.candidate.startswith("nvls/Simple/") and big.method == "nccl-model"
    assert big.predicted_busbw_gbps == pytest.approx(2 ** 30 / seconds / 1e9 * 2 * 7 / 8)
    assert big.error_pct == pytest.approx((big.predicted_busbw_gbps / big.published_busbw_gbps - 1) * 100)


def test_reproduce_across_hosts_picks_among_nccls_algorithms():
    curve = CURVES[1]
    picks = {row.candidate.split("/")[0] for row in reproduce.compare(curve, sizes={4096, 2 ** 33})}
    assert picks == {"tree", "ring"}      # tree/LL at 4 KiB, ring/Simple at 8 GiB; never NVLS across nodes


def test_topology_for_small_counts():
    assert scale.topology_for(4, H100) == Topology((4,))
    assert scale.topology_for(64, H100) == Topology.uniform(8, 8)


@dataclasses.dataclass(frozen=True)
class _Choice:
    algorithm: str
    protocol: str
    channels: int
    time_s: float

    @property
    def run_time_s(self) -> float:  # the row prices NCCL's pick with its pipeline fill (none here)
        return self.time_s


def _fake_nccl(profile, topology, nbytes):
    """A stand-in for nccl_tuning.nccl_choice: 0.9 x the ring's closed form, refused without NCCL constants."""
    if profile.name != "h100-ib":
        raise ValueError(f"profile {profile.name!r} carries no NCCL constants")
    return _Choice("tree", "LL", 4, 0.9 * predict_s("ring", profile, topology, nbytes))


def test_default_columns_are_ring_dbt_hierarchical_and_nccls_choice(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(scale, "nccl_choice", _fake_nccl)
    assert scale.run(_args(tmp_path, gpus="8,16", sizes="4K,64M", algorithms=None)) == 0
    rows = json.loads((tmp_path / "r.json").read_text())
    assert {r["algorithm"] for r in rows} == {"ring", "double_binary_tree", "hierarchical", "nccl"}
    for r in rows:
        if r["algorithm"] == "nccl":
            topology = scale.topology_for(r["gpus"], H100)
            assert r["time_us"] == pytest.approx(0.9e6 * predict_s("ring", H100, topology, r["nbytes"]))
            assert (r["method"], r["detail"]) == ("nccl model", "tree/LL x4")
    out = capsys.readouterr().out
    for gpus, nbytes in {(r["gpus"], r["nbytes"]) for r in rows}:
        point = [r for r in rows if (r["gpus"], r["nbytes"]) == (gpus, nbytes)]
        winner = min(point, key=lambda r: r["time_us"])["algorithm"]
        line = next(line for line in out.splitlines()
                    if line.split()[:2] == [str(gpus), scale_report.format_size(nbytes)] and "us" not in line)
        assert line.split()[-1] == winner and "tree/LL x4" in line
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_nccl_column_needs_a_profile_with_nccls_constants(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(scale, "nccl_choice", _fake_nccl)
    assert scale.run(_args(tmp_path, profile="this-machine", gpus="2", sizes="4K", algorithms=None, plot=None)) == 0
    assert "# nccl left out: profile 'this-machine'" in capsys.readouterr().out
    assert "nccl" not in {r["algorithm"] for r in json.loads((tmp_path / "r.json").read_text())}
    with pytest.raises(ValueError, match="--algorithms nccl: profile 'this-machine'"):
        scale.run(_args(tmp_path, profile="this-machine", gpus="2", sizes="4K", algorithms="ring,nccl", plot=None,
                        json=None))


def test_double_binary_tree_messages_estimate_counts_both_trees_both_ways():
    topology = scale.topology_for(64, H100)
    nbytes = 64 * 2**20  # halves of 32 MiB: 8 segments of 4 MiB per tree
    assert scale.estimated_messages("double_binary_tree", topology, nbytes) == 4 * 63 * 8
    result = simulate_all_reduce("double_binary_tree", nbytes, H100, topology)
    assert sum(stats.messages_sent for stats in result.stats) == 4 * 63 * 8


def test_nccl_column_is_nccl_tunings_choice():
    tuning = pytest.importorskip("gradsync.collectives.cost.nccl_tuning")
    row = scale.predict_row("nccl", 64, 2**20, H100, event=False)
    choice = tuning.nccl_choice(H100, scale.topology_for(64, H100), 2**20)
    assert row.time_us == pytest.approx(choice.time_s * 1e6)
    assert row.detail == f"{choice.algorithm}/{choice.protocol} x{choice.channels}"
