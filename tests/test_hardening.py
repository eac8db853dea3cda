"""Issue 16 hardening: bounded waits on a frozen store host, loopback-only listeners, private run folders.

Process worlds (``run_world``) are kept few and small; every process a test
starts is ended by its PID.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import gradsync
from _dist import run_world

FROZEN_TIMEOUT_S = 1.5  # the issue saw 95 s at 3 s; the bound is the same at any timeout


def _rank_freeze_rank0_then_all_reduce() -> tuple:
    """Rank 0 (which hosts the store) stops itself; rank 1's all_reduce must still end in timeout + 2 s."""
    pids = torch.zeros(2, dtype=torch.int64)
    pids[gradsync.rank()] = os.getpid()
    gradsync.all_reduce(pids)  # ranks learn each other's PID
    if gradsync.rank() == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    started = time.monotonic()
    try:
        gradsync.all_reduce(torch.ones(64), timeout=FROZEN_TIMEOUT_S)
        outcome = ("no error", "")
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        outcome = (type(exc).__name__, str(exc))
    elapsed_s = time.monotonic() - started
    os.kill(int(pids[0]), signal.SIGKILL)  # rank 0 is this test's own process
    return elapsed_s, outcome


@pytest.mark.timeout(60)
def test_frozen_store_host_still_times_out_within_timeout_plus_2s():
    """Trigger: rank 0 (the store's host under MASTER_ADDR) SIGSTOPs; before: rank 1 blocked ~95 s at 3 s."""
    results = run_world(2, _rank_freeze_rank0_then_all_reduce, timeout_s=40,
                        collective_timeout_s=FROZEN_TIMEOUT_S, may_exit=[0])
    elapsed_s, (kind, message) = results[1]
    assert kind == "CollectiveTimeoutError", (kind, message)
    assert "rank 1 of 2" in message and "peer rank 0" in message, message
    assert "the rendezvous store did not answer either" in message, message
    assert elapsed_s <= FROZEN_TIMEOUT_S + 2 + 0.5, f"rank 1 waited {elapsed_s:.1f} s: {message}"


# ---------------------------------------------------------------- item 10: loopback-only listeners

EXPOSED_HOSTS = ("*", "0.0.0.0", "[::]", "::")


def listeners_of(pids) -> list[tuple[str, int]]:
    """``(local address, pid)`` of every TCP listener (``ss -ltnpH``) owned by one of ``pids``."""
    import re
    import subprocess

    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                found.append((fields[3], pid))
    return found


def exposed(listeners) -> list:
    return [(address, pid) for address, pid in listeners if address.rsplit(":", 1)[0] in EXPOSED_HOSTS]


def _rank_listeners() -> list | None:
    """Rank 0 lists the TCP listeners of every rank of the job while all of them are in the group."""
    pids = torch.zeros(gradsync.world_size(), dtype=torch.int64)
    pids[gradsync.rank()] = os.getpid()
    gradsync.all_reduce(pids)
    found = listeners_of(set(pids.tolist())) if gradsync.rank() == 0 else None
    gradsync.all_reduce(torch.ones(1))  # nobody leaves before rank 0 looked
    return found


@pytest.mark.timeout(60)
def test_init_over_loopback_listens_on_loopback_only():
    """Trigger: gradsync.init with MASTER_ADDR=127.0.0.1; before: the TCPStore listened on *:<port>."""
    listeners = run_world(2, _rank_listeners, timeout_s=40)[0]
    assert listeners, "found no listener at all (ss not showing the job's processes?)"
    assert not exposed(listeners), f"listeners on every interface: {listeners}"


def entry_listeners(launcher_pid: int) -> list | None:
    """A ``launch_local`` worker: rank 0 lists the listeners of the launcher and of every worker."""
    gradsync.init(backend="gloo", timeout=20)
    try:
        return _rank_listeners_of({launcher_pid})
    finally:
        gradsync.shutdown()


def _rank_listeners_of(extra: set) -> list | None:
    pids = torch.zeros(gradsync.world_size(), dtype=torch.int64)
    pids[gradsync.rank()] = os.getpid()
    gradsync.all_reduce(pids)
    found = listeners_of(set(pids.tolist()) | extra) if gradsync.rank() == 0 else None
    gradsync.all_reduce(torch.ones(1))  # nobody leaves before rank 0 looked
    return found


@pytest.mark.timeout(90)
def test_launcher_listens_on_loopback_only():
    """Trigger: the ``gradsync train`` launcher (elastic agent); before: its stores listened on *:<port>."""
    from gradsync.launch import launch_local

    listeners = launch_local(2, entry_listeners, os.getpid())[0]
    assert any(pid == os.getpid() for _, pid in listeners), f"the launcher's store is not among {listeners}"
    assert not exposed(listeners), f"listeners on every interface: {listeners}"


def _rank_out_of_step_calls(mode: str = "kinds") -> list:
    """Rank 1 runs one extra buffer-sized broadcast where rank 0 runs a bucket-sized all_reduce
    (an extra grad-enabled forward on one rank), both unverified as DataParallel's are; then both
    make the same call."""
    outcomes = []
    gradsync.all_reduce(torch.zeros(1), algorithm="native")  # both ranks start their 1 s timeouts together
    try:
        comm = gradsync.process_group.default_communicator()
        if mode == "sizes":  # the same collective, unverified, of other sizes or algorithms
            numel, algorithm = (128, "ring") if gradsync.rank() == 0 else (64, "tree")
            gradsync.collectives.all_reduce(torch.ones(numel), comm, algorithm=algorithm, verify=False,
                                            timeout=1.0)
        elif gradsync.rank() == 0:
            gradsync.collectives.all_reduce(torch.ones(1000), gradsync.process_group.default_communicator(),
                                            verify=False, timeout=1.0)
        else:
            gradsync.collectives.broadcast(torch.ones(3), gradsync.process_group.default_communicator(),
                                           verify=False, timeout=1.0)
        outcomes.append("no error")
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        outcomes.append(type(exc).__name__)
        outcomes.append(str(exc))
    time.sleep(2.0)  # rank 0 hosts the store, and a rank that leaves closes its connection: stay until
    # the peer's diagnosis has read the store, even on a loaded machine
    return outcomes


@pytest.mark.timeout(60)
def test_ranks_in_different_collectives_time_out_instead_of_pairing_messages():
    """Trigger (issue 16 trial): one extra grad-enabled forward on one rank made its buffer broadcast
    meet the peer's bucket AllReduce; Gloo aborted the process (SIGABRT, "12 vs 8 ... size doesn't
    match"). Each call's messages now carry its ordinal and kind as their tag: no rank pairs them,
    both raise CollectiveTimeoutError within their timeout, naming where each rank is."""
    results = run_world(2, _rank_out_of_step_calls, timeout_s=40)
    assert [result[0] for result in results] == ["CollectiveTimeoutError"] * 2, results
    assert "out of step: this rank is in all_reduce #" in results[0][1], results[0][1]
    assert "rank 1 in broadcast #" in results[0][1], results[0][1]
    assert "rank 0 in all_reduce #" in results[1][1], results[1][1]


@pytest.mark.timeout(60)
def test_ranks_in_one_collective_of_other_sizes_time_out_instead_of_aborting():
    """Trigger (issue 16, second trial): unverified all_reduce of 128 elements (ring) on rank 0 and 64
    (tree) on rank 1: Gloo aborted the process ("256 vs 128"). The payload tag also carries the
    resolved algorithm and layout: both time out, naming what each rank is in."""
    results = run_world(2, _rank_out_of_step_calls, "sizes", timeout_s=40)
    assert [result[0] for result in results] == ["CollectiveTimeoutError"] * 2, results
    assert "(ring, 128 x float32), rank 1 in all_reduce #" in results[0][1], results[0][1]
    assert "(tree, 64 x float32)" in results[0][1], results[0][1]
