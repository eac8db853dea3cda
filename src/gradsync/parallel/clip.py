"""Global-norm gradient clipping that sees every shard: ``gradsync.clip_grad_norm_(model, max_norm)``.

``torch.nn.utils.clip_grad_norm_`` over a sharded model's parameters would
see no gradient (``.grad`` is None under ZeRO) or, on the optimizer's pieces,
only this rank's share of the norm. Here the norm is taken over the whole
model: each rank sums its pieces' ``|g|^p`` and one AllReduce adds the ranks'
sums (FSDP's ``clip_grad_norm_`` and DeepSpeed's do the same); an unsharded
model, whose gradients are equal on every rank, needs no communication.

Under :class:`~gradsync.parallel.deterministic.DeterministicDataParallel` the
2-norm is summed exactly: squares of float32 gradients are exact in float64,
turned into int64 fixed point with one shared scale (as the deterministic
gradients themselves, :mod:`~gradsync.parallel.exact_sum`), summed as
integers, so the norm, the clipping coefficient and hence the parameters have
the same bits at every world size and shard level.
"""

from __future__ import annotations

import math

import torch

from gradsync.collectives import ops as collectives
from gradsync.parallel.exact_sum import ZERO, NON_FINITE, exponent_codes, precision_bits


def _grads_and_group(model):
    """(gradients to clip, the group their norm spans or None, whether to sum exactly)."""
    zero = getattr(model, "_zero", None)
    exact = getattr(model, "exact_norm", False)
    if zero is not None:
        return [t.grad for t in zero.flat.piece_tensors if t.grad is not None], model.comm, exact
    module = getattr(model, "module", model)
    return [p.grad for p in module.parameters() if p.grad is not None], None, exact


@torch.no_grad()
def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the model's gradients in place so that their global ``norm_type``-norm is at most ``max_norm``.

    Args:
        model: a ``gradsync.DataParallel`` or ``DeterministicDataParallel`` (sharded or not), or a plain
            ``nn.Module`` (then exactly ``torch.nn.utils.clip_grad_norm_`` over its parameters).
        max_norm: > 0. ``norm_type``: a p >= 1 or ``inf``.
        error_if_nonfinite: raise if the norm is NaN or infinite (else the gradients become NaN, as torch's).

    Returns:
        The total norm before clipping, a float32 scalar tensor (equal on every rank).

    Raises:
        ValueError: ``max_norm`` not > 0, ``norm_type`` < 1; RuntimeError: a non-finite norm with
        ``error_if_nonfinite``.

    Collective (a sharded model): every rank calls it at the same point, after backward.
    """
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
    norm_type = float(norm_type)
    if not norm_type >= 1:
        raise ValueError(f"norm_type must be >= 1 or inf, got {norm_type!r}")
    grads, group, exact = _grads_and_group(model)
    if exact and norm_type == 2.0:
        total = _exact_two_norm(grads, group)
    else:
        total = _norm(grads, group, norm_type)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total}), so it "
                           f"cannot be clipped")
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)
    return torch.tensor(total, dtype=torch.float32)


def _norm(grads: list[torch.Tensor], group, norm_type: float) -> float:
    """The global norm in float64: local partial sums (or maxima), combined over ``group``."""
    if norm_type == math.inf:
        local = max((float(g.detach().abs().max()) for g in grads if g.numel()), default=0.0)
        if group is None or group.world_size == 1:
            return local
        gathered = collectives.all_gather(torch.tensor([local], dtype=torch.float64), group, verify=False)
        return max(float(value) for value in gathered)
    local = torch.zeros(1, dtype=torch.float64)
    for grad in grads:  # accumulated in float64 without a float64 copy of the gradient
        local += torch.linalg.vector_norm(grad.detach(), norm_type, dtype=torch.float64) ** norm_type
    if group is not None and group.world_size > 1:
        collectives.all_reduce(local, group, op="sum", verify=False)
    return float(local) ** (1.0 / norm_type)


def _exact_two_norm(grads: list[torch.Tensor], group) -> float:
    """The 2-norm from an exact integer sum of squares (the same bits whatever holds which elements)."""
    squares = [grad.detach().double().square().reshape(-1) for grad in grads]
    codes = exponent_codes(squares)
    local_code = max(codes, default=ZERO - 1)
    numel = sum(square.numel() for square in squares)
    if group is not None and group.world_size > 1:
        header = torch.tensor([local_code, numel], dtype=torch.int64)
        rows = collectives.all_gather(header, group, verify=False)
        exponent, numel = max(int(row[0]) for row in rows), sum(int(row[1]) for row in rows)
    else:
        exponent = local_code
    if exponent >= NON_FINITE:
        return math.nan
    if exponent <= ZERO:
        return 0.0
    bits = precision_bits(max(numel, 1))
    total = torch.zeros(1, dtype=torch.int64)
    for square in squares:  # every element scaled by the shared power of two, rounded, summed as integers
        total += square.mul(2.0 ** (bits - exponent)).round_().to(torch.int64).sum()
    if group is not None and group.world_size > 1:
        collectives.all_reduce(total, group, op="sum", verify=False)
    return math.sqrt(math.ldexp(float(total), exponent - bits))
