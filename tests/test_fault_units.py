"""Fault tolerance in-process: the hang detector, resumable state, and the checks made before any worker starts.

No worker processes: the hang detector runs on threads over a shared
``torch.distributed.HashStore`` and over :class:`ThreadWorld` communicators;
option errors go through ``gradsync.cli.main`` in this process (``_main``),
which must refuse them before launching anything.
"""

from __future__ import annotations

import hashlib
import io
import os
import json
import random
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import gradsync
from _dist import capture_error
from gradsync import collectives
from gradsync.collectives import Communicator
from gradsync.errors import CollectiveTimeoutError
from gradsync.fault.hang import HangDetector
from gradsync.train.config import TrainConfig
from gradsync.train.metrics import MetricsLog, read_metrics, resumed_text
from gradsync.train.resume import check_compatible, config_fields, rng_state, set_rng_state
from gradsync.transport.thread import ThreadWorld
from test_cli import _assert_one_line_error, _main

GRACE_S = 0.5  # the detectors' wait for the other ranks' reports in these tests (seconds)


def _on_threads(world_size: int, fn, timeout_s: float = 20.0) -> list:
    """Run ``fn(rank)`` on one thread per rank; return the results (an exception is returned, not raised)."""
    results: list = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    assert not hung, f"thread ranks {hung} still running after {timeout_s} s"
    return results


# ---------------------------------------------------------------- HangDetector over a shared store


@pytest.mark.timeout(20)
@pytest.mark.parametrize("world_size, silent", [(2, 0), (3, 1), (4, 3)])
def test_hang_detector_names_the_rank_that_never_reported(world_size, silent):
    """Every rank that reports sees exactly the silent rank, after about the grace period."""
    store = dist.HashStore()

    def report(rank):
        if rank == silent:
            return None
        started = time.monotonic()
        found = HangDetector(store, rank, world_size, grace_s=GRACE_S).silent_ranks()
        return found, time.monotonic() - started

    for rank, outcome in enumerate(_on_threads(world_size, report)):
        if rank == silent:
            continue
        found, elapsed_s = outcome
        assert found == [silent], f"rank {rank}: {found}"
        assert GRACE_S - 0.05 <= elapsed_s <= GRACE_S + 1.0, f"rank {rank} took {elapsed_s:.2f} s"


@pytest.mark.timeout(20)
def test_hang_detector_empty_when_every_rank_reports():
    """When all ranks report (a network stall, not one rank), nobody is blamed and nobody waits the grace out."""
    world_size, grace_s = 4, 5.0
    store = dist.HashStore()

    def report(rank):
        time.sleep(0.05 * rank)  # ranks time out at slightly different moments
        started = time.monotonic()
        return HangDetector(store, rank, world_size, grace_s=grace_s).silent_ranks(), time.monotonic() - started

    for rank, (found, elapsed_s) in enumerate(_on_threads(world_size, report)):
        assert found == [], f"rank {rank}: {found}"
        assert elapsed_s < grace_s / 2, f"rank {rank} waited {elapsed_s:.2f} s although everyone reported"


class _BrokenStore:
    """A store whose every operation fails (the rendezvous server is gone)."""

    def set(self, key, value):
        raise RuntimeError("store is gone")

    def check(self, keys):
        raise RuntimeError("store is gone")


class _BreaksOnCheck:
    """A store that accepts the report but fails when asked about the others."""

    def __init__(self):
        self.store = dist.HashStore()

    def set(self, key, value):
        self.store.set(key, value)

    def check(self, keys):
        raise RuntimeError("connection reset")


@pytest.mark.parametrize("store", [_BrokenStore(), _BreaksOnCheck()], ids=["set_fails", "check_fails"])
def test_hang_detector_broken_store_gives_none(store):
    """A store that cannot be used means nothing is known: None, not an exception and not an empty list."""
    assert HangDetector(store, 0, 3, grace_s=GRACE_S).silent_ranks() is None


@pytest.mark.parametrize("grace_s", [0.0, -1.0])
def test_hang_detector_rejects_non_positive_grace(grace_s):
    with pytest.raises(ValueError, match="grace_s"):
        HangDetector(dist.HashStore(), 0, 2, grace_s=grace_s)


# ---------------------------------------------------------------- a ring all_reduce with a silent rank

COLLECTIVE_TIMEOUT_S = 0.5


def _ring_with_silent_rank(world_size: int, silent: int, *, detector: bool, verify: bool) -> list:
    """Every rank but ``silent`` calls a ring all_reduce; returns ``(exception, seconds)`` per rank."""
    world, store = ThreadWorld(world_size), dist.HashStore()
    comms = [Communicator(world.transport(rank), timeout_s=COLLECTIVE_TIMEOUT_S,
                          hang_detector=HangDetector(store, rank, world_size, grace_s=GRACE_S) if detector else None)
             for rank in range(world_size)]

    def call(rank):
        if rank == silent:
            return None, 0.0
        started = time.monotonic()
        try:
            collectives.all_reduce(torch.ones(1000), comms[rank], algorithm="ring", verify=verify)
        except CollectiveTimeoutError as exc:
            return exc, time.monotonic() - started
        return None, time.monotonic() - started

    return _on_threads(world_size, call)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("verify", [False, True], ids=["ring_only", "with_layout_check"])
@pytest.mark.parametrize("world_size, silent", [(3, 1), (4, 0)])
def test_ring_timeout_with_detector_names_the_silent_rank_on_every_rank(world_size, silent, verify):
    """With a hang detector every other rank's CollectiveTimeoutError names the rank that never called."""
    outcomes = _ring_with_silent_rank(world_size, silent, detector=True, verify=verify)
    for rank, (exc, elapsed_s) in enumerate(outcomes):
        if rank == silent:
            continue
        assert isinstance(exc, CollectiveTimeoutError), f"rank {rank}: {exc!r}"
        assert exc.rank == rank and exc.peer == silent, f"rank {rank}: {exc}"
        assert f"peer rank {silent} stopped responding" in str(exc), str(exc)
        assert exc.timed_out
        assert elapsed_s <= COLLECTIVE_TIMEOUT_S + GRACE_S + 2, f"rank {rank} took {elapsed_s:.2f} s"


def _gone_pid() -> int:
    """The PID of a process that ran and was reaped (gone from this machine)."""
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait(10)
    return child.pid


@pytest.mark.timeout(30)
def test_ring_timeout_names_a_silent_rank_whose_process_is_gone_as_dead():
    """Trigger (issue 16): a killed peer was reported as "never reached this call" when the wait timed out
    (a zero-copy barrier, or a connection a child process kept open). Its process is gone: say it died."""
    world_size, silent = 3, 1
    world, store = ThreadWorld(world_size), dist.HashStore()
    comms = [Communicator(world.transport(rank), timeout_s=COLLECTIVE_TIMEOUT_S,
                          hang_detector=HangDetector(store, rank, world_size, grace_s=GRACE_S))
             for rank in range(world_size)]
    boot_id = open("/proc/sys/kernel/random/boot_id", encoding="ascii").read().strip()
    machine = f"{boot_id}/{os.stat('/proc/self/ns/pid').st_ino}"  # this machine and PID namespace
    store.set(f"proc/{silent}", f"{machine} {_gone_pid()}")  # as if rank 1 were another process, now killed

    def call(rank):
        if rank != silent:
            return capture_error(lambda: collectives.all_reduce(torch.ones(100), comms[rank], algorithm="ring"))

    for rank, exc in enumerate(_on_threads(world_size, call)):
        if rank != silent:
            assert isinstance(exc, CollectiveTimeoutError) and exc.peer == silent, f"rank {rank}: {exc!r}"
            assert f"peer rank {silent} died (its process is gone)" in str(exc), str(exc)
            assert "never reached" not in str(exc)



@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size, silent", [(3, 1), (4, 1)])
def test_ring_timeout_without_detector_names_the_waited_for_neighbour(world_size, silent):
    """Without a detector (the old behaviour) each rank names its left neighbour, the peer it waited for."""
    outcomes = _ring_with_silent_rank(world_size, silent, detector=False, verify=False)
    for rank, (exc, elapsed_s) in enumerate(outcomes):
        if rank == silent:
            continue
        left = (rank - 1) % world_size
        assert isinstance(exc, CollectiveTimeoutError), f"rank {rank}: {exc!r}"
        assert exc.peer == left and f"peer rank {left}" in str(exc), f"rank {rank}: {exc}"
        assert "stopped responding" not in str(exc)
        assert elapsed_s <= COLLECTIVE_TIMEOUT_S + 2, f"rank {rank} took {elapsed_s:.2f} s"
    # the rank after the silent one is the only one whose neighbour really is the culprit
    assert sum(exc.peer == silent for exc, _ in outcomes if exc is not None) == 1


# ---------------------------------------------------------------- RNG state in a checkpoint


def _draw() -> tuple:
    """Numbers from each generator, including the cached second Gaussian of numpy's and python's pairs."""
    return (torch.rand(5).tolist(), torch.randn(3).tolist(), np.random.rand(4).tolist(),
            np.random.standard_normal(3).tolist(), random.random(), random.gauss(0.0, 1.0),
            random.randrange(10**9))


@pytest.mark.parametrize("through_file", [False, True], ids=["in_memory", "torch_save_load"])
def test_rng_state_round_trip_draws_the_same_numbers(through_file):
    """After set_rng_state, torch, numpy and python repeat the draws exactly, also after torch.save/load."""
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.standard_normal(1)  # leave numpy with a cached Gaussian (has_gauss = 1)
    random.gauss(0.0, 1.0)  # and python with gauss_next set
    state = rng_state()
    if through_file:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
    first = _draw()
    _draw()  # move every generator on
    set_rng_state(state)
    assert _draw() == first


# ---------------------------------------------------------------- metrics.jsonl on resume


def test_metrics_log_resumed_text_replaces_the_file(tmp_path):
    """A resumed log holds exactly the checkpoint's text plus what is written after, nothing of the failed attempt."""
    path = tmp_path / "metrics.jsonl"
    kept = [{"kind": "step", "step": 1}, {"kind": "step", "step": 2}]
    lost = [{"kind": "step", "step": 3}, {"kind": "step", "step": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept + lost))
    resumed_text = "".join(json.dumps(r) + "\n" for r in kept)
    log = MetricsLog(path, resumed_text=resumed_text)
    assert path.read_text() == resumed_text
    log.write({"kind": "step", "step": 3, "redone": True})
    log.close()
    records = read_metrics(path)
    assert records == kept + [{"kind": "step", "step": 3, "redone": True}]
    data = path.read_bytes()
    assert log.position() == {"path": str(path.resolve()), "nbytes": len(data),
                              "sha256": hashlib.sha256(data).hexdigest()}


def test_checkpointed_metrics_position_reads_the_prefix_back_from_the_run_folder(tmp_path):
    """A checkpoint keeps where metrics.jsonl ends (not its text, issue 16): the prefix is read back on resume,
    from the restarted run's own file or else the checkpointed run's; a changed file gives None."""
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in (1, 2):
        log.write({"kind": "step", "step": step})
    position = log.position()
    log.write({"kind": "step", "step": 3})  # written after the checkpoint: lost on resume
    log.close()
    kept = '{"kind": "step", "step": 1}\n{"kind": "step", "step": 2}\n'
    other = tmp_path / "other" / "metrics.jsonl"
    assert resumed_text(position, [path]) == kept
    assert resumed_text(position, [other]) == kept  # a new run folder: from the checkpointed run's file
    other.parent.mkdir()
    other.write_text(kept.replace("2", "9"))
    path.write_text(kept.replace("1", "7"))
    assert resumed_text(position, [other]) is None


def test_metrics_log_empty_resumed_text_starts_empty(tmp_path):
    """resumed_text="" (no checkpoint yet) empties a file left by a failed first attempt."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "step", "step": 1}\n')
    log = MetricsLog(path, resumed_text="")
    log.close()
    assert path.read_text() == ""


# ---------------------------------------------------------------- DataParallel.bucket_layout


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))  # 4 parameters


@pytest.mark.parametrize("layout", [
    [[0, 1], [2]],            # index 3 missing
    [[0, 1], [2, 3], [3]],    # index 3 twice
    [[0, 1, 2, 3], []],       # an empty bucket
    [[0, 1], [2, 3, 4]],      # an index that is no parameter
])
def test_bucket_layout_setter_rejects_a_non_partition(single_process, layout):
    """A layout must split the parameter indices 0..n-1 into non-empty buckets, each index once."""
    model = gradsync.DataParallel(_mlp())
    with pytest.raises(ValueError, match="bucket layout"):
        model.bucket_layout = layout
    assert model.bucket_layout is None  # nothing was adopted


def test_bucket_layout_setter_adopts_a_partition_and_still_averages(single_process):
    """A valid layout is reported back and the model still trains (gradients unchanged in a world of one)."""
    reference, model = _mlp(), gradsync.DataParallel(_mlp())
    layout = [[3, 1], [0], [2]]
    model.bucket_layout = layout
    assert model.bucket_layout == layout
    x = torch.randn(5, 4)
    model(x).sum().backward()
    reference(x).sum().backward()
    for got, want in zip(model.module.parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad)
    assert model.bucket_layout == layout  # the first backward does not rebuild over it


# ---------------------------------------------------------------- check_compatible


def test_check_compatible_accepts_the_same_job():
    config = TrainConfig(nproc=2, lr=0.05, seed=3)
    check_compatible(config_fields(config), config, 2, 2, "ckpt/step-000000010")


def test_check_compatible_names_every_differing_option():
    saved = config_fields(TrainConfig(lr=0.05, seed=3))
    here = TrainConfig(lr=0.1, seed=4, timeout=7.0)  # --timeout does not change the trajectory
    with pytest.raises(ValueError) as info:
        check_compatible(saved, here, 2, 2, "ckpt/step-000000010")
    message = str(info.value)
    assert "ckpt/step-000000010 belongs to another job" in message
    assert "--lr 0.05 there, 0.1 here" in message and "--seed 3 there, 4 here" in message
    assert "--timeout" not in message and "\n" not in message


def test_check_compatible_accepts_another_world_size_but_not_another_option():
    """A checkpoint of 2 workers resumes at 3 (re-sharded); another --lr is still refused at any world size."""
    config = TrainConfig(nproc=3)
    check_compatible(config_fields(config), config, 3, 2, "ckpt/step-000000010")
    with pytest.raises(ValueError, match="--lr 0.05 there, 0.01 here"):
        check_compatible(config_fields(TrainConfig(lr=0.05)), config, 3, 2, "ckpt/step-000000010")


# ---------------------------------------------------------------- option errors before any worker starts

NUM_SAMPLES = 2000
SMALL = ["--nproc", "2", "--num-samples", str(NUM_SAMPLES), "--epochs", "2", "--batch-size", "32", "--no-progress"]


def _last_step(nproc: int, num_samples: int, batch_size: int, epochs: int) -> int:
    """Optimizer steps of a sync job: DistributedSampler pads the 80% training split to equal shares."""
    num_train = num_samples * 8 // 10
    per_rank = -(-num_train // nproc)
    return per_rank // batch_size * epochs


@pytest.fixture
def run_train(tmp_path, capsys, monkeypatch):
    """``gradsync train SMALL + args`` in this process; returns the result and the would-be run folder."""
    monkeypatch.setenv("GRADSYNC_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "run"

    def run(*args: str):
        return _main(["train", *SMALL, *args, "--out", str(out)], capsys), out
    return run


def _assert_nothing_started(out, tmp_path) -> None:
    assert not out.exists(), "no run folder may be left behind"
    assert not (tmp_path / "data").exists(), "the data is prepared only after the options are checked"


@pytest.mark.parametrize("args, needles", [
    (["--checkpoint-every", "0", "--max-restarts", "1"], ["--checkpoint-every", "0"]),
    (["--max-restarts", "-1"], ["--max-restarts", "-1"]),
    (["--keep-checkpoints", "0", "--max-restarts", "1"], ["--keep-checkpoints", "0"]),
    (["--fail-at", "x"], ["--fail-at", "RANK:STEP", "'x'"]),
    (["--fail-at", "1"], ["--fail-at", "RANK:STEP", "'1'"]),
    (["--fail-at=-1:3"], ["--fail-at", "-1:3", "RANK must be >= 0"]),
    (["--fail-at", "1:0"], ["--fail-at", "1:0", "STEP >= 1"]),
    (["--fail-at", "1:x"], ["--fail-at", "RANK:STEP"]),
    (["--hang-at", "1"], ["--hang-at", "RANK:STEP"]),
    (["--fail-at", "2:5"], ["--fail-at rank 2", "ranks 0..1"]),
    (["--hang-at", "5:5"], ["--hang-at rank 5", "ranks 0..1"]),
    (["--checkpoint-every", "5"], ["--checkpoint-every", "--checkpoint-dir"]),
    (["--keep-checkpoints", "3"], ["--keep-checkpoints", "--checkpoint-dir"]),
    (["--checkpoint-dir", ""], ["--checkpoint-dir", "empty"]),
])
def test_fault_options_rejected_with_one_line_before_any_worker(run_train, tmp_path, args, needles):
    """Each bad fault-tolerance option is one error line naming it, exit 2, and nothing is started or written."""
    result, out = run_train(*args)
    assert result.returncode == 2, result.stderr
    _assert_one_line_error(result, *needles)
    _assert_nothing_started(out, tmp_path)


@pytest.mark.parametrize("flag", ["--fail-at", "--hang-at"])
def test_fault_step_after_the_last_step_is_rejected(run_train, tmp_path, flag):
    """A fault planned after the job's last optimizer step could never fire: refused, naming the last step."""
    last = _last_step(2, NUM_SAMPLES, 32, 2)
    result, out = run_train(flag, f"1:{last + 1}")
    assert result.returncode == 2, result.stderr
    _assert_one_line_error(result, flag, f"step {last + 1}", f"last step {last}")
    _assert_nothing_started(out, tmp_path)


@pytest.mark.parametrize("args", [
    ["--checkpoint-dir", "CKPT"],
    ["--max-restarts", "1"],
    ["--fail-at", "0:3"],
    ["--hang-at", "0:3"],
])
def test_checkpoint_and_fault_options_rejected_in_async_mode(run_train, tmp_path, args):
    """The parameter server does not checkpoint: restart, checkpoint and fault options refuse --mode async."""
    args = [str(tmp_path / "ckpt") if a == "CKPT" else a for a in args]
    result, out = run_train("--mode", "async", *args)
    assert result.returncode == 2, result.stderr
    _assert_one_line_error(result, args[0], "--mode sync and local-sgd")
    _assert_nothing_started(out, tmp_path)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("below_a_file", ["ckpt", "deeper/ckpt"])
def test_unwritable_checkpoint_dir_is_one_line_exit_2(run_train, tmp_path, below_a_file):
    """A --checkpoint-dir that cannot be created (its parent is a regular file) is refused before any worker."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file")
    folder = blocker / below_a_file
    result, out = run_train("--max-restarts", "1", "--checkpoint-dir", str(folder))
    assert result.returncode == 2, result.stderr
    _assert_one_line_error(result, "--checkpoint-dir", str(folder), "not a writable folder")
    _assert_nothing_started(out, tmp_path)
    assert blocker.read_text() == "a regular file"



# ---------------------------------------------------------------- run folders across torchrun restarts

def test_torchrun_out_dir_is_named_after_the_run_id(monkeypatch):
    from gradsync.jobs.job import torchrun_out_dir

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a-b1")
    assert torchrun_out_dir() == os.path.join("runs", "torchrun-3f2a-b1")
    for placeholder in ("none", "", "../x"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", placeholder)
        assert torchrun_out_dir() is None


def test_claim_out_dir_reuse_takes_over_a_claimed_folder_and_refuses_files(tmp_path):
    from gradsync.jobs.job import claim_out_dir

    folder, created = claim_out_dir(str(tmp_path / "run"))
    assert created
    with pytest.raises(ValueError, match="already holds a run"):
        claim_out_dir(str(folder))
    assert claim_out_dir(str(folder), reuse=True) == (folder, False)  # a restarted attempt continues it
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        claim_out_dir(str(tmp_path / "file"))


@pytest.mark.parametrize("value", ["abc", "-1", "1.5"])
def test_malformed_fault_attempts_variable_is_an_error_before_any_worker(value, monkeypatch):
    from gradsync.fault.injection import ATTEMPTS_ENV, check_environment

    monkeypatch.setenv(ATTEMPTS_ENV, value)
    with pytest.raises(ValueError, match=ATTEMPTS_ENV):
        check_environment()


def test_a_fault_already_recorded_by_this_rank_is_not_injected_again(tmp_path, monkeypatch):
    """Under test hosts a host's agent replaced by a re-rendezvous keeps restart count 0: the faults a rank
    recorded in the run folder count as attempts, so --hang-at fires once, not on every new round."""
    from gradsync.fault.events import EventLog
    from gradsync.fault.injection import FaultPlan

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.delenv("GRADSYNC_FAULT_ATTEMPTS", raising=False)
    events = EventLog(tmp_path)
    assert FaultPlan(1, None, (1, 5), events).hang_step == 5
    events.write({"event": "fault", "fault": "hang", "rank": 1, "step": 5, "attempt": 0})
    assert FaultPlan(1, None, (1, 5), events).hang_step is None
    assert FaultPlan(0, (0, 3), None, events).fail_step == 3  # another rank's record does not count
    monkeypatch.setenv("GRADSYNC_FAULT_ATTEMPTS", "2")  # tests that exhaust restarts: the first 2 attempts
    assert FaultPlan(1, None, (1, 5), events).hang_step == 5
