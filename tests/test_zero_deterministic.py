"""--deterministic at every shard level: the same bits for shard none/optimizer/gradients/parameters and world
size 1, 2, 4.

DeterministicDataParallel sums micro-shard gradients exactly; with sharding the int64 sum is
reduce-scattered and each rank converts and steps only its chunk. The parameters after several
AdamW, LARS or LAMB steps with clipping must be bitwise equal to the unsharded single-rank run's. At "parameters"
(ZeRO-3) the model has three units (two named layers and the root's LayerNorm), each gathered for
every micro-shard's forward and backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from _dist import run_threads

torch.set_num_threads(1)
STEPS, BATCH, MICRO_SHARDS = 4, 24, 4


def _build() -> nn.Module:  # 54+9 + 9+9 + 45+5 = 131: odd, padded; LayerNorm stays in the root unit
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.LayerNorm(9), nn.Linear(9, 5))


UNITS = ["0", "3"]  # with the root (the LayerNorm): three units, three buckets


torch.manual_seed(0)
_INITIAL = _build().state_dict()
_DATA = [(torch.randn(BATCH, 6), torch.randint(0, 5, (BATCH,))) for _ in range(STEPS)]


OPTIMIZERS = {"adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
              "lars": lambda params: gradsync.optim.LARS(params, lr=1.0, weight_decay=1e-3),
              "lamb": lambda params: gradsync.optim.LAMB(params, lr=0.01, weight_decay=0.01)}


def _train(comm, shard: str, clip: float | None, name: str = "adamw"):
    module = _build()
    module.load_state_dict(_INITIAL)  # threads share torch's RNG: the same initial model from outside
    model = gradsync.DeterministicDataParallel(module, num_micro_shards=MICRO_SHARDS, group=comm, shard=shard,
                                               units=UNITS if shard == "parameters" else None)
    optimizer = model.shard_optimizer(OPTIMIZERS[name](model.parameters()))
    for step, (x, y) in enumerate(_DATA):
        bounds = model.shard_bounds(len(x))
        for index in model.local_shards():
            start, stop = bounds[index]
            with model.micro_shard(index, step) as micro:
                micro.backward(F.cross_entropy(model(x[start:stop]), y[start:stop], reduction="sum"))
        model.synchronize(divisor=len(x))
        if clip is not None:
            gradsync.clip_grad_norm_(model, clip)
        optimizer.step()
        optimizer.zero_grad()
    model.check_replicas()
    with model.full_parameters():
        return [p.detach().clone() for p in model.module.parameters()]


@pytest.mark.parametrize("clip,name", [(None, "adamw"), (0.05, "adamw"), (None, "lars"), (0.05, "lamb")])
def test_the_same_bits_at_every_shard_level_and_world_size(clip, name):
    """AdamW, LARS and LAMB (whose trust ratios sum each parameter's squares exactly across its pieces):
    bitwise the unsharded single rank's parameters at every level and world size 1, 2, 4."""
    reference = run_threads(1, lambda comm: _train(comm, "none", clip, name))[0]
    for world_size in (1, 2, 4):
        for shard in ("none", "optimizer", "gradients", "parameters"):
            if (world_size, shard) == (1, "none"):
                continue
            results = run_threads(world_size, lambda comm: _train(comm, shard, clip, name))
            for params in results:
                assert all(torch.equal(got, want) for got, want in zip(params, reference)), (world_size, shard)


def test_parameters_sharding_frees_the_units_and_refuses_uneven_micro_shards():
    """At "parameters" a unit is empty outside its forward and backward and the int64 sum is laid out unit
    by unit, each padded; M not a multiple of the world size is refused on every rank (each micro-shard's
    gathers are collective)."""
    def build(comm, micro_shards):
        try:
            model = gradsync.DeterministicDataParallel(_build(), num_micro_shards=micro_shards, group=comm,
                                                       shard="parameters", units=UNITS)
        except ValueError as error:
            return str(error)
        return [tuple(p.shape) for p in model.module.parameters()], model._layout.bases, model._padded

    shapes, bases, padded = run_threads(2, lambda comm: build(comm, 4))[0]
    assert shapes == [(0,)] * 6
    # units in reverse order of their first parameter, the root last: "3" (45+5), "0" (54+9 -> 64), root (9+9)
    assert (bases, padded) == ([0, 50, 114], 132)
    for message in run_threads(2, lambda comm: build(comm, 3)):
        assert "num_micro_shards 3 is not a multiple of the world size 2" in message
