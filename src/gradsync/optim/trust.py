"""What LARS and LAMB share: the 1-D exclusion, the trust ratios, and whole-parameter norms.

A layer-wise optimizer scales each parameter's update by a *trust ratio*
built from two norms of the whole parameter: its weight's and its update's.
:class:`LayerwiseOptimizer` asks a :class:`TensorNorms` for those norms in
one call per step. By default every tensor it steps is a whole parameter and
the norms are local. A sharded optimizer (ZeRO-1/2/3: each rank steps flat
pieces of parameters) installs its own (``gradsync.parallel.shard_norms``):
each rank sums the squares of its pieces per parameter and one small
reduction across ranks gives every rank the whole parameter's sums; under
``--deterministic`` those sums are exact (int64 fixed point), so the trust
ratio has the same bits at every world size.

Bias and normalisation parameters (every parameter with at most one
dimension) take neither weight decay nor a trust ratio when ``exclude_1d``
is on, as You et al. 2017 (LARS), You et al. 2019 (LAMB, BERT's
``exclude_from_weight_decay=["LayerNorm", "bias"]``) and Goyal et al. 2017
(no weight decay on biases and BN's gamma and beta) do.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def adapted(ndim: int, exclude_1d: bool) -> bool:
    """Whether a parameter of ``ndim`` dimensions takes weight decay and a trust ratio (not a bias or a
    normalisation weight, or ``exclude_1d`` off).

    >>> adapted(2, True), adapted(1, True), adapted(0, True), adapted(1, False)
    (True, False, False, True)
    """
    return not exclude_1d or ndim > 1


def lars_trust_ratio(weight_norm: float, grad_norm: float, coefficient: float, weight_decay: float,
                     eps: float) -> float:
    """LARS's local learning rate (You et al. 2017, eq. 6): ``eta * ||w|| / (||g|| + beta * ||w|| + eps)``,
    1.0 when either norm is 0 (a fresh zero layer or no gradient: the plain step).

    >>> lars_trust_ratio(2.0, 0.5, 0.001, 0.0, 0.0)
    0.004
    >>> lars_trust_ratio(0.0, 0.5, 0.001, 0.0, 0.0)
    1.0
    """
    if not (weight_norm > 0.0 and grad_norm > 0.0):
        return 1.0
    return coefficient * weight_norm / (grad_norm + weight_decay * weight_norm + eps)


def lamb_trust_ratio(weight_norm: float, update_norm: float) -> float:
    """LAMB's ratio (You et al. 2019, Algorithm 2, phi the identity): ``||x|| / ||r + lambda x||``, 1.0 when
    either norm is 0.

    >>> lamb_trust_ratio(3.0, 1.5), lamb_trust_ratio(3.0, 0.0)
    (2.0, 1.0)
    """
    if not (weight_norm > 0.0 and update_norm > 0.0):
        return 1.0
    return weight_norm / update_norm


class TensorNorms:
    """Norms of whole tensors: each tensor the optimizer steps is a whole parameter (the default).

    The interface a sharded optimizer replaces: :meth:`ndim` (the parameter's own dimensions, for the
    1-D exclusion: a piece of a matrix is a 1-D view) and :meth:`sums_of_squares`.
    """

    def ndim(self, tensor: torch.Tensor) -> int:
        """Dimensions of the parameter ``tensor`` is (or is a piece of)."""
        return tensor.ndim

    def sums_of_squares(self, tensors: Sequence[torch.Tensor],
                        columns: Sequence[Sequence[torch.Tensor | None]]) -> torch.Tensor:
        """The whole parameters' sums of squares.

        Args:
            tensors: the ``n`` tensors the optimizer steps this step (parameters, or pieces of them).
            columns: ``k`` lists of ``n`` entries each: ``columns[j][i]`` is the ``j``-th quantity of tensor
                ``i`` (its weight, its gradient, its update: the shape of ``tensors[i]``), or None (not
                needed: 0).

        Returns:
            ``(n, k)`` float64: ``out[i, j]`` the sum of squares of quantity ``j`` over the whole parameter
            ``tensors[i]`` belongs to. Collective for a sharded optimizer: every rank calls it once per step.
        """
        out = torch.zeros(len(tensors), len(columns), dtype=torch.float64)
        for j, column in enumerate(columns):
            for i, value in enumerate(column):
                if value is not None and value.numel():
                    out[i, j] = torch.linalg.vector_norm(value.detach(), dtype=torch.float64).square()
        return out


class LayerwiseOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose step needs whole-parameter norms (LARS, LAMB): :attr:`norms` gives them.

    ``gradsync.ShardedOptimizer`` and ``DeterministicDataParallel.shard_optimizer`` call :meth:`use_norms`;
    a user does not.
    """

    def __init__(self, params, defaults: dict):
        super().__init__(params, defaults)
        self.norms: TensorNorms = TensorNorms()

    def use_norms(self, norms: TensorNorms) -> None:
        """Take the parameters' norms from ``norms`` (a sharded or exact :class:`TensorNorms`)."""
        self.norms = norms

    def __getstate__(self):  # copy.deepcopy / pickling: the optimizer, without a sharded norms' group
        state = super().__getstate__()
        state["norms"] = TensorNorms()
        return state

    def _stepped(self) -> list[tuple[dict, torch.Tensor]]:
        """``(group, tensor)`` of every tensor with a gradient, in group order."""
        return [(group, param) for group in self.param_groups for param in group["params"] if param.grad is not None]

    def _adapted(self, stepped: list[tuple[dict, torch.Tensor]]) -> list[bool]:
        return [adapted(self.norms.ndim(param), group["exclude_1d"]) for group, param in stepped]


def norms_of(sums: torch.Tensor) -> list[list[float]]:
    """``(n, k)`` sums of squares -> per row, the ``k`` norms as Python floats (square roots in float64)."""
    return [[math.sqrt(value) if value >= 0 else math.nan for value in row] for row in sums.tolist()]


def check_hyperparameters(lr: float, weight_decay: float, eps: float, **ranges: tuple[float, float, float]) -> None:
    """Raise ValueError naming the first bad hyperparameter; ``ranges``: ``name=(value, low, high)`` with
    ``low <= value < high``."""
    if not (isinstance(lr, (int, float)) and 0.0 <= lr < math.inf):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if not 0.0 <= weight_decay < math.inf:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if not 0.0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    for name, (value, low, high) in ranges.items():
        if not low <= value < high:
            raise ValueError(f"{name} must be in [{low}, {high}), got {value!r}")
