"""``gradsync train`` under srun's variables across test hosts whose SLURM node names resolve only inside them.

Two test hosts carry the aliases ``node07`` and ``node11`` (each host's
``/etc/hosts``, not this machine's); every task runs in its host with the
variables srun would set for ``SLURM_NODELIST=node[07,11]``. Expected values
are a local ``gradsync train --nproc 2`` run of the same ``--deterministic``
job (bitwise equal at any world size). Skipped, with the reason, where
namespaces cannot be made (not root). Slow: each test starts 2 to 4 workers.
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

from gradsync.hosts import netns
from gradsync.hosts.netns import TestHosts, host_addr
from gradsync.hosts.torchrun import host_environment
from gradsync.train.preemption import PREEMPTED_EXIT_CODE

sys.path.insert(0, str(Path(__file__).parent))
from test_slurm import TRAIN, assert_models_equal, fake_scontrol, last_step, srun_env  # noqa: E402

pytest.importorskip("hostlist", reason="SLURM's node lists need gradsync[slurm] (python-hostlist)")
REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.slow]
NODES = {0: ["node07"], 1: ["node11"]}
NODELIST = "node[07,11]"


@pytest.fixture(scope="module")
def hosts():
    with TestHosts(2, aliases=NODES) as made:
        yield made


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """(data folder, model.pt) of the local ``--nproc 2`` run of the job."""
    folder = tmp_path_factory.mktemp("slurm-reference")
    done = subprocess.run([sys.executable, "-m", "gradsync", "train", *TRAIN, "--nproc", "2", "--data-dir",
                           str(folder / "data"), "--out", str(folder / "run")], capture_output=True, text=True,
                          timeout=120, env=_without_launchers(os.environ))
    assert done.returncode == 0, done.stderr[-2000:]
    return folder / "data", folder / "run" / "model.pt"


def _without_launchers(environ) -> dict:
    return {name: value for name, value in environ.items()
            if name not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
            and not name.startswith("SLURM_")}


def start_tasks(hosts: TestHosts, per_host: int, job_id: str, out: Path, data_dir: Path, bin_dir: Path,
                nodelist: str = NODELIST) -> list[subprocess.Popen]:
    """Task r on host r // per_host (srun's block placement), with the variables srun sets."""
    env = dict(_without_launchers(host_environment()), GRADSYNC_PREEMPTION_CHECK_S="1e-6",
               PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    tasks = 2 * per_host
    return [hosts.popen(rank // per_host, [sys.executable, "-m", "gradsync", "train", *TRAIN, "--data-dir",
                                           str(data_dir), "--out", str(out)],
                        env=dict(env, **srun_env(rank, tasks, nodelist, job_id, local_rank=rank % per_host)),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(tasks)]


def finish(processes, timeout_s: float = 80) -> list[tuple[int, str]]:
    found = []
    for process in processes:
        _, err = process.communicate(timeout=timeout_s)
        found.append((process.returncode, err))
    return found


def test_node_names_resolve_only_inside_the_hosts(hosts):
    """node07 / node11 are host 0 / host 1 inside every host; this machine does not know them."""
    for index in (0, 1):
        done = hosts.run(index, ["getent", "hosts", "node07", "node11"], timeout=30)
        assert done.stdout.split() == [host_addr(0), hosts.hostname(0), "node07",
                                       host_addr(1), hosts.hostname(1), "node11"], done.stdout
    with pytest.raises(OSError):
        socket.getaddrinfo("node07", 1)


@pytest.mark.timeout(120)
def test_train_across_hosts_equals_the_local_run(hosts, reference, tmp_path):
    """2 hosts x 2 tasks, SLURM_NODELIST=node[07,11]: the run's model.pt is bitwise the local run's."""
    data_dir, model = reference
    outcomes = finish(start_tasks(hosts, 2, "80001", tmp_path / "run", data_dir, tmp_path / "bin"))
    assert [code for code, _ in outcomes] == [0] * 4, outcomes[0][1][-2000:] + outcomes[-1][1][-2000:]
    assert_models_equal(tmp_path / "run" / "model.pt", model)


@pytest.mark.timeout(120)
def test_preempted_across_hosts_resumes_bitwise(hosts, reference, tmp_path):
    """2 hosts x 1 task: SIGUSR1 to every task mid-run -> checkpoint, scontrol requeue, exit 75; the rerun's
    model.pt is bitwise the uninterrupted local run's."""
    data_dir, model = reference
    log = fake_scontrol(tmp_path / "bin")
    run = tmp_path / "run"
    processes = start_tasks(hosts, 1, "80002", run, data_dir, tmp_path / "bin")
    deadline = time.monotonic() + 60
    while last_step(run / "metrics.jsonl") < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    for index in (0, 1):
        for pid in hosts.hosts[index].processes():
            if b"gradsync\x00train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGUSR1)
    outcomes = finish(processes)
    assert [code for code, _ in outcomes] == [PREEMPTED_EXIT_CODE] * 2, outcomes[0][1][-2000:]
    stopped = [line for line in outcomes[0][1].splitlines() if "preempted at step" in line]
    assert len(stopped) == 1 and "checkpoint saved, requeue to resume" in stopped[0], outcomes[0][1]
    assert log.read_text().splitlines() == ["requeue 80002"] and not (run / "model.pt").exists()
    outcomes = finish(start_tasks(hosts, 1, "80002", run, data_dir, tmp_path / "bin"))
    assert [code for code, _ in outcomes] == [0, 0], outcomes[0][1][-2000:]
    assert "resuming from" in outcomes[0][1]
    assert_models_equal(run / "model.pt", model)


@pytest.mark.timeout(60)
def test_unresolvable_rendezvous_node_is_one_line(hosts, tmp_path):
    """SLURM_NODELIST's first node (node99) resolves nowhere: the task exits at once with one line."""
    started = time.monotonic()
    outcomes = finish(start_tasks(hosts, 1, "80003", tmp_path / "run", tmp_path / "data", tmp_path / "bin",
                                  nodelist="node[99,11]"))
    for code, err in outcomes:
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("gradsync train: error: the rendezvous node node99:15003 (the first node of "
                              "SLURM_NODELIST) does not resolve"), err
    assert time.monotonic() - started < 30
