"""The parameter server through shared memory: taken on one host, the same results as TCP, nothing left behind.

* the channels alone (threads of this process): requests come in ring order, replies carry their header,
  a deadline returns None, a closed side is named at once;
* threads with ``shared_memory=True``: every one-hot update applied exactly once through the shm link; a
  worker that declines makes every worker fall back to the transport, with the reason recorded;
* Gloo processes on this host: the shm link is taken by default, and with ``max_staleness=0`` (one worker
  at a time, steps in order) the final parameters are bitwise those of the TCP link; a killed worker or
  server is named within a second, and no ``/dev/shm`` name of the run survives it.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import gradsync
from _dist import run_threads, run_world
from _ps_helpers import COLLECTIVE_TIMEOUT_S, Vector, catch, one_hot, onehot_server
from _ps_helpers import warm_optimizer  # noqa: F401 (autouse fixture)
from gradsync.transport.shm_channels import SERVER, ShmClientChannel, ShmServerChannels
from gradsync.transport.shm_segment import ShmPeerTimeout


def _names(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"gradsync-{pid}-")]


# ------------------------------------------------------------------------------------------ channels


def test_channels_carry_requests_in_ring_order_and_replies_with_payload():
    server = ShmServerChannels.create(2, push_bytes=16, params_bytes=12)
    clients = [ShmClientChannel.attach(server.name, c, 2, 16, 12) for c in (0, 1)]
    server.unlink()
    assert _names(os.getpid()) == []  # mapped by every client: the name is gone, the memory is not
    try:
        clients[1].push_view(torch.float32, 4).copy_(torch.arange(4.0))
        clients[1].request([2, 7, 8, 9])
        clients[0].request([1, 0, 0, 0])
        assert server.wait_request([0, 1], time.monotonic() + 5) == (1, [2, 7, 8, 9])  # rang first
        assert torch.equal(server.push_view(1, torch.float32, 4), torch.arange(4.0))
        assert server.wait_request([0, 1], time.monotonic() + 5) == (0, [1, 0, 0, 0])
        assert server.wait_request([0, 1], time.monotonic() + 0.05) is None  # nothing new: the deadline
        server.params_view(0, torch.float32, 3).copy_(torch.tensor([5.0, 6.0, 7.0]))
        server.reply(0, [3, 4, 5, 6])
        assert clients[0].wait_reply(time.monotonic() + 5) == [3, 4, 5, 6]
        assert clients[0].params_view(torch.float32, 3).tolist() == [5.0, 6.0, 7.0]
        assert clients[1].wait_reply(time.monotonic() + 0.05) is None
        with pytest.raises(ValueError, match="do not fit"):
            server.push_view(0, torch.float32, 5)
        clients[1].close()
        started = time.monotonic()
        with pytest.raises(ShmPeerTimeout) as raised:  # a closed client is named, long before the deadline
            server.wait_request([1], time.monotonic() + 30)
        assert raised.value.peer == 1 and raised.value.left and time.monotonic() - started < 2
        server.close()
        with pytest.raises(ShmPeerTimeout) as raised:
            clients[0].wait_reply(time.monotonic() + 30)
        assert raised.value.peer == SERVER and raised.value.left
    finally:
        for side in (*clients, server):
            side.close()


def test_an_answer_sent_just_before_its_sender_left_is_taken(monkeypatch):
    """Trigger: the server's last stop, then its close, came before the worker looked at the server;
    before: the worker raised "peer left" instead of taking the stop. The same holds for a request."""
    from gradsync.transport import shm_channels

    monkeypatch.setattr(shm_channels, "LIVENESS_EVERY_S", 0.0)  # look at the peer before anything else
    server = ShmServerChannels.create(1, push_bytes=64, params_bytes=64)
    client = ShmClientChannel.attach(server.name, 0, 1, 64, 64)
    client.request([2, 0, 0, 0])
    client.close()
    assert server.wait_request([0], time.monotonic() + 5) == (0, [2, 0, 0, 0])
    with pytest.raises(ShmPeerTimeout):  # nothing more from it: now it is gone
        server.wait_request([0], time.monotonic() + 5)
    client = ShmClientChannel.attach(server.name, 0, 1, 64, 64)
    server.reply(0, [2, 5, 0, 0])
    server.close()
    assert client.wait_reply(time.monotonic() + 5) == [2, 5, 0, 0]
    with pytest.raises(ShmPeerTimeout):
        client.wait_reply(time.monotonic() + 5)
    client.close()


def test_a_dead_client_is_named_while_another_keeps_the_server_busy():
    """Trigger: one worker pushing every few ms kept each of the server's waits under the liveness period;
    before: a dead worker was named only at its timeout."""
    server = ShmServerChannels.create(2, push_bytes=64, params_bytes=64)
    clients = [ShmClientChannel.attach(server.name, c, 2, 64, 64) for c in (0, 1)]
    server.unlink()
    clients[1].close()
    started = time.monotonic()
    try:
        with pytest.raises(ShmPeerTimeout) as raised:
            while time.monotonic() - started < 5:
                clients[0].request([2, 0, 0, 0])
                assert server.wait_request([0, 1], time.monotonic() + 5)[0] == 0
                time.sleep(0.002)
        assert raised.value.peer == 1 and time.monotonic() - started < 1
    finally:
        for side in (*clients, server):
            side.close()


def test_attach_refuses_another_layout():
    server = ShmServerChannels.create(1, push_bytes=64, params_bytes=64)
    try:
        with pytest.raises(ValueError, match="bytes"):
            ShmClientChannel.attach(server.name, 0, 1, 128, 64)
    finally:
        server.close()
    assert _names(os.getpid()) == []


def test_a_name_left_by_a_server_killed_during_the_set_up_is_removed_by_the_next():
    """A creator killed before it unlinked leaves its name; the next segment made on the host removes it."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child creates, says the name and is killed before unlinking
        os.write(write_end, ShmServerChannels.create(2, 64, 64).name.encode())
        os.kill(os.getpid(), 9)
    os.close(write_end)
    name = os.read(read_end, 200).decode()
    os.close(read_end)
    os.waitpid(child, 0)
    assert name.startswith(f"gradsync-{child}-") and os.path.exists(f"/dev/shm/{name}")
    ShmServerChannels.create(1, 64, 64).close()
    assert not os.path.exists(f"/dev/shm/{name}")


# ------------------------------------------------------------------------------------------ threads


def _onehot_worker(comm, total_steps: int, shared_memory=None) -> dict:
    model = Vector(total_steps)
    worker = gradsync.AsyncWorker(model, group=comm, server_rank=0, shared_memory=shared_memory)
    step, steps = worker.pull(), []
    while step is not None:
        steps.append(step)
        model.weight.grad = one_hot(total_steps, step)
        step = worker.push(float(step))
    return {"steps": steps, "link": worker.link, "weight": model.weight.detach().clone()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_staleness", [None, 0, 2])
def test_every_update_applied_once_through_shared_memory_threads(max_staleness):
    total_steps, links = 29, {}

    def body(comm):
        if comm.rank == 0:
            model = Vector(total_steps)
            server = gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), total_steps,
                                              group=comm, max_staleness=max_staleness, shared_memory=True)
            server.serve()
            links["server"] = (server.link, server.link_fallback)
            return {"weight": model.weight.detach().clone(), "staleness": server.staleness.max}
        return _onehot_worker(comm, total_steps)

    results = run_threads(4, body, timeout_s=40)
    assert links["server"] == ("shared_memory", None)
    expected = torch.full((total_steps,), -1.0)  # SGD lr 1 on e_0 .. e_28, each exactly once
    assert torch.equal(results[0]["weight"], expected)
    assert sorted(s for r in results[1:] for s in r["steps"]) == list(range(total_steps))
    for worker in results[1:]:
        assert worker["link"] == "shared_memory" and torch.equal(worker["weight"], expected)
    if max_staleness is not None:
        assert results[0]["staleness"] <= max_staleness


@pytest.mark.timeout(60)
def test_a_declining_worker_makes_every_worker_use_the_transport_threads():
    total_steps, seen = 13, {}

    def body(comm):
        if comm.rank == 0:
            model = Vector(total_steps)
            server = gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), total_steps,
                                              group=comm, shared_memory=True)
            server.serve()
            seen["server"] = (server.link, server.link_fallback)
            return model.weight.detach().clone()
        return _onehot_worker(comm, total_steps, shared_memory=False if comm.rank == 2 else None)

    results = run_threads(3, body, timeout_s=40)
    link, why = seen["server"]
    assert link == "tcp" and "rank 2" in why and "declined" in why, seen
    assert torch.equal(results[0], torch.full((total_steps,), -1.0))
    assert [r["link"] for r in results[1:]] == ["tcp", "tcp"]


@pytest.mark.timeout(60)
def test_a_segment_that_does_not_fit_dev_shm_falls_back_to_the_transport(monkeypatch):
    """``/dev/shm`` too small (ENOSPC when its pages are reserved): every worker uses TCP, the reason is kept."""
    import errno

    from gradsync.transport import shm_channels

    def full(fd, offset, nbytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm_channels.os, "posix_fallocate", full)
    total_steps, seen = 7, {}

    def body(comm):
        if comm.rank == 0:
            model = Vector(total_steps)
            server = gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), total_steps,
                                              group=comm, shared_memory=True)
            server.serve()
            seen["server"] = (server.link, server.link_fallback)
            return model.weight.detach().clone()
        return _onehot_worker(comm, total_steps)

    results = run_threads(3, body, timeout_s=40)
    link, why = seen["server"]
    assert link == "tcp" and "could not create the shared memory" in why and "No space left" in why, seen
    assert torch.equal(results[0], torch.full((total_steps,), -1.0))
    assert [r["link"] for r in results[1:]] == ["tcp", "tcp"]
    assert _names(os.getpid()) == []


def test_shared_memory_true_refuses_workers_on_another_host():
    from gradsync.collectives import Communicator
    from gradsync.transport.locality import Locality
    from gradsync.transport.thread import ThreadWorld

    comm = Communicator(ThreadWorld(3).transport(0), timeout_s=5.0)
    comm.locality = Locality((0, 0, 1))
    model = Vector(2)
    with pytest.raises(ValueError, match="shared_memory=True needs the server and its workers on one host"):
        gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), 1, group=comm,
                                 shared_memory=True)
    # auto on that group: the transport, no error
    server = gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), 1, group=comm,
                                      workers=[1, 2])
    assert server.link == "tcp" and not server._shared_memory


# ------------------------------------------------------------------------------------------ Gloo processes


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


def _train_rank(total_steps: int, shared_memory, max_staleness):
    """Server: the last rank (Adam); workers: step k's batch is drawn from seed k. Returns what each saw."""
    torch.set_num_threads(1)
    rank, world_size = gradsync.rank(), gradsync.world_size()
    torch.manual_seed(0)
    model = _Net()
    if rank == world_size - 1:
        server = gradsync.ParameterServer(model, torch.optim.Adam(model.parameters(), lr=1e-2), total_steps,
                                          max_staleness=max_staleness, shared_memory=shared_memory)
        server.serve()
        return {"link": server.link, "fallback": server.link_fallback, "losses": server.losses,
                "params": [p.detach().clone() for p in model.parameters()], "names": _names(os.getpid())}
    worker = gradsync.AsyncWorker(model, server_rank=world_size - 1, shared_memory=shared_memory)
    step = worker.pull()
    while step is not None:
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=generator), torch.randint(0, 3, (16,), generator=generator)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        step = worker.push(loss.item())
    return {"link": worker.link, "params": [p.detach().clone() for p in model.parameters()]}


def _both_links(total_steps: int) -> dict:
    """The same run through shared memory (the default here) and then over TCP, in the same processes."""
    return {"shm": _train_rank(total_steps, None, 0), "tcp": _train_rank(total_steps, False, 0)}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_gloo_processes_take_shared_memory_and_match_tcp_bitwise():
    """One host: shm by default; serial steps (max_staleness 0) give bitwise TCP's parameters and losses."""
    total_steps = 40
    results = run_world(3, _both_links, total_steps, timeout_s=90, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    shm, tcp = [r["shm"] for r in results], [r["tcp"] for r in results]
    assert [r["link"] for r in shm] == ["shared_memory"] * 3 and shm[-1]["fallback"] is None
    assert [r["link"] for r in tcp] == ["tcp"] * 3
    assert shm[-1]["names"] == []  # unlinked right after the set-up
    assert shm[-1]["losses"] == tcp[-1]["losses"] and len(tcp[-1]["losses"]) == total_steps
    for mine, theirs in zip(shm[-1]["params"], tcp[-1]["params"]):
        assert torch.equal(mine, theirs)
    for worker in shm[:-1]:  # the stop carried the final parameters
        assert all(torch.equal(a, b) for a, b in zip(worker["params"], shm[-1]["params"]))


def _kill_one(total_steps: int, victim: int, report_dir: str):
    """Rank 0 serves; ``victim`` kills itself (SIGKILL) after its third push; the others report how they end."""
    rank = gradsync.rank()
    model = Vector(total_steps)
    with open(os.path.join(report_dir, f"pid{rank}"), "w") as file:
        file.write(str(os.getpid()))
    if rank == 0:
        server = gradsync.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), total_steps,
                                          timeout=30.0)

        def on_update(worker, version, loss, staleness):
            if victim == 0 and version == 20:
                os.kill(os.getpid(), 9)

        exc, _, seconds = catch(lambda: server.serve(on_update))
        return type(exc).__name__, str(exc), getattr(exc, "peer", None), seconds, server.link
    worker = gradsync.AsyncWorker(model, server_rank=0, timeout=30.0)
    step, pushes = worker.pull(), 0
    started = time.monotonic()
    try:
        while step is not None:
            model.weight.grad = one_hot(total_steps, step)
            time.sleep(0.005)
            if rank == victim and pushes == 3:
                os.kill(os.getpid(), 9)
            step = worker.push()
            pushes += 1
            started = time.monotonic()
    except gradsync.CollectiveTimeoutError as exc:
        return type(exc).__name__, str(exc), exc.peer, time.monotonic() - started, worker.link
    return None


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [2, 0])
def test_killed_worker_or_server_is_named_at_once_and_leaves_no_segment(victim, tmp_path):
    results = run_world(3, _kill_one, 100000, victim, str(tmp_path), timeout_s=60,
                        collective_timeout_s=COLLECTIVE_TIMEOUT_S, may_exit=[victim])
    survivors = [r for r in range(3) if r != victim]
    for rank in survivors:
        name, message, peer, seconds, link = results[rank]
        assert name == "CollectiveTimeoutError" and link == "shared_memory", results[rank]
        if rank == 0 or victim == 0:  # the server names the dead worker; workers name the dead server
            assert peer == victim and f"peer rank {victim} died" in message, message
            assert seconds < 5, seconds  # not the 30 s timeout
        else:  # a worker whose server gave up: it left
            assert peer == 0 and "peer rank 0" in message, message
    server_pid = int((tmp_path / "pid0").read_text())
    assert _names(server_pid) == []
