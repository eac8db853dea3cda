"""gradsync.optim's LARS and LAMB against the papers' formulas written out by hand on fixed tensors, and
against pytorch-optimizer 4.1.0 where the two define the same step (skipped when it is not installed)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import gradsync
from gradsync.optim import LAMB, LARS
from gradsync.parallel.preflight import state_slots

W0 = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])   # ||W0|| = sqrt(7.6875)
B0 = torch.tensor([0.1, -0.2])
GRADS = [(torch.tensor([[0.1, 0.2, -0.3], [0.0, 0.4, 0.1]]), torch.tensor([0.05, -0.1])),
         (torch.tensor([[-0.2, 0.1, 0.3], [0.2, -0.1, 0.0]]), torch.tensor([0.02, 0.3])),
         (torch.tensor([[0.3, 0.3, -0.1], [0.1, 0.0, 0.2]]), torch.tensor([-0.1, 0.1]))]


def _run(optimizer_class, **options) -> tuple[torch.Tensor, torch.Tensor]:
    weight, bias = W0.clone().requires_grad_(), B0.clone().requires_grad_()
    optimizer = optimizer_class([weight, bias], **options)
    for grad_w, grad_b in GRADS:
        weight.grad, bias.grad = grad_w.clone(), grad_b.clone()
        optimizer.step()
    return weight.detach(), bias.detach()


def _norm(tensor: torch.Tensor) -> float:
    return math.sqrt(sum(float(v) ** 2 for v in tensor.reshape(-1)))


def test_lars_is_you_et_al_algorithm_1_with_the_bias_excluded():
    """LARS(lr 2, m 0.9, beta 0.01, eta 0.001) over 3 steps: the weight's update is
    eta ||w|| / (||g|| + beta ||w||) (g + beta w) into the velocity, the bias's its plain gradient."""
    lr, m, beta, eta = 2.0, 0.9, 0.01, 0.001
    weight, bias = W0.double(), B0.double()
    velocity_w = velocity_b = None
    for grad_w, grad_b in GRADS:
        grad_w, grad_b = grad_w.double(), grad_b.double()
        local = eta * _norm(weight) / (_norm(grad_w) + beta * _norm(weight))
        update_w = local * (grad_w + beta * weight)
        velocity_w = update_w if velocity_w is None else m * velocity_w + update_w
        velocity_b = grad_b if velocity_b is None else m * velocity_b + grad_b
        weight, bias = weight - lr * velocity_w, bias - lr * velocity_b
    got_w, got_b = _run(LARS, lr=lr, momentum=m, weight_decay=beta, trust_coefficient=eta, eps=0.0)
    torch.testing.assert_close(got_w, weight.float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_b, bias.float(), rtol=1e-6, atol=1e-7)


def test_lamb_is_you_et_al_algorithm_2_with_the_bias_excluded():
    """LAMB(lr 0.01, betas (0.9, 0.999), eps 1e-6, lambda 0.01) over 3 steps: bias-corrected moments,
    r + lambda x scaled by ||x|| / ||r + lambda x|| for the weight; Adam's r alone for the bias."""
    lr, (b1, b2), eps, decay = 0.01, (0.9, 0.999), 1e-6, 0.01
    weight, bias = W0.double(), B0.double()
    moments = {"w": [0.0, 0.0], "b": [0.0, 0.0]}
    for t, (grad_w, grad_b) in enumerate(GRADS, start=1):
        for key, grad in (("w", grad_w.double()), ("b", grad_b.double())):
            moments[key] = [b1 * moments[key][0] + (1 - b1) * grad, b2 * moments[key][1] + (1 - b2) * grad ** 2]
        r = {key: (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps) for key, (m, v) in moments.items()}
        update = r["w"] + decay * weight
        weight = weight - lr * _norm(weight) / _norm(update) * update
        bias = bias - lr * r["b"]
    got_w, got_b = _run(LAMB, lr=lr, betas=(b1, b2), eps=eps, weight_decay=decay)
    torch.testing.assert_close(got_w, weight.float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_b, bias.float(), rtol=1e-6, atol=1e-7)


def test_exclude_1d_off_adapts_the_bias_and_a_zero_norm_gives_ratio_one():
    """exclude_1d=False: the bias too takes eta ||b|| / ||g_b||; a zero weight (||w|| = 0) steps plainly."""
    bias = B0.clone().requires_grad_()
    bias.grad = GRADS[0][1].clone()
    LARS([bias], lr=1.0, momentum=0.0, eps=0.0, exclude_1d=False).step()
    ratio = 0.001 * _norm(B0) / _norm(GRADS[0][1])
    torch.testing.assert_close(bias.detach(), B0 - ratio * GRADS[0][1])
    zero = torch.zeros(2, 2, requires_grad=True)
    zero.grad = torch.ones(2, 2)
    LARS([zero], lr=0.5, momentum=0.0).step()
    assert torch.equal(zero.detach(), torch.full((2, 2), -0.5))


def test_bad_hyperparameters_are_refused_naming_them():
    params = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="momentum"):
        LARS(params, lr=1.0, momentum=1.0)
    with pytest.raises(ValueError, match="betas"):
        LAMB(params, lr=1e-3, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="lr"):
        LAMB(params, lr=-1.0)


def test_state_slots_deepcopy_and_state_dict_round_trip():
    """The preflight measures LARS at 1 slot and LAMB at 2 (momentum; two moments); a state dict loads into a
    fresh optimizer that then steps as the original (deep copies too)."""
    assert state_slots(LARS([torch.zeros(3, requires_grad=True)], lr=1.0)) == 1
    assert state_slots(LAMB([torch.zeros(3, requires_grad=True)], lr=1.0)) == 2
    for cls, options in ((LARS, {"lr": 1.0}), (LAMB, {"lr": 0.01})):
        weight = W0.clone().requires_grad_()
        optimizer = cls([weight], **options)
        weight.grad = GRADS[0][0].clone()
        optimizer.step()
        twin_weight = weight.detach().clone().requires_grad_()
        twin = cls([twin_weight], **options)
        twin.load_state_dict(copy.deepcopy(optimizer).state_dict())
        weight.grad, twin_weight.grad = GRADS[1][0].clone(), GRADS[1][0].clone()
        optimizer.step()
        twin.step()
        assert torch.equal(weight, twin_weight)


def test_gradsync_optim_is_public():
    assert gradsync.optim.LARS is LARS and gradsync.optim.LAMB is LAMB and "optim" in gradsync.__all__


def test_lars_matches_pytorch_optimizer_without_momentum_and_weight_decay():
    """pytorch-optimizer's LARS (4.1.0) where the two define the same step: momentum 0 (its buffer starts at
    (1 + m) g) and weight decay 0 (it leaves beta ||w|| out of the ratio)."""
    library = pytest.importorskip("pytorch_optimizer")
    ours = _run(LARS, lr=3.0, momentum=0.0, trust_coefficient=0.01, eps=0.0)
    theirs = _run(library.LARS, lr=3.0, momentum=0.0, trust_coefficient=0.01, weight_decay=0.0)
    for got, want in zip(ours, theirs):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_lamb_matches_pytorch_optimizer_without_weight_decay():
    """pytorch-optimizer's Lamb (4.1.0, the paper's v3: no bias correction of r, ||x|| clipped at 10) on every
    parameter (exclude_1d off), weight decay 0 and ``adam_debias=True`` (its default divides the step by
    1 - b1^t): the trust ratio cancels the bias corrections' scale of r, so only eps differs (1e-12 on
    both)."""
    library = pytest.importorskip("pytorch_optimizer")
    ours = _run(LAMB, lr=0.01, eps=1e-12, weight_decay=0.0, exclude_1d=False)
    theirs = _run(library.Lamb, lr=0.01, eps=1e-12, weight_decay=0.0, adam_debias=True)
    for got, want in zip(ours, theirs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
