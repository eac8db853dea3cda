"""``gradsync train --mode sync|async|local-sgd`` and ``gradsync bench modes`` end to end (real processes).

Runs are tiny (400 MNIST-1D samples, one epoch, batch 16, 2 workers) and
every test has a timeout. The async run is a subprocess whose descendants
are recorded from /proc while it runs, so the test can check that none
outlives it; the kill test SIGKILLs one of its own worker processes (found
by the RANK in its environment) and expects a clear error well within the
collective timeout.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _dist import run_world
from _early import early_job
from gradsync.bench.modes import parse_settings
from gradsync.train import data
from gradsync.train.config import TrainConfig
from test_bench import _main

TINY = ["--num-samples", "400", "--epochs", "1", "--batch-size", "16", "--nproc", "2", "--timeout", "30",
        "--no-progress"]
TRAIN_SAMPLES = 320  # 80% of 400


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One data cache for the module (generation costs ~0.6 ms per sample)."""
    return tmp_path_factory.mktemp("mnist1d")


@pytest.fixture
def env(data_dir, monkeypatch):
    monkeypatch.setenv("GRADSYNC_DATA_DIR", str(data_dir))
    return {**os.environ, "GRADSYNC_DATA_DIR": str(data_dir)}


# --------------------------------------------------------------------------------------------------
# /proc helpers: only processes this test started are looked at (descendants of our own Popen)
# --------------------------------------------------------------------------------------------------

def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time in clock ticks) of ``pid``, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """``{pid: start time}`` of every live descendant of ``root``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry))
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            stat = _stat(child)
            if stat is not None and child not in found:
                found[child] = stat[2]
                todo.append(child)
    return found


def _alive(recorded: dict[int, int]) -> list[str]:
    """The recorded processes that still run (same pid and start time, not a zombie), with their cmdlines."""
    alive = []
    for pid, started in recorded.items():
        stat = _stat(pid)
        if stat is not None and stat[2] == started and stat[1] != "Z":
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
            except OSError:
                cmdline = "?"
            alive.append(f"pid {pid}: {cmdline}")
    return alive


def _ranks(recorded: dict[int, int]) -> list[int]:
    """The live worker processes among ``recorded``: the children of the launcher's forkserver."""
    forkservers = {pid for pid in recorded if "multiprocessing.forkserver" in _cmdline(pid)}
    return [pid for pid in forkservers if (_stat(pid) or (None,))[0] in forkservers]


def _holds_open(pid: int, path: Path) -> bool:
    """Whether ``pid`` has ``path`` open (a rank's environment is set after exec, so RANK is not in /proc)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path.resolve()):
                return True
        except OSError:
            pass
    return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _start(args: list[str], env: dict, tmp_path: Path) -> subprocess.Popen:
    """``python -m gradsync ARGS`` with stdout/stderr in files (no pipe to fill up)."""
    out, err = open(tmp_path / "stdout.txt", "w"), open(tmp_path / "stderr.txt", "w")
    try:
        return subprocess.Popen([sys.executable, "-m", "gradsync", *args], stdout=out, stderr=err, env=env,
                                start_new_session=True)
    finally:
        out.close()
        err.close()


def _watch(process: subprocess.Popen, deadline_s: float, recorded: dict[int, int], until=None) -> bool:
    """Record ``process``'s descendants every 50 ms until it exits, ``until()`` is true, or the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        recorded.update(_descendants(process.pid))
        if process.poll() is not None:
            return True
        if until is not None and until():
            return False
        time.sleep(0.05)
    return False


def _stop(process: subprocess.Popen, recorded: dict[int, int]) -> None:
    """Clean-up after a failed test: end the process and the descendants we recorded (ours only)."""
    for pid in [process.pid, *recorded]:
        stat = _stat(pid)
        if stat is not None and (pid == process.pid or recorded.get(pid) == stat[2]):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    process.wait(10)


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


# --------------------------------------------------------------------------------------------------
# async
# --------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(120)
def test_async_run_counts_every_update_and_leaves_no_process(tmp_path, env):
    """--mode async --max-staleness 1 --straggler 1:3 as a subprocess: summary counts agree, no process left."""
    run = tmp_path / "run"
    process = _start(["train", "--mode", "async", *TINY, "--max-staleness", "1", "--straggler", "1:3",
                      "--out", str(run)], env, tmp_path)
    recorded: dict[int, int] = {}
    try:
        assert _watch(process, 90, recorded), "the async run did not finish in 90 s"
    finally:
        if process.poll() is None:
            _stop(process, recorded)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 0, stderr
    assert len(recorded) >= 3, f"expected 2 workers + 1 server among the descendants, saw {recorded}"
    deadline = time.monotonic() + 2.0  # children exit with their parent; allow the kernel a moment
    while _alive(recorded) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(recorded), f"processes outlived gradsync train: {_alive(recorded)}"

    summary = _summary(run)
    steps = 1 * (TRAIN_SAMPLES // 16)
    assert summary["mode"] == "async" and summary["train_samples"] == TRAIN_SAMPLES
    assert summary["num_workers"] == 2 and summary["world_size"] == 3 and summary["server_rank"] == 2
    assert summary["updates_applied"] == summary["gradients_pushed"] == steps == summary["steps"]
    assert sum(summary["gradients_pushed_per_worker"]) == steps
    assert summary["updates_applied_per_worker"] == summary["gradients_pushed_per_worker"]
    assert len(summary["gradients_pushed_per_worker"]) == 2
    assert summary["max_staleness"] == 1 and summary["staleness_max"] <= 1
    assert summary["staleness_lr"] is True  # the default
    histogram = summary["staleness_histogram"]
    assert sum(histogram) == steps and len(histogram) == summary["staleness_max"] + 1
    assert summary["staleness_mean"] == pytest.approx(sum(s * n for s, n in enumerate(histogram)) / steps)
    assert summary["straggler_sleep_s"][0] == 0 and summary["straggler_sleep_s"][1] > 0
    assert 0 <= summary["final_test_accuracy"] <= 1 and math.isfinite(summary["final_test_loss"])
    assert summary["samples"] == steps * 16
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step_records = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in step_records] == list(range(1, steps + 1))
    assert all(r["staleness"] <= 1 and r["worker"] in (0, 1) for r in step_records)
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(120)
def test_killed_worker_gives_a_clear_error_within_the_timeout(tmp_path, env):
    """SIGKILL a worker of a running async job: non-zero exit within --timeout + 15 s, naming it."""
    timeout_s = 10
    run = tmp_path / "run"
    process = _start(["train", "--mode", "async", "--nproc", "2", "--num-samples", "400", "--epochs", "400",
                      "--batch-size", "16", "--timeout", str(timeout_s), "--no-progress", "--straggler", "1:3",
                      "--out", str(run)], env, tmp_path)
    recorded: dict[int, int] = {}

    def training() -> bool:  # the server has applied some gradients
        metrics = run / "metrics.jsonl"
        return metrics.exists() and metrics.stat().st_size > 2000

    try:
        finished = _watch(process, 60, recorded, until=training)
        assert not finished, f"the job ended before it could be killed: {(tmp_path / 'stderr.txt').read_text()}"
        assert training(), "the job did not start training within 60 s"
        recorded.update(_descendants(process.pid))
        # the elastic agent's ranks (forked by its forkserver); the server (rank 2) holds metrics.jsonl open
        ranks = _ranks(recorded)
        assert len(ranks) == 3, {pid: _cmdline(pid) for pid in recorded}
        servers = [pid for pid in ranks if _holds_open(pid, run / "metrics.jsonl")]
        assert len(servers) == 1, servers
        victims = [pid for pid in ranks if pid not in servers]
        os.kill(victims[0], signal.SIGKILL)
        killed_at = time.monotonic()
        assert _watch(process, timeout_s + 15, recorded), f"no exit within {timeout_s + 15} s of the kill"
        elapsed = time.monotonic() - killed_at
    finally:
        if process.poll() is None:
            _stop(process, recorded)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert process.returncode not in (0, None), stderr
    assert elapsed < timeout_s + 15
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("gradsync train: error:")]
    assert len(errors) == 1, stderr
    # a worker (rank 0 or 1, not the server) is named, and the cause: it was killed, not a Python error.
    # (The multiprocessing resource tracker may add a "leaked semaphore" warning: the kill left one behind.)
    assert re.search(r"worker rank [01]\b", errors[0]), stderr
    assert any(needle in errors[0] for needle in ("exit code", "killed", "SIGKILL")), stderr
    deadline = time.monotonic() + 5.0
    while _alive(recorded) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(recorded), f"processes outlived the failed job: {_alive(recorded)}"


@pytest.mark.timeout(120)
def test_killed_launcher_takes_its_workers_with_it(tmp_path, env):
    """SIGKILL to ``gradsync train`` itself (no agent left to stop anyone): every worker is gone within 10 s."""
    process = _start(["train", "--nproc", "2", "--num-samples", "400", "--epochs", "100", "--no-progress",
                      "--out", str(tmp_path / "run")], env, tmp_path)
    recorded: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 60
        while len(_ranks(recorded)) < 2 and process.poll() is None and time.monotonic() < deadline:
            recorded.update(_descendants(process.pid))
            time.sleep(0.1)
        assert len(_ranks(recorded)) == 2, {pid: _cmdline(pid) for pid in recorded}
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        deadline = time.monotonic() + 10
        while _alive(recorded) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(recorded), f"processes outlived their killed launcher: {_alive(recorded)}"
    finally:
        if process.poll() is None:
            _stop(process, recorded)


# --------------------------------------------------------------------------------------------------
# local SGD against sync
# --------------------------------------------------------------------------------------------------

def _rank_train_summary(options: dict, data_dir: str, out_dir: str) -> dict | None:
    """One rank of a ``gradsync train`` job run in a test world: the trainer's summary (rank 0) or None."""
    from gradsync.train.loop import Trainer

    return Trainer(TrainConfig(**options), Path(data_dir), Path(out_dir)).run()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_local_sgd_every_step_matches_sync(tmp_path, data_dir):
    """mode local-sgd with sync_every 1 and mode sync, both SGD + momentum, same seed: same final test loss.

    Both jobs are the trainer of ``gradsync train`` (the same options as ``--optimizer sgd --lr 0.05`` on
    400 samples, 1 epoch, batch 16, 2 workers) in a test world that starts in milliseconds; the CLI and
    launcher paths of the modes are run by the tests above and by ``bench modes`` below.
    """
    tiny = {"nproc": 2, "num_samples": 400, "epochs": 1, "batch_size": 16, "optimizer": "sgd", "lr": 0.05,
            "progress": False, "check_replicas_every": 4}
    data_path = str(data.prepare(Path(data_dir), tiny["num_samples"]))
    summaries = {}
    for mode, extra in (("sync", {}), ("local-sgd", {"sync_every": 1})):
        out = tmp_path / mode
        out.mkdir()
        summaries[mode] = run_world(2, _rank_train_summary, {**tiny, "mode": mode, **extra}, data_path, str(out),
                                    timeout_s=90)[0]
    sync, local = summaries["sync"], summaries["local-sgd"]
    assert sync["mode"] == "sync" and local["mode"] == "local-sgd"
    assert local["final_test_loss"] == pytest.approx(sync["final_test_loss"], rel=1e-5, abs=1e-6)
    assert local["final_test_accuracy"] == pytest.approx(sync["final_test_accuracy"], abs=1e-9)
    assert local["final_train_loss"] == pytest.approx(sync["final_train_loss"], rel=1e-5, abs=1e-6)
    assert sync["staleness_max"] == 0 and local["staleness_max"] == 0  # H - 1
    assert local["staleness_histogram"] == sync["staleness_histogram"]
    # 320 training samples / 2 workers / batch 16 = 10 steps: replicas compared at steps 4 and 8, equal;
    # sync compares the 8 parameters of the CNN and SGD's 8 momentum buffers, local SGD the parameters only
    for mode, tensors in (("sync", 16), ("local-sgd", 8)):
        records = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        checks = [record for record in records if record["kind"] == "replica_check"]
        assert [(c["step"], c["equal"], c["tensors"]) for c in checks] == [(4, True, tensors), (8, True, tensors)]


# --------------------------------------------------------------------------------------------------
# option errors
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needles", [
    (["--max-staleness", "2"], ["--max-staleness", "async"]),
    (["--max-staleness", "2", "--mode", "local-sgd"], ["--max-staleness", "async"]),
    (["--no-staleness-lr"], ["--no-staleness-lr", "async"]),
    (["--no-staleness-lr", "--mode", "local-sgd"], ["--no-staleness-lr", "async"]),
    (["--sync-every", "0"], ["--sync-every"]),
    (["--sync-every", "0", "--mode", "local-sgd"], ["--sync-every", "0"]),
    (["--sync-every", "3", "--mode", "async"], ["--sync-every", "local-sgd"]),
    (["--max-staleness", "-1", "--mode", "async"], ["--max-staleness", "-1"]),
    (["--max-staleness", "1.5", "--mode", "async"], ["--max-staleness", "1.5"]),
    (["--straggler", "9:3"], ["--straggler", "9"]),
    (["--straggler", "2:3", "--mode", "async"], ["--straggler", "2"]),  # rank 2 is the server, not a worker
    (["--straggler", "1:0.5"], ["--straggler", "1:0.5"]),
    (["--straggler", "1:inf"], ["--straggler"]),
    (["--straggler", "-1:2"], ["--straggler"]),
    (["--straggler", "abc"], ["--straggler", "abc"]),
    (["--straggler", "1"], ["--straggler"]),
    (["--mode", "bogus"], ["bogus", "async", "local-sgd"]),
    (["--compression", "fp16", "--mode", "async"], ["--compression", "sync"]),
    (["--compression", "fp16", "--mode", "local-sgd"], ["--compression", "sync"]),
    (["--trace", "trace.json", "--mode", "async"], ["--trace", "sync"]),
    (["--algorithm", "tree", "--mode", "async"], ["--algorithm", "async"]),
    (["--bucket-cap-mb", "5", "--mode", "local-sgd"], ["--bucket-cap-mb", "local-sgd"]),
    (["--mode", "async", "--batch-size", "500", "--num-samples", "400"], ["320 training samples", "500"]),
])
@pytest.mark.timeout(60)
def test_mode_options_rejected_with_one_line(args, needles, tmp_path, env, capsys):
    """Each bad combination: exit 2, one error line naming the option, no process started, no folder."""
    base = {"--nproc": "2", "--num-samples": "400"}
    argv = ["train", *args, "--out", str(tmp_path / "run")]
    for flag, value in base.items():
        if flag not in args:
            argv += [flag, value]
    result = _main(argv, capsys)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------------
# bench modes
# --------------------------------------------------------------------------------------------------

def test_bench_modes_parse_settings():
    """One async run per bound (none = unbounded, +lr = staleness-aware lr), one local-sgd run per H."""
    assert parse_settings("none,1", "2") == [
        {"mode": "sync"}, {"mode": "async", "max_staleness": None, "staleness_lr": False},
        {"mode": "async", "max_staleness": 1, "staleness_lr": False}, {"mode": "local-sgd", "sync_every": 2}]
    assert parse_settings("", "") == [{"mode": "sync"}]
    assert parse_settings(" 0 , none+lr ", "1, 16") == [
        {"mode": "sync"}, {"mode": "async", "max_staleness": 0, "staleness_lr": False},
        {"mode": "async", "max_staleness": None, "staleness_lr": True},
        {"mode": "local-sgd", "sync_every": 1}, {"mode": "local-sgd", "sync_every": 16}]


@pytest.mark.parametrize("args, needle", [
    (["--staleness-bounds", "x"], "--staleness-bounds"),
    (["--staleness-bounds", "-1"], "--staleness-bounds"),
    (["--staleness-bounds", "1,1"], "--staleness-bounds"),
    (["--staleness-bounds", "x+lr"], "--staleness-bounds"),
    (["--sync-every", "0"], "--sync-every"),
    (["--sync-every", "two"], "--sync-every"),
    (["--straggler-factor", "0.5"], "--straggler-factor"),
    (["--straggler-factor", "inf"], "--straggler-factor"),
    (["--nproc", "1"], "--nproc"),
    (["--nproc", "1", "--straggler-factor", "2"], "--nproc"),
    (["--epochs", "0"], "--epochs"),
    (["--target", "1.5"], "--target"),
    (["--repeat", "0"], "--repeat"),
])
@pytest.mark.timeout(60)
def test_bench_modes_rejects_bad_options(args, needle, tmp_path, capsys):
    """Exit 2 with one line naming the option, before any run (no JSON, no run folder)."""
    result = _main(["bench", "modes", *args, "--out", str(tmp_path / "out"), "--json", str(tmp_path / "r.json")],
                   capsys)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "r.json").exists()


BENCH_MODES = early_job("bench-modes", [
    "bench", "modes", "--nproc", "2", "--epochs", "1", "--num-samples", "400", "--staleness-bounds", "none",
    "--sync-every", "2", "--straggler-factor", "1", "--repeat", "1", "--out", "{folder}/bench", "--json",
    "{folder}/rows.json"],
    env={"GRADSYNC_DATA_DIR": "{folder}"})


@pytest.mark.dist
@pytest.mark.early_job(BENCH_MODES)
@pytest.mark.timeout(180)
def test_bench_modes_tiny_run_writes_rows(early):
    """sync, async (unbounded) and local SGD H=2 on 400 samples: one row each with the table's keys.

    (``--staleness-bounds none,1 --straggler-factor 2`` would be 8 runs, ~60 s on 2 cores; the bounded and
    straggler async paths are covered by the ``gradsync train`` tests above, the list parsing by
    ``test_bench_modes_parse_settings``.) The bench is an early job (``_early.py``): started with the
    session, waited for here.
    """
    result = early.wait(170)
    rows_path, out = early.folder / "rows.json", early.folder / "bench"
    assert result.returncode == 0, result.stderr
    rows = json.loads(rows_path.read_text())
    assert [(row["mode"], row["max_staleness"], row["sync_every"]) for row in rows] == [
        ("sync", None, None), ("async", None, None), ("local-sgd", None, 2)]
    keys = {"mode", "straggler", "samples_per_s", "seconds_to_85", "test_accuracy", "staleness_mean",
            "staleness_max"}
    for row in rows:
        assert keys <= set(row), row
        assert row["straggler"] == 1 and row["samples_per_s"] > 0 and 0 <= row["test_accuracy"] <= 1
        assert row["seconds_to_85"] is None or row["seconds_to_85"] > 0
        # default batch 32 per worker: sync and local SGD split each epoch among the workers, async does not
        per_step = 32 if row["mode"] == "async" else 32 * row["num_workers"]
        assert row["steps"] == TRAIN_SAMPLES // per_step
        assert len(row["accuracy_curve"]) == 1 and Path(row["run_folder"], "summary.json").exists()
    sync, asynchronous, local = rows
    assert sync["staleness_max"] == 0 and sync["staleness_mean"] == 0
    assert local["staleness_max"] == 1  # H - 1
    # a gradient at local step k (0 .. H-1) since the last average has staleness k: 0, 1, 0, 1, 0
    assert local["staleness_mean"] == pytest.approx(sum(k % 2 for k in range(local["steps"])) / local["steps"])
    assert (out / "modes_accuracy.png").stat().st_size > 0
    for row in rows:
        assert row["label"] in result.stdout
