"""The rows of bench deterministic, replicas, compression and modes from synthetic repetitions (no processes).

Every row carries the median with min and max of each time, rate and ratio over ``--repeat`` repetitions,
ratios formed within a repetition; the tables render those rows and the committed ones recorded before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.bench import compression, determinism, modes, replica_checks
from gradsync.bench.spread import scaled_cell

BENCH_DIR = Path(__file__).resolve().parents[1] / "docs" / "bench"


_SPREAD_SUFFIXES = ("_median", "_min", "_max", "_reps", "_runs")


def _committed_rows(name: str) -> list[dict]:
    """The committed record's rows as a record of before the spread had them: every spread field dropped."""
    rows = json.loads((BENCH_DIR / f"{name}.json").read_text())["rows"]
    return [{key: value for key, value in row.items() if not _spread_field(key, row)} for row in rows]


def _spread_field(key: str, row: dict) -> bool:
    """``x_median`` / ``x_min`` / ``x_max`` / ``x_reps`` beside a figure ``x`` (not e.g. ``staleness_max`` alone)."""
    return any(key.endswith(suffix) and key[:-len(suffix)] in row for suffix in _SPREAD_SUFFIXES)


def test_scaled_cell_scales_the_median_and_both_extremes():
    """Seconds shown as milliseconds: all three figures times 1e3; a row without spread: the bare value."""
    assert scaled_cell("t_s", 1e3, ".1f")({"t_s": 0.0025, "t_s_min": 0.0012, "t_s_max": 0.004}) == "2.5 (1.2-4.0)"
    assert scaled_cell("f", 100, ".1f", "%")({"f": 0.25}) == "25.0%"
    assert scaled_cell("f", 100, ".1f")({"f": None}) == "-"


# ---------------------------------------------------------------- deterministic

def test_deterministic_rows_pair_the_ratio_within_each_repetition():
    """Repetition 2 slowed normal only: the paired ratios are 0.5, 2/3, 0.25 (median 0.5), not 853/2560."""
    setting = {"model": "cnn", "world_size": 2, "algorithm": "ring", "threads_per_rank": 1}
    runs = {determinism.NORMAL: [{"elapsed_s": 1.0, "comm_s": 0.1}, {"elapsed_s": 2.0, "comm_s": 0.3},
                                 {"elapsed_s": 1.0, "comm_s": 0.2}],
            4: [{"elapsed_s": 2.0, "comm_s": 0.5}, {"elapsed_s": 3.0, "comm_s": 0.4}, {"elapsed_s": 4.0, "comm_s": 0.6}]}
    normal, deterministic = determinism.throughput_rows(setting, runs, steps=10)  # 256 samples x 10 steps
    assert normal["mode"] == "normal" and deterministic["mode"] == "deterministic M=4"
    assert (normal["samples_per_s"], normal["samples_per_s_min"], normal["samples_per_s_max"]) == (2560, 1280, 2560)
    assert deterministic["samples_per_s"] == pytest.approx(2560 / 3)
    assert deterministic["ratio_to_normal"] == deterministic["ratio_to_normal_median"] == pytest.approx(0.5)
    assert (deterministic["ratio_to_normal_min"], deterministic["ratio_to_normal_max"]) == pytest.approx((0.25, 2 / 3))
    assert normal["ratio_to_normal_min"] == normal["ratio_to_normal_max"] == 1.0
    assert (deterministic["comm_s_per_step"], deterministic["comm_s_per_step_min"],
            deterministic["comm_s_per_step_max"]) == pytest.approx((0.05, 0.04, 0.06))
    assert deterministic["repeat"] == 3 and deterministic["global_batch_size"] == 256
    table = determinism.format_table([normal, deterministic])
    assert "0.50x (0.25-0.67)" in table and "853 (640-1280)" in table and "50.00 (40.00-60.00)" in table


def test_deterministic_table_renders_rows_recorded_without_spread():
    rows = _committed_rows("deterministic")
    lines = determinism.format_table(rows).splitlines()
    assert len(lines) == 2 + sum(row["kind"] == "throughput" for row in rows)
    assert "(" not in lines[2] and lines[2].split()[:4] == ["cnn", "2", "normal", f"{rows[0]['samples_per_s']:.0f}"]


def test_deterministic_rejects_repeat_0_naming_it():
    with pytest.raises(ValueError, match="--repeat"):
        determinism.parse_options("2", "cnn", "4", "auto", 1, 0, 0)


# ---------------------------------------------------------------- replicas

def test_replica_figures_pair_each_check_with_the_step_of_its_repetition():
    """check/step 0.1, 0.25, 0.3 (median 0.25: misses 20%, and the range straddles it)."""
    times = {"step_s": [0.010, 0.020, 0.010], "check_s": [0.001, 0.005, 0.003],
             "check_optimizer_s": [0.002, 0.006, 0.004]}
    row = {"model": "cnn", "world_size": 2, "parameters": 10, **replica_checks.check_figures(times, nbytes=10**6)}
    assert (row["check_fraction_of_step"], row["check_fraction_of_step_min"],
            row["check_fraction_of_step_max"]) == pytest.approx((0.25, 0.1, 0.3))
    assert (row["check_optimizer_fraction_of_step"], row["check_optimizer_fraction_of_step_min"],
            row["check_optimizer_fraction_of_step_max"]) == pytest.approx((0.3, 0.2, 0.4))
    assert (row["overhead_every_100"], row["overhead_every_100_min"]) == pytest.approx((0.003, 0.002))
    # 2 x 1 MB checksummed in 2, 6 and 4 ms: 1, 1/3 and 1/2 GB/s
    assert (row["checksum_gb_per_s"], row["checksum_gb_per_s_min"], row["checksum_gb_per_s_max"]) == \
        pytest.approx((0.5, 1 / 3, 1.0))
    assert (row["step_s"], row["step_s_max"], row["repeat"]) == (0.010, 0.020, 3)
    table = replica_checks.format_table([row])
    assert "25.0% (10.0-30.0)" in table and "3.00 (1.00-5.00)" in table and "10.0 (10.0-20.0)" in table
    assert "missed, straddles" in table and table.count("straddles") == 2


def test_replica_table_renders_rows_recorded_without_spread():
    rows = _committed_rows("replicas")
    lines = replica_checks.format_table(rows).splitlines()
    assert len(lines) == 2 + len(rows) and "(" not in "".join(lines[2:])
    expected = "met" if rows[0]["check_fraction_of_step"] <= 0.2 else "missed"
    assert expected in lines[2].split()


def test_replicas_rejects_repeat_0_before_any_process():
    with pytest.raises(ValueError, match="--repeat"):
        replica_checks.run_bench(nproc="2", models="cnn", steps=1, checks=1, repeat=0, json_path=None)


# ---------------------------------------------------------------- compression

def _throughput_runs() -> dict[str, list[dict]]:
    # none: 1.0 s then 2.0 s per repetition (noise in repetition 2); onebit: 2.0 then 3.0
    return {"none": [{"elapsed_s": 1.0, "bytes_per_step": 1000.0, "comm_s_per_step": 0.01},
                     {"elapsed_s": 2.0, "bytes_per_step": 1000.0, "comm_s_per_step": 0.03}],
            "onebit": [{"elapsed_s": 2.0, "bytes_per_step": 40.0, "comm_s_per_step": 0.02},
                       {"elapsed_s": 3.0, "bytes_per_step": 50.0, "comm_s_per_step": 0.02}]}


def test_compression_throughput_rows_pair_speed_and_bytes_with_none():
    setting = {"model": "mlp", "world_size": 2, "num_parameters": 7, "steps": 5, "samples_per_step": 10}
    none, onebit = compression.throughput_rows(setting, _throughput_runs())  # 50 samples per repetition
    assert (none["samples_per_s"], none["samples_per_s_min"], none["samples_per_s_max"]) == (37.5, 25.0, 50.0)
    assert none["speedup"] == none["bytes_reduction"] == 1.0 and none["break_even_gbit_s"] is None
    # speed: 25/50 and 16.7/25 in the two repetitions; bytes: 1000/40 and 1000/50
    assert (onebit["speedup"], onebit["speedup_min"], onebit["speedup_max"]) == pytest.approx((7 / 12, 0.5, 2 / 3))
    assert (onebit["bytes_reduction"], onebit["bytes_reduction_min"], onebit["bytes_reduction_max"]) == \
        pytest.approx((22.5, 20.0, 25.0))
    assert onebit["bytes_per_step"] == 45.0 and onebit["comm_s_per_step_max"] == 0.02 and onebit["repeat"] == 2
    # from the medians: 10 samples a step at 37.5 and 20.83 samples/s, 955 bytes saved
    extra_s = 10 / (50 / 2.4) - 10 / 37.5
    assert onebit["break_even_gbit_s"] == pytest.approx(8 * 955 / extra_s / 1e9)
    table = compression.format_throughput_table([none, onebit])
    assert "0.58x (0.50-0.67)" in table and "22.5 (20.0-25.0)" in table


def test_compression_accuracy_rows_pair_accuracy_with_none_and_take_the_median_curve():
    def run(accuracy, samples_per_s, curve):
        return {"model": "cnn", "test_accuracy": accuracy, "samples_per_s": samples_per_s, "bytes_per_step": 100.0,
                "mean_bytes_per_step": 100.0, "compression_warmup_steps": 0, "steps": 9, "samples_per_step": 64,
                "test_accuracy_per_epoch": curve, "run_folder": "f"}

    runs = {"none": [run(0.90, 100.0, [0.5, 0.9]), run(0.80, 50.0, [0.3, 0.8]), run(0.85, 100.0, [0.4, 0.85])],
            "fp16": [run(0.88, 150.0, [0.6, 0.88]), run(0.81, 50.0, [0.2, 0.81]), run(0.80, 120.0, [0.1, 0.8])]}
    none, fp16 = compression.accuracy_rows(runs, world_size=4)
    assert (fp16["accuracy_delta_pp"], fp16["accuracy_delta_pp_min"], fp16["accuracy_delta_pp_max"]) == \
        pytest.approx((-2.0, -5.0, 1.0))
    assert (fp16["speedup"], fp16["speedup_min"], fp16["speedup_max"]) == pytest.approx((1.2, 1.0, 1.5))
    assert (fp16["test_accuracy"], fp16["test_accuracy_min"]) == (0.81, 0.80) and none["accuracy_delta_pp"] == 0
    assert fp16["test_accuracy_per_epoch"] == [0.2, 0.81] and fp16["kind"] == "accuracy"
    table = compression.format_accuracy_table([none, fp16])
    assert "81.00 (80.00-88.00)" in table and "-2.00 (-5.00-+1.00)" in table


def test_compression_tables_render_rows_recorded_without_spread():
    rows = _committed_rows("compression")
    accuracy = [row for row in rows if row["kind"] == "accuracy"]
    throughput = [row for row in rows if row["kind"] == "throughput"]
    assert "(" not in "".join(compression.format_accuracy_table(accuracy).splitlines()[2:])
    lines = compression.format_throughput_table(throughput).splitlines()
    assert len(lines) == 3 + len(throughput) and f"{throughput[0]['samples_per_s']:.1f}" in lines[2]


# ---------------------------------------------------------------- modes

def _mode_run(samples_per_s, to_target, accuracy=0.86):
    return {"num_workers": 2, "samples_per_s": samples_per_s, "seconds_to_target": to_target,
            "test_accuracy": accuracy, "best_test_accuracy": accuracy, "staleness_mean": 0.5, "staleness_max": 1,
            "wall_s": 10.0, "steps": 5, "samples": 320, "accuracy_curve": [[1.0, accuracy]], "run_folder": "r"}


def test_modes_rows_pair_speed_and_time_to_target_with_sync():
    """async reached the target in 2 of 3 repetitions; its time ratio pairs only those where sync did too."""
    sync = [_mode_run(100.0, 10.0), _mode_run(50.0, 20.0), _mode_run(100.0, None)]
    asynchronous = [_mode_run(150.0, 5.0, 0.8), _mode_run(100.0, None, 0.7), _mode_run(120.0, 8.0, 0.9)]
    sync_row = modes.setting_row({"mode": "sync"}, 1.0, sync, sync, target=0.85)
    row = modes.setting_row({"mode": "async", "max_staleness": None}, 1.0, asynchronous, sync, target=0.85)
    assert (row["samples_per_s_vs_sync"], row["samples_per_s_vs_sync_min"], row["samples_per_s_vs_sync_max"]) \
        == pytest.approx((1.5, 1.2, 2.0))
    assert (row["seconds_to_target"], row["seconds_to_target_min"], row["target_reached"]) == (6.5, 5.0, 2)
    assert row["seconds_to_85"] == 6.5
    assert row["seconds_to_target_vs_sync"] == row["seconds_to_target_vs_sync_max"] == pytest.approx(0.5)
    assert (row["test_accuracy"], row["test_accuracy_min"], row["test_accuracy_max"]) == (0.8, 0.7, 0.9)
    assert sync_row["samples_per_s_vs_sync"] == 1.0 and sync_row["repeat"] == 3
    table = modes.format_table([sync_row, row])
    assert "6.5 (5.0-8.0) in 2/3" in table and "1.50x (1.20-2.00)" in table and "80.00 (70.00-90.00)" in table


def test_modes_time_to_target_is_none_when_no_repetition_reached_it():
    runs = [_mode_run(100.0, None), _mode_run(90.0, None)]
    row = modes.setting_row({"mode": "local-sgd", "sync_every": 16}, 3.0, runs, runs, target=0.85)
    assert row["seconds_to_target"] is None and row["seconds_to_target_vs_sync"] is None
    assert row["target_reached"] == 0 and row["label"] == "local-sgd H=16" and row["straggler"] == 3.0
    assert modes.format_table([row]).splitlines()[2].split()[7] == "-"


def test_modes_table_renders_rows_recorded_without_spread():
    """Old rows lack the paired ratio: the table forms it from the medians as before."""
    rows = [{key: value for key, value in row.items() if "_vs_" not in key} for row in _committed_rows("modes")]
    lines = modes.format_table(rows).splitlines()
    assert len(lines) == 2 + len(rows) and "(" not in "".join(lines[2:])
    sync = next(row for row in rows if row["mode"] == "sync" and row["straggler"] == rows[1]["straggler"])
    assert f"{rows[1]['samples_per_s'] / sync['samples_per_s']:.2f}x" in lines[3]


def test_modes_rejects_repeat_0_before_any_run(tmp_path):
    with pytest.raises(ValueError, match="--repeat"):
        modes.run_bench(repeat=0, out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bench", ["deterministic", "replicas", "compression", "modes"])
def test_every_bench_takes_repeat_and_rejects_0_with_one_line(bench, tmp_path, capsys):
    """``--repeat 0``: exit 2 and one error line naming --repeat, before any process or run folder."""
    from test_bench import _main

    extra = ["--out", str(tmp_path / "out")] if bench in ("compression", "modes") else []
    result = _main(["bench", bench, "--repeat", "0", *extra], capsys)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "--repeat" in lines[0], result.stderr
    assert not (tmp_path / "out").exists()
