"""Shared pieces of the parameter-server tests: a vector model, one-hot gradients, thread groups."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import gradsync
from gradsync.collectives import Communicator
from gradsync.transport.thread import ThreadWorld

COLLECTIVE_TIMEOUT_S = 15.0


@pytest.fixture(autouse=True, scope="module")
def warm_optimizer():
    """torch's first optimizer.step() in a process takes ~1 s (lazy imports): pay it before any timed test."""
    param = nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    torch.optim.SGD([param], lr=1.0).step()


class Vector(nn.Module):
    """One trainable vector of ``numel`` zeros."""

    def __init__(self, numel: int, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel, dtype=dtype))


def one_hot(numel: int, index: int, dtype=torch.float32) -> torch.Tensor:
    grad = torch.zeros(numel, dtype=dtype)
    grad[index] = 1.0
    return grad


def thread_comm(world: ThreadWorld, rank: int, timeout_s: float = 10.0) -> Communicator:
    return Communicator(world.transport(rank), timeout_s=timeout_s)



def catch(call):
    """Run ``call``; return (exception or None, result, seconds)."""
    started = time.monotonic()
    try:
        return None, call(), time.monotonic() - started
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc, None, time.monotonic() - started


def onehot_server(comm, total_steps: int, max_staleness=None, numel: int | None = None, **kwargs) -> dict:
    """Serve ``total_steps`` one-hot steps with SGD lr 1 on a zero vector; returns what the server saw."""
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
