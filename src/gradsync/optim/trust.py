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
import numbers
from typing import Callable, Sequence

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
        check_group(defaults, defaults, None, self._check)
        super().__init__(params, defaults)
        self.norms: TensorNorms = TensorNorms()

    @staticmethod
    def _check(*, where: str, **hyperparameters) -> None:
        """Raise TypeError/ValueError naming a bad hyperparameter (prefixed by ``where``); the subclass's."""

    def add_param_group(self, param_group: dict) -> None:
        """torch's, after checking the group's hyperparameters (the defaults with its overrides): TypeError or
        ValueError naming the hyperparameter and the group (``param group <index>: ...``)."""
        check_group(param_group, self.defaults, len(self.param_groups), self._check)
        super().add_param_group(param_group)

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

    def _whole_norms(self, stepped: list[tuple[dict, torch.Tensor]], adapt: list[bool],
                     directions: list[torch.Tensor]) -> list[list[float]]:
        """Per stepped parameter, ``[weight norm, direction norm]`` of the whole parameter (one reduction
        across shards when sharded); zeros where it is not adapted (its trust ratio is 1)."""
        weights = [param if a else None for (_, param), a in zip(stepped, adapt)]
        others = [direction if a else None for direction, a in zip(directions, adapt)]
        return norms_of(self.norms.sums_of_squares([param for _, param in stepped], [weights, others]))

    @staticmethod
    def _loss(closure):
        """``closure()`` evaluated with gradients enabled (None without a closure)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


def norms_of(sums: torch.Tensor) -> list[list[float]]:
    """``(n, k)`` sums of squares -> per row, the ``k`` norms as Python floats (square roots in float64)."""
    return [[math.sqrt(value) if value >= 0 else math.nan for value in row] for row in sums.tolist()]


def check_number(name: str, value: object, low: float, high: float, *, closed_low: bool = True,
                 where: str = "") -> None:
    """TypeError unless ``value`` is a real number (not a bool); ValueError unless ``low <= value < high``
    (``low < value`` when not ``closed_low``; NaN is refused). ``where`` prefixes the message (a group)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}{name} must be a number, got {value!r}")
    if not ((low <= value if closed_low else low < value) and value < high):
        raise ValueError(f"{where}{name} must be in {'[' if closed_low else '('}{low}, {high}), got {value!r}")


def check_hyperparameters(lr: float, weight_decay: float, eps: float, *, where: str = "",
                          **ranges: tuple[float, float, float]) -> None:
    """Raise TypeError (not a number) or ValueError (out of range) naming the first bad hyperparameter,
    prefixed by ``where`` (e.g. ``"param group 1: "``); ``ranges``: ``name=(value, low, high)`` with
    ``low <= value < high``."""
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{where}{name} must be a number, got {value!r}")
        if not 0.0 <= value < math.inf:
            raise ValueError(f"{where}{name} must be a finite number >= 0, got {value!r}")
    for name, (value, low, high) in ranges.items():
        check_number(name, value, low, high, where=where)


def check_group(group: dict, defaults: dict, index: int | None, check: Callable[..., None]) -> None:
    """Check a parameter group's hyperparameters (``defaults`` overridden by ``group``'s; keys not in
    ``defaults``, a user's own, are left alone) with ``check`` (called with them as keyword arguments and
    ``where``); ``index`` None: the defaults (no prefix). ``exclude_1d`` must be a bool (TypeError)."""
    where = "" if index is None else f"param group {index}: "
    options = {key: group.get(key, default) for key, default in defaults.items()}
    if not isinstance(options.get("exclude_1d", True), bool):
        raise TypeError(f"{where}exclude_1d must be a bool, got {options['exclude_1d']!r}")
    check(where=where, **options)
