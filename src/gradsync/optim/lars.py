"""LARS: SGD with momentum whose step on each layer is scaled by that layer's trust ratio.

You, Gitman & Ginsburg 2017, "Large batch training of convolutional networks" (arXiv 1708.03888),
Algorithm 1: for every layer ``l`` with weight ``w``, gradient ``g``, weight decay ``beta`` and trust
coefficient ``eta``,

    local_lr = eta * ||w|| / (||g|| + beta * ||w||)        (1.0 when ||w|| or ||g|| is 0)
    v        = m * v + local_lr * (g + beta * w)
    w        = w - lr * v

The global ``lr`` multiplies the velocity as ``torch.optim.SGD`` does (the paper writes it inside ``v``;
the two agree at a constant lr, and this form needs no momentum correction when a warm-up or a schedule
changes the lr, Goyal et al. 2017 section 2.1), and the first step's velocity is the first update
(torch's SGD). Biases and normalisation weights (1-D parameters) take the plain momentum step, without
weight decay or trust ratio (``exclude_1d``, as the paper's and Goyal et al.'s ResNet-50 recipes).

Why gradsync has its own rather than pytorch-optimizer's ``LARS`` (4.1.0, which the tests compare against
where the two agree): under ZeRO (``--shard``) gradsync's optimizer steps flat pieces of parameters,
so ``||w||`` and ``||g||`` must be reduced across the ranks holding a parameter's pieces (the library
takes ``torch.linalg.norm`` of the tensor it is given), and under ``--deterministic`` they must be exact
sums so that every world size gives the same bits; the library's also leaves ``beta * ||w||`` out of
the ratio's denominator and starts its momentum buffer at ``(1 + m) * g``.
"""

from __future__ import annotations

import torch

from gradsync.optim.trust import LayerwiseOptimizer, check_hyperparameters, lars_trust_ratio


class LARS(LayerwiseOptimizer):
    """Layer-wise Adaptive Rate Scaling (You et al. 2017) over SGD with momentum.

    Args:
        params: parameters or parameter groups (as any torch optimizer); every group may override the
            hyperparameters below.
        lr: the global learning rate (> 0; LARS's are large, the trust ratio ~``eta`` scales them down:
            ImageNet recipes use 2-30 at ``eta`` 0.001).
        momentum: ``m`` in [0, 1) (0.9, the paper's).
        weight_decay: ``beta`` >= 0 (0.0; the paper trains AlexNet at 5e-4).
        trust_coefficient: ``eta`` > 0 (0.001, the paper's).
        eps: added to the ratio's denominator (1e-8; the paper has none).
        exclude_1d: no weight decay or trust ratio for parameters of at most one dimension (biases,
            normalisation weights).

    State per parameter: ``momentum_buffer`` (its shape) when ``momentum`` > 0.

    Raises:
        ValueError: a hyperparameter out of range; TypeError: not a number (``exclude_1d``: not a bool). Named,
            with the group (``param group <index>: ``) for a group's override, at construction and in
            ``add_param_group``.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, exclude_1d: bool = True):
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_coefficient": trust_coefficient, "eps": eps, "exclude_1d": exclude_1d}
        super().__init__(params, defaults)

    @staticmethod
    def _check(*, where: str, lr, momentum, weight_decay, trust_coefficient, eps, exclude_1d) -> None:
        check_hyperparameters(lr, weight_decay, eps, where=where, momentum=(momentum, 0.0, 1.0),
                              trust_coefficient=(trust_coefficient, 1e-300, float("inf")))

    @torch.no_grad()
    def step(self, closure=None):
        """One LARS step of every parameter with a gradient (one norm reduction across shards when sharded).

        Returns ``closure()``'s loss (evaluated with gradients enabled) or None.
        """
        loss = self._loss(closure)
        stepped = self._stepped()
        adapt = self._adapted(stepped)
        norms = self._whole_norms(stepped, adapt, [param.grad for _, param in stepped])
        for (group, param), a, (weight_norm, grad_norm) in zip(stepped, adapt, norms):
            update = param.grad
            if a:
                decay = group["weight_decay"]
                ratio = lars_trust_ratio(weight_norm, grad_norm, group["trust_coefficient"], decay, group["eps"])
                update = update.add(param, alpha=decay) if decay else update.clone()
                update.mul_(ratio)
            self._apply(group, param, update)
        return loss

    def _apply(self, group: dict, param: torch.Tensor, update: torch.Tensor) -> None:
        """``v = m v + update`` (``v`` = the first update at the first step), ``w -= lr v``."""
        momentum = group["momentum"]
        if momentum:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = update.detach().clone()
            else:
                state["momentum_buffer"].mul_(momentum).add_(update)
            update = state["momentum_buffer"]
        param.add_(update, alpha=-group["lr"])
