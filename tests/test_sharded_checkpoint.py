"""ZeRO optimizer state in checkpoints, over thread ranks: each rank's shard saved, consolidated, loaded again.

The reference is plain torch in one process (the same model on the concatenated batches); a shard
consolidated must equal its optimizer state, and training resumed from it at another world size or
shard level must follow its parameters (allclose, rtol 1e-5); resumed at the same world size and level
from each rank's own shard, it must be bitwise the run that was never stopped.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradsync
from gradsync.fault import checkpoint
from gradsync.parallel.sharded_state import consolidate
from gradsync.train import resume, sharded_checkpoint
from gradsync.train.config import TrainConfig
from gradsync.train.setup import make_scheduler
from gradsync.train.state import TrainState
from _dist import run_threads

torch.set_num_threads(1)


def _build() -> nn.Module:
    # odd element counts (7x5, 7, 3x7, 3): buckets padded, parameters cut between ranks
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


torch.manual_seed(0)
_INITIAL = _build().state_dict()  # threads share torch's RNG: models are built from this, never seeded in them


def _model(state: dict | None = None) -> nn.Module:
    model = _build()
    model.load_state_dict(_INITIAL if state is None else state)
    return model


def _batches(steps: int, world_size: int = 6, seed: int = 1):
    """Batches of 12 samples (split evenly over 1, 2, 3 or 4 ranks)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 5, generator=generator), torch.randn(12, 3, generator=generator)) for _ in range(steps)]


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def _reference(name: str, batches) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = _optimizer(name, model.parameters())
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model, optimizer


def _steps(comm, model, optimizer, batches) -> None:
    rank, world_size = comm.rank, comm.world_size
    for x, y in batches:
        rows = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    with torch.no_grad():
        model(batches[0][0])  # waits for the last all-gather


def _wrapped(comm, shard: str, name: str, model_state: dict | None = None):
    model = gradsync.DataParallel(_model(model_state), group=comm, shard=shard, bucket_cap_mb=1e-4,
                                  algorithm="ring")
    return model, model.shard_optimizer(_optimizer(name, model.parameters()))


def _assert_state_close(got: dict, want: dict, exact: bool = False) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for position, entry in want["state"].items():
        assert got["state"][position].keys() == entry.keys()
        for key, value in entry.items():
            if exact:
                assert torch.equal(got["state"][position][key], value), (position, key)
            else:
                torch.testing.assert_close(got["state"][position][key], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("shard, world_size", [("optimizer", 2), ("gradients", 3)])
def test_every_rank_shard_consolidates_into_the_unsharded_state(name, shard, world_size):
    """Each rank's state_dict holds its pieces only; consolidated, they are the one-process optimizer's."""
    batches = _batches(4)
    _, reference = _reference(name, batches)

    def body(comm):
        model, optimizer = _wrapped(comm, shard, name)
        _steps(comm, model, optimizer, batches)
        return optimizer.state_dict()

    shards = run_threads(world_size, body)
    owned = [sum(value.numel() for entry in s["state"].values() for key, value in entry.items() if key != "step")
             for s in shards]
    per_state = 2 if name == "adamw" else 1  # exp_avg, exp_avg_sq / momentum_buffer
    assert sum(owned) == per_state * sum(p.numel() for p in _build().parameters())  # every element once
    _assert_state_close(consolidate(list(reversed(shards))), reference.state_dict())


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_shard_resumes_bitwise_and_a_consolidated_state_at_any_world_size_and_level(name):
    """Saved after 3 of 6 steps at (2 ranks, gradients): each rank's own shard continues bitwise like the
    run that never stopped; the consolidated state continues at (3 ranks, optimizer) and in one unsharded
    torch optimizer like the one-process reference."""
    batches = _batches(6)
    reference_model, _ = _reference(name, batches)

    def first(comm):
        model, optimizer = _wrapped(comm, "gradients", name)
        _steps(comm, model, optimizer, batches[:3])
        saved = copy.deepcopy((model.module.state_dict(), optimizer.state_dict()))  # state_dict() holds references
        _steps(comm, model, optimizer, batches[3:])
        return saved, [p.detach().clone() for p in model.module.parameters()]

    halves = run_threads(2, first)
    model_state = halves[0][0][0]
    shards = [saved[1] for saved, _ in halves]
    whole = consolidate(shards)

    def again(comm, shard, state):
        model, optimizer = _wrapped(comm, shard, name, model_state)
        optimizer.load_state_dict(state(comm.rank))
        _steps(comm, model, optimizer, batches[3:])
        return [p.detach().clone() for p in model.module.parameters()]

    same = run_threads(2, lambda comm: again(comm, "gradients", lambda rank: shards[rank]))
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(same[rank], halves[rank][1]))
    other = run_threads(3, lambda comm: again(comm, "optimizer", lambda rank: whole))
    plain = _model(model_state)
    optimizer = _optimizer(name, plain.parameters())
    optimizer.load_state_dict(whole)
    for x, y in batches[3:]:
        optimizer.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        optimizer.step()
    for params in [*other, list(plain.parameters())]:
        for got, want in zip(params, reference_model.parameters()):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)


def test_a_shard_of_another_world_size_is_refused_naming_consolidate():
    batches = _batches(1)

    def body(comm):
        model, optimizer = _wrapped(comm, "optimizer", "adamw")
        _steps(comm, model, optimizer, batches)
        return optimizer.state_dict()

    shard = run_threads(2, body)[0]

    def load(comm):
        _, optimizer = _wrapped(comm, "optimizer", "adamw")
        with pytest.raises(ValueError, match="consolidate"):
            optimizer.load_state_dict(shard)

    run_threads(3, load)


def _replica(comm, shard: str, model_state: dict | None = None) -> resume.Replica:
    model, optimizer = _wrapped(comm, shard, "adamw", model_state)
    return resume.Replica(model, optimizer, make_scheduler(optimizer, TrainConfig(lr_schedule="constant"), 10))


def test_a_sharded_checkpoint_has_one_shard_per_rank_file_and_exports_whole(tmp_path):
    """checkpoint.save at (3 ranks, gradients): shared.pt holds the model and the level, not the optimizer; each
    rank file its shard. export_checkpoint's optimizer is the one-process reference's; every rank of
    (2 ranks, optimizer) and an unsharded replica restore it from the rank files."""
    batches = _batches(3)
    reference_model, reference = _reference("adamw", batches)
    make_scheduler(reference, TrainConfig(lr_schedule="constant"), 10)  # its groups get "initial_lr" as the saved
    metrics = {"path": "metrics.jsonl", "nbytes": 0, "sha256": ""}

    def save(comm):
        replica = _replica(comm, "gradients")
        _steps(comm, replica.model, replica.optimizer, batches)
        state = TrainState(step=3)
        own = resume.rank_state(state, replica)
        shared = resume.shared_state(state, replica, TrainConfig(), metrics, 1.0) if comm.rank == 0 else None
        checkpoint.save(tmp_path / "ckpt", 3, shared, own, comm)

    run_threads(3, save)
    found = checkpoint.latest(tmp_path / "ckpt")
    shared = found.load_shared()
    assert found.world_size == 3 and shared["shard"] == "gradients" and "optimizer" not in shared
    assert shared["bucket_layout"] is None
    assert [found.load_rank(r)[sharded_checkpoint.SHARD_KEY]["shard"]["rank"] for r in range(3)] == [0, 1, 2]
    exported = sharded_checkpoint.export_checkpoint(tmp_path / "ckpt", tmp_path / "whole.pt")
    on_disk = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert on_disk["step"] == 3 and on_disk["shard"] == "gradients" and on_disk["world_size"] == 3
    _assert_state_close(on_disk["optimizer"], reference.state_dict())
    _assert_state_close(exported["optimizer"], on_disk["optimizer"], exact=True)
    for name, tensor in reference_model.state_dict().items():
        torch.testing.assert_close(on_disk["model"][name], tensor, rtol=1e-5, atol=1e-6)

    def restore(comm, shard):
        replica = _replica(comm, shard)
        every = sharded_checkpoint.needs_every_rank(shared, 3, comm.world_size, replica.sharded)
        resume.restore_replica(replica, shared, {}, sharded_checkpoint.every_rank(found) if every else None)
        return every, replica.optimizer.state_dict(), replica.model.module.state_dict()

    for shard, world_size in (("optimizer", 2), ("none", 1)):
        results = run_threads(world_size, lambda comm: restore(comm, shard))
        assert all(every for every, _, _ in results)
        states = [state for _, state, _ in results]
        _assert_state_close(consolidate(states) if shard != "none" else states[0], on_disk["optimizer"], exact=True)
        for _, _, model_state in results:
            assert all(torch.equal(model_state[name], tensor) for name, tensor in on_disk["model"].items())


def test_export_refuses_what_is_not_a_sync_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="no complete gradsync train checkpoint"):
        sharded_checkpoint.export_checkpoint(tmp_path, tmp_path / "out.pt")

    class _Comm:
        rank, world_size = 0, 1

    # a local-SGD checkpoint: each rank's model is in its own file
    folder = checkpoint.save(tmp_path / "ckpt", 1, {"config": {}}, {"model": {}}, _Comm())
    with pytest.raises(ValueError, match="local-SGD"):
        sharded_checkpoint.export_checkpoint(folder, tmp_path / "out.pt")
