"""``gradsync bench faults``: its arithmetic on recorded events, its table, and bad options fail before any run."""

from __future__ import annotations

import pytest

from gradsync.bench.faults import default_fault_step, format_table, measure
from test_bench import _main


def _events(fault_time: float, fault_step: int, detected: list[float], resumed_time: float, from_step: int) -> list:
    events = [{"event": "checkpoint", "step": from_step, "attempt": 0, "time": fault_time - 1.0},
              {"event": "fault", "fault": "hang", "rank": 2, "step": fault_step, "attempt": 0, "time": fault_time}]
    events += [{"event": "detected", "rank": r, "peer": 2, "attempt": 0, "time": t}
               for r, t in zip((0, 1, 3), detected)]
    events += [{"event": "resumed", "from_step": from_step, "attempt": 1, "time": resumed_time},
               {"event": "detected", "rank": 0, "peer": 1, "attempt": 1, "time": resumed_time + 50}]
    return events


def test_measure_takes_the_first_detection_of_the_faulty_attempt_and_counts_lost_steps():
    row = measure(_events(100.0, fault_step=60, detected=[106.6, 106.5, 106.7], resumed_time=115.25, from_step=50))
    assert row["detect_s"] == pytest.approx(6.5)
    assert row["recover_s"] == pytest.approx(15.25)
    assert row["steps_recomputed"] == 60 - 1 - 50  # steps 51..59 were done, then lost
    assert row["resumed_from_step"] == 50
    assert row["blamed"] == [1, 2]


def test_measure_without_a_fault_event_says_so():
    with pytest.raises(RuntimeError, match="never fired"):
        measure([{"event": "checkpoint", "step": 5, "attempt": 0, "time": 1.0}])


def test_measure_reports_missing_detection_and_resume_as_none():
    row = measure([{"event": "fault", "fault": "kill", "rank": 1, "step": 9, "attempt": 0, "time": 3.0}])
    assert row["detect_s"] is None and row["recover_s"] is None and row["steps_recomputed"] is None


@pytest.mark.parametrize("last_step, every, expected", [(375, 25, 200), (100, 10, 60), (30, 25, 30), (8, 10, 8)])
def test_default_fault_step_is_mid_run_just_before_a_checkpoint(last_step, every, expected):
    step = default_fault_step(last_step, every)
    assert step == expected
    assert 1 <= step <= last_step


def test_format_table_prints_one_line_per_fault_and_dashes_for_missing_values():
    base = {"rank": 1, "step": 200, "timeout_s": 5.0, "checkpoint_every": 25, "params_equal": True,
            "job_s": 40.0, "baseline_job_s": 28.0, "extra_s": 12.0, "checkpoint_s": 0.5}
    rows = [{**base, "fault": "kill", "detect_s": 0.03, "recover_s": 13.9, "steps_recomputed": 24},
            {**base, "fault": "hang", "detect_s": None, "recover_s": None, "steps_recomputed": None}]
    lines = format_table(rows).splitlines()
    assert lines[2].split()[:7] == ["kill", "1:200", "5", "0.03", "13.90", "24", "25"]
    assert lines[3].split()[3:6] == ["-", "-", "-"]
    assert "0.50 s" in lines[-1]


@pytest.mark.parametrize("args, needle", [
    (["--checkpoint-every", "0"], "--checkpoint-every"),
    (["--timeout", "0"], "--timeout"),
    (["--fault-rank", "4"], "--fault-rank 4 is not a worker"),
    (["--fault-step", "0"], "--fault-step must be in [1, 375]"),
    (["--fault-step", "100000"], "--fault-step must be in [1, 375]"),
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "1"], "--nproc must be >= 2"),
    (["--repeat", "3"], "--repeat and --no-torchft need --elastic"),
    (["--elastic", "--repeat", "0"], "--repeat must be an integer >= 1"),
    (["--elastic", "--chaos-s", "0"], "--chaos-s and --kill-every must be > 0"),
])
@pytest.mark.timeout(60)
def test_bench_faults_rejects_bad_options_before_any_run(args, needle, tmp_path, capsys):
    result = _main(["bench", "faults", "--out", str(tmp_path / "out"), *args], capsys)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_bench_faults_refuses_an_out_folder_with_earlier_runs_or_a_file(tmp_path, capsys):
    (tmp_path / "hang").mkdir()
    result = _main(["bench", "faults", "--out", str(tmp_path)], capsys)
    assert result.returncode == 2 and "already holds bench faults runs (hang)" in result.stderr, result.stderr
    (tmp_path / "afile").write_text("x")
    result = _main(["bench", "faults", "--out", str(tmp_path / "afile")], capsys)
    assert result.returncode == 2 and "is a file, not a folder" in result.stderr, result.stderr
