"""A communicator's plans by layout: an AllReduce whose arguments were checked once runs its plan directly.

A fast path (:mod:`~gradsync.collectives.fast_path`) may hand :func:`~gradsync.collectives.validate.start_call`
a plan (``fast_path.Plan``) for a call's layout (the one-host small-call round, for instance); the
communicator keeps it under :func:`plan_key` (``Communicator.plans``), so a
repeated call checks its arguments, resolves its algorithm and fingerprints
its options once (:func:`gradsync.collectives.ops.all_reduce`).
"""

from __future__ import annotations

import math

import torch

_STRIDED = torch.strided
MAX_PLANS = 512  # layouts kept per communicator (a program has a handful; a pathological one stays bounded)


def plan_key(tensor, op, algorithm, timeout) -> tuple | None:
    """The layout a plan is kept under, or None when the arguments are of a kind never planned (the
    full checks then run). Everything the argument checks read is in it; a timeout is checked per call."""
    if type(tensor) is not torch.Tensor or type(op) is not str or type(algorithm) is not str:
        return None
    if timeout is not None and not (type(timeout) in (int, float) and 0 < timeout < math.inf):
        return None
    if tensor.layout is not _STRIDED:
        return None
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.is_inference(),
            torch.is_inference_mode_enabled(), op, algorithm)


def keep(plans: dict, key: tuple | None, plan) -> None:
    """Keep ``plan`` under ``key`` (forgetting every plan when ``MAX_PLANS`` are kept)."""
    if key is None:
        return
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan
