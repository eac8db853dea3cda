"""SLURM: srun's variables read by ``gradsync.init()`` and ``gradsync train``, preemption, requeue.

Fast: the variables' parsing against python-hostlist and Lightning's own
``SLURMEnvironment`` (its port and first-node rules), refusals in one line,
the requeue command (a fake ``scontrol`` on PATH), the preemption handler,
an unreachable rendezvous, and two loopback tasks joining through SLURM's
variables. Slow: ``gradsync train`` as two loopback tasks preempted and
requeued (bitwise equal to an uninterrupted local run with
``--deterministic``) and across test hosts whose node names (``node07``)
resolve only inside them (``test_slurm_hosts.py``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gradsync
from gradsync import process_group, slurm
from gradsync.errors import CollectiveTimeoutError
from gradsync.jobs.job import check_options, placement
from gradsync.train.config import TrainConfig
from gradsync.train.preemption import PREEMPTED_EXIT_CODE, Preemption

sys.path.insert(0, str(Path(__file__).parent))
from _cli import run_cli  # noqa: E402

pytest.importorskip("hostlist", reason="SLURM's node lists need gradsync[slurm] (python-hostlist)")

LAUNCHER = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
            "SLURM_JOB_NAME", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", *slurm.VARIABLES)


def srun_env(rank: int, tasks: int, nodelist: str, job_id: str, local_rank: int | None = None) -> dict:
    """The variables srun sets for task ``rank`` of ``tasks`` (block placement)."""
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(tasks),
            "SLURM_LOCALID": str(rank if local_rank is None else local_rank), "SLURM_NODELIST": nodelist,
            "SLURM_JOB_ID": job_id}


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variable of torchrun's or SLURM's (each test sets its own); restored afterwards."""
    for name in LAUNCHER:
        monkeypatch.setenv(name, "x")  # recorded, so that what a test (or Lightning) sets is undone
        monkeypatch.delenv(name)
    return monkeypatch


def set_env(monkeypatch, variables: dict) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def free_job_id() -> str:
    """A job id whose SLURM port (last four digits + 15000) is free on loopback now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if slurm.PORT_BASE <= port < slurm.PORT_BASE + 10000:
            return f"7{port - slurm.PORT_BASE:04d}"
    for port in range(21000, 24999, 37):  # ephemeral ports outside the range: probe the range itself
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return f"7{port - slurm.PORT_BASE:04d}"
    raise RuntimeError("no free port in SLURM's range")


# ---------------------------------------------------------------- the variables


@pytest.mark.parametrize("nodelist, nodes", [
    ("node[01-04,07]", ("node01", "node02", "node03", "node04", "node07")),
    ("a[1-2],b3", ("a1", "a2", "b3")),
    ("gpu-[009-011]", ("gpu-009", "gpu-010", "gpu-011")),
    ("localhost", ("localhost",)),
])
def test_nodelist_is_expanded_and_its_first_node_hosts_the_rendezvous(nodelist, nodes):
    """A compressed SLURM_NODELIST expands as python-hostlist does; the first node is MASTER_ADDR."""
    task = slurm.read(srun_env(2, 4, nodelist, "123456", local_rank=0))
    assert task.nodes == nodes and task.master_addr == nodes[0]
    assert (task.rank, task.world_size, task.local_rank, task.job_id) == (2, 4, 0, "123456")


@pytest.mark.parametrize("job_id", ["1", "42", "4242", "123456", "9999", "10000"])
@pytest.mark.parametrize("nodelist", ["node[01-04,07]", "a[1-2],b3", "host7"])
def test_port_and_address_are_lightnings(clean_env, job_id, nodelist):
    """Port and rendezvous node equal Lightning's SLURMEnvironment's for the same variables."""
    environments = pytest.importorskip("lightning.fabric.plugins.environments",
                                       reason="the reference is Lightning's SLURMEnvironment (gradsync[lightning])")
    variables = dict(srun_env(1, 4, nodelist, job_id), SLURM_NTASKS_PER_NODE="2")
    set_env(clean_env, variables)
    reference = environments.SLURMEnvironment(auto_requeue=False)
    expected = (reference.main_address, reference.main_port, reference.global_rank(), reference.world_size(),
                reference.local_rank())
    task = slurm.read(variables)
    assert (task.master_addr, task.master_port, task.rank, task.world_size, task.local_rank) == expected


def test_master_addr_and_port_take_precedence_as_in_lightning():
    """MASTER_ADDR / MASTER_PORT set beside SLURM's variables are the rendezvous."""
    task = slurm.read(dict(srun_env(0, 2, "node[1-2]", "4242"), MASTER_ADDR="10.1.2.3", MASTER_PORT="23456"))
    assert (task.master_addr, task.master_port) == ("10.1.2.3", 23456)
    assert slurm.read(srun_env(0, 2, "node[1-2]", "4242")).master_port == 19242  # 4242 + 15000


def test_torchrun_variables_win(clean_env):
    """With RANK and WORLD_SIZE set beside SLURM's, torchrun's variables are read (init and gradsync train)."""
    set_env(clean_env, srun_env(1, 4, "node[1-2]", "4242"))
    assert slurm.under_srun() and placement(TrainConfig()) == "slurm"
    set_env(clean_env, {"RANK": "0", "WORLD_SIZE": "1"})
    assert not slurm.under_srun() and placement(TrainConfig()) == "torchrun"
    clean_env.delenv("RANK")
    clean_env.delenv("WORLD_SIZE")
    set_env(clean_env, {"SLURM_JOB_NAME": "interactive"})  # Lightning's rule: a shell, not a launch
    assert not slurm.under_srun() and placement(TrainConfig()) == "local"


@pytest.mark.parametrize("missing", [("SLURM_JOB_ID",), ("SLURM_PROCID", "SLURM_LOCALID")])
def test_a_missing_variable_is_named_in_one_line(clean_env, missing, tmp_path, capsys):
    """Some SLURM variables set, others not: init() and gradsync train raise one line naming the missing ones."""
    variables = srun_env(0, 2, "node[1-2]", "4242")
    set_env(clean_env, {name: value for name, value in variables.items() if name not in missing})
    with pytest.raises(ValueError) as caught:
        gradsync.init(timeout=5)
    message = str(caught.value)
    assert "\n" not in message and all(name in message for name in missing), message
    assert not any(name in message.split("not set")[0] for name in set(slurm.VARIABLES) - set(missing))
    assert not gradsync.is_initialized()
    done = run_cli(["train", "--out", str(tmp_path / "run")], capsys)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and all(name in lines[0] for name in missing), done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("variables, fragment", [
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 must be in [0, SLURM_NTASKS=4)"),
    ({"SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' is not an integer"),
    ({"SLURM_NODELIST": "node[1-"}, "SLURM_NODELIST='node[1-' is not a SLURM host list"),
    ({"SLURM_JOB_ID": "12ab"}, "SLURM_JOB_ID='12ab' is not a SLURM job id"),
])
def test_malformed_variables_are_refused_in_one_line(variables, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        slurm.read({**srun_env(0, 4, "node[1-2]", "4242"), **variables})


# ---------------------------------------------------------------- gradsync train's options under srun


@pytest.mark.parametrize("fields, given, fragment", [
    ({"nproc": 3}, {"nproc"}, "--nproc 3 disagrees with SLURM_NTASKS=4: under srun each task is one worker"),
    ({"hosts": 2}, set(), "--hosts is not honoured with --mode sync under srun"),
    ({"max_restarts": 1}, set(), "--max-restarts is not honoured with --mode sync under srun"),
    ({"elastic": True}, set(), "--elastic starts its own launcher per worker: under srun"),
    ({"mode": "async"}, set(), "under srun, --mode sync or local-sgd"),
    ({"memory_limit_mib": 512}, set(), "--memory-limit-mib is not honoured with --mode sync under srun"),
])
def test_options_gradsync_cannot_honour_under_srun_are_refused(clean_env, fields, given, fragment):
    set_env(clean_env, srun_env(0, 4, "node[1-2]", "4242"))
    with pytest.raises(ValueError) as caught:
        check_options(TrainConfig(**fields), "slurm", given)
    assert str(caught.value).startswith(fragment) and "\n" not in str(caught.value), str(caught.value)


def test_nproc_equal_to_the_tasks_is_accepted(clean_env):
    set_env(clean_env, srun_env(0, 4, "node[1-2]", "4242"))
    check_options(TrainConfig(nproc=4), "slurm", {"nproc"})


# ---------------------------------------------------------------- requeue and preemption


def fake_scontrol(folder: Path, exit_code: int = 0) -> Path:
    """An ``scontrol`` that appends its arguments to ``<folder>/scontrol.log``; returns the log's path."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "scontrol.log"
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexit {exit_code}\n', encoding="utf-8")
    script.chmod(0o755)
    return log


def test_requeue_runs_scontrol_as_lightning(clean_env, tmp_path):
    """``scontrol requeue <job>`` (array jobs: ``<array job>_<task>``); without scontrol it says so."""
    log = fake_scontrol(tmp_path / "bin")
    clean_env.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert slurm.requeue({"SLURM_JOB_ID": "31337"}) == "requeued SLURM job 31337 (scontrol requeue 31337)"
    slurm.requeue({"SLURM_JOB_ID": "31338", "SLURM_ARRAY_JOB_ID": "500", "SLURM_ARRAY_TASK_ID": "3"})
    assert log.read_text().splitlines() == ["requeue 31337", "requeue 500_3"]
    clean_env.setenv("PATH", str(tmp_path / "empty"))
    assert slurm.requeue({"SLURM_JOB_ID": "31337"}).startswith("scontrol is not on PATH: requeue job 31337")
    with pytest.raises(ValueError, match="not digits"):
        slurm.requeue({"SLURM_JOB_ID": "1; rm -rf /"})


def test_preemption_flag_is_agreed_and_handlers_restored(single_process):
    """SIGUSR1 to this rank: the next agreement says stop; without a signal the old handlers come back."""
    before = signal.getsignal(signal.SIGUSR1)
    with Preemption(interval_s=1e-9) as preemption:
        assert signal.getsignal(signal.SIGUSR1) == preemption._handle
        assert not preemption.requested(1)
    assert signal.getsignal(signal.SIGUSR1) == before
    with Preemption(interval_s=1e-9) as preemption:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while preemption.received is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert preemption.requested(2) and preemption.stop(2).step == 2
        assert str(preemption.stop(2)).startswith("preempted at step 2: checkpoint saved, requeue to resume")
    assert signal.getsignal(signal.SIGUSR1) == preemption._handle  # going down: a second notice is ignored
    signal.signal(signal.SIGUSR1, before)


def test_agreements_come_every_interval_not_every_step(single_process, monkeypatch):
    """Rank 0 spaces the agreements to ``interval_s`` of steps at the measured pace: 1 ms steps and 50 ms
    -> step 1 (no pace yet), then every 50 steps from step 2 (a fake clock: no timing in the test)."""
    from gradsync.train import preemption as module

    clock = {"now": 0.0}
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock["now"])
    preemption = Preemption(interval_s=0.05)
    agreed = []
    for step in range(1, 301):
        clock["now"] = step * 0.001
        checks = preemption.checks
        preemption.requested(step)
        if preemption.checks > checks:
            agreed.append(step)
    assert agreed == [1, 2, 52, 102, 152, 202, 252], agreed


# ---------------------------------------------------------------- joining through SLURM's variables


def test_unresolvable_rendezvous_node_is_one_line(clean_env):
    """The first node of SLURM_NODELIST does not resolve: one line naming node and port, at once."""
    set_env(clean_env, srun_env(1, 2, "no-such-node-gs[7-8]", "4242"))
    started = time.monotonic()
    with pytest.raises(ValueError) as caught:
        gradsync.init(timeout=5)
    assert str(caught.value).startswith("the rendezvous node no-such-node-gs7:19242 (the first node of "
                                        "SLURM_NODELIST) does not resolve")
    assert time.monotonic() - started < 10


def test_nobody_listening_is_one_line_within_the_startup_timeout(clean_env):
    """Task 1 of 2 and nobody hosts the store: CollectiveTimeoutError naming host:port within the start-up timeout."""
    job_id = free_job_id()
    set_env(clean_env, srun_env(1, 2, "localhost", job_id))
    clean_env.setattr(process_group, "MIN_STARTUP_TIMEOUT_S", 1.0)
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as caught:
        gradsync.init(timeout=1)
    message = str(caught.value)
    assert f"could not reach the rendezvous store at localhost:{slurm.port_of(job_id)} within 1 s" in message
    assert "\n" not in message and time.monotonic() - started < 1 + 5
    gradsync.shutdown()


_JOIN = ("import json, torch, gradsync; gradsync.init(timeout=30); t = torch.tensor([gradsync.rank() + 1.0]); "
         "gradsync.all_reduce(t); print(json.dumps([gradsync.rank(), gradsync.world_size(), t.item()])); "
         "gradsync.shutdown()")


def test_two_tasks_join_through_slurm_variables_on_loopback(clean_env):
    """Two processes with only srun's variables (nodelist ``localhost``) form one group: ranks, size, a sum."""
    job_id = free_job_id()
    processes = [subprocess.Popen([sys.executable, "-c", _JOIN], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=dict(os.environ, **srun_env(rank, 2, "localhost", job_id)))
                 for rank in range(2)]
    found = []
    for process in processes:
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err[-2000:]
        found.append(json.loads(out.strip().splitlines()[-1]))
    assert found == [[0, 2, 3.0], [1, 2, 3.0]]


# ---------------------------------------------------------------- gradsync train under srun (slow)

TRAIN = ["--model", "mlp", "--epochs", "2", "--num-samples", "3000", "--global-batch-size", "32", "--deterministic",
         "--lr-schedule", "constant", "--no-progress", "--timeout", "30"]


def start_tasks(tasks: int, job_id: str, cwd: Path, data_dir: Path, path_dir: Path) -> list[subprocess.Popen]:
    env = dict(os.environ, PATH=f"{path_dir}{os.pathsep}{os.environ['PATH']}", GRADSYNC_PREEMPTION_CHECK_S="1e-6")
    return [subprocess.Popen([sys.executable, "-m", "gradsync", "train", *TRAIN, "--data-dir", str(data_dir)],
                             cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(env, **srun_env(rank, tasks, "localhost", job_id)))
            for rank in range(tasks)]


def last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if '"kind": "step"' in line]
    return steps[-1] if steps else 0


def assert_models_equal(path: Path, reference: Path) -> None:
    mine, theirs = torch.load(path), torch.load(reference)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_train_preempted_and_requeued_resumes_bitwise(clean_env, tmp_path):
    """Two loopback tasks: SIGUSR1 to both mid-run -> one line, scontrol requeue, exit 75; the rerun of the
    same job id resumes and its model.pt is bitwise the local ``--nproc 2`` run's."""
    from gradsync.cli import main

    job_id, data_dir = free_job_id(), tmp_path / "data"
    assert main(["train", *TRAIN, "--nproc", "2", "--data-dir", str(data_dir), "--out", str(tmp_path / "local")]) == 0
    log = fake_scontrol(tmp_path / "bin")
    run = tmp_path / "runs" / f"slurm-{job_id}"
    processes = start_tasks(2, job_id, tmp_path, data_dir, tmp_path / "bin")
    deadline = time.monotonic() + 60
    while last_step(run / "metrics.jsonl") < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    for process in processes:
        process.send_signal(signal.SIGUSR1)
    outcomes = [process.communicate(timeout=60) for process in processes]
    assert [process.returncode for process in processes] == [PREEMPTED_EXIT_CODE] * 2, outcomes[0][1][-2000:]
    stopped = [line for line in outcomes[0][1].splitlines() if "preempted at step" in line]
    assert len(stopped) == 1 and "checkpoint saved, requeue to resume" in stopped[0], outcomes[0][1]
    step = int(stopped[0].split("preempted at step ")[1].split(":")[0])
    assert 20 <= step < 150 and last_step(run / "metrics.jsonl") == step  # 2 epochs of 2400 // 32 steps
    assert not any("preempted" in line for line in outcomes[1][1].splitlines())
    assert log.read_text().splitlines() == [f"requeue {job_id}"]
    assert (run / "checkpoints" / f"step-{step:09d}").is_dir() and not (run / "model.pt").exists()
    processes = start_tasks(2, job_id, tmp_path, data_dir, tmp_path / "bin")
    outcomes = [process.communicate(timeout=60) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outcomes[0][1][-2000:]
    assert f"resuming from {run.resolve() / 'checkpoints'}" in outcomes[0][1], outcomes[0][1]
    assert_models_equal(run / "model.pt", tmp_path / "local" / "model.pt")


def test_test_host_aliases_go_into_the_hosts_file_only():
    """``TestHosts(aliases=...)`` names host h also ``node07`` in the hosts' /etc/hosts; bad aliases are refused."""
    from gradsync.hosts.netns import TestHosts, host_addr

    made = TestHosts(2, aliases={0: ["node07"], 1: ["node11", "gpu-a.cluster"]}, run_id="t")
    lines = made.etc_hosts().splitlines()
    assert f"{host_addr(0)} gs-t-h0 node07" in lines and f"{host_addr(1)} gs-t-h1 node11 gpu-a.cluster" in lines
    for aliases in ({2: ["node07"]}, {0: ["bad name"]}):
        with pytest.raises(ValueError, match="aliases"):
            TestHosts(2, aliases=aliases)
