"""Worlds spread over test hosts (network, UTS, mount and PID namespaces on this machine).

Skipped, with the reason, where namespaces cannot be made (not root). One
pair of hosts is shared by the tests (``hosts`` fixture); ranks are started
inside them directly (``_hosts_worker.py``) except where torchrun itself is
under test. Expected values are closed forms (``_reference``) or a one-host
run of the same job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync.collectives import auto

from gradsync.hosts import netns
from gradsync.hosts.torchrun import HostsFailedError, host_environment, run_on_hosts
from gradsync.hosts.netns import TestHosts, host_addr

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(120)]
WORKER = str(Path(__file__).with_name("_hosts_worker.py"))
PORT = 29611


@pytest.fixture(scope="module")
def hosts():
    with TestHosts(2) as made:
        yield made


def start_world(hosts: TestHosts, placement: tuple[int, ...], scenario: str, timeout_s: float = 20):
    """Start one rank per entry of ``placement`` (its host), rank 0's host holding the store."""
    env = dict(host_environment(), MASTER_ADDR=host_addr(placement[0]), MASTER_PORT=str(PORT),
               WORLD_SIZE=str(len(placement)), GRADSYNC_TEST_TIMEOUT=str(timeout_s))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env["PYTHONPATH"]])
    return [hosts.popen(host, [sys.executable, WORKER, scenario], env=dict(env, RANK=str(rank)),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank, host in enumerate(placement)]


def results(processes, timeout_s: float = 90) -> list[dict]:
    found = []
    for process in processes:
        out, err = process.communicate(timeout=timeout_s)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert lines and "ready" not in lines[-1], f"rank exited with {process.returncode}: {err[-2000:]}"
        found.append(lines[-1])
    return found


def test_locality_shm_refusal_and_hierarchical_across_unequal_hosts(hosts):
    """Ranks 0, 2 on host 0 and rank 1 on host 1: locality is learnt from the hosts, shm is refused
    naming them, hierarchical gives the exact sum bitwise equal on every rank, auto picks the model's choice."""
    found = results(start_world(hosts, (0, 1, 0), "collectives"))
    assert [row["rank"] for row in found] == [0, 1, 2]
    assert all(row["hosts"] == [0, 1, 0] for row in found)
    assert found[0]["hostname"] != found[1]["hostname"] and found[0]["hostname"] == found[2]["hostname"]
    for row in found:
        assert "host 0: ranks [0, 2]; host 1: ranks [1]" in row["shm"], row["shm"]
    for key, (exact, _) in found[0]["hierarchical"].items():
        assert exact, key
        assert len({row["hierarchical"][key][1] for row in found}) == 1, key  # the same bytes everywhere
    model = auto.choose  # what the cost model picks for hosts of 2 and 1 ranks (test-hosts profile)
    assert found[0]["auto"] == {str(n): model(n, 3, 1, False, (2, 1)) for n in (1024, 2**20)}
    assert len({row["auto_digest"] for row in found}) == 1 and found[0]["auto_changed"]


@pytest.mark.parametrize("victim", [1, 0])
def test_killed_host_is_named_by_the_others(hosts, victim):
    """Every process on one host is killed (host 0 holds the store): the other host's rank raises
    naming the killed rank within the timeout + 2 s."""
    timeout_s = 3.0
    processes = start_world(hosts, (0, 1), "loop", timeout_s)
    survivor = 1 - victim
    assert json.loads(processes[survivor].stdout.readline())["ready"]
    hosts.kill_host(victim)
    found = results([processes[survivor]])[0]
    assert found["error"] == "CollectiveTimeoutError", found
    assert f"rank {victim}" in found["message"], found["message"]
    assert found["waited_s"] <= timeout_s + 2.0, found
    processes[victim].wait(timeout=10)


@pytest.mark.slow
def test_cut_link_is_named_on_both_sides(hosts):
    """Host 1's interface goes down: each side raises naming the other side's rank within timeout + 2 s."""
    timeout_s = 3.0
    processes = start_world(hosts, (0, 1), "loop", timeout_s)
    for process in processes:
        assert json.loads(process.stdout.readline())["ready"]
    hosts.set_link(1, up=False)
    try:
        found = results(processes)
    finally:
        hosts.set_link(1, up=True)
    for rank, row in enumerate(found):
        assert row["error"] == "CollectiveTimeoutError", row
        assert f"rank {1 - rank}" in row["message"], row["message"]
        assert row["waited_s"] <= timeout_s + 2.0, row


@pytest.mark.slow
def test_rendezvous_names_how_many_hosts_arrived(hosts, tmp_path):
    """Host 1's torchrun never starts: host 0's agent gives up after the join timeout and the error says
    1 of 2 hosts arrived."""
    started = time.monotonic()
    with pytest.raises(HostsFailedError, match=r"1 of 2 hosts arrived within the 4 s join timeout \(host 1 never"):
        run_on_hosts(2, 1, ["train", "--epochs", "1"], join_timeout_s=4, absent_hosts=(1,),
                     testhosts=hosts, log_dir=tmp_path, echo_host0=False, deadline_s=90)
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_a_host_whose_workers_hang_is_stopped_once_another_host_gave_up(hosts, tmp_path):
    """Host 1's worker hangs (no restarts): host 0's worker raises naming rank 1 and its agent exits, but
    host 1's agent would watch its frozen worker forever. The harness stops host 1 soon after and the
    error names both: host 0's timeout and host 1 stopped by the harness."""
    started = time.monotonic()
    with pytest.raises(HostsFailedError) as caught:
        run_on_hosts(2, 1, ["train", "--epochs", "1", "--num-samples", "1000", "--hang-at", "1:5", "--timeout",
                            "3", "--no-progress", "--out", str(tmp_path / "run")], join_timeout_s=20,
                     testhosts=hosts, log_dir=tmp_path / "logs", echo_host0=False, deadline_s=60,
                     stop_others_after_s=2)
    message = str(caught.value)
    assert "host 0 (198.18.0.1) failed:" in message and "peer rank 1" in message, message
    assert "host 1 (198.18.0.2) stopped by the harness" in message, message
    assert time.monotonic() - started < 50
    deadline = time.monotonic() + 5
    while hosts.hosts[1].processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in hosts.hosts[1].processes()}
    assert not left, f"host 1 still runs {left}"


def _train(args: list[str], out: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradsync", "train", *args, "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=timeout_s, env=host_environment())


@pytest.mark.slow
def test_train_across_hosts_survives_a_killed_host_bitwise(tmp_path):
    """2 hosts x 1 rank with ring (reduction order set by rank, not placement), host 1 killed at step 8
    and its agent restarted: model.pt is bitwise equal to the uninterrupted 2-rank run on one host."""
    import torch

    common = ["--epochs", "1", "--num-samples", "1000", "--algorithm", "ring", "--checkpoint-every", "5",
              "--max-restarts", "1", "--timeout", "3"]
    # the reference runs while the hosts' run waits on its rendezvous, detection and restart
    local = subprocess.Popen([sys.executable, "-m", "gradsync", "train", *common, "--nproc", "2", "--out",
                              str(tmp_path / "local"), "--no-progress"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=host_environment())
    try:
        across = _train([*common, "--hosts", "2", "--nproc", "1", "--kill-host-at", "1:8", "--join-timeout",
                         "40"], tmp_path / "hosts")
        _, local_stderr = local.communicate(timeout=240)
    finally:
        if local.poll() is None:
            local.kill()
            local.wait()
    assert local.returncode == 0, local_stderr[-3000:]
    assert across.returncode == 0, across.stderr[-3000:] + across.stdout[-3000:]
    summary = json.loads((tmp_path / "hosts" / "summary.json").read_text())
    assert summary["hosts"] == 2 and summary["world_size"] == 2
    a = torch.load(tmp_path / "local" / "model.pt")
    b = torch.load(tmp_path / "hosts" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "injected host loss" in (tmp_path / "hosts" / "hosts" / "host1.log").read_text()
    events = [json.loads(line) for line in (tmp_path / "hosts" / "events.jsonl").read_text().splitlines()]
    assert any(event.get("fault") == "kill-host" and event.get("step") == 8 for event in events), events
    assert any(event.get("event") == "resumed" and event.get("attempt") == 1 for event in events), events


@pytest.mark.slow
def test_nothing_left_after_the_harness_is_killed(tmp_path):
    """A harness killed with SIGKILL leaves no namespace holder, process, or interface behind."""
    before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    script = ("import time\nfrom gradsync.hosts.netns import TestHosts\nh = TestHosts(2)\nh.start()\n"
              "print([ns.pid for ns in [h.switch, *h.hosts]], flush=True)\ntime.sleep(600)\n")
    harness = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env=host_environment())
    pids = json.loads(harness.stdout.readline())
    assert all(netns._start_time(pid) for pid in pids)
    harness.send_signal(signal.SIGKILL)
    harness.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(netns._start_time(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(netns._start_time(pid) for pid in pids)
    assert not [pid for pid in netns._pids() if (netns._marker_of(pid) or "").split(":")[1:2] == [str(harness.pid)]]
    assert subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout == before
