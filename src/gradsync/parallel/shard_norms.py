"""Whole-parameter norms for LARS/LAMB's trust ratios when each rank steps pieces of parameters (ZeRO-1/2/3).

A sharded optimizer steps this rank's *pieces* (:mod:`~gradsync.parallel.shard_layout`): the part of a
parameter inside its chunk of a bucket, a 1-D view. The trust ratio needs the norm of the whole
parameter, of its weight and of its update, so :class:`ShardNorms` (installed by
:class:`~gradsync.parallel.sharded_optimizer.ShardedOptimizer` into a
:class:`~gradsync.optim.trust.LayerwiseOptimizer`) sums the squares of each piece into a vector of
per-parameter partial sums, ``(parameters x quantities,)``, and one small AllReduce adds the ranks'
vectors: every rank then holds every parameter's sums and steps its pieces with the same ratio.
FSDP's and DeepSpeed's gradient clipping reduce partial norms the same way; so does
:func:`gradsync.clip_grad_norm_` for the one global norm.

Exact (``exact=True``, under :class:`~gradsync.parallel.deterministic.DeterministicDataParallel`): the
squares of float32 values are exact in float64; each is turned into int64 fixed point with one
power-of-two scale per (parameter, quantity), the largest exponent over every rank
(:mod:`~gradsync.parallel.exact_sum`), so the sums are integers added exactly and the norms have the
same bits whatever the world size and shard level (one all_gather of the exponents, one AllReduce of the
integers). Whole tensors under ``exact=True`` (``shard="none"``) take the same fixed-point sum without
communication, so they agree with the sharded runs bit for bit.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from gradsync.collectives import ops as collectives
from gradsync.optim.trust import TensorNorms
from gradsync.parallel.exact_sum import NO_VALUE, NON_FINITE, ZERO, exponent_codes, precision_bits


class ShardNorms(TensorNorms):
    """Sums of squares of whole parameters from pieces held across ranks (see the module docstring).

    Args:
        segment_of: ``{id(piece tensor): parameter index}`` for every tensor the optimizer steps; None:
            each tensor is a whole parameter of its own (no communication).
        ndims: per parameter index, its dimensions (a freed ZeRO-3 parameter's own, not its storage's).
        numels: per parameter index, its element count.
        comm: the group the pieces are spread over (None or one rank: local sums).
        exact: int64 fixed-point sums (the same bits at any world size) instead of float64 ones.
    """

    def __init__(self, segment_of: dict[int, int] | None = None, ndims: Sequence[int] = (),
                 numels: Sequence[int] = (), comm=None, exact: bool = False):
        self.segment_of, self.ndims, self.numels = segment_of, list(ndims), list(numels)
        self.comm, self.exact = comm, exact

    def ndim(self, tensor: torch.Tensor) -> int:
        return tensor.ndim if self.segment_of is None else self.ndims[self.segment_of[id(tensor)]]

    def sums_of_squares(self, tensors: Sequence[torch.Tensor],
                        columns: Sequence[Sequence[torch.Tensor | None]]) -> torch.Tensor:
        """As :meth:`TensorNorms.sums_of_squares`; collective over ``comm`` (every rank calls it once per step,
        holding pieces or not)."""
        if self.segment_of is None:
            rows, numels = list(range(len(tensors))), [tensor.numel() for tensor in tensors]
        else:
            rows, numels = [self.segment_of[id(tensor)] for tensor in tensors], self.numels
        width = len(columns)
        entries = [(rows[i] * width + j, value.detach()) for j, column in enumerate(columns)
                   for i, value in enumerate(column) if value is not None and value.numel()]
        slots = (len(tensors) if self.segment_of is None else len(self.ndims)) * width
        group = self.comm if self.comm is not None and self.comm.world_size > 1 else None
        if self.exact:
            sums = _exact_sums(entries, [numels[slot // width] for slot in range(slots)], group)
        else:
            sums = _float_sums(entries, slots, group)
        return sums.view(-1, width)[rows] if rows else torch.zeros(0, width, dtype=torch.float64)


def _float_sums(entries: list[tuple[int, torch.Tensor]], slots: int, group) -> torch.Tensor:
    """``(slots,)`` float64: each slot's sum of squares over its entries, added over ``group``."""
    sums = torch.zeros(slots, dtype=torch.float64)
    if entries:
        squares = torch.stack([torch.linalg.vector_norm(value, dtype=torch.float64).square() for _, value in entries])
        sums.index_add_(0, torch.tensor([slot for slot, _ in entries], dtype=torch.int64), squares)
    if group is not None:
        collectives.all_reduce(sums, group, op="sum", verify=False)
    return sums


def _exact_sums(entries: list[tuple[int, torch.Tensor]], numels: list[int], group) -> torch.Tensor:
    """``(len(numels),)`` float64: each slot's sum of squares, summed exactly (int64 fixed point, the slot's
    exponent the largest over ``group``; ``numels[slot]`` elements contribute in all)."""
    squares = [value.double().square().reshape(-1) for _, value in entries]  # exact: float32 squares fit float64
    exponents = torch.full((len(numels),), NO_VALUE, dtype=torch.int64)
    for (slot, _), code in zip(entries, exponent_codes(squares)):
        exponents[slot] = max(int(exponents[slot]), code)
    if group is not None:
        exponents = torch.stack(collectives.all_gather(exponents, group, verify=False)).amax(dim=0)
    exponents = exponents.tolist()
    totals = torch.zeros(len(numels), dtype=torch.int64)
    for (slot, _), square in zip(entries, squares):
        exponent = exponents[slot]
        if ZERO < exponent < NON_FINITE:
            bits = precision_bits(max(numels[slot], 1))
            totals[slot] += square.mul(2.0 ** (bits - exponent)).round_().to(torch.int64).sum()
    if group is not None:
        collectives.all_reduce(totals, group, op="sum", verify=False)
    out = []
    for slot, (total, exponent) in enumerate(zip(totals.tolist(), exponents)):
        if exponent >= NON_FINITE:
            out.append(math.nan)
        elif exponent <= ZERO:
            out.append(0.0)
        else:
            out.append(math.ldexp(float(total), exponent - precision_bits(max(numels[slot], 1))))
    return torch.tensor(out, dtype=torch.float64)
