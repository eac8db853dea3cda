"""PowerSGD: rank-r approximation of each gradient matrix by one warm-started power iteration.

Vogels, Karimireddy & Jaggi 2019, "PowerSGD: Practical low-rank gradient
compression for distributed optimization" (Algorithm 1), as PyTorch's
``powerSGD_hook``. For each parameter viewed as an n x m matrix M (first
dimension x the rest), with error feedback e:

    M <- M + e;  P <- M Q;  all-reduce P (sum);  P <- orthogonalise(P)
    Q <- M^T P;  all-reduce Q (sum) / ranks;     approximation = P Q^T
    e <- M - P (M^T P)^T (this rank's own projection);  keep Q for the next step (warm start)

After the orthogonalisation P is the same on every rank, so P Q^T is the
average of the ranks' projections onto span(P): the average, divided once.
(With every rank contributing, the residuals sum to PyTorch's M - approximation
summed over ranks; under join a rank without data keeps its own residual.)
Per matrix (n + m) · r values travel instead of n · m. Parameters where that
saves less than half (1-D biases, tiny or thin matrices) are summed
uncompressed, in the same all-reduce as the P matrices.
"""

from __future__ import annotations

import zlib

import torch

from gradsync.collectives import ops as collectives
from gradsync.collectives.communicator import Communicator
from gradsync.compression.compressor import BucketLayout, Compressor
from gradsync.compression.error_feedback import ErrorFeedback, forget_non_finite

MIN_COMPRESSION_RATE = 2  # compress only where (n + m) · r is under half of n · m (as PyTorch)


class _Matrix:
    """One compressed parameter of a bucket: its ``(n, m)`` view and approximation rank."""

    def __init__(self, name: str, view: torch.Tensor, rank: int, offset: int):
        self.name, self.view, self.rank, self.offset = name, view, rank, offset
        self.residual: torch.Tensor | None = None
        self.p: torch.Tensor | None = None


def approximation_rank(shape: torch.Size, rank: int) -> int:
    """The rank used for a parameter of ``shape``, or 0 when it is sent uncompressed."""
    if len(shape) < 2 or shape.numel() == 0:
        return 0
    rows = shape[0]
    cols = shape.numel() // rows
    rank = min(rank, rows, cols)
    return rank if (rows + cols) * rank * MIN_COMPRESSION_RATE < rows * cols else 0


class PowerSGD(Compressor):
    """Low-rank (rank ``rank``) gradient compression with error feedback and warm start.

    Args:
        rank: approximation rank r >= 1 (Vogels et al. use 1 to 4).
        seed: seed of the initial Q matrices (equal on every rank).

    Raises:
        ValueError: ``rank`` is not a positive int, or ``seed`` is not an int in [0, 2**32).

    State (:meth:`state_dict`): ``{"residual": {name: tensor shaped like the
    parameter}, "q": {name: (m, r) warm-start matrix}}`` for compressed parameters.
    """

    name = "powersgd"

    def __init__(self, rank: int = 2, seed: int = 0, warmup_steps: int = 0):
        super().__init__(warmup_steps)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be an int >= 1, got {rank!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"PowerSGD seed must be an int in [0, 2**32), got {seed!r}")
        self.rank = rank
        self.seed = seed
        self.feedback = ErrorFeedback()
        self.q: dict[str, torch.Tensor] = {}

    def _reduce_float(self, flat: torch.Tensor, layout: BucketLayout, comm: Communicator, divisor: int,
                      algorithm: str) -> None:
        matrices, plain = self._split(flat, layout)
        for matrix in matrices:
            matrix.residual = self.feedback.compensate(layout, matrix.view.view(-1), matrix.offset)
            matrix.p = matrix.view @ self._q_for(matrix)
        sums = torch.cat([view for view in plain] + [matrix.p.view(-1) for matrix in matrices])
        collectives.all_reduce(sums, comm, op="sum", algorithm=algorithm, verify=False)
        offset = 0
        for view in plain:
            torch.div(sums[offset:offset + view.numel()], divisor, out=view)
            offset += view.numel()
        if not matrices:
            return
        for matrix in matrices:
            p = sums[offset:offset + matrix.p.numel()].view_as(matrix.p)
            offset += p.numel()
            matrix.p = torch.linalg.qr(p, mode="reduced").Q
        local_qs = [matrix.view.T @ matrix.p for matrix in matrices]
        qs = torch.cat([q.view(-1) for q in local_qs])
        collectives.all_reduce(qs, comm, op="sum", algorithm=algorithm, verify=False)
        qs /= divisor
        offset = 0
        for matrix, local_q in zip(matrices, local_qs):
            q = qs[offset:offset + matrix.view.shape[1] * matrix.rank].view(-1, matrix.rank)
            offset += q.numel()
            if bool(torch.isfinite(q).all()):  # equal on every rank: all keep it or all start afresh
                self.q[matrix.name] = q.clone()
            else:
                self.q.pop(matrix.name, None)
            # the residual is what this rank did not transmit, M - P (M^T P)^T: the ranks' projections
            # sum to divisor x the approximation also under join (divisor < world size), where
            # M - approximation would take the average away from ranks that sent nothing
            torch.sub(matrix.view.view(-1), (matrix.p @ local_q.T).view(-1), out=matrix.residual)
            forget_non_finite(matrix.residual)
            matrix.view.copy_(matrix.p @ q.T)

    def _split(self, flat: torch.Tensor, layout: BucketLayout) -> tuple[list[_Matrix], list[torch.Tensor]]:
        matrices, plain = [], []
        for name, shape, offset, numel in zip(layout.names, layout.shapes, layout.offsets, layout.numels):
            view = flat[offset:offset + numel]
            rank = approximation_rank(shape, self.rank)
            if rank:
                matrices.append(_Matrix(name, view.view(shape[0], -1), rank, offset))
            elif numel:
                plain.append(view)
        return matrices, plain

    def _q_for(self, matrix: _Matrix) -> torch.Tensor:
        cols = matrix.view.shape[1]
        q = self.q.get(matrix.name)
        if q is None:
            generator = torch.Generator().manual_seed(self.seed ^ zlib.crc32(matrix.name.encode()))
            q = self.q[matrix.name] = torch.randn(cols, matrix.rank, generator=generator).to(matrix.view)
        elif q.shape != (cols, matrix.rank):
            raise ValueError(f"PowerSGD state for {matrix.name!r} has Q of shape {tuple(q.shape)}, expected "
                             f"{(cols, matrix.rank)} (rank {self.rank})")
        return q.to(matrix.view)

    def _state_dict(self) -> dict:
        return {"residual": self.feedback.state_dict(), "q": {name: q.clone() for name, q in self.q.items()}}

    def _load_state_dict(self, state: dict) -> None:
        q = state["q"]
        if not isinstance(q, dict) or not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in q.values()):
            raise ValueError("PowerSGD state 'q' must be a dict of (m, r) tensors keyed by parameter name")
        self.feedback.load_state_dict(state["residual"])
        self.q = {name: tensor.detach().clone() for name, tensor in q.items()}

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, seed={self.seed}, warmup_steps={self.warmup_steps})"
