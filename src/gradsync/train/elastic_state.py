"""What an elastic membership hands over and checks: rank 0's state on every rank, equal replicas."""

from __future__ import annotations

import io

import torch

import gradsync


def broadcast_state(state: dict | None, before_payload=None) -> dict:
    """Rank 0's ``state`` on every rank (collective; ``torch.save`` bytes: tensors, numbers, lists, dicts).

    ``before_payload``: called between the length and the payload (fault injection).
    """
    if state is not None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        payload, length = None, torch.zeros(1, dtype=torch.int64)
    gradsync.broadcast(length, src=0)
    if before_payload is not None:
        before_payload()
    if payload is None:
        payload = torch.empty(int(length[0]), dtype=torch.uint8)
    gradsync.broadcast(payload, src=0)
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)


def check_replicas_equal(module: torch.nn.Module) -> bool:
    """Whether every member holds the same parameter bits (collective: rank 0's bytes against each rank's)."""
    flat = torch.cat([p.detach().reshape(-1).view(torch.uint8) if p.dtype != torch.bool else p.reshape(-1)
                      for p in module.state_dict().values()]).clone()
    reference = flat.clone()
    gradsync.broadcast(reference, src=0)
    unequal = torch.tensor([int(not torch.equal(flat, reference))], dtype=torch.int64)
    gradsync.all_reduce(unequal, op="sum")
    return int(unequal[0]) == 0


def clone(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {key: clone(value) for key, value in state.items()}
    if isinstance(state, list):
        return [clone(value) for value in state]
    return state
