"""DataParallel: ranks that run different forward/backward sequences raise on every rank (issue 16).

Every synchronised backward compares, across ranks, how many grad-enabled
forwards each rank ran since its last synchronised backward. All scenarios
run on in-process thread ranks.
"""

from __future__ import annotations

import time

import pytest

import torch
from torch import nn

import gradsync
from gradsync.errors import GradsyncError
from _dist import capture_error, run_threads



def _linear():
    torch.manual_seed(0)
    return nn.Linear(2, 1, bias=False).double()


def _x(rank, it):
    return torch.full((1, 2), float(rank + 1 + 10 * it), dtype=torch.float64)


def _step(model, rank, it):
    model.zero_grad()
    model(_x(rank, it)).sum().backward()
    return model.module.weight.grad.clone()


def test_skipped_backward_on_one_rank_raises_on_every_rank_and_reset_recovers():
    """Before: rank 0's iteration-1 gradient was averaged with rank 1's iteration-2 one (16.5, not 11.5)."""
    def body(comm):
        model = gradsync.DataParallel(_linear(), group=comm)
        _step(model, comm.rank, 0)
        if comm.rank == 1:
            model(_x(1, 1)).sum()  # forward, then `continue` without backward (a NaN-loss skip)
            failed = capture_error(lambda: _step(model, 1, 2))
        else:
            failed = capture_error(lambda: _step(model, 0, 1))
        refused = capture_error(lambda: model(_x(comm.rank, 3)))
        model.reset_after_failure()
        return failed, refused, _step(model, comm.rank, 4)

    started = time.monotonic()
    per_rank = run_threads(2, body, timeout_s=30, collective_timeout_s=10)
    assert time.monotonic() - started < 5  # nobody waited for a timeout
    for failed, refused, grad in per_rank:
        assert isinstance(failed, GradsyncError)
        assert "rank 1 ran 2 forwards since the last gradient sync, rank 0 ran 1" in str(failed)
        assert "skipped backward()" in str(failed) and "no_sync()" in str(failed)
        assert isinstance(refused, GradsyncError) and "reset_after_failure" in str(refused)
        # after the reset: iteration 4's average, (1+40 + 2+40) / 2 per element
        torch.testing.assert_close(grad, torch.full((1, 2), 41.5, dtype=torch.float64))


def test_no_sync_on_one_rank_only_raises_on_every_rank():
    """Before: rank 0 got a silently wrong average (paired with rank 1's next backward), later a timeout."""
    def body(comm):
        model = gradsync.DataParallel(_linear(), group=comm)
        if comm.rank == 1:
            with model.no_sync():
                model(_x(1, 0)).sum().backward()
            return capture_error(lambda: _step(model, 1, 1))
        return capture_error(lambda: _step(model, 0, 0))

    started = time.monotonic()
    errors = run_threads(2, body, timeout_s=30, collective_timeout_s=10)
    assert time.monotonic() - started < 5
    for error in errors:
        assert isinstance(error, GradsyncError)
        assert "rank 1 ran 2 forwards since the last gradient sync, rank 0 ran 1" in str(error)


def test_legit_patterns_agree():
    """Accumulation under no_sync, a grad-enabled forward without backward, two forwards per backward,
    on every rank: no error and the right average."""
    def body(comm):
        model = gradsync.DataParallel(_linear(), group=comm)
        model.zero_grad()
        with model.no_sync():
            model(_x(comm.rank, 0)).sum().backward()
        model(_x(comm.rank, 1)).sum().backward()  # accumulated: x0 + x1
        accumulated = model.module.weight.grad.clone()
        model(_x(comm.rank, 2))  # a grad-enabled "validation" forward on every rank
        model.zero_grad()
        (model(_x(comm.rank, 0)) + model(_x(comm.rank, 1))).sum().backward()
        return accumulated, model.module.weight.grad.clone()

    for accumulated, two in run_threads(2, body, timeout_s=30, collective_timeout_s=10):
        want = torch.full((1, 2), (1.5 + 11.5), dtype=torch.float64)
        torch.testing.assert_close(accumulated, want)
        torch.testing.assert_close(two, want)


@pytest.mark.parametrize("world_size, dtype, compression", [(3, torch.bfloat16, None), (3, torch.float64, "fp16")])
def test_counts_survive_low_precision_and_compressed_buckets(world_size, dtype, compression):
    """The status slots are averaged in the bucket's dtype, or summed as uint8 by a compressor."""
    def body(comm):
        torch.manual_seed(0)
        model = gradsync.DataParallel(nn.Linear(2, 1, bias=False).to(dtype), group=comm, compression=compression)
        x = torch.ones(1, 2, dtype=dtype)
        for _ in range(3 if comm.rank == 2 else 1):  # rank 2 skipped two backward()s
            model(x)
        return capture_error(lambda: model(x).sum().backward())

    for error in run_threads(world_size, body, timeout_s=30, collective_timeout_s=10):
        assert "rank 2 ran 4 forwards since the last gradient sync, rank 0 ran 2, rank 1 ran 2" in str(error)
