"""gradsync.preflight: the per-rank estimate against hand-computed bytes, and its refusal naming what fits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync
from gradsync.parallel.preflight import estimate, state_slots


def _linear():
    torch.manual_seed(0)
    return nn.Linear(10, 20)  # 200 + 20 parameters: 880 bytes of float32


@pytest.mark.parametrize("optimizer, slots", [
    (lambda p: torch.optim.AdamW(p), 2), (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
    (lambda p: torch.optim.SGD(p, lr=0.1), 0), (lambda p: torch.optim.Adagrad(p), 1)])
def test_optimizer_state_slots_are_measured_from_its_layout(optimizer, slots):
    assert state_slots(optimizer(_linear().parameters())) == slots


def test_the_estimate_matches_a_hand_computed_case():
    model = _linear()
    batch = torch.randn(4, 10)
    adamw = torch.optim.AdamW(model.parameters())
    # activations: Linear saves its (4, 10) float32 input for the weight's gradient: 160 bytes
    assert estimate(model, adamw, batch, 2) == gradsync.MemoryEstimate(880, 880, 1760, 880, 160)
    assert estimate(model, adamw, batch, 2, "optimizer") == gradsync.MemoryEstimate(880, 440, 880, 880, 160)
    # ZeRO-2: one bucket, so one slab of it
    assert estimate(model, adamw, batch, 4, "gradients") == gradsync.MemoryEstimate(880, 220, 440, 880, 160)


def test_a_run_that_does_not_fit_is_refused_naming_what_would():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])  # 8 buckets of 16.6 KB at a tiny cap
    adamw = torch.optim.AdamW(model.parameters())
    batch = torch.randn(2, 64)
    whole = estimate(model, adamw, batch, 4, bucket_cap_mb=0.02)
    assert gradsync.preflight(model, adamw, batch, 4, available_bytes=whole.total_bytes,
                              bucket_cap_mb=0.02) == whole
    zero2 = estimate(model, adamw, batch, 4, "gradients", bucket_cap_mb=0.02)
    with pytest.raises(gradsync.MemoryPreflightError, match=r"largest part is optimizer state .*"
                                                           r"shard='gradients' would need") as caught:
        gradsync.preflight(model, adamw, batch, 4, available_bytes=zero2.total_bytes, bucket_cap_mb=0.02)
    assert caught.value.estimate == whole
    with pytest.raises(gradsync.MemoryPreflightError, match="tensor or pipeline parallelism"):
        gradsync.preflight(model, adamw, batch, 4, available_bytes=whole.parameter_bytes // 2, bucket_cap_mb=0.02)
