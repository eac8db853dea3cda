"""A bad argument to DataParallel or LocalSGD on one rank raises at once on every rank (issue 16).

The rank with the bad argument raises its own TypeError/ValueError; the
others raise CollectiveMismatchError naming it and the argument, instead of
waiting for it until their timeout. Thread ranks, except for a bad ``group``
(which needs a default group: processes).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import gradsync
from gradsync.errors import CollectiveMismatchError, GradsyncError
from _dist import capture_error, run_threads, run_world



def _assert_rank1_rejected(error0, error1, words):
    assert isinstance(error1, (ValueError, TypeError)) and not isinstance(error1, GradsyncError), error1
    assert isinstance(error0, CollectiveMismatchError), error0
    assert "rank 1 has arguments=rejected" in str(error0) and words in str(error0), str(error0)


def test_data_parallel_non_module_on_one_rank_raises_at_once_on_every_rank():
    """Before: rank 1 raised TypeError before any exchange; rank 0 waited for the whole timeout."""
    def body(comm):
        module = "x" if comm.rank == 1 else nn.Linear(2, 1)
        return capture_error(lambda: gradsync.DataParallel(module, group=comm))

    started = time.monotonic()
    error0, error1 = run_threads(2, body, timeout_s=30, collective_timeout_s=10)
    assert time.monotonic() - started < 5
    _assert_rank1_rejected(error0, error1, "wraps a torch.nn.Module, got str")


@pytest.mark.parametrize("argument, value, words", [
    ("sync_every", 0, "sync_every must be an int >= 1, got 0"),
    ("algorithm", "bogus", "bogus"),
    ("module", "x", "wraps a torch.nn.Module, got str"),
    ("timeout", -1, "timeout must be a finite number of seconds > 0, got -1"),
])
def test_local_sgd_bad_argument_on_one_rank_raises_at_once_on_every_rank(argument, value, words):
    """Before: rank 1 raised at once, the others waited the whole timeout (timeout=-1 was accepted)."""
    def body(comm):
        kwargs = {"module": nn.Linear(2, 1), "sync_every": 4, "group": comm}
        if comm.rank == 1:
            kwargs[argument] = value
        return capture_error(lambda: gradsync.LocalSGD(**kwargs))

    started = time.monotonic()
    error0, error1 = run_threads(2, body, timeout_s=30, collective_timeout_s=10)
    assert time.monotonic() - started < 5
    _assert_rank1_rejected(error0, error1, words)


def test_local_sgd_timeout_is_checked_at_construction():
    with pytest.raises(ValueError, match="finite number of seconds > 0"):
        gradsync.LocalSGD(nn.Linear(2, 1), sync_every=2, timeout=-1, group=_single())
    with pytest.raises(TypeError, match="timeout must be a number"):
        gradsync.LocalSGD(nn.Linear(2, 1), sync_every=2, timeout="soon", group=_single())


def _single():
    from gradsync.transport.thread import ThreadWorld
    return gradsync.Communicator(ThreadWorld(1).transport(0))


def _rank_bad_group_on_rank_1():
    """Each wrapper with group="g" on rank 1 and the default group on rank 0, then a free collective."""
    rank, results = gradsync.rank(), []
    for build in (lambda group: gradsync.DataParallel(nn.Linear(2, 1), group=group),
                  lambda group: gradsync.LocalSGD(nn.Linear(2, 1), sync_every=2, group=group)):
        started = time.monotonic()
        error = capture_error(lambda: build("g" if rank == 1 else None))
        results.append((type(error).__name__, str(error), time.monotonic() - started))
    total = torch.full((2,), float(rank + 1))
    gradsync.all_reduce(total)  # still in step
    return results, total.tolist()


def test_bad_group_on_one_rank_raises_at_once_on_every_rank():
    """Before: TypeError on rank 1 before any exchange; rank 0 waited for the timeout, the next call mis-paired."""
    (results0, total0), (results1, total1) = run_world(2, _rank_bad_group_on_rank_1, timeout_s=60,
                                                       collective_timeout_s=20)
    for (name0, message0, seconds0), (name1, message1, _) in zip(results0, results1):
        assert name1 == "TypeError" and "group must be None" in message1
        assert name0 == "CollectiveMismatchError" and "rank 1 has arguments=rejected" in message0
        assert "group must be None" in message0 and seconds0 < 10
    assert total0 == total1 == [3.0, 3.0]
