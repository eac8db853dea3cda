"""Asynchronous data parallelism: the parameter server, its workers and the staleness bound.

Most scenarios run the server and its workers as threads over
:class:`~gradsync.transport.thread.ThreadWorld` (milliseconds each); two run
in real Gloo processes (tagged messages and no lost update; a worker that
dies). The central checks:

* the gate: whatever order gradients arrive in, no applied gradient is staler
  than the bound and the server never deadlocks (a simulation of the server's
  bookkeeping driven by random push orders);
* no update is lost or applied twice: the gradient of step ``k`` is the
  one-hot ``e_k`` and plain SGD with lr 1 must leave every parameter at
  exactly -1, with pushes == applied == versions == total_steps;
* the bound holds under a straggler, and without a bound the straggler's
  gradients are visibly staler;
* async SGD on a strongly convex problem reaches the same optimum as sync
  SGD and as an independent full-batch solver.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import gradsync
from _dist import run_threads, run_world
from gradsync.collectives import Communicator
from gradsync.parallel.ps_protocol import check_layout
from gradsync.parallel.staleness import StalenessGate, StalenessStats
from gradsync.process_group import resolve_group
from gradsync.transport.base import PeerFailure
from gradsync.transport.thread import ThreadWorld

COLLECTIVE_TIMEOUT_S = 15.0


@pytest.fixture(autouse=True, scope="module")
def _warm_optimizer():
    """torch's first optimizer.step() in a process takes ~1 s (lazy imports): pay it before any timed test."""
    param = nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    torch.optim.SGD([param], lr=1.0).step()


class Vector(nn.Module):
    """One trainable vector of ``numel`` zeros."""

    def __init__(self, numel: int, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel, dtype=dtype))


def _one_hot(numel: int, index: int, dtype=torch.float32) -> torch.Tensor:
    grad = torch.zeros(numel, dtype=dtype)
    grad[index] = 1.0
    return grad


def _comm(world: ThreadWorld, rank: int, timeout_s: float = 10.0) -> Communicator:
    return Communicator(world.transport(rank), timeout_s=timeout_s)


# --------------------------------------------------------------------------------------------------
# StalenessGate / StalenessStats
# --------------------------------------------------------------------------------------------------

def _simulate_server(num_workers: int, bound: int | None, total_steps: int, rng: random.Random) -> list[int]:
    """Drive a StalenessGate exactly as ParameterServer does, with random arrival orders.

    Workers first contact the server in a random order; afterwards the next
    gradient to arrive is a random one of those in flight. A worker whose
    gradient arrived (or that just pulled) queues for parameters; the queue
    is answered oldest first while the gate allows. Returns the staleness of
    every applied gradient; fails on a deadlock (work left, nobody in flight,
    the queue's head refused).
    """
    gate = StalenessGate(bound)
    version = next_step = 0
    waiting: list[int] = []
    stopped: set[int] = set()
    not_contacted = list(range(num_workers))
    rng.shuffle(not_contacted)
    staleness: list[int] = []

    def answer():
        nonlocal next_step
        while waiting:
            worker = waiting[0]
            if next_step >= total_steps:
                stopped.add(worker)
            elif gate.may_start(version):
                gate.start(worker, version)
                next_step += 1
            else:
                return
            waiting.pop(0)

    while len(stopped) < num_workers:
        in_flight = list(gate.in_flight)
        choices = [("pull", w) for w in not_contacted[:1]] + [("push", w) for w in in_flight]
        assert choices, (f"deadlock: version {version}, step {next_step}/{total_steps}, waiting {waiting}, "
                         f"in flight {gate.in_flight}, bound {bound}")
        kind, worker = rng.choice(choices)
        if kind == "pull":
            not_contacted.pop(0)
        else:
            read = gate.finish(worker)
            staleness.append(version - read)
            version += 1
        waiting.append(worker)
        answer()
        assert bound is None or len(gate.in_flight) <= bound + 1
    assert version == total_steps and next_step == total_steps
    return staleness


@given(num_workers=st.integers(1, 7), bound=st.one_of(st.none(), st.integers(0, 6)),
       total_steps=st.integers(0, 60), seed=st.integers(0, 2**31))
def test_gate_bounds_staleness_for_any_arrival_order(num_workers, bound, total_steps, seed):
    """Random push orders: every applied gradient's staleness <= bound, every step applied, no deadlock."""
    staleness = _simulate_server(num_workers, bound, total_steps, random.Random(seed))
    assert len(staleness) == total_steps
    assert all(s >= 0 for s in staleness)
    if bound is not None:
        assert max(staleness, default=0) <= bound, (staleness, bound)


def test_gate_without_bound_lets_staleness_grow():
    """The same simulation without a bound reaches staleness above any small bound (the gate matters)."""
    worst = max(max(_simulate_server(6, None, 60, random.Random(seed)), default=0) for seed in range(20))
    assert worst > 6


def test_gate_zero_is_serial_and_counts_in_flight_workers():
    """max_staleness=0 admits one worker at a time; bound b admits at most b + 1 on the same version."""
    gate = StalenessGate(0)
    assert gate.may_start(0)
    gate.start(worker=1, version=0)
    assert not gate.may_start(0) and not gate.may_start(5)
    assert gate.finish(1) == 0
    assert gate.may_start(1)

    gate = StalenessGate(2)
    for worker in range(3):
        assert gate.may_start(0)
        gate.start(worker, 0)
    assert not gate.may_start(0)
    assert gate.finish(0) == 0
    # one applied (version 1): worker 1 and 2 still on version 0, a newcomer makes 1 + 2 others > 2
    assert not gate.may_start(1)
    with pytest.raises(ValueError, match="worker rank 1"):
        gate.start(1, 1)

    unbounded = StalenessGate(None)
    for worker in range(50):
        assert unbounded.may_start(1000)
        unbounded.start(worker, worker)


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, False, float("nan")])
def test_gate_rejects_bad_bound(bad):
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(bad)


def test_stats_histogram_mean_max():
    stats = StalenessStats()
    assert (stats.count, stats.max, stats.mean) == (0, 0, 0.0)
    assert stats.as_dict() == {"staleness_mean": 0.0, "staleness_max": 0, "staleness_histogram": []}
    for s in (0, 3, 3, 1):
        stats.record(s)
    stats.record(0, count=4)
    assert stats.histogram == [5, 1, 0, 2]
    assert stats.count == 8 and stats.max == 3
    assert stats.mean == pytest.approx((1 + 6) / 8)
    assert stats.as_dict() == {"staleness_mean": pytest.approx(7 / 8), "staleness_max": 3,
                               "staleness_histogram": [5, 1, 0, 2]}
    with pytest.raises(ValueError, match="staleness"):
        stats.record(-1)


# --------------------------------------------------------------------------------------------------
# Tagged messages
# --------------------------------------------------------------------------------------------------

def test_thread_transport_tagged_messages_match_on_peer_and_tag():
    """FIFO per (peer, tag); tags never cross; irecv_any takes whichever peer sent first."""
    world = ThreadWorld(3)
    t0, t1, t2 = (world.transport(r) for r in range(3))
    t1.isend_tagged(torch.tensor([10.0]), 0, tag=5)
    t1.isend_tagged(torch.tensor([11.0]), 0, tag=6)
    t1.isend_tagged(torch.tensor([12.0]), 0, tag=5)
    t2.isend_tagged(torch.tensor([20.0]), 0, tag=5)
    t1.isend(torch.tensor([99.0]), 0)  # untagged (collective) traffic stays apart
    out = torch.zeros(1)
    t0.irecv_tagged(out, 1, tag=6).wait(1.0)
    assert out.item() == 11.0
    t0.irecv_tagged(out, 2, tag=5).wait(1.0)
    assert out.item() == 20.0
    handle = t0.irecv_any(out, tag=5)
    handle.wait(1.0)
    assert (handle.source, out.item()) == (1, 10.0)
    t0.irecv_tagged(out, 1, tag=5).wait(1.0)
    assert out.item() == 12.0
    t0.irecv(out, 1).wait(1.0)
    assert out.item() == 99.0
    with pytest.raises(PeerFailure) as failure:
        t0.irecv_any(out, tag=5).wait(0.05)
    assert failure.value.timed_out and failure.value.peer == -1
    with pytest.raises(PeerFailure) as failure:
        t0.irecv_tagged(out, 2, tag=7).wait(0.05)
    assert failure.value.peer == 2


# --------------------------------------------------------------------------------------------------
# No update lost or applied twice (one-hot gradients)
# --------------------------------------------------------------------------------------------------

def _onehot_server(comm, total_steps: int, max_staleness=None, numel: int | None = None, **kwargs) -> dict:
    model = Vector(total_steps if numel is None else numel)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    server = gradsync.ParameterServer(model, optimizer, total_steps, group=comm, max_staleness=max_staleness,
                                      **kwargs)
    updates = []
    final = server.serve(on_update=lambda worker, version, loss, staleness: updates.append(
        (worker, version, loss, staleness)))
    assert list(final) == ["weight"] and torch.equal(final["weight"], model.weight.detach())
    final["weight"].add_(100.0)  # a copy: the module keeps its parameters
    assert not torch.equal(final["weight"], model.weight.detach())
    return {"params": model.weight.detach().clone(), "version": server.version,
            "applied": dict(server.applied_per_worker), "losses": list(server.losses),
            "histogram": list(server.staleness.histogram), "max": server.staleness.max, "updates": updates,
            "lr_after": optimizer.param_groups[0]["lr"]}


def _onehot_worker(comm, total_steps: int, server_rank: int, compute_s: float = 0.0,
                   before_pull=None, after_pull=None, timeout: float | None = None) -> dict:
    """Push e_step for every step handed out; check that the parameters received are consistent."""
    model = Vector(total_steps)
    worker = gradsync.AsyncWorker(model, group=comm, server_rank=server_rank, timeout=timeout)
    assert worker.step is None and worker.pushes == 0
    if before_pull is not None:
        before_pull()
    steps = []
    step = worker.pull()
    if after_pull is not None:
        after_pull()
    while step is not None:
        assert worker.step == step
        # version v means v one-hot updates applied: exactly v entries are -1, the rest 0
        weight = model.weight.detach()
        assert int((weight == -1).sum()) == worker.version and int((weight == 0).sum()) == total_steps - worker.version
        steps.append(step)
        model.weight.grad = _one_hot(total_steps, step)
        if compute_s:
            time.sleep(compute_s)
        step = worker.push(float(step))
        assert model.weight.grad is None
    assert worker.step is None
    # the stop carries the final parameters: every update applied
    assert worker.version == total_steps and torch.equal(model.weight.detach(), torch.full((total_steps,), -1.0))
    return {"steps": steps, "pushes": worker.pushes}


def _check_onehot(results: list[dict], server_rank: int, total_steps: int) -> dict:
    server = results[server_rank]
    workers = [r for r in range(len(results)) if r != server_rank]
    assert torch.equal(server["params"], torch.full((total_steps,), -1.0)), server["params"]
    pushes = {w: results[w]["pushes"] for w in workers}
    assert sum(pushes.values()) == server["version"] == total_steps == sum(server["applied"].values())
    assert server["applied"] == pushes
    steps = sorted(s for w in workers for s in results[w]["steps"])
    assert steps == list(range(total_steps))  # every step handed out exactly once
    assert sorted(server["losses"]) == [float(s) for s in range(total_steps)]
    assert sum(server["histogram"]) == total_steps
    assert [version for _, version, _, _ in server["updates"]] == list(range(1, total_steps + 1))
    return server


@pytest.mark.parametrize("max_staleness", [None, 0, 1, 3])
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.timeout(60)
def test_no_update_lost_or_applied_twice_threads(world_size, max_staleness):
    """Every step's one-hot gradient is applied exactly once: final parameters are exactly -1."""
    total_steps, server_rank = 37, world_size - 1

    def body(comm):
        if comm.rank == server_rank:
            return _onehot_server(comm, total_steps, max_staleness)
        return _onehot_worker(comm, total_steps, server_rank, compute_s=0.0005 * comm.rank)

    server = _check_onehot(run_threads(world_size, body, timeout_s=30), server_rank, total_steps)
    if max_staleness is not None:
        assert server["max"] <= max_staleness
    if world_size == 2:  # one worker: every gradient is fresh
        assert server["histogram"] == [total_steps]


@pytest.mark.timeout(30)
def test_server_rank_zero_and_explicit_workers_threads():
    """The server need not be the last rank; ``workers`` may leave a rank of the group out."""
    total_steps = 11

    def body(comm):
        if comm.rank == 0:
            return _onehot_server(comm, total_steps, workers=[1, 3])
        if comm.rank == 2:
            return {"steps": [], "pushes": 0}  # not a worker: never talks to the server
        return _onehot_worker(comm, total_steps, server_rank=0)

    results = run_threads(4, body, timeout_s=20)
    server = results[0]
    assert set(server["applied"]) == {1, 3}
    assert torch.equal(server["params"], torch.full((total_steps,), -1.0))
    assert results[1]["pushes"] + results[3]["pushes"] == server["version"] == total_steps


@pytest.mark.timeout(30)
def test_zero_total_steps_stops_every_worker_at_once():
    def body(comm):
        if comm.rank == 0:
            return _onehot_server(comm, 0, numel=3)
        model = Vector(3)
        with torch.no_grad():
            model.weight.fill_(7.0)
        worker = gradsync.AsyncWorker(model, group=comm, server_rank=0)
        first = worker.pull()
        assert worker.version == 0 and torch.equal(model.weight.detach(), torch.zeros(3))  # the server's
        with pytest.raises(RuntimeError, match="stop"):
            worker.push()
        return first, worker.pushes

    results = run_threads(3, body, timeout_s=20)
    assert results[0]["version"] == 0 and results[0]["applied"] == {1: 0, 2: 0}
    assert results[1:] == [(None, 0), (None, 0)]


def _rank_onehot_and_tagged(total_steps: int, server_rank: int) -> dict:
    """Gloo: a tagged-message round first (tags cross, receive from any source), then the one-hot run."""
    rank, world_size = gradsync.rank(), gradsync.world_size()
    transport = resolve_group(None).transport
    workers = [r for r in range(world_size) if r != server_rank]
    tagged = None
    if rank == server_rank:
        out = torch.zeros(2)
        by_tag6 = {}
        for worker in reversed(workers):  # tag 6 was sent second: matched on (peer, tag), not order
            transport.irecv_tagged(out, worker, 6).wait(10.0)
            by_tag6[worker] = out.tolist()
        sources = []
        for _ in workers:
            handle = transport.irecv_any(out, 5)
            handle.wait(10.0)
            assert out.tolist() == [float(handle.source), 5.0]
            sources.append(handle.source)
        tagged = {"tag6": by_tag6, "sources": sorted(sources)}
        result = _onehot_server(None, total_steps)
    else:
        handles = [transport.isend_tagged(torch.tensor([float(rank), 5.0]), server_rank, 5),
                   transport.isend_tagged(torch.tensor([float(rank), 6.0]), server_rank, 6)]
        for handle in handles:
            handle.wait(10.0)
        result = _onehot_worker(None, total_steps, server_rank, compute_s=0.001 * rank)
    result["tagged"] = tagged
    return result


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_no_update_lost_gloo_processes():
    """3 worker processes + 1 server process over Gloo: tagged messages match; every update applied once."""
    total_steps, server_rank = 41, 3
    results = run_world(4, _rank_onehot_and_tagged, total_steps, server_rank, timeout_s=60,
                        collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    _check_onehot(results, server_rank, total_steps)
    tagged = results[server_rank]["tagged"]
    assert tagged["sources"] == [0, 1, 2]
    assert tagged["tag6"] == {w: [float(w), 6.0] for w in (0, 1, 2)}


# --------------------------------------------------------------------------------------------------
# Staleness under a straggler
# --------------------------------------------------------------------------------------------------

STRAGGLER_S, FAST_S = 0.05, 0.001


def _run_with_straggler(max_staleness, total_steps: int = 40, num_workers: int = 4) -> dict:
    """Worker 0 sleeps STRAGGLER_S per gradient, the others FAST_S; worker 0 pulls first (version 0)."""
    server_rank = num_workers
    pulled = threading.Event()

    def body(comm):
        if comm.rank == server_rank:
            return _onehot_server(comm, total_steps, max_staleness)
        if comm.rank == 0:
            return _onehot_worker(comm, total_steps, server_rank, compute_s=STRAGGLER_S, after_pull=pulled.set)
        return _onehot_worker(comm, total_steps, server_rank, compute_s=FAST_S,
                              before_pull=lambda: pulled.wait(10.0))

    results = run_threads(num_workers + 1, body, timeout_s=40)
    server = _check_onehot(results, server_rank, total_steps)
    server["straggler_pushes"] = results[0]["pushes"]
    return server


@pytest.mark.timeout(60)
def test_staleness_bound_holds_under_a_straggler():
    """4 workers, one 50x slower: bounds 1, 2, 4 hold; unbounded, the straggler's gradients are staler."""
    unbounded = _run_with_straggler(None)
    # the straggler computed step 0 on version 0 while the fast workers applied many updates
    assert unbounded["max"] > 4, unbounded["histogram"]
    for bound in (1, 2, 4):
        bounded = _run_with_straggler(bound)
        assert bounded["max"] <= bound, (bound, bounded["histogram"])
        assert bounded["straggler_pushes"] >= 1
        stale_straggler = [s for worker, _, _, s in bounded["updates"] if worker == 0]
        assert max(stale_straggler) <= bound


@pytest.mark.timeout(30)
def test_max_staleness_zero_is_serial_sgd():
    """Bound 0: one worker computes at a time, every gradient is fresh, updates in step order."""
    server = _run_with_straggler(0, total_steps=20)
    assert server["histogram"] == [20]
    assert server["losses"] == [float(s) for s in range(20)]  # serial: step k is applied k-th


# --------------------------------------------------------------------------------------------------
# Convergence: async reaches the optimum of a strongly convex problem, as sync does
# --------------------------------------------------------------------------------------------------

FEATURES, SAMPLES, SHARDS, L2 = 6, 216, 6, 0.05
CONVEX_STEPS, ETA0, ETA_DECAY_STEPS = 600, 1.0, 20.0
# Distance allowed between the final SGD weights and the optimum (max abs, the optimum's entries are ~0.2-1.3).
# SGD with step eta on shard gradients stays within O(eta * G * (cycle + staleness)) of the optimum, G the
# largest shard gradient at the optimum (~0.16 here): eta_T ~ 0.032 gives ~0.005 * (6 + 3) ~ 0.05 as a
# crude bound; serial, sync and async runs measure 0.0015-0.0025. 0.01 is 4x the measurement and more than
# 100x below the distance of the starting point (0) from the optimum.
CONVEX_TOLERANCE = 0.01


def _convex_data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
    x[:, -1] = 1.0  # bias
    teacher = torch.randn(FEATURES, generator=generator, dtype=torch.float64)
    noise = 0.8 * torch.randn(SAMPLES, generator=generator, dtype=torch.float64)
    y = torch.where(x @ teacher + noise > 0, 1.0, -1.0).to(torch.float64)  # noisy: not separable
    return x, y, torch.arange(SAMPLES).reshape(SHARDS, -1)


def _convex_loss(w, x, y):
    """Logistic loss (labels +-1) + L2: strongly convex, so the optimum is unique."""
    return F.softplus(-y * (x @ w)).mean() + L2 / 2 * w.dot(w)


def _lr_factor(step: int) -> float:
    return ETA0 / (1 + step / ETA_DECAY_STEPS)


def _optimum() -> torch.Tensor:
    """Full-batch L-BFGS to machine precision, in one process, independent of gradsync."""
    x, y, _ = _convex_data()
    w = torch.zeros(FEATURES, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w], lr=1, max_iter=500, tolerance_grad=1e-14, tolerance_change=1e-16,
                                  line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = _convex_loss(w, x, y)
        loss.backward()
        return loss

    optimizer.step(closure)
    w = w.detach()
    gradient = torch.func.grad(lambda v: _convex_loss(v, x, y))(w)
    assert gradient.norm() < 1e-8, gradient.norm()
    return w


def _sgd_server(model, comm, total_steps, max_staleness):
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor)
    return gradsync.ParameterServer(model, optimizer, total_steps, group=comm, max_staleness=max_staleness,
                                    scheduler=scheduler)


def _async_convex(num_workers: int, max_staleness) -> tuple[torch.Tensor, dict]:
    x, y, shards = _convex_data()
    server_rank = num_workers

    def body(comm):
        model = Vector(FEATURES, torch.float64)
        if comm.rank == server_rank:
            server = _sgd_server(model, comm, CONVEX_STEPS, max_staleness)
            server.serve()
            return model.weight.detach().clone(), server.staleness.as_dict()
        worker = gradsync.AsyncWorker(model, group=comm, server_rank=server_rank)
        step = worker.pull()
        while step is not None:  # step k uses shard k % SHARDS, whoever computes it
            rows = shards[step % SHARDS]
            loss = _convex_loss(model.weight, x[rows], y[rows])
            loss.backward()
            step = worker.push(loss.item())
        return None

    return run_threads(num_workers + 1, body, timeout_s=60)[server_rank]


def _sync_convex(world_size: int) -> torch.Tensor:
    """The sync reference: DataParallel, each rank takes its part of shard k at step k."""
    x, y, shards = _convex_data()

    def body(comm):
        model = gradsync.DataParallel(Vector(FEATURES, torch.float64), group=comm)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor)
        for step in range(CONVEX_STEPS):
            rows = shards[step % SHARDS].tensor_split(world_size)[comm.rank]
            optimizer.zero_grad()
            _convex_loss(model.module.weight, x[rows], y[rows]).backward()
            model.module.weight.grad  # noqa: B018 - the hook has averaged it
            optimizer.step()
            scheduler.step()
        return model.module.weight.detach().clone()

    results = run_threads(world_size, body, timeout_s=60)
    assert all(torch.equal(r, results[0]) for r in results)
    return results[0]


@pytest.mark.timeout(90)
def test_async_logistic_regression_reaches_the_sync_optimum():
    """Async SGD (unbounded and bounded) and sync SGD end within CONVEX_TOLERANCE of the L-BFGS optimum."""
    optimum = _optimum()
    assert optimum.abs().max() > 100 * CONVEX_TOLERANCE  # the start (0) is far outside the tolerance
    sync = _sync_convex(3)
    assert (sync - optimum).abs().max() < CONVEX_TOLERANCE, (sync, optimum)
    for num_workers, bound in ((3, None), (4, 2)):
        weights, staleness = _async_convex(num_workers, bound)
        error = (weights - optimum).abs().max().item()
        assert error < CONVEX_TOLERANCE, (num_workers, bound, error, staleness)
        assert staleness["staleness_max"] >= 1  # really asynchronous
        if bound is not None:
            assert staleness["staleness_max"] <= bound


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------

def _catch(call):
    """Run ``call``; return (exception or None, result, seconds)."""
    started = time.monotonic()
    try:
        return None, call(), time.monotonic() - started
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc, None, time.monotonic() - started


@pytest.mark.timeout(30)
def test_worker_with_a_different_model_is_named():
    """Worker rank 2 has one element more: the server raises ValueError naming it."""
    def body(comm):
        if comm.rank == 0:
            return _catch(lambda: _onehot_server(comm, 10, timeout=3.0))
        numel = 11 if comm.rank == 2 else 10
        worker = gradsync.AsyncWorker(Vector(numel), group=comm, server_rank=0, timeout=1.0)

        def work():
            step = worker.pull()
            while step is not None:
                worker.params[0].grad = torch.ones(numel)
                step = worker.push()

        return _catch(work)

    results = run_threads(3, body, timeout_s=20)
    exc = results[0][0]
    assert isinstance(exc, ValueError), results[0]
    assert "worker rank 2" in str(exc) and "11" in str(exc) and "10" in str(exc), exc
    # the mismatched worker gets no reply: it times out naming the server instead of hanging
    assert isinstance(results[2][0], gradsync.CollectiveTimeoutError) and "peer rank 0" in str(results[2][0])


def test_check_layout_message():
    with pytest.raises(ValueError, match="worker rank 4 has 7 .* the server 3"):
        check_layout([nn.Parameter(torch.zeros(3))], 7, 4, "parameter server")


def _busy_worker(comm, compute_s: float, timeout: float):
    """Push ones on a 4-element model until stopped or the server fails; returns the error or None."""
    model = Vector(4)
    worker = gradsync.AsyncWorker(model, group=comm, server_rank=0, timeout=timeout)

    def work():
        step = worker.pull()
        while step is not None:
            model.weight.grad = torch.ones(4)
            time.sleep(compute_s)
            step = worker.push()

    return _catch(work)[0]


@pytest.mark.parametrize("total_steps, compute_s", [(30, 0.001), (10**9, 0.0)],
                         ids=["others-finish", "others-keep-pushing"])
@pytest.mark.timeout(30)
def test_silent_worker_times_out_naming_it_threads(total_steps, compute_s):
    """Worker 2 pulls and returns without pushing: the server names "peer rank 2" within timeout + 2 s,
    also while workers 1, 3 and 4 keep pushing (their requests must not postpone the silent one's deadline)."""
    timeout_s = 1.0

    def body(comm):
        if comm.rank == 0:
            model = Vector(4)
            server = gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps,
                                              group=comm, timeout=timeout_s)
            return _catch(server.serve) + (server.version,)
        if comm.rank == 2:
            gradsync.AsyncWorker(Vector(4), group=comm, server_rank=0).pull()
            return None
        return _busy_worker(comm, compute_s=compute_s, timeout=1.5)

    results = run_threads(5, body, timeout_s=25)
    exc, _, seconds, version = results[0]
    assert isinstance(exc, gradsync.CollectiveTimeoutError), results[0]
    assert isinstance(exc, TimeoutError)
    assert "peer rank 2" in str(exc) and exc.peer == 2 and exc.timed_out, exc
    assert seconds < timeout_s + 2
    assert version < total_steps
    for rank in (1, 3, 4):  # left waiting for a server that gave up: a timeout naming it, not a hang
        assert results[rank] is None or (isinstance(results[rank], gradsync.CollectiveTimeoutError)
                                          and "peer rank 0" in str(results[rank])), results[rank]


@pytest.mark.timeout(30)
def test_busy_server_does_not_blame_a_worker_that_sent_in_time():
    """on_update takes longer than the timeout once (as the CLI's epoch-end evaluation may): the workers
    sent their requests in time and they wait in the server's queue, so the run must complete."""
    timeout_s, total_steps = 1.0, 20

    def body(comm):
        model = Vector(4)
        if comm.rank == 0:
            server = gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.01), total_steps,
                                              group=comm, timeout=timeout_s)

            def slow_evaluation(worker, version, loss, staleness):
                if version == 5:
                    time.sleep(1.5 * timeout_s)

            exc, _, _ = _catch(lambda: server.serve(on_update=slow_evaluation))
            return exc, server.version
        return _busy_worker(comm, compute_s=0.01, timeout=3.0)

    results = run_threads(3, body, timeout_s=25)
    assert results[0] == (None, total_steps), results
    assert results[1] is None and results[2] is None, results


class _UntaggedTransport:
    """A transport without tagged any-source receives (as NCCL): the parameter server cannot run on it."""

    def __init__(self, inner):
        self._inner = inner
        self.rank, self.world_size, self.stats = inner.rank, inner.world_size, inner.stats

    def isend(self, tensor, peer):
        return self._inner.isend(tensor, peer)

    def irecv(self, tensor, peer):
        return self._inner.irecv(tensor, peer)


def test_transport_without_any_source_receive_is_rejected():
    world = ThreadWorld(2)
    model = Vector(3)
    with pytest.raises(ValueError, match="gloo"):
        gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), 5,
                                 group=Communicator(_UntaggedTransport(world.transport(0))))
    with pytest.raises(ValueError, match="gloo"):
        gradsync.AsyncWorker(Vector(3), group=Communicator(_UntaggedTransport(world.transport(1))), server_rank=0)


@pytest.mark.timeout(30)
def test_silent_server_times_out_naming_it():
    """A worker whose server never answers raises CollectiveTimeoutError naming the server."""
    world = ThreadWorld(2)
    worker = gradsync.AsyncWorker(Vector(4), group=_comm(world, 1), server_rank=0, timeout=0.3)
    exc, _, seconds = _catch(worker.pull)
    assert isinstance(exc, gradsync.CollectiveTimeoutError) and "peer rank 0" in str(exc), exc
    assert seconds < 0.3 + 2


def _rank_dies_after_first_pull(total_steps: int, dead_rank: int, timeout_s: float):
    """Server rank 0; ``dead_rank`` exits (os._exit) right after its first pull; others work normally."""
    rank = gradsync.rank()
    model = Vector(total_steps)
    if rank == 0:
        server = gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), total_steps,
                                          timeout=timeout_s)
        exc, _, seconds = _catch(server.serve)
        return (type(exc).__name__ if exc else None, str(exc), getattr(exc, "peer", None), seconds,
                server.version)
    worker = gradsync.AsyncWorker(model, server_rank=0, timeout=timeout_s + 10)
    step = worker.pull()
    if rank == dead_rank:
        os._exit(1)
    exc, _, _ = _catch(lambda: _finish(worker, model, step))
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _finish(worker, model, step):
    while step is not None:
        model.weight.grad = _one_hot(model.weight.numel(), step)
        time.sleep(0.002)
        step = worker.push()


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_dead_worker_process_is_named_within_the_timeout():
    """Gloo: worker rank 2 calls os._exit(1) after its first pull: the server raises naming it in ~5 s."""
    timeout_s = 5.0
    results = run_world(4, _rank_dies_after_first_pull, 60, 2, timeout_s, timeout_s=60,
                        collective_timeout_s=COLLECTIVE_TIMEOUT_S, may_exit=[2])
    name, message, peer, seconds, version = results[0]
    assert name == "CollectiveTimeoutError", results[0]
    assert "peer rank 2" in message and peer == 2, message
    assert seconds < timeout_s + 2, seconds
    assert version < 60  # the dead worker's step was never applied
    assert results[2] is None
    for rank in (1, 3):  # waiting for a stop that needs the dead worker's gradient: an error naming the server
        assert results[rank] is None or ("CollectiveTimeoutError" in results[rank]
                                          and "peer rank 0" in results[rank]), results[rank]


@pytest.mark.timeout(10)
def test_push_before_pull_and_after_stop_raise_runtime_error():
    world = ThreadWorld(2)
    worker = gradsync.AsyncWorker(Vector(3), group=_comm(world, 1), server_rank=0)
    with pytest.raises(RuntimeError, match="pull"):
        worker.push(0.5)
    assert worker.pushes == 0


@pytest.mark.timeout(10)
def test_pull_twice_raises_runtime_error():
    world = ThreadWorld(2)
    server_comm = _comm(world, 0)
    worker = gradsync.AsyncWorker(Vector(3), group=_comm(world, 1), server_rank=0)
    # answer the first pull by hand: a PARAMS reply and the parameters
    from gradsync.parallel import ps_protocol as protocol

    server_comm.transport.isend_tagged(torch.tensor([protocol.PARAMS, 0, 0, 0]), 1, protocol.TAG_REPLY)
    server_comm.transport.isend_tagged(torch.tensor([1.0, 2.0, 3.0]), 1, protocol.TAG_PARAMETERS)
    assert worker.pull() == 0
    assert worker.params[0].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(RuntimeError, match="once"):
        worker.pull()


@pytest.mark.parametrize("server_rank", [1, -1, 2, 1.0, None])
def test_server_rank_must_be_another_rank(server_rank):
    world = ThreadWorld(2)
    with pytest.raises(ValueError, match="server_rank"):
        gradsync.AsyncWorker(Vector(3), group=_comm(world, 1), server_rank=server_rank)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(3, dtype=torch.float64))


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3), requires_grad=False)


@pytest.mark.parametrize("module, exc_type, needle", [
    (Mixed(), ValueError, "dtype"),
    (Frozen(), ValueError, "no trainable parameters"),
    ("not a module", TypeError, "nn.Module"),
])
def test_bad_modules_rejected_by_server_and_worker(module, exc_type, needle):
    world = ThreadWorld(2)
    with pytest.raises(exc_type, match=needle):
        gradsync.AsyncWorker(module, group=_comm(world, 1), server_rank=0)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(exc_type, match=needle):
        gradsync.ParameterServer(module, optimizer, 5, group=_comm(world, 0))


@pytest.mark.parametrize("kwargs, needle", [
    ({"total_steps": -1}, "total_steps"),
    ({"total_steps": 2.0}, "total_steps"),
    ({"total_steps": True}, "total_steps"),
    ({"workers": [0]}, "workers"),
    ({"workers": [1, 1]}, "workers"),
    ({"workers": [5]}, "workers"),
    ({"workers": []}, "workers"),
    ({"max_staleness": -1}, "max_staleness"),
    ({"timeout": 0}, "timeout"),
    ({"timeout": math.inf}, "timeout"),
])
def test_parameter_server_rejects_bad_arguments(kwargs, needle):
    world = ThreadWorld(3)
    model = Vector(3)
    arguments = {"total_steps": 5, **kwargs}
    with pytest.raises(ValueError, match=needle):
        gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), group=_comm(world, 0),
                                 **arguments)


def test_worker_rejects_bad_timeout():
    world = ThreadWorld(2)
    with pytest.raises(ValueError, match="timeout"):
        gradsync.AsyncWorker(Vector(3), group=_comm(world, 1), server_rank=0, timeout=-1)


# --------------------------------------------------------------------------------------------------
# Staleness-aware learning rate
# --------------------------------------------------------------------------------------------------

def _staleness_lr_run(staleness_aware_lr: bool, lr: float = 0.5) -> dict:
    """Worker 0 holds step 0 on version 0 until the others applied >= 3 updates, so its staleness is >= 3."""
    total_steps, server_rank = 9, 3
    pulled = threading.Event()
    others_pushed = [0]
    lock = threading.Lock()

    def count():
        with lock:
            others_pushed[0] += 1

    def body(comm):
        if comm.rank == server_rank:
            model = Vector(total_steps)
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            server = gradsync.ParameterServer(model, optimizer, total_steps, group=comm,
                                              staleness_aware_lr=staleness_aware_lr)
            updates = {}
            server.serve(on_update=lambda w, v, loss, s: updates.__setitem__(int(loss), s))
            return {"params": model.weight.detach().clone(), "updates": updates,
                    "lr_after": optimizer.param_groups[0]["lr"]}
        model = Vector(total_steps)
        worker = gradsync.AsyncWorker(model, group=comm, server_rank=server_rank)
        if comm.rank != 0:
            pulled.wait(10.0)
        step = worker.pull()
        while step is not None:
            if comm.rank == 0:
                pulled.set()
                deadline = time.monotonic() + 10.0
                while others_pushed[0] < 3 and time.monotonic() < deadline:
                    time.sleep(0.001)
            model.weight.grad = _one_hot(total_steps, step)
            step = worker.push(float(step))
            if comm.rank != 0:
                count()
        return None

    return run_threads(4, body, timeout_s=30)[server_rank]


@pytest.mark.timeout(30)
def test_staleness_aware_lr_divides_by_staleness():
    """Each one-hot update lands as -lr / staleness when staleness > 1, else -lr; the lr is restored."""
    lr = 0.5
    result = _staleness_lr_run(True, lr)
    updates = result["updates"]
    assert sorted(updates) == list(range(9))
    assert updates[0] >= 3, updates  # the held-back gradient
    expected = torch.tensor([-lr / s if s > 1 else -lr for _, s in sorted(updates.items())])
    assert torch.allclose(result["params"], expected, rtol=1e-6, atol=0), (result["params"], updates)
    assert result["params"][0].item() == pytest.approx(-lr / updates[0])
    assert result["lr_after"] == lr

    plain = _staleness_lr_run(False, lr)
    assert plain["updates"][0] >= 3
    assert torch.equal(plain["params"], torch.full((9,), -lr))
