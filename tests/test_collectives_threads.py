"""Collectives over the in-process thread transport: the same algorithm code as real runs, in milliseconds.

Expected values are closed forms (see ``_reference``), checked against
``torch.stack(inputs).sum(0)`` computed in float64/int64, so results are
compared bitwise.
"""


import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradsync
from _dist import RankError, capture, run_threads
from _reference import (ALL_DTYPES, FLOAT_DTYPES, INT_DTYPES, SENTINEL, assert_bitwise_equal,
                        closed_form_input, closed_form_result, reference_all_reduce,
                        strided_column_view, transposed_view)
from gradsync import CollectiveMismatchError, CollectiveTimeoutError

ALGORITHMS = gradsync.ALGORITHMS
WORLD_SIZES = (1, 2, 3, 4, 5, 7)
DTYPE_OPS = [(dtype, "sum") for dtype in ALL_DTYPES] + [(dtype, "avg") for dtype in FLOAT_DTYPES]
# ring and native run the whole dtype grid; the other algorithms share the
# dtype plumbing of the public layer, so a float, a float32-accumulated and an
# integer dtype (plus avg) keep the grid's runtime reasonable.
FULL_DTYPE_ALGORITHMS = ("ring", "native")
REDUCED_DTYPE_OPS = [(torch.float32, "sum"), (torch.float32, "avg"), (torch.float16, "sum"),
                     (torch.int64, "sum")]
ALGORITHM_DTYPE_OPS = [(algorithm, dtype, op) for algorithm in ALGORITHMS
                       for dtype, op in (DTYPE_OPS if algorithm in FULL_DTYPE_ALGORITHMS
                                         else REDUCED_DTYPE_OPS)]


def numels_for(world_size):
    """The numel cases: empty, one element, fewer than world_size, not divisible, large."""
    return sorted({0, 1, max(world_size - 1, 0), world_size + 1, 1000})


WORLD_NUMELS = [(world_size, numel) for world_size in WORLD_SIZES for numel in numels_for(world_size)]


# ---------------------------------------------------------------- all_reduce: values


@pytest.mark.parametrize("algorithm,dtype,op", ALGORITHM_DTYPE_OPS, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("world_size,numel", WORLD_NUMELS)
def test_all_reduce_matches_reference_sum(world_size, numel, algorithm, dtype, op):
    """all_reduce equals the exact stacked sum (or average) on every rank, in place, for every algorithm and dtype."""
    inputs = [closed_form_input(numel, rank, world_size, dtype) for rank in range(world_size)]
    expected = reference_all_reduce(inputs, op)
    assert_bitwise_equal(expected, closed_form_result(numel, world_size, dtype, op), "reference")

    def rank_fn(comm):
        tensor = inputs[comm.rank].clone()
        returned = gradsync.all_reduce(tensor, op=op, algorithm=algorithm, group=comm)
        assert returned is tensor, "all_reduce must return the tensor it was given"
        return tensor

    for rank, result in enumerate(run_threads(world_size, rank_fn)):
        assert_bitwise_equal(result, expected, f"rank {rank}")


@given(world_size=st.integers(min_value=1, max_value=8), numel=st.integers(min_value=0, max_value=4096),
       dtype=st.sampled_from(ALL_DTYPES), algorithm=st.sampled_from(ALGORITHMS))
def test_all_reduce_matches_closed_form_for_any_world_and_numel(world_size, numel, dtype, algorithm):
    """For p in 1..8 and numel in 0..4096 every rank holds the exact closed-form sum."""
    expected = closed_form_result(numel, world_size, dtype, "sum")

    def rank_fn(comm):
        tensor = closed_form_input(numel, comm.rank, world_size, dtype)
        return gradsync.all_reduce(tensor, algorithm=algorithm, group=comm)

    for rank, result in enumerate(run_threads(world_size, rank_fn)):
        assert_bitwise_equal(result, expected, f"rank {rank}")


@given(world_size=st.integers(min_value=1, max_value=8), numel=st.integers(min_value=0, max_value=4096),
       op=st.sampled_from(("sum", "avg")), algorithm=st.sampled_from(ALGORITHMS),
       seed=st.integers(min_value=0, max_value=2**31 - 1))
def test_all_reduce_random_floats_bitwise_equal_across_ranks(world_size, numel, op, algorithm, seed):
    """Random float32 inputs: results are bitwise equal on every rank and close to the float64 sum."""
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(numel, generator=generator) for _ in range(world_size)]
    reference = torch.stack([tensor.double() for tensor in inputs]).sum(0)
    if op == "avg":
        reference /= world_size

    def rank_fn(comm):
        return gradsync.all_reduce(inputs[comm.rank].clone(), op=op, algorithm=algorithm, group=comm)

    results = run_threads(world_size, rank_fn)
    for rank, result in enumerate(results):
        assert_bitwise_equal(result, results[0], f"rank {rank} vs rank 0")
    torch.testing.assert_close(results[0].double(), reference, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("shape", [(), (2, 3, 4), (0, 3)], ids=["scalar", "3d", "empty-2d"])
def test_all_reduce_keeps_any_shape(shape, algorithm):
    """0-dim, multi-dimensional and empty tensors are reduced in place and keep their shape."""
    world_size = 3
    numel = int(torch.tensor(shape).prod()) if shape else 1
    inputs = [closed_form_input(numel, rank, world_size, torch.float32).reshape(shape)
              for rank in range(world_size)]
    expected = closed_form_result(numel, world_size, torch.float32, "sum").reshape(shape)

    def rank_fn(comm):
        return gradsync.all_reduce(inputs[comm.rank].clone(), algorithm=algorithm, group=comm)

    for rank, result in enumerate(run_threads(world_size, rank_fn)):
        assert_bitwise_equal(result, expected, f"rank {rank}")


@pytest.mark.parametrize("layout", [strided_column_view, transposed_view], ids=["strided-column", "transposed"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32], ids=str)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_writes_result_through_non_contiguous_view(world_size, dtype, algorithm, layout):
    """A non-contiguous input gets the sum written back through the view; other storage is untouched."""
    numel = 12
    expected = closed_form_result(numel, world_size, dtype, "sum")

    def rank_fn(comm):
        base, view = layout(closed_form_input(numel, comm.rank, world_size, dtype))
        assert not view.is_contiguous()
        gradsync.all_reduce(view, algorithm=algorithm, group=comm)
        return base, view

    for rank, (base, view) in enumerate(run_threads(world_size, rank_fn)):
        if layout is strided_column_view:
            assert_bitwise_equal(view, expected, f"rank {rank} view")
            assert (base[:, 0] == SENTINEL).all() and (base[:, 2] == SENTINEL).all(), f"rank {rank}"
        else:
            assert_bitwise_equal(base, expected.reshape(3, -1), f"rank {rank} storage")


# ---------------------------------------------------------------- all_reduce: fp16/bf16 accumulation


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_reduce_fp16_avg_does_not_overflow(algorithm):
    """4 ranks of fp16 60000 averaged give 60000: the 240000 partial sum lives in float32."""
    def rank_fn(comm):
        return gradsync.all_reduce(torch.full((8,), 60000.0, dtype=torch.float16), op="avg",
                                   algorithm=algorithm, group=comm)

    expected = torch.full((8,), 60000.0, dtype=torch.float16)
    for rank, result in enumerate(run_threads(4, rank_fn)):
        assert_bitwise_equal(result, expected, f"rank {rank}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_reduce_fp16_sum_survives_overflowing_partial_sums(algorithm):
    """Ranks holding +60000, +60000, -60000, -60000 in fp16 sum to 0 whatever the ring order (no inf/nan)."""
    values = [60000.0, 60000.0, -60000.0, -60000.0]

    def rank_fn(comm):
        return gradsync.all_reduce(torch.full((8,), values[comm.rank], dtype=torch.float16),
                                   algorithm=algorithm, group=comm)

    for rank, result in enumerate(run_threads(4, rank_fn)):
        assert_bitwise_equal(result, torch.zeros(8, dtype=torch.float16), f"rank {rank}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_reduce_bf16_rounds_once_from_float32_sum(algorithm):
    """bf16 256 + 1 + 1 + 1 is the float32 sum 259 rounded once to bf16, not a bf16 running sum."""
    values = [256.0, 1.0, 1.0, 1.0]

    def rank_fn(comm):
        return gradsync.all_reduce(torch.full((8,), values[comm.rank], dtype=torch.bfloat16),
                                   algorithm=algorithm, group=comm)

    expected = torch.full((8,), 259.0).to(torch.bfloat16)
    for rank, result in enumerate(run_threads(4, rank_fn)):
        assert_bitwise_equal(result, expected, f"rank {rank}")


# ---------------------------------------------------------------- argument errors


def _errors_on_every_rank(world_size, call):
    """Run ``call(comm)`` on every thread-rank; return each rank's exception (None if none)."""
    return [exc for exc, _ in run_threads(world_size, lambda comm: capture(lambda: call(comm)),
                                          collective_timeout_s=2)]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_all_reduce_avg_on_integer_raises_type_error(dtype, algorithm):
    """op='avg' on an integer tensor raises TypeError on every rank and leaves the tensor as it was."""
    def call(comm):
        tensor = torch.arange(5, dtype=dtype)
        try:
            gradsync.all_reduce(tensor, op="avg", algorithm=algorithm, group=comm)
        finally:
            assert torch.equal(tensor, torch.arange(5, dtype=dtype))

    for rank, exc in enumerate(_errors_on_every_rank(2, call)):
        assert isinstance(exc, TypeError), f"rank {rank}: {exc!r}"


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


# ---------------------------------------------------------------- broadcast, all_gather, reduce_scatter


@pytest.mark.parametrize("world_size,src", [(p, src) for p in WORLD_SIZES for src in range(p)])
def test_broadcast_copies_src_tensor_to_every_rank(world_size, src):
    """After broadcast every rank holds rank src's tensor, in place."""
    inputs = [torch.arange(6, dtype=torch.float32) * 10 + rank for rank in range(world_size)]

    def rank_fn(comm):
        tensor = inputs[comm.rank].clone()
        assert gradsync.broadcast(tensor, src=src, group=comm) is tensor
        return tensor

    for rank, result in enumerate(run_threads(world_size, rank_fn)):
        assert_bitwise_equal(result, inputs[src], f"rank {rank}")


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("numel", [0, 1, 7])
def test_broadcast_handles_dtypes_numels_and_strided_views(numel, dtype):
    """Broadcast from rank 2 of 4 into a strided view copies the data and leaves other storage alone."""
    world_size, src = 4, 2
    inputs = [closed_form_input(numel, rank, world_size, dtype) for rank in range(world_size)]

    def rank_fn(comm):
        base, view = strided_column_view(inputs[comm.rank])
        gradsync.broadcast(view, src=src, group=comm)
        return base

    for rank, base in enumerate(run_threads(world_size, rank_fn)):
        assert_bitwise_equal(base[:, 1], inputs[src], f"rank {rank}")
        assert (base[:, 0] == SENTINEL).all() and (base[:, 2] == SENTINEL).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.bfloat16], ids=str)
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 7])
def test_all_gather_returns_every_rank_tensor_by_rank(world_size, dtype):
    """all_gather returns world_size tensors, index k holding rank k's (2, 3) input, on every rank."""
    inputs = [(torch.arange(6).reshape(2, 3) * world_size + rank).to(dtype) for rank in range(world_size)]

    def rank_fn(comm):
        tensor = inputs[comm.rank].clone()
        gathered = gradsync.all_gather(tensor, group=comm)
        assert_bitwise_equal(tensor, inputs[comm.rank], "input after all_gather")
        return gathered

    for rank, gathered in enumerate(run_threads(world_size, rank_fn)):
        assert len(gathered) == world_size
        for source, part in enumerate(gathered):
            assert_bitwise_equal(part, inputs[source], f"rank {rank}, part {source}")


@pytest.mark.parametrize("world_size", [1, 3])
def test_all_gather_of_empty_tensor_returns_empty_tensors(world_size):
    """all_gather of a (0, 2) tensor returns world_size empty (0, 2) tensors."""
    def rank_fn(comm):
        return gradsync.all_gather(torch.zeros(0, 2), group=comm)

    for gathered in run_threads(world_size, rank_fn):
        assert [tuple(part.shape) for part in gathered] == [(0, 2)] * world_size


RS_DTYPE_OPS = [(torch.float32, "sum"), (torch.float64, "avg"), (torch.float16, "sum"), (torch.int16, "sum")]


@pytest.mark.parametrize("dtype,op", RS_DTYPE_OPS, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("world_size,numel", WORLD_NUMELS)
def test_reduce_scatter_returns_tensor_split_chunk_of_sum(world_size, numel, dtype, op):
    """Rank r gets chunk r (torch.tensor_split order) of the exact sum; its input is not modified."""
    inputs = [closed_form_input(numel, rank, world_size, dtype) for rank in range(world_size)]
    chunks = torch.tensor_split(reference_all_reduce(inputs, op), world_size)

    def rank_fn(comm):
        tensor = inputs[comm.rank].clone()
        chunk = gradsync.reduce_scatter(tensor, op=op, group=comm)
        assert_bitwise_equal(tensor, inputs[comm.rank], "input after reduce_scatter")
        return chunk

    for rank, chunk in enumerate(run_threads(world_size, rank_fn)):
        assert_bitwise_equal(chunk, chunks[rank], f"rank {rank}")


def test_reduce_scatter_flattens_multidimensional_input():
    """A (3, 5) input is flattened before splitting: rank r gets tensor_split(sum.flatten(), p)[r]."""
    world_size = 4
    inputs = [closed_form_input(15, rank, world_size, torch.float32).reshape(3, 5) for rank in range(world_size)]
    chunks = torch.tensor_split(reference_all_reduce(inputs, "sum").flatten(), world_size)

    def rank_fn(comm):
        return gradsync.reduce_scatter(inputs[comm.rank].clone(), group=comm)

    for rank, chunk in enumerate(run_threads(world_size, rank_fn)):
        assert_bitwise_equal(chunk, chunks[rank], f"rank {rank}")


# ---------------------------------------------------------------- mismatches across ranks

# kind -> (rank-dependent tensor factory, the call); rank 1 is the odd one out of 3.
MISMATCHES = {
    "all_reduce-numel": (lambda odd: torch.ones(5 if odd else 4),
                         lambda t, comm, odd: gradsync.all_reduce(t, group=comm)),
    "all_reduce-shape-same-numel": (lambda odd: torch.ones((3, 2) if odd else (2, 3)),
                                    lambda t, comm, odd: gradsync.all_reduce(t, group=comm)),
    "all_reduce-dtype": (lambda odd: torch.ones(4, dtype=torch.float64 if odd else torch.float32),
                         lambda t, comm, odd: gradsync.all_reduce(t, group=comm)),
    "native-all_reduce-numel": (lambda odd: torch.ones(5 if odd else 4),
                                lambda t, comm, odd: gradsync.all_reduce(t, algorithm="native", group=comm)),
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


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_collectives_mismatch_raises_on_every_rank_and_group_recovers(kind):
    """Ranks disagreeing on layout all raise CollectiveMismatchError, tensors untouched; the next call works."""
    world_size, odd_rank = 3, 1
    make_tensor, call = MISMATCHES[kind]

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
_TIMED_CALLS = {
    "ring": lambda comm: gradsync.all_reduce(torch.ones(10), group=comm, timeout=TIMEOUT_S),
    "native": lambda comm: gradsync.all_reduce(torch.ones(10), algorithm="native", group=comm,
                                               timeout=TIMEOUT_S),
    "broadcast": lambda comm: gradsync.broadcast(torch.ones(10), group=comm, timeout=TIMEOUT_S),
    "reduce_scatter": lambda comm: gradsync.reduce_scatter(torch.ones(10), group=comm, timeout=TIMEOUT_S),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("collective", sorted(_TIMED_CALLS))
@pytest.mark.parametrize("world_size", [2, 3, 4])
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


# ---------------------------------------------------------------- bytes on the wire


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("numel", [840, 1001, 1])
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 7])
def test_ring_all_reduce_payload_bytes_match_formula(world_size, numel, dtype):
    """Ring rank r sends (2n - c_r - c_(r+1)) elements (2(p-1)/p·n when p divides n); checks go to control bytes."""
    def rank_fn(comm):
        gradsync.all_reduce(torch.ones(numel, dtype=dtype), group=comm)
        return comm.stats.as_dict()

    element_nbytes = torch.tensor([], dtype=dtype).element_size()
    chunk_numels = [part.numel() for part in torch.tensor_split(torch.arange(numel), world_size)]
    all_stats = run_threads(world_size, rank_fn)
    for rank, stats in enumerate(all_stats):
        left, right = (rank - 1) % world_size, (rank + 1) % world_size
        sent = 2 * numel - chunk_numels[rank] - chunk_numels[right]
        received = 2 * numel - chunk_numels[left] - chunk_numels[rank]
        assert stats["bytes_sent"] == sent * element_nbytes, f"rank {rank}: {stats}"
        assert stats["bytes_received"] == received * element_nbytes, f"rank {rank}: {stats}"
        assert stats["control_bytes_sent"] > 0, f"rank {rank}: the layout check must be counted as control"
        if numel % world_size == 0:
            assert stats["bytes_sent"] * world_size == 2 * (world_size - 1) * numel * element_nbytes
    total_sent = sum(stats["bytes_sent"] for stats in all_stats)
    assert total_sent == 2 * (world_size - 1) * numel * element_nbytes


@pytest.mark.parametrize("world_size", [1, 3])
def test_ring_all_reduce_of_empty_tensor_sends_no_payload(world_size):
    """An empty all_reduce moves no payload bytes; only the layout check's control bytes (none alone)."""
    def rank_fn(comm):
        gradsync.all_reduce(torch.ones(0), group=comm)
        return comm.stats.as_dict()

    for rank, stats in enumerate(run_threads(world_size, rank_fn)):
        assert stats["bytes_sent"] == 0 and stats["bytes_received"] == 0, f"rank {rank}: {stats}"
        assert (stats["control_bytes_sent"] > 0) == (world_size > 1), f"rank {rank}: {stats}"


def test_run_threads_reports_failing_rank():
    """The helper re-raises a rank's exception naming that rank (so failures are attributable)."""
    def rank_fn(comm):
        if comm.rank == 1:
            raise KeyError("boom")
        return comm.rank

    with pytest.raises(RankError, match="rank 1 raised KeyError") as info:
        run_threads(2, rank_fn)
    assert info.value.rank == 1


@pytest.mark.parametrize("collective", ["all_reduce", "broadcast", "all_gather", "reduce_scatter"])
def test_collectives_on_a_parameter_return_plain_tensors(collective):
    """Collectives on a tensor that requires grad give correct values without autograd history."""
    def rank_fn(comm):
        param = torch.nn.Parameter(torch.full((5,), float(comm.rank + 1)))
        result = getattr(gradsync, collective)(param, group=comm)
        return [result] if isinstance(result, torch.Tensor) else result

    expected = {"all_reduce": [torch.full((5,), 3.0)], "broadcast": [torch.full((5,), 1.0)],
                "all_gather": [torch.full((5,), 1.0), torch.full((5,), 2.0)]}
    for rank, outputs in enumerate(run_threads(2, rank_fn)):
        for output in outputs:
            assert output.grad_fn is None, f"rank {rank}: {collective} output has grad_fn {output.grad_fn}"
        wanted = expected.get(collective, [torch.full((3,), 3.0) if rank == 0 else torch.full((2,), 3.0)])
        for output, value in zip(outputs, wanted):
            torch.testing.assert_close(output.detach(), value, rtol=0, atol=0)
