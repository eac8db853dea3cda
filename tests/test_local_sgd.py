"""Local SGD: every rank steps alone, parameters are averaged every ``sync_every`` steps.

Threads over :class:`~gradsync.transport.thread.ThreadWorld` (each rank a
``gradsync.Communicator``). With ``sync_every=1`` and SGD (momentum, weight
decay) averaging the parameters after every step equals averaging the
gradients, so the run must match single-process training on the
concatenated batch; with ``sync_every=H`` the replicas drift apart between
averages and are bitwise equal right after each one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from _dist import run_threads
from gradsync.transport.thread import ThreadWorld

IN_FEATURES, HIDDEN, CLASSES = 5, 7, 3
BATCH, STEPS, LR, MOMENTUM, WEIGHT_DECAY = 4, 6, 0.1, 0.9, 0.01


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def make_data(world_size: int, steps: int = STEPS):
    """(steps, world_size, BATCH, features) inputs and labels: different data per rank and step."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(steps, world_size, BATCH, IN_FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (steps, world_size, BATCH), generator=generator)
    return x, y


def make_optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def reference(world_size: int, steps: int = STEPS) -> torch.Tensor:
    """One process, the concatenated batch of all ranks at every step."""
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    x, y = make_data(world_size, steps)
    for step in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x[step].reshape(-1, IN_FEATURES)), y[step].reshape(-1)).backward()
        optimizer.step()
    return flat(model)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.timeout(30)
def test_sync_every_one_equals_sync_training(world_size):
    """H = 1 with momentum SGD + weight decay: the parameters follow the single-process full-batch run."""
    x, y = make_data(world_size)
    # built here: torch's global RNG is shared by the rank threads
    modules = [make_model(seed=rank) for rank in range(world_size)]

    def body(comm):
        model = gradsync.LocalSGD(modules[comm.rank], sync_every=1, group=comm)  # rank 0's init wins
        optimizer = make_optimizer(model.parameters())
        averaged = []
        for step in range(STEPS):
            optimizer.zero_grad()
            F.cross_entropy(model(x[step, comm.rank]), y[step, comm.rank]).backward()
            optimizer.step()
            averaged.append(model.step())
        return flat(model.module), averaged, model.averages, model.local_steps

    results = run_threads(world_size, body, timeout_s=20)
    expected = reference(world_size)
    for params, averaged, averages, local_steps in results:
        assert averaged == [True] * STEPS and averages == STEPS and local_steps == 0
        torch.testing.assert_close(params, expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(params, results[0][0])  # replicas bitwise equal after every average


@pytest.mark.parametrize("sync_every, steps", [(3, 8), (2, 5)])
@pytest.mark.timeout(30)
def test_sync_every_h_averages_exactly_every_h_steps(sync_every, steps):
    """Ranks differ between averages, are bitwise equal right after one, and the average is the mean."""
    world_size = 3
    x, y = make_data(world_size, steps)
    modules = [make_model() for _ in range(world_size)]

    def body(comm):
        model = gradsync.LocalSGD(modules[comm.rank], sync_every=sync_every, group=comm)
        optimizer = make_optimizer(model.parameters())
        trace = []
        for step in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(model(x[step, comm.rank]), y[step, comm.rank]).backward()
            optimizer.step()
            before = flat(model.module)
            averaged = model.step()
            trace.append((averaged, before, flat(model.module), model.local_steps, model.averages))
        return trace

    traces = run_threads(world_size, body, timeout_s=20)
    for step in range(steps):
        due = (step + 1) % sync_every == 0
        rows = [trace[step] for trace in traces]
        for averaged, _, _, local_steps, averages in rows:
            assert averaged == due
            assert local_steps == (0 if due else (step + 1) % sync_every)
            assert averages == (step + 1) // sync_every
        befores = [row[1] for row in rows]
        afters = [row[2] for row in rows]
        if due:
            assert all(torch.equal(after, afters[0]) for after in afters), step
            torch.testing.assert_close(afters[0], torch.stack(befores).mean(0), rtol=1e-6, atol=1e-7)
        else:
            assert all(torch.equal(after, before) for after, before in zip(afters, befores))  # no communication
            assert not torch.equal(afters[0], afters[1]), f"ranks should drift apart at step {step}"


@pytest.mark.timeout(30)
def test_construction_broadcasts_rank_zero_parameters_and_buffers():
    modules = []
    for rank in range(3):  # built here: torch's global RNG is shared by the rank threads
        torch.manual_seed(100 + rank)
        modules.append(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
        modules[-1][1].running_mean.fill_(float(rank + 1))

    def body(comm):
        model = gradsync.LocalSGD(modules[comm.rank], sync_every=5, group=comm)
        return {name: t.detach().clone() for name, t in
                list(model.module.named_parameters()) + list(model.module.named_buffers())}

    results = run_threads(3, body, timeout_s=20)
    torch.manual_seed(100)
    rank0 = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    for result in results:
        for name, param in rank0.named_parameters():
            assert torch.equal(result[name], param.detach()), name
        assert torch.equal(result["1.running_mean"], torch.ones(4))


@pytest.mark.timeout(30)
def test_average_covers_floating_buffers_not_integer_ones():
    """average(): BatchNorm running stats are averaged; num_batches_tracked (int64) is left alone."""
    def body(comm):
        module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        model = gradsync.LocalSGD(module, sync_every=100, group=comm)
        with torch.no_grad():
            module[1].running_mean.fill_(float(comm.rank))
            module[1].num_batches_tracked.fill_(comm.rank + 10)
            module[0].bias.fill_(float(comm.rank) * 2)
        model.average()
        return (module[1].running_mean.clone(), int(module[1].num_batches_tracked), module[0].bias.clone(),
                model.averages, model.local_steps)

    results = run_threads(3, body, timeout_s=20)
    for rank, (running_mean, tracked, bias, averages, local_steps) in enumerate(results):
        assert torch.equal(running_mean, torch.full((4,), 1.0))
        assert torch.equal(bias, torch.full((4,), 2.0))
        assert tracked == rank + 10
        assert (averages, local_steps) == (1, 0)


@pytest.mark.parametrize("sync_every", [0, -1, 1.5, True, "2", None])
def test_bad_sync_every_raises_value_error(sync_every):
    comm = gradsync.Communicator(ThreadWorld(1).transport(0))
    with pytest.raises(ValueError, match="sync_every"):
        gradsync.LocalSGD(nn.Linear(2, 1), sync_every=sync_every, group=comm)


def test_bad_algorithm_and_module():
    comm = gradsync.Communicator(ThreadWorld(1).transport(0))
    with pytest.raises(ValueError, match="carrier-pigeon"):
        gradsync.LocalSGD(nn.Linear(2, 1), sync_every=2, group=comm, algorithm="carrier-pigeon")
    with pytest.raises(TypeError):
        gradsync.LocalSGD("not a module", sync_every=2, group=comm)


@pytest.mark.timeout(30)
def test_mismatched_sync_every_fails_on_every_rank():
    """Ranks built with different H get CollectiveMismatchError on every rank naming sync_every, not a hang."""
    def body(comm):
        try:
            gradsync.LocalSGD(make_model(), sync_every=2 if comm.rank == 1 else 4, group=comm)
        except Exception as exc:  # noqa: BLE001 - every rank must raise; the test inspects it
            return exc
        return None

    results = run_threads(3, body, timeout_s=20)
    for rank, exc in enumerate(results):
        assert isinstance(exc, gradsync.CollectiveMismatchError), (rank, exc)
        assert isinstance(exc, ValueError)
        assert "sync_every" in str(exc) and "rank 1 has sync_every=2" in str(exc), str(exc)


@pytest.mark.timeout(30)
def test_mismatched_models_fail_on_every_rank():
    def body(comm):
        try:
            gradsync.LocalSGD(nn.Linear(3, 2 + comm.rank % 2), sync_every=2, group=comm)
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    for exc in run_threads(2, body, timeout_s=20):
        assert isinstance(exc, gradsync.CollectiveMismatchError), exc


@pytest.mark.timeout(30)
def test_silent_peer_times_out():
    """A rank that never averages: the others raise CollectiveTimeoutError instead of hanging."""
    def body(comm):
        model = gradsync.LocalSGD(nn.Linear(2, 2), sync_every=1, group=comm, timeout=0.5)
        if comm.rank == 1:
            return None
        try:
            model.step()
        except gradsync.CollectiveTimeoutError as exc:
            return exc
        return None

    exc = run_threads(2, body, timeout_s=20)[0]
    assert isinstance(exc, gradsync.CollectiveTimeoutError) and "peer rank 1" in str(exc), exc


def test_single_rank_wrapper_and_forward():
    comm = gradsync.Communicator(ThreadWorld(1).transport(0))
    inner = nn.Linear(2, 1)
    model = gradsync.LocalSGD(inner, sync_every=2, group=comm)
    x = torch.randn(4, 2)
    assert torch.equal(model(x), inner(x))
    with model.no_sync():
        pass
    assert [model.step(), model.step(), model.step()] == [False, True, False]
    assert model.averages == 1 and model.local_steps == 1
    assert model.exposed_comm_seconds == model.comm_seconds >= 0
