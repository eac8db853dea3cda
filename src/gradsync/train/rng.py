"""The global RNG states (torch, numpy, python) as checkpointable data, and a fresh per-rank stream.

The states are tensors, numbers and strings, so they load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """torch, numpy and python RNG states as tensors and numbers."""
    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    return _as_data(torch.get_rng_state(), (kind, keys, position, has_gauss, cached_gauss), random.getstate())


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss_next"]))


def stream_seed(seed: int, rank: int) -> int:
    """A 32-bit seed derived from ``(seed, rank)`` (numpy's SeedSequence): distinct ranks, distinct streams."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, rank, 0x67726164]).generate_state(1)[0])


def fresh_rng_state(seed: int, rank: int) -> dict:
    """The :func:`rng_state` of generators seeded with :func:`stream_seed` ``(seed, rank)``; touches no global one."""
    derived = stream_seed(seed, rank)
    torch_state = torch.Generator().manual_seed(derived).get_state()
    return _as_data(torch_state, np.random.RandomState(derived).get_state(), random.Random(derived).getstate())


def _as_data(torch_state: torch.Tensor, numpy_state: tuple, python_state: tuple) -> dict:
    kind, keys, position, has_gauss, cached_gauss = numpy_state
    version, state, gauss_next = python_state
    return {"torch": torch_state,
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(position),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gauss)},
            "python": {"version": version, "state": torch.tensor(state, dtype=torch.int64),
                       "gauss_next": gauss_next}}
