"""The parameter server's failures: a different model, a silent or dead worker, a silent server, bad arguments.

Every failure is a clear error naming the rank at fault within the timeout,
never a hang; a busy server does not blame a worker whose request waits.
"""

from __future__ import annotations

import math
import os
import threading
import time

import pytest
import torch
from torch import nn

import gradsync
from _dist import run_threads, run_world
from gradsync.collectives import Communicator
from gradsync.parallel.ps_protocol import SharedModel
from gradsync.transport.thread import ThreadWorld


from _ps_helpers import COLLECTIVE_TIMEOUT_S, Vector, catch, one_hot, onehot_server, thread_comm
from _ps_helpers import warm_optimizer  # noqa: F401 (autouse fixture)


@pytest.mark.timeout(30)
def test_worker_with_a_different_model_is_named():
    """Worker rank 2 has one element more: the server raises ValueError naming it."""
    def body(comm):
        if comm.rank == 0:
            return catch(lambda: onehot_server(comm, 10, timeout=3.0))
        numel = 11 if comm.rank == 2 else 10
        worker = gradsync.AsyncWorker(Vector(numel), group=comm, server_rank=0, timeout=1.0)

        def work():
            step = worker.pull()
            while step is not None:
                worker.params[0].grad = torch.ones(numel)
                step = worker.push()

        return catch(work)

    results = run_threads(3, body, timeout_s=20)
    exc = results[0][0]
    assert isinstance(exc, ValueError), results[0]
    assert "worker rank 2" in str(exc) and "11" in str(exc) and "10" in str(exc), exc
    # the mismatched worker is told at once instead of waiting out its timeout
    assert isinstance(results[2][0], ValueError) and "rejected" in str(results[2][0]), results[2]
    assert results[2][2] < 1.0


@pytest.mark.parametrize("worker_model, needle", [
    (lambda: Vector(4, dtype=torch.float64), "dtype torch.float64 != torch.float32"),
    (lambda: nn.Sequential(nn.Linear(2, 1, bias=False), nn.Linear(2, 1, bias=False)), "shapes"),
    (lambda: Vector(5), "numel .* 5 != 4"),
])
def test_model_check_names_what_differs(worker_model, needle):
    """Same element count but other dtype or shapes is refused too, before any payload could abort Gloo."""
    server = SharedModel(Vector(4))
    with pytest.raises(ValueError, match=f"worker rank 3's model differs .*{needle}"):
        server.check_peer(list(SharedModel(worker_model()).signature), 3)
    server.check_peer(list(SharedModel(Vector(4)).signature), 3)  # the same model passes


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

    return catch(work)[0]


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
            return catch(server.serve) + (server.version,)
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

            exc, _, _ = catch(lambda: server.serve(on_update=slow_evaluation))
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
    worker = gradsync.AsyncWorker(Vector(4), group=thread_comm(world, 1), server_rank=0, timeout=0.3)
    exc, _, seconds = catch(worker.pull)
    assert isinstance(exc, gradsync.CollectiveTimeoutError) and "peer rank 0" in str(exc), exc
    assert seconds < 0.3 + 2


def _rank_dies_after_first_pull(total_steps: int, dead_rank: int, timeout_s: float):
    """Server rank 0; ``dead_rank`` exits (os._exit) right after its first pull; others work normally."""
    rank = gradsync.rank()
    model = Vector(total_steps)
    if rank == 0:
        server = gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), total_steps,
                                          timeout=timeout_s)
        exc, _, seconds = catch(server.serve)
        return (type(exc).__name__ if exc else None, str(exc), getattr(exc, "peer", None), seconds,
                server.version)
    worker = gradsync.AsyncWorker(model, server_rank=0, timeout=timeout_s + 10)
    step = worker.pull()
    if rank == dead_rank:
        os._exit(1)
    exc, _, _ = catch(lambda: _finish(worker, model, step))
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _finish(worker, model, step):
    while step is not None:
        model.weight.grad = one_hot(model.weight.numel(), step)
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
    worker = gradsync.AsyncWorker(Vector(3), group=thread_comm(world, 1), server_rank=0)
    with pytest.raises(RuntimeError, match="pull"):
        worker.push(0.5)
    assert worker.pushes == 0


@pytest.mark.timeout(10)
def test_pull_twice_raises_runtime_error():
    world = ThreadWorld(2)
    server_comm = thread_comm(world, 0)
    worker = gradsync.AsyncWorker(Vector(3), group=thread_comm(world, 1), server_rank=0)
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
        gradsync.AsyncWorker(Vector(3), group=thread_comm(world, 1), server_rank=server_rank)


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
        gradsync.AsyncWorker(module, group=thread_comm(world, 1), server_rank=0)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(exc_type, match=needle):
        gradsync.ParameterServer(module, optimizer, 5, group=thread_comm(world, 0))


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
        gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), group=thread_comm(world, 0),
                                 **arguments)


def test_worker_rejects_bad_timeout():
    world = ThreadWorld(2)
    with pytest.raises(ValueError, match="timeout"):
        gradsync.AsyncWorker(Vector(3), group=thread_comm(world, 1), server_rank=0, timeout=-1)


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
            model.weight.grad = one_hot(total_steps, step)
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


class _SubgroupTransport(_UntaggedTransport):
    """A tagged transport that, like TorchP2PTransport on a torch subgroup, has a ``group``."""

    group = object()

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_subgroup_is_rejected_at_construction_on_both_sides():
    """Gloo's any-source receive needs the default group: say so before anyone waits."""
    world = ThreadWorld(2)
    model = Vector(3)
    with pytest.raises(ValueError, match="default group"):
        gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), 5,
                                 group=Communicator(_SubgroupTransport(world.transport(0))))
    with pytest.raises(ValueError, match="default group"):
        gradsync.AsyncWorker(Vector(3), group=Communicator(_SubgroupTransport(world.transport(1))), server_rank=0)


def test_optimizer_must_hold_the_module_parameters():
    world = ThreadWorld(2)
    with pytest.raises(ValueError, match="does not hold 1 of the module's 1 trainable parameters"):
        gradsync.ParameterServer(Vector(3), torch.optim.SGD(Vector(3).parameters(), lr=1.0), 5,
                                 group=thread_comm(world, 0))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        gradsync.ParameterServer(Vector(3), "sgd", 5, group=thread_comm(world, 0))


@pytest.mark.timeout(30)
def test_zero_grad_in_on_update_does_not_stop_training_and_serve_runs_once():
    """optimizer.zero_grad() (set_to_none) inside on_update must not make later steps skip every parameter."""
    total_steps = 9

    def body(comm):
        if comm.rank == 0:
            model = Vector(total_steps)
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            server = gradsync.ParameterServer(model, optimizer, total_steps, group=comm)
            server.serve(on_update=lambda *args: optimizer.zero_grad(set_to_none=True))
            again = catch(server.serve)[0]
            return model.weight.detach().clone(), again
        model = Vector(total_steps)
        worker = gradsync.AsyncWorker(model, group=comm, server_rank=0)
        step = worker.pull()
        while step is not None:
            model.weight.grad = one_hot(total_steps, step)
            step = worker.push()
        return None

    params, again = run_threads(3, body, timeout_s=20)[0]
    assert torch.equal(params, torch.full((total_steps,), -1.0))
    assert isinstance(again, RuntimeError) and "once" in str(again)


class _ClosedSends:
    """A ThreadWorld transport whose tagged sends fail as Gloo's do on a pair the peer closed."""

    def __init__(self, inner):
        self._inner = inner
        self.rank, self.world_size, self.stats = inner.rank, inner.world_size, inner.stats

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def isend_tagged(self, tensor, peer, tag):
        from gradsync.transport.base import PeerFailure

        raise PeerFailure(peer, "closed the connection (it died or left the group)", False)


@pytest.mark.timeout(20)
def test_closed_connection_is_collective_timeout_error_naming_the_peer_on_worker_and_server():
    """Trigger: a peer's connection is closed when a send is posted; before: the internal PeerFailure leaked."""
    world = ThreadWorld(2)
    worker = gradsync.AsyncWorker(Vector(4), group=Communicator(_ClosedSends(world.transport(1))), server_rank=0,
                                  timeout=2.0)
    exc, _, _ = catch(worker.pull)
    assert isinstance(exc, gradsync.CollectiveTimeoutError), repr(exc)
    assert exc.peer == 0 and "peer rank 0 closed the connection" in str(exc) and not exc.timed_out, exc

    world = ThreadWorld(2)
    model = Vector(4)
    server = gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), 3,
                                      group=Communicator(_ClosedSends(world.transport(0))), timeout=2.0)
    asking = threading.Thread(target=catch, daemon=True, args=(gradsync.AsyncWorker(
        Vector(4), group=thread_comm(world, 1), server_rank=0, timeout=0.5).pull,))
    asking.start()
    exc, _, _ = catch(server.serve)
    asking.join(5)
    assert isinstance(exc, gradsync.CollectiveTimeoutError), repr(exc)
    assert exc.peer == 1 and "peer rank 1 closed the connection" in str(exc), exc
