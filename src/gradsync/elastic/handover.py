"""What an elastic membership hands over: rank 0's state on every rank, as ``torch.save`` bytes."""

from __future__ import annotations

import io

import torch

from gradsync import api


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
    api.broadcast(length, src=0)
    if before_payload is not None:
        before_payload()
    if payload is None:
        payload = torch.empty(int(length[0]), dtype=torch.uint8)
    api.broadcast(payload, src=0)
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)


def clone(state):
    """A deep copy of the tensors in nested dicts and lists (a compressor's state, kept past the next step)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {key: clone(value) for key, value in state.items()}
    if isinstance(state, list):
        return [clone(value) for value in state]
    return state
