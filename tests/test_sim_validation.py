"""gradsync simulate --validate as a harness: each row's spread, bound and verdict, the summary and its
breakdown (rows from dicts, answers by hand), the validated points taken from the simulator itself, and
the calibrate/validate split refusing an overlap before anything is measured (fast: no process starts)."""

from __future__ import annotations

import statistics

import pytest

from gradsync.bench import calibrate, sim_validation_run
from gradsync.bench.sim_report import tables
from gradsync.bench.sim_validation import (LARGE_BYTES, ValidationRow, breakdown, format_breakdown, format_rows,
                                           format_summary, relative_spread, summarize)
from gradsync.bench.sim_validation_points import (as_point, check_disjoint, plan, predict, split_rows,
                                                  validation_points)
from gradsync.cli import main
from gradsync.collectives.cost.profile import Link, Profile, ShmModel
from gradsync.sim import Topology, engine

MIB = 2**20


def _profile() -> Profile:
    return Profile(name="t", description="", intra=Link(1e-5, 1e9, True), inter=Link(2e-5, 1.25e8),
                   gamma_s_per_byte=1e-10, copy_s_per_byte=1e-10, ranks_per_host=2, cores_per_host=2,
                   call_overhead_s=1e-5, shm=ShmModel(barrier_s=1e-6, memory_bandwidth_bytes_per_s=2e10))


def _row(collective: str, algorithm: str, nbytes: int, world_size: int, hosts: int, predicted: float,
         runs: list[float]) -> ValidationRow:
    return ValidationRow.from_dict({"collective": collective, "algorithm": algorithm, "nbytes": nbytes,
                                    "world_size": world_size, "hosts": hosts, "predicted_us": predicted,
                                    "measured_us": statistics.median(runs), "measured_us_runs": runs})


def _rows() -> list[ValidationRow]:
    """Five rows whose verdicts are worked out by hand (errors within each repetition, then the median)."""
    return [
        # large, spread (120 - 90) / 100 = 30%: bound 30%; errors +22.2, +10, -8.3% -> median +10%: pass
        _row("all_reduce", "ring", MIB, 2, 1, 110.0, [90.0, 100.0, 120.0]),
        # large, spread 2%: bound 25%; errors -39.4, -40, -40.6% -> -40%: 15 points over
        _row("all_reduce", "tree", MIB, 3, 1, 60.0, [99.0, 100.0, 101.0]),
        # small, spread 10%: bound 40%; errors +57.9, +50, +42.9% -> +50%: 10 points over
        _row("reduce_scatter", "ring", 4092, 3, 1, 150.0, [95.0, 100.0, 105.0]),
        # small, spread 60%: bound 60%; errors +50% at the median: pass
        _row("all_gather", "halving_doubling", 4096, 4, 2, 150.0, [80.0, 100.0, 140.0]),
        # large, spread 0: bound 25%; errors -20%: pass
        _row("all_gather", "ring", 64 * MIB, 4, 2, 80.0, [100.0, 100.0, 100.0]),
    ]


def test_each_rows_spread_bound_and_verdict_by_hand():
    rows = _rows()
    assert relative_spread([90.0, 100.0, 120.0]) == pytest.approx(0.3) and relative_spread([5.0]) == 0.0
    assert [row.spread for row in rows] == pytest.approx([0.3, 0.02, 0.1, 0.6, 0.0])
    assert [row.bound for row in rows] == pytest.approx([0.3, 0.25, 0.4, 0.6, 0.25])
    assert [row.error for row in rows] == pytest.approx([0.1, -0.4, 0.5, 0.5, -0.2])
    assert [row.passes for row in rows] == [True, False, False, True, True]
    assert rows[1].excess == pytest.approx(0.15) and rows[2].excess == pytest.approx(0.1)
    written = rows[2].as_dict()
    assert (written["spread"], written["bound"], written["passes"]) == (pytest.approx(0.1), 0.4, False)
    assert ValidationRow.from_dict(written) == rows[2]
    table = format_rows(rows)
    line = next(text for text in table.splitlines() if "reduce_scatter" in text)
    assert line.split()[:4] == ["reduce_scatter", "1x3", "4092", "ring"]
    assert "10.0%" in line and "+50.0% (+42.9-+57.9)" in line and "40.0%" in line and line.endswith("FAIL")
    assert rows[0].nbytes >= LARGE_BYTES > rows[3].nbytes


def test_summary_counts_failing_rows_worst_by_excess_and_breaks_down():
    rows = _rows()
    summary = summarize(rows)
    times = [(110.0, [90.0, 100.0, 120.0]), (60.0, [99.0, 100.0, 101.0]), (150.0, [95.0, 100.0, 105.0]),
             (150.0, [80.0, 100.0, 140.0]), (80.0, [100.0, 100.0, 100.0])]
    per_repetition = [statistics.median(abs(predicted / runs[k] - 1) for predicted, runs in times) for k in range(3)]
    assert summary.repetitions == 3 and summary.median_abs_error == pytest.approx(statistics.median(per_repetition))
    assert summary.median_abs_error == pytest.approx(1 - 60 / 99)  # repetition 0's, between 0.4 and 0.2
    assert [row.algorithm for row in summary.failing] == ["tree", "ring"]  # 15 points over, then 10
    text = format_summary(summary)
    assert "2 of 5 (goal 0: missed); worst 1x3 all_reduce tree 1048576 B: -40.0% against a bound of 25.0% " \
           "(15.0 points over)" in text and text.endswith("goal MISSED")
    lines = {(line["by"], line["group"]): line for line in breakdown(rows)}
    assert set(lines) == {("hosts x ranks", "1x2"), ("hosts x ranks", "1x3"), ("hosts x ranks", "2x2"),
                          ("collective", "all_reduce"), ("collective", "reduce_scatter"), ("collective", "all_gather")}
    assert (lines["hosts x ranks", "1x3"]["rows"], lines["hosts x ranks", "1x3"]["failing"]) == (2, 2)
    assert lines["hosts x ranks", "1x3"]["worst_excess"] == pytest.approx(0.15)
    assert lines["collective", "all_gather"]["median_abs_error"] == pytest.approx(0.35)  # |+50%|, |-20%|
    assert lines["collective", "all_gather"]["worst_excess"] is None
    assert "15.0 pts" in format_breakdown(rows)


def test_validated_points_follow_the_simulator_and_leave_native_out(monkeypatch):
    profile = _profile()
    points = validation_points([4096, MIB], True, {1: profile, 2: profile})
    by_layout = plan(points)
    assert list(by_layout) == [(1, 2), (1, 3), (1, 4), (2, 4)]
    assert by_layout[1, 3]["all_reduce"] == list(engine.SIMULATED)           # every simulated AllReduce
    assert "shm" not in by_layout[2, 4]["all_reduce"]                         # shm spans one host only
    for layout in by_layout.values():
        assert "ring" in layout["reduce_scatter"] and "ring" in layout["all_gather"]
        assert not {"tree", "shm", "native"} & set(layout["reduce_scatter"] + layout["all_gather"])
        assert "native" not in layout["all_reduce"]
    # a reduce-scatter's message is a multiple of p floats: 4096 B at 3 ranks is 1023 floats
    assert ("reduce_scatter", "ring", 4092, 3, 1) in points and ("all_reduce", "ring", 4096, 3, 1) in points
    monkeypatch.setattr(engine, "SIMULATED", ("ring",))
    assert {algorithm for _, algorithm, *_ in validation_points([4096], False, {1: profile})} == {"ring"}


def test_predict_prices_each_rows_collective():
    profile = _profile()
    rows = predict([dict(collective="reduce_scatter", algorithm="ring", nbytes=MIB, world_size=4, hosts=2,
                         time_us=900.0, runs_us=[900.0, 1000.0]),
                    dict(collective="all_gather", algorithm="native", nbytes=MIB, world_size=2, time_us=9.0)], profile)
    row, = rows
    expected = engine.simulate_all_reduce("ring", MIB, profile, Topology.uniform(2, 2), collective="reduce_scatter")
    assert row.predicted_us == pytest.approx(expected.time_s * 1e6) and row.collective == "reduce_scatter"
    whole = engine.simulate_all_reduce("ring", MIB, profile, Topology.uniform(2, 2)).time_s
    assert expected.time_s < whole  # a reduce-scatter is half an AllReduce's steps


def test_the_split_refuses_a_validated_point_among_the_calibrations():
    validated = [("all_reduce", "ring", 4096, 2, 1), ("all_reduce", "shm", 65536, 2, 1)]
    check_disjoint(validated, [("all_reduce", "shm", 65540, 2, 1), ("pingpong", "pingpong", 4096, 2, 1)])
    with pytest.raises(ValueError, match=r"^--validate-sizes: 1 validated point\(s\) are calibration points "
                                         r"\(first: all_reduce shm 65536 B at 1x2\)[^\n]*$"):
        check_disjoint(validated, [("all_reduce", "shm", 65536, 2, 1)])
    assert as_point({"collective": "all_reduce", "algorithm": "ring", "nbytes": 4, "world_size": 4,
                     "hosts": True}) == ("all_reduce", "ring", 4, 4, 2)
    rows = split_rows(validated, [("all_reduce", "shm", 65540, 2, 1)])
    assert rows[0] == {"role": "calibrate", "collective": "all_reduce", "algorithm": "shm", "hosts": 1,
                       "world_sizes": [2], "sizes": [65540]}


def _fake_points(overlap: bool):
    def calibration_points(hosts: bool) -> list[dict]:
        size = 64 * 2**10 if overlap else 65540
        return [{"collective": "all_reduce", "algorithm": "shm", "nbytes": size, "world_size": 2, "hosts": 1},
                {"collective": "pingpong", "algorithm": "pingpong", "nbytes": 4, "world_size": 2, "hosts": 1}]
    return calibration_points


def test_validate_refuses_an_overlapping_calibration_before_calibrating(monkeypatch, capsys):
    monkeypatch.setattr(calibrate, "calibration_points", _fake_points(True), raising=False)
    monkeypatch.setattr(sim_validation_run, "calibrate", lambda **kw: pytest.fail("calibrated"))
    assert main(["simulate", "--validate", "--no-hosts", "--validate-sizes", "4K,64K"]) == 2
    err = capsys.readouterr().err
    assert "1 validated point(s) are calibration points (first: all_reduce shm 65536 B at 1x2)" in err
    assert len(err.strip().splitlines()) == 1


class _Stop(Exception):
    pass


def test_validate_prints_the_split_before_calibrating(monkeypatch, capsys):
    monkeypatch.setattr(calibrate, "calibration_points", _fake_points(False), raising=False)

    def stop(**kw):
        raise _Stop

    monkeypatch.setattr(sim_validation_run, "calibrate", stop)
    with pytest.raises(_Stop):
        main(["simulate", "--validate", "--no-hosts", "--validate-sizes", "4K"])
    out = capsys.readouterr().out
    assert "2 points calibrate" in out and "not modelled, no rows: native" in out
    calibrate_line = next(line for line in out.splitlines() if line.split()[:1] == ["calibrate"])
    assert calibrate_line.split() == ["calibrate", "all_reduce", "shm", "1", "2", "65540"]
    assert any(line.split() == ["validate", "all_reduce", "ring", "1", "2,3,4", "4K"] for line in out.splitlines())
    validate_lines = [line.split()[3:] for line in out.splitlines()
                      if line.split()[:3] == ["validate", "reduce_scatter", "ring"]]
    assert validate_lines == [["1", "2,4", "4K"], ["1", "3", "4092"]]  # 1023 floats at 3 ranks


def test_a_record_renders_the_split_and_the_new_columns_and_old_records_still_read():
    rows = [row.as_dict() for row in _rows()]
    rows.append({"role": "calibrate", "collective": "all_reduce", "algorithm": "shm", "nbytes": 65540,
                 "world_size": 2, "hosts": 1})
    split, validation, by_group, picks = tables("sim_validate", rows)
    assert "calibrate" in split and "65540" in split and "not modelled, no rows: native" in split
    assert "sizes that also calibrate" not in split  # 65540 B is no validated size
    rows.append(dict(rows[-1], nbytes=MIB, collective="pingpong", algorithm="pingpong"))
    assert "in other collectives or algorithms (no point shared): 1M" in tables("sim_validate", rows)[0]
    assert "spread" in validation.splitlines()[0] and "2 of 5" in validation and "1x3" in by_group
    old = [{key: value for key, value in row.items() if key not in ("collective", "spread", "bound", "passes")}
           for row in rows[:2]]
    rendered = tables("sim_validate", old)
    assert len(rendered) == 3 and "all_reduce" in rendered[0] and "30.0%" in rendered[0]  # spread from the runs


def test_the_modules_examples_run():
    import doctest

    from gradsync.bench import sim_validation, sim_validation_points

    for module in (sim_validation, sim_validation_points):
        result = doctest.testmod(module, verbose=False)
        assert result.attempted > 0 and result.failed == 0, module.__name__
