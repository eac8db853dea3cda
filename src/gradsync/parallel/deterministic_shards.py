"""DeterministicDataParallel's int64 sum laid out as ZeRO's buckets: reduce-scattered, each rank converting its chunk.

The exact sum (:mod:`~gradsync.parallel.exact_sum`) is one int64 buffer with
every parameter's fixed-point gradient at its own offset, then the loss.
Unsharded, the parameters lie back to back in registration order. At
``shard="optimizer"`` and ``"gradients"`` (ZeRO-1/2) the buffer is laid out
as one ZeRO bucket of every parameter (:mod:`~gradsync.parallel.shard_layout`:
the same order, padded to a multiple of the world size). At
``shard="parameters"`` (ZeRO-3) it is one bucket per unit and dtype
(:mod:`~gradsync.parallel.units`), the padded buckets one after another;
each is reduce-scattered in place, so rank r holds the exact sum of its
chunk of every bucket, and converts exactly those elements into its
optimizer pieces' ``.grad``.

The bits do not depend on the layout: each element's integer is computed
alone (a scaling by a power of two and a rounding), the integer sum is exact
in any grouping, and the conversion back is element by element.

>>> from torch import nn
>>> net = nn.Linear(3, 2)
>>> layout = ExactSumLayout(net, list(net.named_parameters()), None, "ring", "none", [])
>>> layout.bounds, layout.numel, layout.largest_segment
([(0, 6), (6, 8)], 8, 8)
"""

from __future__ import annotations

import torch

from gradsync.collectives.scatter_gather import reduce_scatter_flat
from gradsync.parallel.exact_sum import NO_VALUE, add_fixed_point_many, from_fixed_point
from gradsync.parallel.zero import ZeroState, unit_assignment

UNIT_CAP_MB = 25.0  # ZeRO-3's units chosen by size: at most this many MiB of parameters each (DataParallel's default)


class ExactSumLayout:
    """Where each parameter's fixed-point gradient lies in the int64 accumulator; at a ZeRO level, the sharded state.

    Args:
        module: the wrapped module; ``named``: its trainable ``(name, parameter)`` pairs (index = parameter index).
        comm, algorithm: the model's group and the reduce-scatter's algorithm.
        shard: ``"none"``, ``"optimizer"``, ``"gradients"`` or ``"parameters"``.
        units: ZeRO-3's units, root last (:func:`~gradsync.parallel.zero.zero_units`); empty below ``"parameters"``.

    Attributes:
        zero: the :class:`~gradsync.parallel.zero.ZeroState` (None unsharded): built here, it frees ZeRO-3's
            parameters, so build this after the parameters are checked and broadcast.
        segments: per bucket ``(base, parameter indices, their (start, stop) in the bucket)``: a run of the
            accumulator from ``base`` that holds those parameters back to back (unsharded: one segment).
        bases: per bucket, its first element in the accumulator.
        bounds: per parameter, ``(start, stop)`` in the accumulator.
        numel: the accumulator's elements before the loss (padded buckets included).
        largest_param, largest_segment: the most elements of one parameter, of one segment (scratch sizes).
    """

    def __init__(self, module, named, comm, algorithm: str, shard: str, units):
        numels = [param.numel() for _, param in named]
        self.comm, self.algorithm, self.zero = comm, algorithm, None
        if shard == "none":
            self.bases, sizes = [0], [sum(numels)]
            assignment = [list(range(len(numels)))]
        else:
            params = [param for _, param in named]
            assignment, unit_buckets = (unit_assignment(units, params) if shard == "parameters"
                                        else ([list(range(len(named)))], None))
            self.zero = ZeroState(module, named, assignment, comm, algorithm, shard, units=units or None,
                                  unit_buckets=unit_buckets)
            sizes = self.zero.layout.padded_numel
            self.bases = [sum(sizes[:bucket]) for bucket in range(len(sizes))]
        self.segments, self.bounds = [], [(0, 0)] * len(numels)
        for base, indices in zip(self.bases, assignment):
            local, offset = [], 0
            for index in indices:
                local.append((offset, offset + numels[index]))
                self.bounds[index] = (base + offset, base + offset + numels[index])
                offset += numels[index]
            self.segments.append((base, indices, local))
        self.numel = sum(sizes)
        self.largest_param = max(numels, default=0)
        self.largest_segment = max((local[-1][1] for _, _, local in self.segments if local), default=0)

    def accumulate(self, accumulator: torch.Tensor, grads: list, codes: list[int], bits: int,
                   work: torch.Tensor, integers: torch.Tensor) -> None:
        """Add one micro-shard's ``grads`` (per parameter, None where it had none) to ``accumulator`` as fixed
        point with each parameter's shared exponent ``codes`` (``add_fixed_point_many``, one call per segment).
        ``work``: float32 and ``integers``: int64 scratch of at least ``largest_segment`` elements."""
        for base, indices, local in self.segments:
            if not indices:
                continue
            add_fixed_point_many(accumulator[base:base + local[-1][1]], local, [grads[i] for i in indices],
                                 [codes[i] for i in indices], bits, work, integers)

    def reduce_scatter(self, accumulator: torch.Tensor, run) -> None:
        """Reduce-scatter each bucket's run of ``accumulator`` in place (rank r's chunk then holds the sum);
        ``run(collective, *args, bucket=b, **kwargs)`` calls and times it. Collective, every rank in bucket order."""
        for bucket, (base, size) in enumerate(zip(self.bases, self.zero.layout.padded_numel)):
            run(reduce_scatter_flat, accumulator[base:base + size], self.comm, algorithm=self.algorithm,
                bucket=bucket)

    def write_shards(self, accumulator: torch.Tensor, codes: list[int], bits: int, divisor: float,
                     scratch: torch.Tensor) -> None:
        """This rank's chunk of the exact sum, divided by ``divisor``, as its optimizer pieces' ``.grad`` (the
        same bits, element for element, as the whole gradient unsharded); every parameter's ``.grad`` None.
        ``scratch``: float64 of at least the largest parameter's elements."""
        zero = self.zero
        for k, (piece, tensor) in enumerate(zip(zero.flat.pieces, zero.flat.piece_tensors)):
            code = codes[piece.param]
            if code == NO_VALUE:
                tensor.grad = None
                continue
            start = self.bases[piece.bucket] + piece.flat_start
            from_fixed_point(accumulator[start:start + piece.numel], code, bits, divisor, tensor.dtype, scratch,
                             out=zero.grads.grad_view(k))
            tensor.grad = zero.grads.grad_view(k)
        for param in zero.params:
            param.grad = None
