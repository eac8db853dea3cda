"""The staleness bound and record of asynchronous training, and the tagged messages it travels on.

* the gate: whatever order gradients arrive in, no applied gradient is staler
  than the bound and the server never deadlocks (a simulation of the server's
  bookkeeping driven by random push orders);
* the histogram, mean and max that summary.json reports;
* tagged messages over the thread transport match on (peer, tag) in order,
  and an any-source receive names its sender.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradsync.parallel.staleness import StalenessGate, StalenessStats
from gradsync.transport.base import PeerFailure
from gradsync.transport.thread import ThreadWorld




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
