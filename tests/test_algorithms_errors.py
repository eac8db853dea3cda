"""Collectives that fail over in-process thread ranks: bad arguments, mismatches across ranks, silent peers.

Bad ops, algorithms and dtypes raise on every rank; ranks that disagree on
layout, op, algorithm, src or collective raise CollectiveMismatchError and the
group recovers; one rank's bad argument does not hang the others; a rank that
never calls makes the others raise CollectiveTimeoutError naming the
algorithm, the peer and the step, within the timeout plus 2 s (also for
algorithm='auto'); Communicator rejects bad options at construction.
"""

from __future__ import annotations

import pytest
import torch

import gradsync
from _dist import RankError, capture, run_threads
from _reference import INT_DTYPES, assert_bitwise_equal
from _variants import ALGORITHMS, SMALL, VARIANTS, Variant, run_variant, smallest_world
from gradsync import CollectiveMismatchError, CollectiveTimeoutError, Communicator
from gradsync.collectives import ops as collectives_api
from gradsync.collectives import HierarchicalOptions, SegmentOptions, auto
from gradsync.transport.thread import ThreadWorld


# ---------------------------------------------------------------- argument errors


def _errors_on_every_rank(world_size, call):
    """Run ``call(comm)`` on every thread-rank; return each rank's exception (None if none)."""
    return [exc for exc, _ in run_threads(world_size, lambda comm: capture(lambda: call(comm)),
                                          collective_timeout_s=2)]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_reduce_avg_on_integer_raises_type_error(algorithm):
    """op='avg' on every integer dtype raises TypeError on every rank and leaves the tensor as it was."""
    def rank_fn(comm):
        outcomes = {}
        for dtype in INT_DTYPES:
            tensor = torch.arange(5, dtype=dtype)
            exc, _ = capture(lambda: gradsync.all_reduce(tensor, op="avg", algorithm=algorithm, group=comm))
            outcomes[dtype] = (exc, torch.equal(tensor, torch.arange(5, dtype=dtype)))
        return outcomes

    for rank, outcomes in enumerate(run_threads(2, rank_fn, collective_timeout_s=2)):
        for dtype, (exc, untouched) in outcomes.items():
            assert isinstance(exc, TypeError), f"rank {rank} {dtype}: {exc!r}"
            assert untouched, f"rank {rank} {dtype}: the tensor was modified"


def test_reduce_scatter_avg_on_integer_raises_type_error():
    """reduce_scatter with op='avg' on int64 raises TypeError on every rank."""
    def call(comm):
        gradsync.reduce_scatter(torch.arange(5), op="avg", group=comm)

    for rank, exc in enumerate(_errors_on_every_rank(2, call)):
        assert isinstance(exc, TypeError), f"rank {rank}: {exc!r}"


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_collectives_unknown_op_raises_value_error_listing_choices(collective):
    """An unknown op raises ValueError whose message lists every valid op."""
    def call(comm):
        getattr(gradsync, collective)(torch.ones(4), op="max", group=comm)

    for rank, exc in enumerate(_errors_on_every_rank(2, call)):
        assert isinstance(exc, ValueError), f"rank {rank}: {exc!r}"
        assert all(op in str(exc) for op in gradsync.OPS), str(exc)


def test_all_reduce_unknown_algorithm_raises_value_error_listing_choices():
    """An unknown algorithm raises ValueError whose message lists every name in ALGORITHMS."""
    def call(comm):
        gradsync.all_reduce(torch.ones(4), algorithm="butterfly", group=comm)

    for rank, exc in enumerate(_errors_on_every_rank(2, call)):
        assert isinstance(exc, ValueError), f"rank {rank}: {exc!r}"
        assert all(name in str(exc) for name in gradsync.ALGORITHMS), str(exc)


_COLLECTIVE_CALLS = {
    "all_reduce": lambda tensor, comm: gradsync.all_reduce(tensor, group=comm),
    "native_all_reduce": lambda tensor, comm: gradsync.all_reduce(tensor, algorithm="native", group=comm),
    "broadcast": lambda tensor, comm: gradsync.broadcast(tensor, src=0, group=comm),
    "all_gather": lambda tensor, comm: gradsync.all_gather(tensor, group=comm),
    "reduce_scatter": lambda tensor, comm: gradsync.reduce_scatter(tensor, group=comm),
}


@pytest.mark.parametrize("collective", sorted(_COLLECTIVE_CALLS))
@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64], ids=str)
def test_collectives_unsupported_dtype_raises_type_error(dtype, collective):
    """bool and complex tensors raise TypeError on every rank, for every collective."""
    def call(comm):
        _COLLECTIVE_CALLS[collective](torch.zeros(4, dtype=dtype), comm)

    for rank, exc in enumerate(_errors_on_every_rank(2, call)):
        assert isinstance(exc, TypeError), f"rank {rank}: {exc!r}"


def test_run_threads_reports_failing_rank():
    """The helper re-raises a rank's exception naming that rank (so failures are attributable)."""
    def rank_fn(comm):
        if comm.rank == 1:
            raise KeyError("boom")
        return comm.rank

    with pytest.raises(RankError, match="rank 1 raised KeyError") as info:
        run_threads(2, rank_fn)
    assert info.value.rank == 1


# ---------------------------------------------------------------- mismatches across ranks

MISMATCHES = {  # kind -> tensor for (odd rank?)
    "numel": lambda odd: torch.ones(5 if odd else 4),
    "shape-same-numel": lambda odd: torch.ones((3, 2) if odd else (2, 3)),
    "dtype": lambda odd: torch.ones(4, dtype=torch.float64 if odd else torch.float32),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_algorithms_mismatch_raises_on_every_rank_and_group_recovers(name):
    """One rank's odd layout (numel, shape, dtype; in turn on one group) raises CollectiveMismatchError (a
    ValueError) everywhere; tensors untouched; the next call works."""
    variant = VARIANTS[name]
    world_size = smallest_world(variant)
    odd_rank = world_size - 1

    def rank_fn(comm):
        outcomes = {}
        for kind in sorted(MISMATCHES):
            tensor = MISMATCHES[kind](comm.rank == odd_rank) * (comm.rank + 2)
            before = tensor.clone()
            exc, _ = capture(lambda: gradsync.all_reduce(tensor, algorithm=variant.algorithm, group=comm))
            follow_up = gradsync.all_reduce(torch.full((7,), comm.rank + 1.0), algorithm=variant.algorithm,
                                            group=comm)
            outcomes[kind] = exc, tensor, before, follow_up
        return outcomes

    expected_follow_up = torch.full((7,), world_size * (world_size + 1) / 2)
    for rank, outcomes in enumerate(run_variant(variant, world_size, rank_fn)):
        for kind, (exc, tensor, before, follow_up) in outcomes.items():
            assert isinstance(exc, CollectiveMismatchError), f"rank {rank} {kind}: {exc!r}"
            assert isinstance(exc, ValueError), f"rank {rank} {kind}: {exc!r}"
            assert_bitwise_equal(tensor, before, f"rank {rank} {kind}: tensor after the failed call")
            assert_bitwise_equal(follow_up, expected_follow_up, f"rank {rank} {kind}: follow-up all_reduce")


# kind -> (rank-dependent tensor factory, the call); rank 1 is the odd one out of 3. Layout mismatches
# of all_reduce (numel, shape, dtype) are covered for every variant above.
CALL_MISMATCHES = {
    "all_reduce-op": (lambda odd: torch.ones(4),
                      lambda t, comm, odd: gradsync.all_reduce(t, op="avg" if odd else "sum", group=comm)),
    "all_reduce-algorithm": (lambda odd: torch.ones(4),
                             lambda t, comm, odd: gradsync.all_reduce(
                                 t, algorithm="native" if odd else "ring", group=comm)),
    "broadcast-src": (lambda odd: torch.ones(4),
                      lambda t, comm, odd: gradsync.broadcast(t, src=1 if odd else 0, group=comm)),
    "broadcast-shape": (lambda odd: torch.ones(5 if odd else 4),
                        lambda t, comm, odd: gradsync.broadcast(t, src=0, group=comm)),
    "all_gather-shape": (lambda odd: torch.ones(5 if odd else 4),
                         lambda t, comm, odd: gradsync.all_gather(t, group=comm)),
    "reduce_scatter-dtype": (lambda odd: torch.ones(4, dtype=torch.int32 if odd else torch.int64),
                             lambda t, comm, odd: gradsync.reduce_scatter(t, group=comm)),
    "collective-kind": (lambda odd: torch.ones(4),
                        lambda t, comm, odd: (gradsync.broadcast(t, group=comm) if odd
                                              else gradsync.all_reduce(t, group=comm))),
}


@pytest.mark.parametrize("kind", sorted(CALL_MISMATCHES))
def test_collectives_mismatch_raises_on_every_rank_and_group_recovers(kind):
    """Ranks disagreeing on op, algorithm, src, shape, dtype or collective all raise CollectiveMismatchError,
    tensors untouched; the next call works."""
    world_size, odd_rank = 3, 1
    make_tensor, call = CALL_MISMATCHES[kind]

    def rank_fn(comm):
        odd = comm.rank == odd_rank
        tensor = make_tensor(odd) * (comm.rank + 2)
        before = tensor.clone()
        exc, _ = capture(lambda: call(tensor, comm, odd))
        follow_up = gradsync.all_reduce(torch.full((3,), comm.rank + 1.0), group=comm)
        return exc, tensor, before, follow_up

    expected_follow_up = torch.full((3,), world_size * (world_size + 1) / 2)
    for rank, (exc, tensor, before, follow_up) in enumerate(run_threads(world_size, rank_fn)):
        assert isinstance(exc, CollectiveMismatchError), f"rank {rank}: {exc!r}"
        assert isinstance(exc, ValueError)
        assert_bitwise_equal(tensor, before, f"rank {rank} tensor after the failed call")
        assert_bitwise_equal(follow_up, expected_follow_up, f"rank {rank} follow-up all_reduce")


# kind -> (expected error type on the bad rank, the call with bad = this rank is the one with a bad argument)
ONE_BAD_RANK = {
    "bool-dtype": (TypeError, lambda comm, bad: gradsync.all_reduce(
        torch.zeros(4, dtype=torch.bool) if bad else torch.zeros(4), group=comm)),
    "broadcast-src-out-of-range": (ValueError, lambda comm, bad: gradsync.broadcast(
        torch.zeros(4), src=comm.world_size + 2 if bad else 0, group=comm)),
    "avg-on-int": (TypeError, lambda comm, bad: gradsync.all_reduce(
        torch.zeros(4, dtype=torch.int64), op="avg" if bad else "sum", group=comm)),
    "unknown-op": (ValueError, lambda comm, bad: gradsync.all_reduce(
        torch.zeros(4), op="max" if bad else "sum", group=comm)),
    "unknown-algorithm": (ValueError, lambda comm, bad: gradsync.all_reduce(
        torch.zeros(4), algorithm="butterfly" if bad else "ring", group=comm)),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", sorted(ONE_BAD_RANK))
def test_collectives_bad_argument_on_one_rank_does_not_hang_the_others(kind):
    """One rank's bad argument raises its own error there and CollectiveMismatchError (not a timeout) elsewhere."""
    world_size, bad_rank, timeout_s = 3, 1, 5.0
    expected_type, call = ONE_BAD_RANK[kind]

    def rank_fn(comm):
        exc, elapsed_s = capture(lambda: call(comm, comm.rank == bad_rank))
        return exc, elapsed_s, gradsync.all_reduce(torch.ones(2), group=comm)

    outcomes = run_threads(world_size, rank_fn, timeout_s=3 * timeout_s, collective_timeout_s=timeout_s)
    for rank, (exc, elapsed_s, follow_up) in enumerate(outcomes):
        wanted = expected_type if rank == bad_rank else CollectiveMismatchError
        assert isinstance(exc, wanted), f"rank {rank}: expected {wanted.__name__}, got {exc!r}"
        assert elapsed_s < timeout_s / 2, f"rank {rank} waited {elapsed_s:.2f} s"
        assert_bitwise_equal(follow_up, torch.full((2,), float(world_size)), f"rank {rank} follow-up")


# ---------------------------------------------------------------- a silent peer

TIMEOUT_S = 0.5
# Words the error's step must contain when the silence is met inside the algorithm's own exchanges.
STEP_WORDS = {"ring": ("hop",), "tree": ("segment",), "double_binary_tree": ("segment",),
              "halving_doubling": ("distance", "fold"), "hierarchical": ("hop",), "native": ("backend",)}
TIMEOUT_VARIANTS = {  # one per algorithm and path; hierarchical spans two nodes at p = 4
    "ring": lambda p: Variant("ring"),
    "tree": lambda p: Variant("tree"),
    "double_binary_tree": lambda p: Variant("double_binary_tree"),
    "halving_doubling-short": lambda p: VARIANTS["halving_doubling-short"],
    "halving_doubling-long": lambda p: VARIANTS["halving_doubling-long"],
    "hierarchical": lambda p: Variant("hierarchical", ranks_per_node=2 if p % 2 == 0 else 1),
    "native": lambda p: Variant("native"),
}


def _silent_rank_outcomes(variant, world_size, call):
    """Run ``call(comm)`` on every rank but the last, which never calls; return (exc, seconds) per rank."""
    silent = world_size - 1

    def rank_fn(comm):
        return (None, 0.0) if comm.rank == silent else capture(lambda: call(comm))

    return run_variant(variant, world_size, rank_fn, timeout_s=TIMEOUT_S + 10), silent


def _check_timeouts(outcomes, silent, algorithm_name):
    """Every rank but ``silent`` timed out in time, naming the algorithm, itself and a peer; one names ``silent``."""
    for rank, (exc, elapsed_s) in enumerate(outcomes):
        if rank == silent:
            continue
        assert isinstance(exc, CollectiveTimeoutError) and isinstance(exc, TimeoutError), f"rank {rank}: {exc!r}"
        message = str(exc)
        assert TIMEOUT_S - 0.05 <= elapsed_s <= TIMEOUT_S + 2, f"rank {rank} took {elapsed_s:.2f} s"
        assert algorithm_name in message and exc.algorithm.startswith(algorithm_name), message
        assert exc.peer not in (rank, None) and f"peer rank {exc.peer}" in message, message
        assert exc.rank == rank and f"on rank {rank} of {len(outcomes)}" in message, \
            f"rank {rank} is misnamed: {message}"
    assert any(exc is not None and exc.peer == silent for exc, _ in outcomes), \
        f"no rank named the silent rank {silent}: {[str(exc) for exc, _ in outcomes]}"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("algorithm", gradsync.ALGORITHMS)
def test_algorithms_silent_rank_raises_timeout_naming_algorithm_and_peer(algorithm):
    """p = 4, last rank silent: the others raise CollectiveTimeoutError in timeout+2 s naming algorithm and peer."""
    world_size = 4
    variant = Variant(algorithm, ranks_per_node=2 if algorithm == "hierarchical" else None)
    outcomes, silent = _silent_rank_outcomes(variant, world_size, lambda comm: gradsync.all_reduce(
        torch.ones(10), algorithm=variant.algorithm, group=comm, timeout=TIMEOUT_S))
    _check_timeouts(outcomes, silent, variant.algorithm)
    # The layout check talks to every peer directly, so every rank names the silent one.
    for rank, (exc, _) in enumerate(outcomes):
        if rank != silent:
            assert exc.peer == silent and f"peer rank {silent}" in str(exc), f"rank {rank}: {exc}"


_TIMED_CALLS = {
    "ring": lambda comm: gradsync.all_reduce(torch.ones(10), group=comm, timeout=TIMEOUT_S),
    "native": lambda comm: gradsync.all_reduce(torch.ones(10), algorithm="native", group=comm,
                                               timeout=TIMEOUT_S),
    "broadcast": lambda comm: gradsync.broadcast(torch.ones(10), group=comm, timeout=TIMEOUT_S),
    "reduce_scatter": lambda comm: gradsync.reduce_scatter(torch.ones(10), group=comm, timeout=TIMEOUT_S),
}
# all_reduce (ring, native) at p = 4 is the test above.
TIMED_CASES = [(world_size, collective) for world_size in (2, 3, 4) for collective in sorted(_TIMED_CALLS)
               if not (world_size == 4 and collective in ("ring", "native"))]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("world_size,collective", TIMED_CASES)
def test_collectives_silent_rank_raises_timeout_naming_peer(world_size, collective):
    """A rank that never calls makes every other rank raise CollectiveTimeoutError naming it within timeout+2 s."""
    silent = world_size - 1

    def rank_fn(comm):
        if comm.rank == silent:
            return None, 0.0
        return capture(lambda: _TIMED_CALLS[collective](comm))

    outcomes = run_threads(world_size, rank_fn, timeout_s=TIMEOUT_S + 10)
    for rank, (exc, elapsed_s) in enumerate(outcomes):
        if rank == silent:
            continue
        assert isinstance(exc, CollectiveTimeoutError) and isinstance(exc, TimeoutError), f"rank {rank}: {exc!r}"
        assert TIMEOUT_S - 0.05 <= elapsed_s <= TIMEOUT_S + 2, f"rank {rank} took {elapsed_s:.2f} s"
        assert exc.rank == rank and exc.peer not in (rank, None), f"rank {rank}: {exc}"
        assert f"peer rank {exc.peer}" in str(exc), str(exc)
    # The layout check talks to every peer directly, so every rank names the silent one.
    for rank, (exc, _) in enumerate(outcomes):
        if rank != silent:
            assert exc.peer == silent and f"peer rank {silent}" in str(exc), f"rank {rank}: {exc}"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", sorted(TIMEOUT_VARIANTS))
@pytest.mark.parametrize("world_size", [3, 4])
def test_algorithms_silent_rank_in_payload_exchange_names_step(world_size, name):
    """Silence met inside the algorithm (layout check skipped) names algorithm, this rank, peer and step."""
    variant = TIMEOUT_VARIANTS[name](world_size)
    outcomes, silent = _silent_rank_outcomes(variant, world_size, lambda comm: collectives_api.all_reduce(
        torch.ones(10), comm, algorithm=variant.algorithm, timeout=TIMEOUT_S, verify=False))
    _check_timeouts(outcomes, silent, variant.algorithm)
    for rank, (exc, _) in enumerate(outcomes):
        if rank != silent:
            words = STEP_WORDS[variant.algorithm]
            assert any(word in exc.step for word in words) and exc.step in str(exc), \
                f"rank {rank}: step {exc.step!r} lacks {words}: {exc}"


AUTO_TIMEOUT_CASES = {"small": (4, None, 10), "large": (4, None, SMALL // 4 + 1),
                      "large-two-nodes": (4, 2, SMALL // 4 + 1)}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("verify", [False, True], ids=["silent-in-payload", "silent-from-start"])
@pytest.mark.parametrize("case", sorted(AUTO_TIMEOUT_CASES))
def test_auto_timeout_message_names_chosen_algorithm(case, verify):
    """A failing algorithm='auto' call names the algorithm it chose (e.g. 'ring (auto)'), not just 'auto'."""
    world_size, ranks_per_node, numel = AUTO_TIMEOUT_CASES[case]
    chosen = auto.choose(numel * 4, world_size, ranks_per_node or world_size)
    variant = Variant("auto", ranks_per_node=ranks_per_node)
    outcomes, silent = _silent_rank_outcomes(variant, world_size, lambda comm: collectives_api.all_reduce(
        torch.ones(numel), comm, algorithm="auto", timeout=TIMEOUT_S, verify=verify))
    for rank, (exc, _) in enumerate(outcomes):
        if rank != silent:
            assert isinstance(exc, CollectiveTimeoutError), f"rank {rank}: {exc!r}"
            assert chosen in str(exc), f"rank {rank}: auto chose {chosen}, but the error says: {exc}"


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("world_size,ranks_per_node", [(4, 3), (6, 4), (4, 8), (4, 0), (4, -2), (3, 2), (5, 2)])
def test_communicator_rejects_ranks_per_node_that_does_not_divide_world_size(world_size, ranks_per_node):
    """ranks_per_node must be >= 1 and divide the world size: ValueError at Communicator construction."""
    with pytest.raises(ValueError, match="ranks_per_node"):
        Communicator(ThreadWorld(world_size).transport(0), options=[HierarchicalOptions(ranks_per_node)])


@pytest.mark.parametrize("segment_bytes", [0, -4])
def test_communicator_rejects_non_positive_segment_bytes(segment_bytes):
    """segment_bytes must be > 0: ValueError at Communicator construction."""
    with pytest.raises(ValueError, match="segment_bytes"):
        Communicator(ThreadWorld(2).transport(0), options=[SegmentOptions(segment_bytes=segment_bytes)])


@pytest.mark.parametrize("world_size,ranks_per_node", [(4, 1), (4, 2), (4, 4), (6, 3), (1, 1)])
def test_communicator_accepts_ranks_per_node_that_divides_world_size(world_size, ranks_per_node):
    """A ranks_per_node that divides the world size is kept as given."""
    comm = Communicator(ThreadWorld(world_size).transport(0), options=[HierarchicalOptions(ranks_per_node)])
    assert comm.options(HierarchicalOptions).ranks_per_node == ranks_per_node


def test_communicator_rejects_unknown_inter_node_algorithm():
    """inter_node_algorithm must be one hierarchical can run across nodes (not itself, not shm)."""
    for name in ("hierarchical", "shm"):
        with pytest.raises(ValueError, match="ring, tree, halving_doubling, native"):
            Communicator(ThreadWorld(2).transport(0), options=[HierarchicalOptions(inter_node_algorithm=name)])
