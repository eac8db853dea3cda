"""LAMB: Adam's update with decoupled weight decay, scaled on each layer by that layer's trust ratio.

You et al. 2019, "Large batch optimization for deep learning: training BERT in 76 minutes" (ICLR 2020,
arXiv 1904.00962), Algorithm 2 with ``phi`` the identity: for every layer with weight ``x``, gradient
``g`` and step ``t``,

    m = b1 * m + (1 - b1) * g            v = b2 * v + (1 - b2) * g^2
    r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    u = r + lambda * x
    x = x - lr * ||x|| / ||u|| * u       (the ratio 1.0 when ||x|| or ||u|| is 0)

Defaults are the paper's: ``b1`` 0.9, ``b2`` 0.999, ``eps`` 1e-6, ``lambda`` 0.01. Biases and
normalisation weights (1-D parameters) take Adam's step ``x -= lr * r``, without weight decay or trust
ratio (``exclude_1d``; BERT's LAMB excludes "LayerNorm" and "bias").

Why gradsync has its own rather than pytorch-optimizer's ``Lamb`` (4.1.0, which the tests compare against
where the two agree): under ZeRO (``--shard``) gradsync's optimizer steps flat pieces of parameters, so
``||x||`` and ``||u||`` must be reduced across the ranks holding a parameter's pieces, and under
``--deterministic`` exactly, so that every world size gives the same bits; the library's follows the
paper's v3 instead (no bias correction of ``r``, but the step divided by ``1 - b1^t`` unless
``adam_debias``; weight decay applied before the step and outside ``u``; ``||x||`` clipped at 10) and
applies the ratio to every parameter.
"""

from __future__ import annotations

import torch

from gradsync.optim.trust import LayerwiseOptimizer, check_hyperparameters, lamb_trust_ratio


class LAMB(LayerwiseOptimizer):
    """Layer-wise Adaptive Moments for Batch training (You et al. 2019).

    Args:
        params: parameters or parameter groups (as any torch optimizer); every group may override the
            hyperparameters below.
        lr: the global learning rate (> 0).
        betas: ``(b1, b2)``, each in [0, 1) ((0.9, 0.999), the paper's).
        eps: added to ``sqrt(v)`` (1e-6, the paper's).
        weight_decay: ``lambda`` >= 0 (0.01, the paper's), decoupled (added to the update, AdamW-style).
        exclude_1d: no weight decay or trust ratio for parameters of at most one dimension.

    State per parameter: ``step`` (a 0-dim float32 tensor, as torch's Adam), ``exp_avg``, ``exp_avg_sq``
    (its shape). The step holds every parameter's update at once (transient, the size of the parameters
    it steps) between computing the norms and applying them.

    Raises:
        ValueError: a hyperparameter out of range; TypeError: not a number (``exclude_1d``: not a bool). Named,
            with the group (``param group <index>: ``) for a group's override, at construction and in
            ``add_param_group``.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, exclude_1d: bool = True):
        betas = tuple(betas) if isinstance(betas, list) else betas
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "exclude_1d": exclude_1d}
        super().__init__(params, defaults)

    @staticmethod
    def _check(*, where: str, lr, betas, eps, weight_decay, exclude_1d) -> None:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{where}betas must be a pair (b1, b2), got {betas!r}")
        check_hyperparameters(lr, weight_decay, eps, where=where, **{"betas[0]": (betas[0], 0.0, 1.0),
                                                                     "betas[1]": (betas[1], 0.0, 1.0)})

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB step of every parameter with a gradient (one norm reduction across shards when sharded).

        Returns ``closure()``'s loss (evaluated with gradients enabled) or None.
        """
        loss = self._loss(closure)
        stepped = self._stepped()
        adapt = self._adapted(stepped)
        updates = [self._update(group, param, a) for (group, param), a in zip(stepped, adapt)]
        norms = self._whole_norms(stepped, adapt, updates)
        for (group, param), update, a, (weight_norm, update_norm) in zip(stepped, updates, adapt, norms):
            ratio = lamb_trust_ratio(weight_norm, update_norm) if a else 1.0
            param.add_(update, alpha=-group["lr"] * ratio)
        return loss

    def _update(self, group: dict, param: torch.Tensor, adapt: bool) -> torch.Tensor:
        """Advance the moments; ``u = r + lambda x`` (``r`` alone for an excluded parameter)."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        grad, exp_avg, exp_avg_sq = param.grad, state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        step = int(state["step"].item())
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denominator = (exp_avg_sq / (1.0 - beta2 ** step)).sqrt_().add_(group["eps"])
        update = (exp_avg / (1.0 - beta1 ** step)).div_(denominator)
        if adapt and group["weight_decay"]:
            update.add_(param, alpha=group["weight_decay"])
        return update
