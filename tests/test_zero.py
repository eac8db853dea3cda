"""ZeRO-1/2 (DataParallel(shard=...)): the same training as unsharded DataParallel, over thread ranks.

Each case trains a small model for some steps on every rank's own batches and compares the parameters
with a single-process run on the concatenated batches (the reference: plain torch, no gradsync), and
with unsharded DataParallel, allclose (rtol 1e-5); replicas are bitwise equal after every all-gather.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync
from _dist import run_threads

torch.set_num_threads(1)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # odd element counts (7x5, 5, 3x7, 3): buckets padded, parameters cut between ranks
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batches(steps: int, world_size: int, per_rank: int = 4, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(world_size * per_rank, 5, generator=generator),
             torch.randn(world_size * per_rank, 3, generator=generator)) for _ in range(steps)]


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def _reference(optimizer_name: str, batches, clip: float | None = None) -> list[torch.Tensor]:
    model = _model()
    optimizer = _optimizer(optimizer_name, model.parameters())
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _train(comm, shard: str, optimizer_name: str, batches, accumulate: int = 1, bucket_cap_mb: float = 25.0,
           compression=None, clip: float | None = None, algorithm: str = "ring"):
    model = gradsync.DataParallel(_model(), group=comm, shard=shard, bucket_cap_mb=bucket_cap_mb,
                                  compression=compression, algorithm=algorithm)
    optimizer = model.shard_optimizer(_optimizer(optimizer_name, model.parameters()))
    rank, world_size = comm.rank, comm.world_size
    for x, y in batches:
        per_rank = len(x) // world_size
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        optimizer.zero_grad()
        micro = len(xs) // accumulate
        for k in range(accumulate):
            part = slice(k * micro, (k + 1) * micro)
            if k < accumulate - 1:
                with model.no_sync():
                    (nn.functional.mse_loss(model(xs[part]), ys[part]) / accumulate).backward()
            else:
                (nn.functional.mse_loss(model(xs[part]), ys[part]) / accumulate).backward()
        if clip is not None:
            gradsync.clip_grad_norm_(model, clip)
        optimizer.step()
        model.check_replicas()
    model(xs)  # waits for the last all-gather
    return [p.detach().clone() for p in model.module.parameters()]


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_training_matches_one_process(shard, optimizer_name, world_size):
    batches = _batches(12, world_size)
    expected = _reference(optimizer_name, batches)
    results = run_threads(world_size, lambda comm: _train(comm, shard, optimizer_name, batches, bucket_cap_mb=1e-4))
    for params in results:
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for params in results[1:]:  # replicas bitwise equal
        assert all(torch.equal(a, b) for a, b in zip(params, results[0]))
