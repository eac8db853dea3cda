"""SLURM start-up faults: a port in use or a duplicate SLURM_PROCID, a job id that is not one, srun's
default checkpoint folder, and a preemption signal that comes while a task is still starting.

Fast: each refusal is one line, checked in this process (no worker starts). Slow: ``gradsync train`` as
two loopback tasks, one signalled during its imports, stops at step 1 with a checkpoint and a requeue.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import HashStore

import gradsync
from gradsync import process_group, slurm
from gradsync.train.config import TrainConfig
from gradsync.train.preemption import PREEMPTED_EXIT_CODE, Preemption

sys.path.insert(0, str(Path(__file__).parent))
from _cli import run_cli  # noqa: E402
from test_slurm import (TRAIN, clean_env, fake_scontrol, free_job_id, last_step, set_env,  # noqa: E402,F401
                        srun_env)

pytest.importorskip("hostlist", reason="SLURM's node lists need gradsync[slurm] (python-hostlist)")


def test_a_port_in_use_is_one_line_naming_the_port_and_the_likely_causes(clean_env):
    """Task 0 cannot host the store (another task of the same SLURM_PROCID, or another job, holds the
    job's port): one line naming host:port, where the port came from, and what to do."""
    job_id = free_job_id()
    port = slurm.port_of(job_id)
    set_env(clean_env, srun_env(0, 2, "localhost", job_id))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        with pytest.raises(OSError) as caught:
            gradsync.init(timeout=1)
    message = str(caught.value)
    assert f"localhost:{port}" in message and f"SLURM_JOB_ID={job_id}" in message, message
    assert "SLURM_PROCID=0" in message and "MASTER_PORT" in message and "\n" not in message, message
    assert not gradsync.is_initialized()


def test_a_second_task_of_the_same_rank_is_refused_at_check_in():
    """Two tasks claim rank 1: the second to check in fails at once in one line (no start-up timeout)."""
    store = HashStore()
    store.add("joined/1", 1)  # the first task of rank 1 checked in
    started = time.monotonic()
    with pytest.raises(ValueError) as caught:
        process_group._wait_for_every_rank(store, 1, 2, 30.0)
    message = str(caught.value)
    assert "rank 1" in message and "SLURM_PROCID" in message and "\n" not in message, message
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("job_id", ["../../pwn1234", "abc1234", "12_34", ""])
def test_a_job_id_that_is_not_digits_is_refused(job_id):
    with pytest.raises(ValueError, match=f"SLURM_JOB_ID={job_id!r} is not a SLURM job id"):
        slurm.read(srun_env(0, 2, "node[1-2]", job_id))


def test_train_refuses_a_bad_job_id_before_anything_starts(clean_env, tmp_path, capsys):
    """``runs/slurm-../../pwn1234`` would write outside runs/: refused in one line, nothing created."""
    set_env(clean_env, srun_env(0, 2, "localhost", "../../pwn1234"))
    clean_env.chdir(tmp_path)
    done = run_cli(["train", "--nproc", "3"], capsys)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "SLURM_JOB_ID='../../pwn1234'" in lines[0], done.stderr
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_every_applies_under_srun(clean_env, tmp_path, capsys):
    """srun's default --checkpoint-dir counts: --checkpoint-every passes the checks (the run then stops at
    the --nproc mismatch, so nothing starts)."""
    set_env(clean_env, srun_env(0, 2, "localhost", "4242"))
    clean_env.chdir(tmp_path)
    done = run_cli(["train", "--checkpoint-every", "50", "--nproc", "3"], capsys)
    assert done.returncode == 2 and "--nproc 3 disagrees with SLURM_NTASKS=2" in done.stderr, done.stderr
    config = TrainConfig(checkpoint_every=50)
    from gradsync.jobs.srun import fill_defaults

    fill_defaults(config)
    assert config.out == str(Path("runs") / "slurm-4242")
    assert config.checkpoint_dir == str(Path("runs") / "slurm-4242" / "checkpoints")


def test_a_signal_before_the_trainer_starts_is_remembered(clean_env, single_process):
    """Under srun, ``gradsync train`` catches SIGUSR1 from its first import; the trainer's Preemption takes it
    over and the first agreement says stop. Other commands and other launchers keep the default action."""
    before = {number: signal.getsignal(number) for number in (signal.SIGUSR1, signal.SIGTERM)}
    environ = srun_env(0, 2, "localhost", "4242")
    try:
        assert not slurm.catch_preemption_early(["-c", "train"], environ)
        assert not slurm.catch_preemption_early(["-m", "bench", "train"], environ)
        assert not slurm.catch_preemption_early(["-m", "train"], {**environ, "RANK": "0"})
        assert signal.getsignal(signal.SIGUSR1) == before[signal.SIGUSR1]
        assert slurm.catch_preemption_early(["/usr/bin/gradsync", "train"], environ)
        assert slurm.catch_preemption_early(["-m", "train", "--epochs", "1"], environ)
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while slurm.early_signal() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slurm.early_signal() == signal.SIGUSR1
        with Preemption(interval_s=1e-9) as preemption:
            assert preemption.received == signal.SIGUSR1 and preemption.requested(1)
            assert preemption.stop(1).signal_name == "SIGUSR1"
        assert slurm.early_signal() is None  # taken over once
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
        slurm.take_early_signal()


def _catches(pid: int, number: int) -> bool:
    """Whether process ``pid`` has a handler for signal ``number`` (``SigCgt`` in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (number - 1) & 1)


def _loaded_torch(pid: int) -> bool:
    """Whether process ``pid`` has mapped torch's libraries (its import began)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads SigCgt from /proc (Linux)")
def test_a_signal_during_start_up_stops_at_step_1_and_requeues(clean_env, tmp_path):
    """SIGUSR1 to task 1 as soon as it catches it or loads torch, before task 0 even starts (so during task
    1's imports): both tasks stop at step 1 with a checkpoint, task 0 requeues, both exit 75 (before: task 1
    died by SIGUSR1's default action, task 0 waited out its start-up timeout)."""
    job_id, log = free_job_id(), fake_scontrol(tmp_path / "bin")
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")

    def start(rank: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "gradsync", "train", *TRAIN, "--data-dir",
                                 str(tmp_path / "data")], cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=dict(env, **srun_env(rank, 2, "localhost",
                                                                                            job_id)))

    task1 = start(1)
    deadline = time.monotonic() + 20
    while not (_catches(task1.pid, signal.SIGUSR1) or _loaded_torch(task1.pid)) and time.monotonic() < deadline:
        time.sleep(0.002)  # whichever comes first: it catches the signal from its first import, before torch
    task1.send_signal(signal.SIGUSR1)
    processes = [start(0), task1]
    try:
        outcomes = [process.communicate(timeout=60) for process in processes]
    finally:
        for process in processes:
            process.kill()
    assert [process.returncode for process in processes] == [PREEMPTED_EXIT_CODE] * 2, outcomes[1][1][-2000:]
    assert "gradsync train: preempted at step 1: checkpoint saved" in outcomes[0][1], outcomes[0][1][-2000:]
    run = tmp_path / "runs" / f"slurm-{job_id}"
    assert last_step(run / "metrics.jsonl") == 1 and (run / "checkpoints" / f"step-{1:09d}").is_dir()
    assert log.read_text().splitlines() == [f"requeue {job_id}"]
