"""A call one rank rejects, and algorithm choices the ranks must agree on (issue 16, items 2, 6, 11a).

A rank-local problem (a bad timeout, a sparse or inference tensor, a failed
staging allocation, ...) travels in the layout descriptor as a rejection:
that rank raises its own error, every other rank a CollectiveMismatchError
naming it and the cause, and the group stays in step. The algorithm that
"auto" resolves to, and the options it runs with, are compared the same way.
Locality (which ranks share a host) comes from host identities the ranks
exchange, never from each rank's LOCAL_WORLD_SIZE.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import gradsync
from _dist import capture, run_threads, run_world
from _reference import assert_bitwise_equal, assert_rejected_everywhere
from _strict_transport import StrictWorld
from gradsync import CollectiveMismatchError, Communicator
from gradsync.collectives import auto
from gradsync.collectives import ops as collectives_api
from gradsync.collectives import SegmentOptions, ShmState
from gradsync.process_group import resolve_group
from gradsync.transport import locality
from gradsync.transport.shm_segment import ShmSegment

BAD_RANK = 1


def _non_contiguous(comm):
    return torch.ones(8, 2)[:, 0]


# kind -> (error type on the bad rank, words its message and the others' must contain, the call)
REJECTIONS = {
    "timeout-negative": (ValueError, "timeout", lambda comm, bad: gradsync.all_reduce(
        torch.ones(64), group=comm, timeout=-1 if bad else None)),
    "timeout-nan": (ValueError, "timeout", lambda comm, bad: gradsync.all_reduce(
        torch.ones(4), group=comm, timeout=math.nan if bad else None)),
    "timeout-inf": (ValueError, "timeout", lambda comm, bad: gradsync.broadcast(
        torch.ones(4), group=comm, timeout=math.inf if bad else None)),
    "timeout-str": (TypeError, "timeout", lambda comm, bad: gradsync.all_gather(
        torch.ones(4), group=comm, timeout="5" if bad else None)),
    "sparse": (TypeError, "sparse", lambda comm, bad: gradsync.all_reduce(
        torch.ones(4).to_sparse() if bad else torch.ones(4), group=comm)),
    "inference": (ValueError, "inference", lambda comm, bad: gradsync.all_reduce(
        _inference_ones(4) if bad else torch.ones(4), group=comm)),
    "meta": (ValueError, "meta", lambda comm, bad: gradsync.all_reduce(
        torch.ones(4, device="meta") if bad else torch.ones(4), group=comm)),
    "op-none": (TypeError, "op", lambda comm, bad: gradsync.all_reduce(
        torch.ones(4), op=None if bad else "sum", group=comm)),
    "op-none-string": (ValueError, "op", lambda comm, bad: gradsync.all_reduce(
        torch.ones(4), op="none" if bad else "sum", group=comm)),
    "op-int": (TypeError, "op", lambda comm, bad: gradsync.all_reduce(
        torch.ones(4), op=3 if bad else "sum", group=comm)),
    "algorithm-none": (TypeError, "algorithm", lambda comm, bad: gradsync.all_reduce(
        torch.ones(4), algorithm=None if bad else "ring", group=comm)),
    "algorithm-int": (TypeError, "algorithm", lambda comm, bad: gradsync.reduce_scatter(
        torch.ones(4), algorithm=5 if bad else None, group=comm)),
    "src-str": (TypeError, "src", lambda comm, bad: gradsync.broadcast(
        torch.ones(4), src="0" if bad else 0, group=comm)),
    "not-a-tensor": (TypeError, "Tensor", lambda comm, bad: gradsync.all_reduce(
        [1.0] if bad else torch.ones(4), group=comm)),
    "staging-allocation": (RuntimeError, "not enough memory", lambda comm, bad: _failing_staging(comm, bad)),
    "all_to_all-count": (ValueError, "all_to_all", lambda comm, bad: gradsync.all_to_all(
        [torch.ones(2)] * (comm.world_size + int(bad)), [torch.empty(2) for _ in range(comm.world_size)],
        group=comm)),
    "shared_buffer-nbytes": (TypeError, "nbytes", lambda comm, bad: collectives_api.shared_buffer(
        comm, "64" if bad else 64, "shm")),
}


def _inference_ones(numel):
    with torch.inference_mode():
        return torch.ones(numel)


def _failing_staging(comm, bad):
    if bad:
        def out_of_memory(*args, **kwargs):
            raise RuntimeError("DefaultCPUAllocator: not enough memory")
        comm.workspace.get = out_of_memory
    try:
        return gradsync.all_reduce(_non_contiguous(comm), group=comm)
    finally:
        comm.workspace.__dict__.pop("get", None)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", sorted(REJECTIONS))
def test_a_call_one_rank_rejects_raises_on_every_rank_and_the_group_stays_in_step(kind):
    """The rejecting rank raises its own error; every other rank a CollectiveMismatchError naming it and the
    cause, at once (no timeout); the next all_reduce gives the exact sum on every rank."""
    world_size, timeout_s = 3, 4.0
    expected_type, words, call = REJECTIONS[kind]

    def rank_fn(comm):
        exc, elapsed_s = capture(lambda: call(comm, comm.rank == BAD_RANK))
        follow_up = torch.arange(64, dtype=torch.float32) * (comm.rank + 1)
        gradsync.all_reduce(follow_up, group=comm)
        return exc, elapsed_s, follow_up

    outcomes = run_threads(world_size, rank_fn, timeout_s=3 * timeout_s, collective_timeout_s=timeout_s)
    expected = torch.arange(64, dtype=torch.float32) * sum(range(1, world_size + 1))
    assert_rejected_everywhere(outcomes, BAD_RANK, expected_type, words, expected, max_wait_s=timeout_s / 2)


def test_ranks_with_different_segment_options_raise_a_mismatch_not_a_timeout():
    """Ring pipelining with different segment sizes would pair messages of different sizes."""
    def rank_fn(comm):
        segments = SegmentOptions(segment_bytes=64 if comm.rank == BAD_RANK else 4096)
        comm = Communicator(comm.transport, 4.0, options=[segments])
        exc, _ = capture(lambda: gradsync.all_reduce(torch.ones(1000), group=comm, algorithm="ring"))
        return exc

    for rank, exc in enumerate(run_threads(2, rank_fn)):
        assert isinstance(exc, CollectiveMismatchError) and "options" in str(exc), f"rank {rank}: {exc!r}"


def test_ranks_that_resolve_auto_differently_raise_a_mismatch_on_every_rank():
    """Rank 1 knows shared memory is unavailable (auto: the model's fastest without it), rank 0 does not
    (auto: shm): the resolved algorithm is in the descriptor, so both raise before any data moves."""
    without_shm = auto.choose(64, 2, 2, shm_available=False)
    assert auto.choose(64, 2, 2) == "shm" and without_shm != "shm"

    def rank_fn(comm):
        state = ShmState()
        state.available = False if comm.rank == BAD_RANK else None
        comm = Communicator(comm.transport, 4.0, options=[state])
        tensor = torch.ones(16)
        exc, _ = capture(lambda: gradsync.all_reduce(tensor, group=comm, algorithm="auto"))
        return exc, tensor

    for rank, (exc, tensor) in enumerate(run_threads(2, rank_fn)):
        assert isinstance(exc, CollectiveMismatchError), f"rank {rank}: {exc!r}"
        assert "shm" in str(exc) and without_shm in str(exc), f"rank {rank}: {exc}"
        assert_bitwise_equal(tensor, torch.ones(16), f"rank {rank} tensor")


# ---------------------------------------------------------------- locality from host identities

HOST_A, HOST_B, HOST_C = (1, 2, 3, 4), (5, 6, 3, 4), (1, 2, 7, 8)  # C: A's boot, another /dev/shm


@pytest.mark.parametrize("identities, hosts, one_host, ranks_per_node", [
    ([HOST_A] * 3, (0, 0, 0), True, 3),
    ([HOST_A, HOST_A, HOST_B, HOST_B], (0, 0, 1, 1), False, 2),
    ([HOST_A, HOST_B, HOST_C], (0, 1, 2), False, 1),
    ([HOST_A, HOST_A, HOST_B], (0, 0, 1), False, None),           # unequal hosts
    ([HOST_A, HOST_B, HOST_A, HOST_B], (0, 1, 0, 1), False, None),  # not contiguous blocks
    ([HOST_A, HOST_C], (0, 1), False, 1),                         # same boot, private /dev/shm
])
def test_locality_derived_from_host_identities(identities, hosts, one_host, ranks_per_node):
    derived = locality.derive(identities)
    assert derived.hosts == hosts
    assert derived.one_host is one_host
    assert derived.ranks_per_node == ranks_per_node
    assert derived.sub([0]).one_host


def test_host_identity_is_boot_id_and_dev_shm():
    identity = locality.host_identity()
    assert len(identity) == locality.IDENTITY_WORDS and identity == locality.host_identity()
    if os.path.isdir("/dev/shm"):
        status = os.stat("/dev/shm")
        assert identity[2:] == (status.st_dev, status.st_ino)


def test_a_hand_built_communicator_learns_its_locality_in_its_first_call():
    """A transport that does not know its hosts: the first collective exchanges identities (as control
    traffic) and every rank learns the same locality; the call's result is exact."""
    world = StrictWorld(2, "early")

    def rank_fn(comm):
        comm = Communicator(world.transport(comm.rank), 4.0)
        before = comm.locality
        tensor = gradsync.all_reduce(torch.full((3,), comm.rank + 1.0), group=comm, algorithm="auto")
        return before, comm.locality, tensor, comm.options(ShmState).segment is not None

    for rank, (before, learnt, tensor, used_shm) in enumerate(run_threads(2, rank_fn)):
        assert before is None and learnt == locality.Locality((0, 0)), f"rank {rank}: {before} -> {learnt}"
        assert_bitwise_equal(tensor, torch.full((3,), 3.0), f"rank {rank}")
        assert used_shm, f"rank {rank}: one host, so auto runs shm"


def _rank_auto_and_hierarchical_with_uneven_local_world_sizes(local_world_sizes):
    """Join again with this rank's own LOCAL_WORLD_SIZE; all_reduce with auto and hierarchical."""
    rank = gradsync.rank()
    gradsync.shutdown()
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_sizes[rank])
    gradsync.init(backend="gloo", timeout=10.0)
    results = {}
    for algorithm in ("auto", "hierarchical"):
        tensor = torch.arange(1000, dtype=torch.float32) * (rank + 1)
        try:
            results[algorithm] = gradsync.all_reduce(tensor, algorithm=algorithm)
        except Exception as exc:  # noqa: BLE001 - reported per rank
            results[algorithm] = f"{type(exc).__name__}: {exc}"
    group = torch.distributed.new_group(list(range(gradsync.world_size())))
    learnt = resolve_group(group).locality  # learnt when resolve_group made the communicator
    return results, gradsync.process_group.default_communicator().locality, learnt


@pytest.mark.timeout(60)
def test_auto_and_hierarchical_ignore_each_ranks_local_world_size():
    """ws 3 with LOCAL_WORLD_SIZE 2, 2, 1: all ranks share this host, so both give the exact sum."""
    outcomes = run_world(3, _rank_auto_and_hierarchical_with_uneven_local_world_sizes, (2, 2, 1),
                         timeout_s=45, collective_timeout_s=10.0)
    expected = torch.arange(1000, dtype=torch.float32) * 6
    for rank, (results, default_locality, group_locality) in enumerate(outcomes):
        assert default_locality == group_locality == locality.Locality((0, 0, 0)), f"rank {rank}"
        for algorithm, result in results.items():
            assert isinstance(result, torch.Tensor), f"rank {rank} {algorithm}: {result}"
            assert_bitwise_equal(result, expected, f"rank {rank} {algorithm}")


# ---------------------------------------------------------------- the exact trigger, in processes

def _rank_bad_timeout_then_good_call():
    rank = gradsync.rank()
    tensor = torch.arange(64, dtype=torch.float32) + rank
    try:
        gradsync.all_reduce(tensor, timeout=-1 if rank == 1 else None)
        first = "no error"
    except Exception as exc:  # noqa: BLE001 - reported per rank
        first = f"{type(exc).__name__}: {exc}"
    second = gradsync.all_reduce(torch.arange(64, dtype=torch.float32) + rank)
    return first, tensor, second


@pytest.mark.timeout(60)
def test_bad_timeout_on_one_process_rank_raises_everywhere_and_the_next_call_is_right():
    """Issue 16 item 2's trigger: before, rank 0 returned garbage (1.14e24) with no error."""
    outcomes = run_world(2, _rank_bad_timeout_then_good_call, timeout_s=45, collective_timeout_s=10.0)
    expected = torch.arange(64, dtype=torch.float32) * 2 + 1
    for rank, (first, tensor, second) in enumerate(outcomes):
        wanted = "ValueError" if rank == 1 else "CollectiveMismatchError"
        assert first.startswith(wanted) and "timeout" in first, f"rank {rank}: {first}"
        assert_bitwise_equal(tensor, torch.arange(64, dtype=torch.float32) + rank, f"rank {rank} untouched")
        assert_bitwise_equal(second, expected, f"rank {rank} second call")


# ---------------------------------------------------------------- a failed shared-memory attach

def test_a_failed_shm_attach_on_one_rank_raises_on_every_rank_naming_it(monkeypatch):
    """Before: FileNotFoundError on that rank, 'never reached this call' on the others."""
    real_attach = ShmSegment.attach.__func__

    def attach(cls, name, rank, *args, **kwargs):
        if rank == BAD_RANK:
            raise FileNotFoundError(2, "No such file or directory", f"/dev/shm/{name}")
        return real_attach(cls, name, rank, *args, **kwargs)

    monkeypatch.setattr(ShmSegment, "attach", classmethod(attach))

    def rank_fn(comm):
        exc, elapsed_s = capture(lambda: gradsync.all_reduce(torch.ones(8), group=comm, algorithm="shm"))
        return exc, elapsed_s, gradsync.all_reduce(torch.ones(8), group=comm, algorithm="ring")

    for rank, (exc, elapsed_s, follow_up) in enumerate(run_threads(3, rank_fn, timeout_s=12)):
        message = str(exc)
        assert isinstance(exc, gradsync.GradsyncError), f"rank {rank}: {exc!r}"
        assert f"rank {BAD_RANK}" in message and "FileNotFoundError" in message and "attach" in message, message
        assert elapsed_s < 3, f"rank {rank} waited {elapsed_s:.2f} s"
        assert_bitwise_equal(follow_up, torch.full((8,), 3.0), f"rank {rank} follow-up")


def test_unequal_hosts_shm_raises_on_every_rank_hierarchical_and_auto_sum():
    """Hosts {0, 1} and {2}: shm has no common host (ValueError on every rank, naming the hosts);
    hierarchical (chunks split by the smallest host) and auto (flat at this size) give the exact sum."""
    def rank_fn(comm):
        comm.locality = locality.Locality((0, 0, 1))
        outcomes = {}
        for algorithm in ("hierarchical", "shm", "auto"):
            tensor = torch.arange(10, dtype=torch.float32) * (comm.rank + 1)
            exc, _ = capture(lambda: gradsync.all_reduce(tensor, group=comm, algorithm=algorithm))
            outcomes[algorithm] = exc, tensor
        return outcomes

    for rank, outcomes in enumerate(run_threads(3, rank_fn)):
        exc, tensor = outcomes["shm"]
        assert type(exc) is ValueError and "ranks [0, 1]" in str(exc), f"rank {rank} shm: {exc!r}"
        assert_bitwise_equal(tensor, torch.arange(10, dtype=torch.float32) * (rank + 1), f"rank {rank}")
        for algorithm in ("hierarchical", "auto"):
            exc, tensor = outcomes[algorithm]
            assert exc is None, f"rank {rank} {algorithm}: {exc!r}"
            assert_bitwise_equal(tensor, torch.arange(10, dtype=torch.float32) * 6, f"rank {rank} {algorithm}")
