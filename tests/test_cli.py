"""The ``gradsync train`` command: bad input fails fast and clearly; a small real run writes its folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _early import early_job
from gradsync.cli import main
from gradsync.train import data
from gradsync.train.models import MLP


def _gradsync(*args: str, env: dict | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradsync", *args], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **(env or {})})


def _main(argv: list[str], capsys) -> subprocess.CompletedProcess:
    """Run the CLI in this process (no interpreter start-up) and return its exit code and output."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)


def _assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode not in (0, None), result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("args, needles", [
    (["--nproc", "0"], ["--nproc", "0"]),
    (["--batch-size", "0"], ["--batch-size"]),
    (["--batch-size", "-3"], ["--batch-size", "-3"]),
    (["--batch-size", "abc"], ["--batch-size", "abc"]),
    (["--model", "resnet"], ["resnet", "cnn"]),
    (["--algorithm", "carrier-pigeon"], ["carrier-pigeon", "ring"]),
    (["--epochs", "0"], ["--epochs"]),
    (["--lr", "-1"], ["--lr"]),
    (["--timeout", "0"], ["--timeout"]),
    (["--nproc", "9", "--num-samples", "10", "--batch-size", "1"], ["world size 9", "8 training samples"]),
    (["--nproc", "2", "--num-samples", "100", "--batch-size", "64"], ["--batch-size 64"]),
    (["--trace", "/no-such-folder/trace.json"], ["--trace", "/no-such-folder"]),
    (["--trace", "/"], ["--trace", "folder"]),
    (["--trace", "/proc/trace.json"], ["--trace", "cannot be written"]),
    (["--trace", ""], ["--trace", "empty"]),
    (["--bogus"], ["gradsync train: error:", "--bogus"]),
    (["--check-replicas-every", "-1"], ["--check-replicas-every", "-1"]),
    (["--mode", "async", "--check-replicas-every", "5"], ["--check-replicas-every", "async"]),
])
@pytest.mark.timeout(60)
def test_cli_rejects_bad_input_with_one_line(args, needles, tmp_path, capsys, monkeypatch):
    """Each bad option gives one error line naming it and a non-zero exit, before any worker starts."""
    monkeypatch.setenv("GRADSYNC_DATA_DIR", str(tmp_path))
    result = _main(["train", *args, "--out", str(tmp_path / "run")], capsys)
    _assert_one_line_error(result, *needles)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.fixture
def small_cache(tmp_path_factory, monkeypatch, capsys) -> list[str]:
    """A prepared 400-sample data cache in GRADSYNC_DATA_DIR; returns the options that select it.

    Without it the command would first generate (and announce on stderr) the default 20000 samples
    in ~/.cache, which takes seconds and adds a line to the one-line error these tests expect.
    """
    cache = tmp_path_factory.mktemp("mnist1d")
    data.prepare(cache, 400)  # 80 training samples for each of the default 4 workers
    capsys.readouterr()  # the generation notice is not the command's output
    monkeypatch.setenv("GRADSYNC_DATA_DIR", str(cache))
    return ["--num-samples", "400"]


def test_cli_rejects_unwritable_out(tmp_path, capsys, small_cache):
    """An --out below a regular file cannot be created: one line naming the folder."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = _main(["train", *small_cache, "--out", str(blocker / "run")], capsys)
    _assert_one_line_error(result, "--out", str(blocker / "run"))


def test_cli_refuses_a_bad_out_before_generating_any_data(tmp_path, capsys, monkeypatch):
    """On a machine without the data cache, a bad --out is one line and generates nothing (seconds saved)."""
    empty_cache = tmp_path / "cache"
    empty_cache.mkdir()
    monkeypatch.setenv("GRADSYNC_DATA_DIR", str(empty_cache))
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    result = _main(["train", "--out", str(tmp_path)], capsys)
    _assert_one_line_error(result, "already holds a run")
    assert list(empty_cache.iterdir()) == []


def test_cli_refuses_to_mix_with_an_earlier_run(tmp_path, capsys, small_cache):
    """A run folder that already holds metrics.jsonl is not appended to."""
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    result = _main(["train", *small_cache, "--out", str(tmp_path)], capsys)
    _assert_one_line_error(result, "already holds a run")
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.timeout(60)
def test_cli_bad_input_exit_code_from_a_real_process(tmp_path):
    """The console entry point really exits non-zero with one line (not just main()'s return value)."""
    result = _gradsync("train", "--nproc", "0", "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    _assert_one_line_error(result, "--nproc")


_INJECT_FAILURE = """
import os
import gradsync.train.loop as loop

_original_init = loop.Trainer.__init__


def _failing_init(self, *args, **kwargs):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("injected failure on rank 1")
    _original_init(self, *args, **kwargs)


loop.Trainer.__init__ = _failing_init
"""


WORKER_FAILURE = early_job(  # sitecustomize.py (on PYTHONPATH) runs in every worker process
    "cli-worker-failure",
    ["train", "--nproc", "2", "--num-samples", "1000", "--out", "{folder}/run", "--no-progress", "--timeout", "20"],
    env={"GRADSYNC_DATA_DIR": "{folder}",
         "PYTHONPATH": os.pathsep.join(filter(None, ["{folder}", os.environ.get("PYTHONPATH")]))},
    files={"sitecustomize.py": _INJECT_FAILURE})


@pytest.mark.dist
@pytest.mark.early_job(WORKER_FAILURE)
@pytest.mark.timeout(120)
def test_cli_worker_failure_exits_nonzero_naming_the_failing_worker(early):
    """A worker that raises ends the job with exit 1 and that worker's error, not the others' fallout.

    The run is an early job (``_early.py``): started with the session, waited for here.
    """
    tmp_path = early.folder
    result = early.wait(110)
    assert result.returncode == 1, result.stderr
    assert "worker rank 1 failed: RuntimeError: injected failure on rank 1" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    # a run that wrote nothing leaves no folder behind, but for the flight records of the ranks whose
    # collectives failed with it (rank 0's, when rank 1 left during a collective)
    left = sorted(path.name for path in (tmp_path / "run").iterdir()) if (tmp_path / "run").exists() else []
    assert left in ([], ["flight"]), left


def test_cli_corrupt_data_cache_is_regenerated(tmp_path):
    """A truncated or garbage cache file is replaced by freshly generated data, with a warning."""
    cache = data.cache_path(tmp_path, 100, data.DEFAULT_DATA_SEED)
    cache.write_bytes(b"this is not an npz file")
    path = data.prepare(tmp_path, num_samples=100)
    splits = data.load(path)
    fresh = data.generate(100)
    assert torch.equal(splits.x_train, torch.from_numpy(fresh["x_train"]))
    assert torch.equal(splits.y_test, torch.from_numpy(fresh["y_test"]))


def _check_trace(events, steps, micro_batches):
    """One track per rank with every step's forward, backward, optimizer and several bucket AllReduces."""
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        count = {kind: sum(e["cat"] == kind for e in mine) for kind in ("forward", "backward", "optimizer")}
        assert count == {"forward": steps * micro_batches, "backward": steps * micro_batches,
                         "optimizer": steps}, count
        buckets = {e["args"]["bucket"] for e in mine if e["cat"] == "allreduce"}
        assert len(buckets) >= 2
        # every bucket but the last runs on the communication thread, during backward
        assert {e["tid"] for e in mine if e["cat"] == "allreduce" and e["args"]["bucket"] < max(buckets)} == {1}
        assert all(e["dur"] >= 0 for e in mine)


def _check_preflight(summary: dict, stdout: str) -> None:
    """The memory preflight's fields (issue 39): the MLP's parameters, whole gradients and AdamW's two
    moments counted from the model's own sizes; the measured peak, the largest of the two ranks'."""
    fields = summary["preflight"]
    numel = sum(p.numel() for p in MLP().parameters())
    parts = fields["estimate_parts_mib"]
    assert parts["parameter"] == parts["gradient"] == numel * 4 / 2**20
    assert parts["optimizer_state"] == 2 * numel * 4 / 2**20
    assert fields["estimate_mib"] == pytest.approx(sum(parts.values()))
    assert len(fields["measured_peak_mib_per_rank"]) == 2 and fields["measured_by"] in ("rss", "cgroup")
    assert fields["measured_peak_mib"] == max(fields["measured_peak_mib_per_rank"]) > 0
    assert f"gradsync: memory per rank: estimated {fields['estimate_mib']:.1f} MiB, measured peak " in stdout


def assert_private(*paths: Path) -> None:
    """Every folder under ``paths`` is 0700 and every file 0600 (issue 16: they were 0755 / 0644)."""
    found = [path for top in paths for path in [top, *(top.rglob("*") if top.is_dir() else [])]]
    modes = {str(path): oct(path.stat().st_mode & 0o777) for path in found}
    wanted = {str(path): oct(0o700 if path.is_dir() else 0o600) for path in found}
    assert modes == wanted


SMALL_RUN = early_job("cli-small-run", [
    "train", "--nproc", "2", "--model", "mlp", "--epochs", "2", "--num-samples", "2000", "--batch-size", "16",
    "--accumulate", "2", "--out", "{folder}/run", "--no-progress", "--trace", "{folder}/trace.json",
    "--bucket-cap-mb", "0.01", "--check-replicas-every", "10",
    "--algorithm", "ring"],  # ring: its bytes go through the transport and are counted (auto picks shm here)
    env={"GRADSYNC_DATA_DIR": "{folder}"})


@pytest.mark.dist
@pytest.mark.early_job(SMALL_RUN)
@pytest.mark.timeout(180)
def test_cli_small_run_writes_metrics_summary_and_plots(early):
    """Two workers train the MLP for two epochs; the folder's records agree with each other.

    The run is an early job (``_early.py``): started with the session, waited for here.
    """
    tmp_path = early.folder
    out = tmp_path / "run"
    result = early.wait(170)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    # 1600 train samples / 2 ranks = 800 per rank; 800 // 16 = 50 micro-batches; // 2 = 25 steps per epoch
    assert len(steps) == summary["steps"] == 2 * 25
    assert [r["step"] for r in steps] == list(range(1, 51))
    checks = [r for r in records if r["kind"] == "replica_check"]  # 6 parameters and Adam's 3 states of each
    assert [(r["step"], r["equal"], r["tensors"]) for r in checks] == [(step, True, 24) for step in range(10, 51, 10)]
    assert len(epochs) == 2
    assert summary["samples"] == 50 * 16 * 2 * 2
    assert summary["final_test_accuracy"] == epochs[-1]["test_accuracy"]
    assert summary["final_test_accuracy"] > 0.2  # ten classes: chance is 0.10
    assert epochs[-1]["train_loss"] < 0.9 * steps[0]["loss"]  # it learned
    assert summary["world_size"] == 2 and len(summary["bytes_sent_per_rank"]) == 2
    assert min(summary["bytes_sent_per_rank"]) > 0
    # per-step timings and bytes: exposed communication is part of backward, bytes add up to the total
    for record in steps:
        assert 0 <= record["exposed_comm_s"] <= min(record["backward_s"], record["comm_s"]), record
        assert record["comm_s"] > 0 and record["forward_s"] > 0 and record["optimizer_s"] > 0, record
        assert record["bytes_sent"] > 0
    assert [r["bytes_sent_total"] for r in steps] == sorted(r["bytes_sent_total"] for r in steps)
    for before, after in zip(steps, steps[1:]):  # totals also count the epoch-end loss and test AllReduces
        assert after["bytes_sent"] <= after["bytes_sent_total"] - before["bytes_sent_total"]
    assert 0 <= summary["exposed_communication_s"] <= min(summary["backward_s"], summary["communication_s"])
    assert summary["exposed_communication_fraction"] == pytest.approx(
        summary["exposed_communication_s"] / summary["communication_s"])
    _check_trace(json.loads((tmp_path / "trace.json").read_text())["traceEvents"], steps=50, micro_batches=2)
    assert summary["config"]["accumulate"] == 2 and summary["config"]["out"] == str(out)
    # the summary and the end-of-run line name the algorithm per bucket
    assert len(summary["algorithms"]) >= 2 and {e["algorithm"] for e in summary["algorithms"]} == {"ring"}
    assert all(e["bucket_nbytes"] > 0 for e in summary["algorithms"])
    assert f"gradsync: AllReduce algorithm: ring for {len(summary['algorithms'])} buckets of " in result.stdout
    _check_preflight(summary, result.stdout)
    for name in ("loss.png", "accuracy.png", "time.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_private(out, tmp_path / "trace.json")
    # the cached arrays are what the generator makes, so the second run does not regenerate
    cached = np.load(data.cache_path(tmp_path, 2000, data.DEFAULT_DATA_SEED))
    assert cached["x_train"].shape == (1600, 40) and cached["x_test"].shape == (400, 40)


@pytest.mark.timeout(60)
def test_a_reader_that_goes_away_is_not_an_error():
    """``gradsync explain ring | head -1``: the pipe's reader closes early; nothing on stderr (it used to
    print "error: [Errno 32] Broken pipe")."""
    process = subprocess.Popen([sys.executable, "-m", "gradsync", "explain", "ring"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=50) == 1
    assert stderr == ""
