"""Arguments one rank gets wrong that used to mis-pair calls or crash (issue 16, hostile-trial round 2).

A ``group=`` this rank cannot resolve, ``dist.group.WORLD`` against None,
``all_to_all`` sizes or dtypes that differ between ranks, a tensor whose
elements overlap in memory, a shape of many dims: each raises on every
rank before any payload moves (the bad rank its own error, every other
rank a CollectiveMismatchError naming it), and the next call is exact.
"""

from __future__ import annotations

import threading

import pytest
import torch

import gradsync
from _dist import capture, run_threads, run_world
from _reference import assert_bitwise_equal, assert_rejected_everywhere
from gradsync import CollectiveMismatchError
from gradsync import process_group

BAD_RANK = 1


@pytest.fixture
def thread_default_group(monkeypatch):
    """Make each thread rank's communicator its default group (``group=None``), as gradsync.init would."""
    local = threading.local()
    monkeypatch.setattr(process_group, "default_communicator", lambda: local.comm)

    def run(world_size, fn, **kwargs):
        def body(comm):
            local.comm = comm
            return fn(comm)
        return run_threads(world_size, body, **kwargs)
    return run


def _follow_up(comm):
    tensor = torch.arange(16, dtype=torch.float32) * (comm.rank + 1)
    return gradsync.all_reduce(tensor, group=comm)


def _check_rejected(outcomes, bad_type, words, world_size):
    expected = torch.arange(16, dtype=torch.float32) * sum(range(1, world_size + 1))
    assert_rejected_everywhere(outcomes, BAD_RANK, bad_type, words, expected, max_wait_s=2.0)


# ---------------------------------------------------------------- item 1: a group this rank cannot resolve

def _a2a(comm, **kwargs):
    n = comm.world_size
    return gradsync.all_to_all([torch.ones(2)] * n, [torch.empty(2) for _ in range(n)], **kwargs)


CALLS = {
    "all_reduce": lambda comm, **kw: gradsync.all_reduce(torch.ones(4), **kw),
    "broadcast": lambda comm, **kw: gradsync.broadcast(torch.ones(4), **kw),
    "all_gather": lambda comm, **kw: gradsync.all_gather(torch.ones(4), **kw),
    "reduce_scatter": lambda comm, **kw: gradsync.reduce_scatter(torch.ones(4), **kw),
    "all_to_all": _a2a,
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("what", sorted(CALLS))
def test_a_group_one_rank_cannot_resolve_raises_on_every_rank_and_calls_stay_paired(what, thread_default_group):
    """Before: rank 1 raised TypeError without sending anything; rank 0's call paired with rank 1's next."""
    def rank_fn(comm):
        group = "oops" if comm.rank == BAD_RANK else None
        exc, elapsed_s = capture(lambda: CALLS[what](comm, group=group))
        return exc, elapsed_s, _follow_up(comm)

    _check_rejected(thread_default_group(3, rank_fn, timeout_s=12, collective_timeout_s=4.0),
                    TypeError, "group must be", 3)


def test_resolve_group_or_reject_without_a_default_group_just_raises():
    assert not gradsync.is_initialized()
    with pytest.raises(TypeError, match="group must be"):
        process_group.resolve_group_or_reject(3, "all_reduce")


# ---------------------------------------------------------------- items 1 and 2 in processes (the exact triggers)

def _rank_bad_group_then_world_group():
    import torch.distributed as dist
    rank = gradsync.rank()
    bad = rank == 1
    outcomes = []
    for group in ("oops", dist.group.WORLD, dist.distributed_c10d._get_default_group()):
        tensor = torch.full((4,), float(rank + 1))
        try:
            gradsync.all_reduce(tensor, group=group if bad else None)
            outcomes.append(tensor.tolist())
        except Exception as exc:  # noqa: BLE001 - reported per rank
            outcomes.append(f"{type(exc).__name__}: {exc}")
        outcomes.append(gradsync.all_reduce(torch.full((4,), 100.0 * (rank + 1))).tolist())
    return outcomes, process_group.resolve_group(dist.group.WORLD) is process_group.default_communicator()


@pytest.mark.timeout(60)
def test_bad_group_and_world_group_on_one_process_rank():
    """q1/q2: before, rank 0 returned 201 for a call rank 1 rejected, then every call was off by one;
    ``dist.group.WORLD`` on one rank made Gloo abort (SIGABRT)."""
    outcomes = run_world(2, _rank_bad_group_then_world_group, timeout_s=45, collective_timeout_s=10.0)
    for rank, (results, world_is_default) in enumerate(outcomes):
        first = results[0]
        wanted = "TypeError" if rank == 1 else "CollectiveMismatchError"
        assert first.startswith(wanted) and "group must be" in first, f"rank {rank}: {first}"
        assert results[2] == results[4] == [3.0] * 4, f"rank {rank}: {results}"
        assert results[1] == results[3] == results[5] == [300.0] * 4, f"rank {rank}: {results}"
        assert world_is_default, f"rank {rank}"


# ---------------------------------------------------------------- item 3: all_to_all sizes and dtypes

def _a2a_pairs(comm, send_numel, send_dtype, recv_numel, recv_dtype):
    """Rank r sends ``full(r * 10 + p)`` to rank p; returns (exception, receives)."""
    n = comm.world_size
    sends = [torch.full((send_numel,), float(comm.rank * 10 + p), dtype=send_dtype) for p in range(n)]
    receives = [torch.full((recv_numel,), -7.0, dtype=recv_dtype) for _ in range(n)]
    exc, elapsed_s = capture(lambda: gradsync.all_to_all(sends, receives, group=comm))
    return exc, elapsed_s, receives


A2A_MISMATCHES = {  # what the bad rank does -> words every rank's error must contain (world size 2)
    "send-size": (dict(send_numel=5), "rank 1 sends 5 float32 elements to rank 0, which receives 4 float32"),
    "send-dtype": (dict(send_dtype=torch.float64), "rank 1 sends 4 float64 elements to rank 0, which receives "
                                                   "4 float32"),
    "receive-dtype": (dict(recv_dtype=torch.float64), "rank 0 sends 4 float32 elements to rank 1, which receives "
                                                      "4 float64"),
    "receive-bigger": (dict(recv_numel=5), "rank 0 sends 4 float32 elements to rank 1, which receives 5 float32"),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", sorted(A2A_MISMATCHES))
def test_all_to_all_sizes_or_dtypes_that_differ_raise_on_every_rank_before_data_moves(kind, world_size):
    """c2.py a2a: before, Gloo aborted (``op.preamble.length <= op.nbytes``) or a rank raised alone."""
    bad, words = A2A_MISMATCHES[kind]

    def rank_fn(comm):
        args = dict(send_numel=4, send_dtype=torch.float32, recv_numel=4, recv_dtype=torch.float32)
        if comm.rank == BAD_RANK:
            args.update(bad)
        exc, elapsed_s, receives = _a2a_pairs(comm, **args)
        return exc, elapsed_s, receives, _follow_up(comm)

    expected = torch.arange(16, dtype=torch.float32) * sum(range(1, world_size + 1))
    for rank, (exc, elapsed_s, receives, follow_up) in enumerate(
            run_threads(world_size, rank_fn, timeout_s=12, collective_timeout_s=4.0)):
        assert isinstance(exc, CollectiveMismatchError), f"rank {rank}: {exc!r}"
        assert words in str(exc), f"rank {rank}: {exc}"
        assert elapsed_s < 2.0, f"rank {rank} waited {elapsed_s:.2f} s"
        assert all(bool((buffer == -7).all()) for buffer in receives), f"rank {rank}: receives were written"
        assert_bitwise_equal(follow_up, expected, f"rank {rank} follow-up")


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_with_uneven_but_matching_sizes_still_works(world_size):
    """Rank r sends (r + p + 1) elements to rank p: every pair matches, sizes differ between ranks."""
    def rank_fn(comm):
        n, r = comm.world_size, comm.rank
        sends = [torch.full((r + p + 1,), float(r * 10 + p), dtype=torch.float64) for p in range(n)]
        receives = [torch.empty(r + p + 1, dtype=torch.float64) for p in range(n)]
        return gradsync.all_to_all(sends, receives, group=comm)

    for rank, receives in enumerate(run_threads(world_size, rank_fn)):
        for src, received in enumerate(receives):
            expected = torch.full((rank + src + 1,), float(src * 10 + rank), dtype=torch.float64)
            assert_bitwise_equal(received, expected, f"rank {rank} from {src}")


# ---------------------------------------------------------------- item 4: a tensor that overlaps itself

def _expanded(numel):
    return torch.ones(1).expand(numel)


OVERLAPS = {
    "all_reduce-ring": lambda comm, bad: gradsync.all_reduce(_expanded(64) if bad else torch.ones(64), group=comm),
    "all_reduce-tree": lambda comm, bad: gradsync.all_reduce(_expanded(64) if bad else torch.ones(64), group=comm,
                                                             algorithm="tree"),
    "all_reduce-as_strided": lambda comm, bad: gradsync.all_reduce(
        torch.ones(3).as_strided((3,), (0,)) if bad else torch.ones(3), group=comm),
    "broadcast": lambda comm, bad: gradsync.broadcast(_expanded(64) if bad else torch.ones(64), src=0, group=comm),
    "all_to_all-receive": lambda comm, bad: gradsync.all_to_all(
        [torch.ones(4)] * comm.world_size,
        [torch.zeros(1).expand(4) if bad else torch.zeros(4) for _ in range(comm.world_size)], group=comm),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", sorted(OVERLAPS))
def test_a_tensor_that_overlaps_itself_on_one_rank_is_rejected_before_data_moves(kind):
    """c3.py: before, rank 1 raised torch's RuntimeError after data moved and rank 0 returned a result."""
    def rank_fn(comm):
        exc, elapsed_s = capture(lambda: OVERLAPS[kind](comm, comm.rank == BAD_RANK))
        return exc, elapsed_s, _follow_up(comm)

    outcomes = run_threads(2, rank_fn, timeout_s=12, collective_timeout_s=4.0)
    _check_rejected(outcomes, ValueError, "overlapping memory", 2)


def test_an_overlapping_tensor_is_still_fine_where_it_is_only_read():
    """reduce_scatter and all_gather do not write their input: an expanded tensor works (exact values)."""
    def rank_fn(comm):
        value = torch.full((1,), comm.rank + 1.0)
        return (gradsync.reduce_scatter(value.expand(6), group=comm),
                gradsync.all_gather(value.expand(3), group=comm))

    for rank, (chunk, gathered) in enumerate(run_threads(2, rank_fn)):
        assert_bitwise_equal(chunk, torch.full((3,), 3.0), f"rank {rank} reduce_scatter")
        for src, part in enumerate(gathered):
            assert_bitwise_equal(part, torch.full((3,), src + 1.0), f"rank {rank} all_gather from {src}")


# ---------------------------------------------------------------- item 5: shapes of many dims

MANY_DIMS = {  # rank 0's shape, rank 1's shape, words every rank's message contains
    "last-dim": ((1,) * 26 + (3,), (1,) * 26 + (4,),
                 ["(1, 1, 1, 1, 1, 1, …, 3) with 27 dims", "(1, 1, 1, 1, 1, 1, …, 4) with 27 dims"]),
    "dim-count": ((1,) * 9 + (3,), (1,) * 10 + (3,), ["with 10 dims", "with 11 dims"]),
    "middle-dim": ((1,) * 7 + (2,) + (1,) * 3, (1,) * 8 + (2,) + (1,) * 2, ["with 11 dims", "dims 6 to 9 differ"]),
}


@pytest.mark.parametrize("kind", sorted(MANY_DIMS))
def test_a_shape_mismatch_of_many_dims_is_shown_without_a_hash(kind):
    """Before: ``rank 0 has (1, 1, 1, 1, 1, 1, 1, 1729875179)`` (the folded tail's hash)."""
    shapes = MANY_DIMS[kind][:2]

    def rank_fn(comm):
        exc, _ = capture(lambda: gradsync.all_reduce(torch.ones(shapes[comm.rank]), group=comm))
        return exc

    for rank, exc in enumerate(run_threads(2, rank_fn)):
        assert isinstance(exc, CollectiveMismatchError), f"rank {rank}: {exc!r}"
        for words in MANY_DIMS[kind][2]:
            assert words in str(exc), f"rank {rank}: {exc}"
        assert "1729875179" not in str(exc) and not any(len(word) > 6 for word in str(exc).replace(",", " ")
                                                        .replace(")", " ").split() if word.isdigit())


@pytest.mark.parametrize("make, overlaps", [
    (lambda: torch.ones(8, 2)[:, 0], False), (lambda: torch.ones(4, 6).t(), False),
    (lambda: torch.ones(4, 6)[:, ::2], False), (lambda: torch.ones(2, 3, 4).permute(2, 0, 1), False),
    (lambda: torch.ones(1).expand(4), True), (lambda: torch.ones(4, 1).expand(4, 3), True),
    (lambda: torch.ones(10).as_strided((3, 3), (1, 2)), True),
])
def test_overlaps_itself_tells_views_from_overlapping_tensors(make, overlaps):
    from gradsync.collectives.validate import overlaps_itself
    assert overlaps_itself(make()) is overlaps


# ---------------------------------------------------------------- item 6: gradsync.init with a bad argument on one rank

def _rank_init_again_with_a_bad_timeout_on_rank_1():
    """Leave the group, then join again: rank 1 with timeout=-1, rank 0 with a 2 s start-up bound."""
    import time
    rank = gradsync.rank()
    gradsync.shutdown()
    process_group.MIN_STARTUP_TIMEOUT_S = 2.0
    started = time.monotonic()
    try:
        gradsync.init(backend="gloo", timeout=-1 if rank == 1 else 2.0)
        outcome = "joined"
    except Exception as exc:  # noqa: BLE001 - reported per rank
        outcome = exc
    return outcome, time.monotonic() - started


@pytest.mark.timeout(60)
def test_init_with_a_bad_argument_on_one_rank_names_the_rank_that_never_joined():
    """Before: rank 0 waited 61 s, then torch's DistStoreError ("1/2 clients joined")."""
    outcomes = run_world(2, _rank_init_again_with_a_bad_timeout_on_rank_1, timeout_s=45, collective_timeout_s=10.0)
    (first, first_s), (second, _) = outcomes
    assert type(second) is ValueError and "timeout" in str(second), repr(second)
    assert isinstance(first, gradsync.CollectiveTimeoutError), repr(first)
    assert "rank 1" in str(first) and "never joined" in str(first) and "bad argument" in str(first), str(first)
    assert first_s < 8.0, f"rank 0 waited {first_s:.1f} s"
