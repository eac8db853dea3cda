"""DiLoCo's outer optimizer: a step on the global parameters from the averaged pseudo-gradient.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models") runs H inner steps on each worker, then treats
the pseudo-gradient ``Δ = θ_global - θ_local`` (averaged over the workers) as
a gradient of the global parameters and steps them with Nesterov momentum,
outer lr 0.7 and momentum 0.9 (the paper's best; plain SGD with lr 1 is
parameter averaging, Adam outer steps were unstable there). Nesterov as
``torch.optim.SGD(nesterov=True, dampening=0)`` writes it::

    m ← μ·m + Δ          (m = Δ at the first step)
    θ ← θ - lr·(Δ + μ·m)

State (the momentum ``m``) is kept per fragment key, in float32, and is the
same on every rank: every rank steps the same global parameters with the
same averaged Δ.

>>> import torch
>>> outer = make_outer_optimizer("nesterov", lr=0.5, momentum=0.9)
>>> theta = torch.tensor([1.0]); outer.step(0, theta, torch.tensor([0.2])); theta
tensor([0.8100])
"""

from __future__ import annotations

import math

import torch

from gradsync.parallel.option_names import KEYWORDS, Spelling

OUTER_OPTIMIZERS = ("none", "nesterov")
DILOCO_OUTER_LR = 0.7        # Douillard et al. 2023, Table 8's best outer lr for Nesterov
DILOCO_OUTER_MOMENTUM = 0.9  # ... and its momentum


class ParameterAveraging:
    """``none``: the global parameters become the workers' average (``θ ← θ - Δ``, plain local SGD)."""

    name = "none"

    def step(self, key: int, params: torch.Tensor, delta: torch.Tensor) -> None:
        """Step ``params`` (``(numel,)`` float32, in place) by the averaged pseudo-gradient ``delta``."""
        params.sub_(delta)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Nesterov:
    """SGD with Nesterov momentum on the global parameters (DiLoCo's outer optimizer).

    Args:
        lr: outer learning rate (finite, > 0).
        momentum: μ in [0, 1).
    """

    name = "nesterov"

    def __init__(self, lr: float = DILOCO_OUTER_LR, momentum: float = DILOCO_OUTER_MOMENTUM):
        self.lr, self.momentum = float(lr), float(momentum)
        self.buffers: dict[int, torch.Tensor] = {}  # fragment key -> m, (numel,) float32

    def step(self, key: int, params: torch.Tensor, delta: torch.Tensor) -> None:
        """Step ``params`` (``(numel,)`` float32, in place) by the averaged pseudo-gradient ``delta`` (same shape)."""
        buffer = self.buffers.get(key)
        if buffer is None:
            buffer = self.buffers[key] = delta.detach().clone()
        else:
            buffer.mul_(self.momentum).add_(delta)
        params.sub_(delta.add(buffer, alpha=self.momentum), alpha=self.lr)

    def state_dict(self) -> dict:
        return {"momentum": {int(key): tensor.clone() for key, tensor in self.buffers.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.buffers = {int(key): tensor.detach().clone().to(torch.float32)
                        for key, tensor in state.get("momentum", {}).items()}


def check_outer_options(name: str, lr: float | None, momentum: float | None, *,
                        spelling: Spelling = KEYWORDS) -> None:
    """ValueError (one line naming the option as ``spelling`` does: keyword arguments, or the CLI's flags) for an
    unknown outer optimizer or a bad lr / momentum (None: the default, accepted)."""
    if name not in OUTER_OPTIMIZERS:
        raise ValueError(f"unknown {spelling.setting('outer_optimizer', name)}; "
                         f"choose one of {', '.join(OUTER_OPTIMIZERS)}")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf):
        raise ValueError(f"{spelling.name('outer_lr')} must be a finite number > 0, got {lr!r}")
    if momentum is not None and (isinstance(momentum, bool) or not isinstance(momentum, (int, float))
                                 or not 0 <= momentum < 1):
        raise ValueError(f"{spelling.name('outer_momentum')} must be a number in [0, 1), got {momentum!r}")


def make_outer_optimizer(name: str, lr: float | None = None,
                         momentum: float | None = None) -> ParameterAveraging | Nesterov:
    """The outer optimizer called ``name`` (``OUTER_OPTIMIZERS``); ``lr`` and ``momentum`` are Nesterov's
    (None: the DiLoCo paper's 0.7 and 0.9).

    Raises:
        ValueError: see :func:`check_outer_options`; or ``lr`` / ``momentum`` given (not None) with ``"none"``
            (parameter averaging has neither: the value would be ignored).
    """
    check_outer_options(name, lr, momentum)
    if name == "none":
        for option, value in (("outer_lr", lr), ("outer_momentum", momentum)):
            if value is not None:
                raise ValueError(f"{option}={value!r} needs outer_optimizer='nesterov' (outer_optimizer='none' "
                                 f"averages the parameters: it has no outer lr or momentum)")
        return ParameterAveraging()
    return Nesterov(DILOCO_OUTER_LR if lr is None else lr, DILOCO_OUTER_MOMENTUM if momentum is None else momentum)
