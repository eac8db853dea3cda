"""Compressors under abuse: non-finite gradients, ranks configured differently, reuse, malformed state."""

from __future__ import annotations

import copy
import gc
import math

import pytest
import torch
from torch import nn

import gradsync
from _dist import run_threads
from gradsync.compression import BucketLayout, OneBit, PowerSGD, TopK, make

LAYOUT = BucketLayout(("w", "b"), (torch.Size([16, 12]), torch.Size([5])))


@pytest.mark.parametrize("name", ["onebit", "topk", "powersgd"])
def test_one_non_finite_step_does_not_poison_later_steps(name):
    """A step with inf/NaN gradients still yields non-finite averages (so a GradScaler can skip it), but the
    residuals forget them: the next clean steps are finite again, as without error feedback."""
    def body(comm):
        compressor = make(name)
        results = []
        for step in range(3):
            grad = torch.randn(LAYOUT.numel, generator=torch.Generator().manual_seed(10 * step + comm.rank))
            if step == 0 and comm.rank == 0:
                grad[3], grad[190] = math.inf, math.nan
            compressor.reduce(grad, LAYOUT, comm, comm.world_size)
            results.append(grad)
        state = compressor.state_dict()
        residuals = [t for key, part in state.items() if key != "steps" for t in part.values()]
        return results, residuals

    for results, residuals in run_threads(2, body):
        assert not torch.isfinite(results[0]).all()
        assert torch.isfinite(results[1]).all() and torch.isfinite(results[2]).all()
        assert all(torch.isfinite(residual).all() for residual in residuals)


@pytest.mark.parametrize("settings, needle", [
    ([{"compression": "onebit"}, {}], "compression"),
    ([{"compression": "topk"}, {"compression": TopK(0.5)}], "compression"),
    ([{"compression": PowerSGD(1)}, {"compression": PowerSGD(2)}], "compression"),
    ([{"compression": TopK(0.01)}, {"compression": TopK(0.010000001)}], "compression"),  # exact, not rounded
    ([{"compression": OneBit(warmup_steps=2)}, {"compression": "onebit"}], "compression"),
    ([{"bucket_cap_mb": 1.0}, {}], "bucket_cap_mb"),
    ([{"algorithm": "tree"}, {}], "algorithm"),
])
def test_ranks_configured_differently_get_a_mismatch_error_naming_the_setting(settings, needle):
    """Different buckets or compressors would exchange messages of different sizes (Gloo aborts the
    process on that): every rank raises CollectiveMismatchError naming the setting and both values."""
    def body(comm):
        try:
            gradsync.DataParallel(nn.Linear(12, 16), group=comm, **settings[comm.rank])
        except gradsync.CollectiveMismatchError as exc:
            return str(exc)
        return None

    messages = run_threads(2, body)
    assert all(message and needle in message and "rank 0 has" in message and "rank 1 has" in message
               for message in messages), messages


@pytest.mark.parametrize("seed", [None, 1.5, "a", -1, 2**70, True])
def test_powersgd_rejects_a_bad_seed_at_construction(seed):
    with pytest.raises(ValueError, match="seed"):
        PowerSGD(2, seed=seed)


def test_a_compressor_serves_one_live_model_and_copies_are_free():
    """Sharing between two live models fails; after the first is dropped the instance may be reused, and
    a deep copy (state included) serves a new model at once."""
    def body(comm):
        compressor = OneBit()
        first = gradsync.DataParallel(nn.Linear(4, 3), group=comm, compression=compressor)
        first(torch.randn(2, 4)).sum().backward()
        with pytest.raises(ValueError, match="another model"):
            gradsync.DataParallel(nn.Linear(4, 3), group=comm, compression=compressor)
        clone = copy.deepcopy(compressor)
        gradsync.DataParallel(nn.Linear(4, 3), group=comm, compression=clone)
        assert clone.state_dict()["steps"] == compressor.state_dict()["steps"] == {"weight": 1, "bias": 1}
        return compressor

    compressors = run_threads(2, body)
    gc.collect()  # outside the rank threads: drops the first models

    def reuse(comm):
        gradsync.DataParallel(nn.Linear(4, 3), group=comm, compression=compressors[comm.rank])
        return True

    assert run_threads(2, reuse) == [True, True]


@pytest.mark.parametrize("name, bad", [
    ("onebit", {"steps": 5, "worker": {}, "server": {}}),
    ("onebit", {"steps": {}, "worker": None, "server": {}}),
    ("onebit", {"steps": {}, "worker": {"w": torch.zeros(3, dtype=torch.int64)}, "server": {}}),
    ("powersgd", {"steps": {}, "residual": {}, "q": None}),
    ("powersgd", {"steps": {}, "residual": {}, "q": {"w": 3}}),
    ("topk", {"steps": {"w": -1}, "residual": {}}),
])
def test_malformed_state_is_rejected_at_load_with_value_error(name, bad):
    with pytest.raises(ValueError):
        make(name).load_state_dict(bad)
