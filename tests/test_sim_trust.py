"""The trust table of docs/simulator.md: each row's errors taken from the records' rows."""

from __future__ import annotations

from gradsync.bench.sim_trust import format_trust, trust_rows


def _validate(hosts: int, nbytes: int, predicted: float, runs: list[float]) -> dict:
    return {"collective": "all_reduce", "algorithm": "ring", "nbytes": nbytes, "world_size": 2 * hosts,
            "hosts": hosts, "predicted_us": predicted, "measured_us": sorted(runs)[len(runs) // 2],
            "measured_us_runs": runs}


def _curve(source: str, nbytes: int, error_pct: float) -> dict:
    return {"source": source, "nbytes": nbytes, "error_pct": error_pct}


def test_rows_take_median_and_worst_error_per_layout_region_and_curve():
    validate = [_validate(1, 4096, 150.0, [100.0, 100.0, 100.0]),      # +50%: over the 40% bound
                _validate(1, 4096, 90.0, [100.0, 100.0, 100.0]),       # -10%: within
                _validate(1, 2**20, 120.0, [100.0, 100.0, 100.0]),     # +20%: within 25%
                _validate(2, 2**26, 70.0, [80.0, 100.0, 120.0])]       # -30%, spread 40%: within
    reproduce = [_curve("A", 4096, -30.0), _curve("A", 2**20, 5.0), _curve("A", 2**26, -12.0), _curve("A", 2**30, 4.0)]
    documents = {"sim_validate": {"rows": validate}, "sim_reproduce": {"rows": reproduce}}
    rows = {row["scope"]: row for row in trust_rows(documents)}
    small = rows["this machine, 1 host x 2-4 ranks, < 64 KiB"]
    assert (small["rows"], small["median"], small["worst"], small["within"]) == (2, 30.0, 50.0, "1/2")
    large = rows["this machine, 1 host x 2-4 ranks, >= 64 KiB"]
    assert (large["rows"], large["worst"], large["within"]) == (1, 20.0, "1/1")
    hosts = rows["2 x 2 test hosts (shaped veth), >= 64 KiB"]
    assert hosts["worst"] == 30.0 and hosts["within"] == "1/1"
    assert rows["2 x 2 test hosts (shaped veth), < 64 KiB"]["rows"] == 0
    everything = rows["A, >= 4 KiB"]
    assert (everything["rows"], everything["median"], everything["worst"], everything["within"]) == (4, 8.5, 30.0, "3/4")
    large_curve = rows["A, >= 64 MiB"]
    assert (large_curve["rows"], large_curve["worst"], large_curve["within"]) == (2, 12.0, "1/2")
    assert rows["64-4096 GPUs (sim_scale, gradsync explain)"]["rows"] == 0


def test_missing_records_leave_only_the_extrapolation_row():
    assert [row["evidence"] for row in trust_rows({})] == ["none: extrapolated"]
    assert "none: extrapolated" in format_trust({})
