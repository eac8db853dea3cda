"""``gradsync bench compression``: bad options fail fast; a small run writes rows, a table and a plot."""

from __future__ import annotations

import json

import pytest

from _early import early_job
from gradsync.bench import compression as compression_bench
from test_bench import _main


@pytest.mark.parametrize("args, needle", [
    (["--compressions", "bogus"], "bogus"),
    (["--compressions", ","], "--compressions"),
    (["--nproc", "0"], "--nproc"),
    (["--epochs", "0"], "--epochs"),
    (["--compression-warmup-steps", "-1"], "--compression-warmup-steps"),
    (["--throughput-nproc", "0"], "--throughput-nproc"),
    (["--throughput-steps", "0"], "--throughput-steps"),
    (["--repeat", "0"], "--repeat"),
    (["--num-samples", "5"], "--num-samples"),
    (["--no-accuracy", "--no-throughput"], "nothing to run"),
])
def test_bench_compression_rejects_bad_options_with_one_line(args, needle, capsys):
    """Each bad option: exit 2 and one error line naming it, before any process starts."""
    result = _main(["bench", "compression", *args], capsys)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_bench_compression_out_must_be_a_folder(tmp_path, capsys):
    """--out naming a file: exit 2 and one line, before any run."""
    path = tmp_path / "a-file"
    path.write_text("")
    result = _main(["bench", "compression", "--out", str(path)], capsys)
    assert result.returncode == 2 and "not a folder" in result.stderr, result.stderr


def test_ratios_against_the_uncompressed_row():
    """x fewer bytes, speed and the break-even link speed follow from the figures (one repetition each)."""
    fields = compression_bench.compare_to_none({
        "none": {"bytes_per_step": [1000.0], "samples_per_s": [100.0], "test_accuracy": [0.9]},
        "onebit": {"bytes_per_step": [40.0], "samples_per_s": [50.0], "test_accuracy": [0.88]},
        "fp16": {"bytes_per_step": [500.0], "samples_per_s": [200.0], "test_accuracy": [0.9]},
    }, samples_per_step=10)
    none, onebit, fp16 = fields["none"], fields["onebit"], fields["fp16"]
    assert none["bytes_reduction"] == 1 and none["speedup"] == 1 and none["break_even_gbit_s"] is None
    assert onebit["bytes_reduction"] == pytest.approx(25.0) and onebit["speedup"] == pytest.approx(0.5)
    assert onebit["accuracy_delta_pp"] == pytest.approx(-2.0)
    # 960 bytes saved per step for 0.1 s more per step (0.2 s against 0.1 s)
    assert onebit["break_even_gbit_s"] == pytest.approx(8 * 960 / 0.1 / 1e9)
    assert fp16["break_even_gbit_s"] is None  # faster: no break-even
    without_none = compression_bench.compare_to_none({"fp16": {"bytes_per_step": [5.0], "samples_per_s": [2.0]}}, 1)
    assert without_none["fp16"]["speedup"] is None and without_none["fp16"]["break_even_gbit_s"] is None


SMALL_RUN = early_job("bench-compression", [
    "bench", "compression", "--compressions", "none,onebit", "--nproc", "2", "--epochs", "1",
    "--num-samples", "400", "--compression-warmup-steps", "0", "--throughput-nproc", "2",
    "--throughput-steps", "1", "--repeat", "1", "--out", "{folder}/bench", "--json", "{folder}/rows.json"],
    env={"GRADSYNC_DATA_DIR": "{folder}"})


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.early_job(SMALL_RUN)
@pytest.mark.timeout(240)
def test_bench_compression_small_run_writes_rows_table_and_plot(early):
    """Two compressors, tiny accuracy runs and one MLP step: rows carry the issue's keys, bytes drop ~28x.

    The command runs as an early job (``_early.py``): started with the session, waited for here.
    """
    result = early.wait(230)
    out, rows_path = early.folder / "bench", early.folder / "rows.json"
    assert result.returncode == 0, result.stderr
    rows = json.loads(rows_path.read_text())
    assert [(row["kind"], row["compression"]) for row in rows] == [
        ("accuracy", "none"), ("accuracy", "onebit"), ("throughput", "none"), ("throughput", "onebit")]
    for row in rows:
        assert {"model", "compression", "test_accuracy", "bytes_per_step", "samples_per_s"} <= set(row), row
        assert row["samples_per_s"] > 0 and row["bytes_per_step"] > 0
    accuracy_none, accuracy_onebit, throughput_none, throughput_onebit = rows
    assert accuracy_none["model"] == "cnn" and 0 <= accuracy_onebit["test_accuracy"] <= 1
    assert len(accuracy_onebit["test_accuracy_per_epoch"]) == 1
    assert throughput_onebit["model"] == "mlp" and throughput_onebit["test_accuracy"] is None
    # 25.2M float32 parameters: 1.125 bits per value against 32 (a few flag and header bytes aside)
    assert 27 < throughput_none["bytes_per_step"] / throughput_onebit["bytes_per_step"] < 29
    assert (out / "compression_accuracy.png").stat().st_size > 0
    assert compression_bench.format_accuracy_table(rows[:2]).splitlines()[0] in result.stdout
