"""``algorithm="auto"`` on a repeated call: the algorithm it picked runs as an explicit call runs it.

Counted, not timed: once a message's pick is settled, a repeated ``auto`` call evaluates no cost model
(``auto.choose`` is not called) and runs the same functions as a call naming the picked algorithm (the
lean plan's round for a small message, the algorithm's own function for a large one); DataParallel's
``auto`` buckets likewise. The picks are kept per communicator and made again when the locality changes.
The bench runs ``auto`` on the shm row's shared memory, as a user's call does.
"""

from __future__ import annotations

import threading

import pytest
import torch

import gradsync
from _dist import run_threads
from gradsync.bench.allreduce import _row_communicators
from gradsync.collectives import (HierarchicalOptions, SegmentOptions, ShmState, auto, registry, shm_lean, shm_setup,
                                  validate)
from gradsync.collectives import ops as collectives_api
from gradsync.collectives.communicator import Communicator
from gradsync.transport.locality import Locality
from gradsync.transport.thread import ThreadWorld

WORLD_SIZE = 2
REPEATS = 4


@pytest.fixture
def events(monkeypatch):
    """(thread name, what ran) of every cost-model pick, lean round and algorithm function, in order."""
    log: list[tuple[str, str]] = []

    def recorded(what, function):
        def run(*args, **kwargs):
            log.append((threading.current_thread().name, what))
            return function(*args, **kwargs)
        return run

    monkeypatch.setattr(auto, "choose", recorded("choose", auto.choose))
    monkeypatch.setattr(shm_lean.LeanPlan, "run", recorded("lean round", shm_lean.LeanPlan.run))
    for name, function in list(registry.ALL_REDUCE.items()):
        monkeypatch.setitem(registry.ALL_REDUCE, name, recorded(name, function))
    return log


def _mine(log, start=0):
    me = threading.current_thread().name
    return [what for name, what in log[start:] if name == me]


def _calls(comm, tensor, algorithm, log):
    """What ``REPEATS`` calls of ``algorithm`` ran on this rank; each sums (rank + 1) over the ranks."""
    start = len(log)
    for _ in range(REPEATS):
        tensor.fill_(comm.rank + 1)
        collectives_api.all_reduce(tensor, comm, algorithm=algorithm, verify=False)
        assert torch.equal(tensor, torch.full_like(tensor, WORLD_SIZE * (WORLD_SIZE + 1) / 2)), algorithm
    return _mine(log, start)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numel,hosts", [(1024, None), (2**18, None), (2**14, (0, 1))],
                         ids=["lean-4KiB", "cells-1MiB", "across-hosts-64KiB"])
def test_repeated_auto_calls_run_the_picked_path_without_the_cost_model(events, numel, hosts):
    def rank_fn(comm):
        if hosts is not None:
            comm.locality = Locality(hosts)
        tensor = torch.zeros(numel)
        for _ in range(2):  # the first call may set the segment up, after which the pick is settled
            collectives_api.all_reduce(tensor, comm, algorithm="auto", verify=False)
        picked = validate.resolve_algorithm(comm, numel * 4, "auto")
        return picked, _calls(comm, tensor, "auto", events), _calls(comm, tensor, picked, events)

    for rank, (picked, by_auto, by_name) in enumerate(run_threads(WORLD_SIZE, rank_fn, timeout_s=40)):
        expected = "lean round" if numel * 4 <= 64 * 2**10 and picked == "shm" else picked
        assert (hosts is None) == (picked == "shm"), f"rank {rank}: picked {picked}"
        assert by_auto == [expected] * REPEATS, f"rank {rank}: auto ran {by_auto}"
        assert by_name == by_auto, f"rank {rank}: {picked!r} ran {by_name}, auto {by_auto}"


def test_a_pick_is_kept_once_settled_and_made_again_for_another_locality(events):
    """Unknown shm availability: no pick kept; settled: one pick per size; a new locality: picked again."""
    comm = Communicator(ThreadWorld(WORLD_SIZE).transport(0))
    assert comm.options(ShmState).available is None
    for _ in range(2):
        assert validate.resolve_algorithm(comm, 2**20, "auto") == "shm"  # shm assumed until known
    assert _mine(events).count("choose") == 2 and not comm.decisions
    comm.options(ShmState).available = True
    for nbytes in (2**20, 2**20, 2**12, 2**20, 2**12):
        validate.resolve_algorithm(comm, nbytes, "auto")
    assert _mine(events).count("choose") == 4  # 2 + one per size
    comm.locality = Locality((0, 1))
    assert validate.resolve_algorithm(comm, 2**20, "auto") != "shm"
    assert validate.resolve_algorithm(comm, 2**20, "auto") != "shm"
    assert _mine(events).count("choose") == 5
    assert validate.resolve_algorithm(comm, 2**20, "ring") == "ring" and _mine(events).count("choose") == 5


@pytest.mark.timeout(60)
def test_data_parallel_auto_buckets_pick_once(events):
    """After the first step, DataParallel's auto buckets reduce through shm (its own function, as an
    explicit "shm" bucket does) without a cost-model pick on any rank or thread."""
    from torch import nn

    inputs = [torch.full((4, 64), float(rank + 1)) for rank in range(WORLD_SIZE)]
    steps_done = threading.Barrier(WORLD_SIZE)
    window = []

    def rank_fn(comm):
        torch.manual_seed(0)
        model = gradsync.DataParallel(nn.Sequential(nn.Linear(64, 300), nn.Linear(300, 4)), algorithm="auto",
                                      group=comm, bucket_cap_mb=0.05)
        grads = []
        for step in range(3):
            if step == 1:
                if steps_done.wait() == 0:
                    window.append(len(events))  # every rank's first step is done (one rank notes where)
                steps_done.wait()  # and no rank starts its second step before the note (it once did)
            model.zero_grad()
            model(inputs[comm.rank]).sum().backward()
            grads.append(model.module[0].weight.grad.clone())
        if steps_done.wait() == 0:
            window.append(len(events))
        steps_done.wait()
        return grads, model.bucket_algorithms()

    per_rank = run_threads(WORLD_SIZE, rank_fn, timeout_s=40)
    later = [what for _, what in events[window[0]:window[1]]]
    buckets = per_rank[0][1]
    assert len(buckets) > 1 and all(name == "shm" for _, name in buckets), buckets
    each_step = ["lean round" if nbytes <= shm_setup.LEAN_MAX_BYTES else "shm" for nbytes, _ in buckets]
    assert sorted(later) == sorted(each_step * 2 * WORLD_SIZE), later  # 2 steps, no "choose"
    for rank, (grads, _) in enumerate(per_rank):
        for step, grad in enumerate(grads):
            torch.testing.assert_close(grad, per_rank[0][0][step], msg=f"rank {rank} step {step}")


def test_the_bench_runs_auto_on_the_shm_rows_shared_memory():
    """auto's row: the group itself without pretend nodes, else a communicator with its ShmState."""
    transport = ThreadWorld(4).transport(0)
    flat = Communicator(transport, options=[SegmentOptions(), HierarchicalOptions(ranks_per_node=4)])
    assert _row_communicators(flat, ["shm", "auto"])["auto"] is flat
    pretend = Communicator(transport, options=[SegmentOptions(4096), HierarchicalOptions(ranks_per_node=2)])
    row = _row_communicators(pretend, ["shm", "auto"])["auto"]
    assert row is not pretend and row.options(ShmState) is pretend.options(ShmState)
    assert row.options(SegmentOptions).segment_bytes == 4096
    assert row.options(HierarchicalOptions).ranks_per_node is None
