"""ZeRO-1/2 over real processes (Gloo): sharded DataParallel trains as one process on the whole batch."""

from __future__ import annotations

import torch
from torch import nn

import gradsync
from _dist import run_world

STEPS, PER_RANK = 5, 4


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 11), nn.ReLU(), nn.Linear(11, 3))


def _data(world_size: int):
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(world_size * PER_RANK, 5, generator=generator),
             torch.randn(world_size * PER_RANK, 3, generator=generator)) for _ in range(STEPS)]


def _rank_training(shard: str, algorithm: str) -> list[torch.Tensor]:
    rank, world_size = gradsync.rank(), gradsync.world_size()
    model = gradsync.DataParallel(_build(), shard=shard, algorithm=algorithm, bucket_cap_mb=1e-4)
    optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01))
    for x, y in _data(world_size):
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        gradsync.clip_grad_norm_(model, 0.5)
        optimizer.step()
    model.check_replicas()
    return [p.detach().clone() for p in model.module.parameters()]


def _reference(world_size: int) -> list[torch.Tensor]:
    model = _build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    for x, y in _data(world_size):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def test_sharded_levels_over_gloo_match_one_process():
    expected = _reference(3)
    for shard in ("optimizer", "gradients"):
        for params in run_world(3, _rank_training, shard, "ring", timeout_s=90):
            for got, want in zip(params, expected):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
