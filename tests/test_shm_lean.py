"""The lean shm AllReduce (collectives.shm_lean), the group's shared-memory layout check and the cells.

* repeated calls of one layout (the cached plan) on every dtype, shape and stride, sum and avg, world
  sizes 2-5, equal to a torch reference and bitwise equal on every rank, both mailbox parities;
* after plans are cached, a rank that calls another shape, dtype, op, algorithm or collective, or that
  rejects its call, makes every rank raise in that one round; tensors untouched; the group goes on;
* a rank that never arrives: every other rank raises CollectiveTimeoutError naming it at the deadline,
  in the lean round and inside the cells of a large call;
* a rank SIGKILLed in the middle of a pipelined call: the survivors name it as dead at once;
* cell boundaries: numel around multiples of the cell, every world size 2-6.

Expected values come from plain torch (``_reference``), never from gradsync.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

import gradsync
from _dist import capture, run_threads, run_world
from _reference import (ALL_DTYPES, FLOAT_DTYPES, assert_bitwise_equal, closed_form_input, reference_all_reduce,
                        strided_column_view, transposed_view)
from gradsync import CollectiveMismatchError, CollectiveTimeoutError
from gradsync.collectives import ShmState, shm_pipeline, shm_setup
from gradsync.collectives import ops as collectives_api
from gradsync.process_group import default_communicator

THREAD_RUN = {"timeout_s": 30, "collective_timeout_s": 10}
TIMEOUT_S = 1.0


def _warm(comm):
    collectives_api.all_reduce(torch.zeros(1), comm, algorithm="shm")


def _layouts(dtype):
    """name -> tensor factory(values (numel,) of ``dtype``): shapes and strides the lean path must keep."""
    return {
        "scalar": lambda v: v[:1].reshape(()).clone(),
        "vector-7": lambda v: v[:7].clone(),
        "matrix-3x5": lambda v: v[:15].reshape(3, 5).clone(),
        "transposed-3x5": lambda v: transposed_view(v[:15])[1],
        "strided-column": lambda v: strided_column_view(v[:24])[1],
        "largest-lean": lambda v: v[:shm_setup.LEAN_MAX_BYTES // 8].clone(),  # at the limit for 8-byte dtypes
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_lean_repeated_calls_match_reference_on_every_dtype_and_layout(world_size):
    """Three rounds per (dtype, layout, op) on one group: the first builds the plan, the next two reuse it
    (both mailbox parities); each equals the torch reference, bitwise equal on every rank."""
    numel = shm_setup.LEAN_MAX_BYTES // 4
    cases = [(dtype, name, op) for dtype in ALL_DTYPES for name in _layouts(dtype)
             for op in (("sum", "avg") if dtype in FLOAT_DTYPES else ("sum",))]

    def inputs(dtype, rank, round_index):
        return closed_form_input(numel, rank, world_size, dtype) + round_index

    def rank_fn(comm):
        _warm(comm)
        out = []
        for dtype, name, op in cases:
            make = _layouts(dtype)[name]
            for round_index in range(3):
                tensor = make(inputs(dtype, comm.rank, round_index))
                out.append(gradsync.all_reduce(tensor, op=op, algorithm="shm", group=comm).clone())
        return out, len(comm.plans)

    per_rank = run_threads(world_size, rank_fn, **THREAD_RUN)
    for rank, (out, plans) in enumerate(per_rank):
        assert plans == len(cases), f"rank {rank}: {plans} plans kept for {len(cases)} layouts"
        index = 0
        for dtype, name, op in cases:
            make = _layouts(dtype)[name]
            for round_index in range(3):
                expected = reference_all_reduce([make(inputs(dtype, r, round_index)) for r in range(world_size)], op)
                got = out[index]
                assert got.shape == expected.shape, (dtype, name, op)
                if dtype in FLOAT_DTYPES and op == "avg":
                    torch.testing.assert_close(got, expected, msg=f"{dtype} {name} {op} round {round_index}")
                else:
                    assert_bitwise_equal(got, expected, f"rank {rank} {dtype} {name} {op} round {round_index}")
                assert_bitwise_equal(got, per_rank[0][0][index], f"rank {rank} vs rank 0 {dtype} {name} {op}")
                index += 1


# kind -> call(tensor, comm) of the odd rank, after every rank cached the plan of all_reduce(ones(4)).
ODD_CALLS = {
    "numel": lambda t, comm: gradsync.all_reduce(torch.ones(5), algorithm="shm", group=comm),
    "shape": lambda t, comm: gradsync.all_reduce(torch.ones(2, 2), algorithm="shm", group=comm),
    "dtype": lambda t, comm: gradsync.all_reduce(torch.ones(4, dtype=torch.float64), algorithm="shm", group=comm),
    "op": lambda t, comm: gradsync.all_reduce(t, op="avg", algorithm="shm", group=comm),
    "algorithm-ring": lambda t, comm: gradsync.all_reduce(t, algorithm="ring", group=comm),
    "algorithm-native": lambda t, comm: gradsync.all_reduce(t, algorithm="native", group=comm),
    "large-pipelined": lambda t, comm: gradsync.all_reduce(torch.ones(50_000), algorithm="shm", group=comm),
    "broadcast": lambda t, comm: gradsync.broadcast(t, src=0, group=comm),
    "all_gather-shm": lambda t, comm: gradsync.all_gather(t, group=comm, algorithm="shm"),
    "rejects-timeout": lambda t, comm: gradsync.all_reduce(t, algorithm="shm", group=comm, timeout=-1),
    "rejects-op": lambda t, comm: gradsync.all_reduce(t, op="max", algorithm="shm", group=comm),
    "rejects-non-tensor": lambda t, comm: gradsync.all_reduce([1.0, 2.0], algorithm="shm", group=comm),
    "rejects-inference": lambda t, comm: gradsync.all_reduce(_inference_ones(), algorithm="shm", group=comm),
}
REJECTIONS = {"rejects-timeout": ValueError, "rejects-op": ValueError, "rejects-non-tensor": TypeError,
              "rejects-inference": ValueError}


def _inference_ones():
    with torch.inference_mode():
        return torch.ones(4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(ODD_CALLS))
def test_lean_round_meets_another_call_and_every_rank_raises(kind):
    """Ranks 0 and 2 take the cached lean path while rank 1 calls something else: every rank raises at once
    (peers CollectiveMismatchError naming rank 1 for a rejection; the rejecting rank its own error), tensors
    untouched, and the group's next lean and pipelined calls are right."""
    world_size, odd_rank = 3, 1

    def rank_fn(comm):
        for _ in range(2):
            gradsync.all_reduce(torch.ones(4), algorithm="shm", group=comm)
        tensor = torch.full((4,), comm.rank + 2.0)
        before = tensor.clone()
        if comm.rank == odd_rank:
            exc, seconds = capture(lambda: ODD_CALLS[kind](tensor, comm))
        else:
            exc, seconds = capture(lambda: gradsync.all_reduce(tensor, algorithm="shm", group=comm))
        small = gradsync.all_reduce(torch.full((4,), comm.rank + 1.0), algorithm="shm", group=comm)
        large = gradsync.all_reduce(torch.full((50_000,), comm.rank + 1.0), algorithm="shm", group=comm)
        return exc, seconds, tensor, before, small, large

    per_rank = run_threads(world_size, rank_fn, timeout_s=30, collective_timeout_s=5)
    total = float(sum(range(1, world_size + 1)))
    for rank, (exc, seconds, tensor, before, small, large) in enumerate(per_rank):
        expected = REJECTIONS.get(kind, CollectiveMismatchError) if rank == odd_rank else CollectiveMismatchError
        assert type(exc) is expected, f"rank {rank}: {exc!r}"
        assert seconds < 2.0, f"rank {rank} took {seconds:.2f} s to raise"
        if rank != odd_rank and kind in REJECTIONS:
            assert "rank 1 rejected the call" in str(exc), str(exc)
        assert_bitwise_equal(tensor, before, f"rank {rank} tensor after the failed call")
        assert_bitwise_equal(small, torch.full((4,), total), f"rank {rank} next lean call")
        assert_bitwise_equal(large, torch.full((50_000,), total), f"rank {rank} next pipelined call")


def test_lean_plan_is_not_reused_for_a_tensor_its_checks_would_reject():
    """A plan cached for a plain tensor does not let an inference tensor of the same layout through: it is
    rejected on its rank and every other rank raises; a leaf that requires grad is reduced (autograd off)."""
    def rank_fn(comm):
        _warm(comm)
        leaf = torch.full((3,), comm.rank + 1.0, requires_grad=True)
        gradsync.all_reduce(torch.ones(3), algorithm="shm", group=comm)
        reduced = gradsync.all_reduce(leaf, algorithm="shm", group=comm).detach().clone()
        odd = _inference_ones()[:3] if comm.rank == 1 else torch.ones(3)
        exc, _ = capture(lambda: gradsync.all_reduce(odd, algorithm="shm", group=comm))
        return reduced, exc

    per_rank = run_threads(2, rank_fn, **THREAD_RUN)
    for rank, (reduced, exc) in enumerate(per_rank):
        assert_bitwise_equal(reduced, torch.full((3,), 3.0), f"rank {rank}")
        assert type(exc) is (ValueError if rank == 1 else CollectiveMismatchError), f"rank {rank}: {exc!r}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("numel", [4, 50_000], ids=["lean", "pipelined"])
def test_silent_rank_named_at_the_deadline(numel):
    """The last rank never calls: the others raise CollectiveTimeoutError naming it, within timeout + 2 s."""
    world_size, silent = 3, 2

    def rank_fn(comm):
        for _ in range(2):
            gradsync.all_reduce(torch.ones(numel), algorithm="shm", group=comm)
        if comm.rank == silent:
            return None, 0.0
        return capture(lambda: gradsync.all_reduce(torch.ones(numel), algorithm="shm", group=comm,
                                                   timeout=TIMEOUT_S))

    outcomes = run_threads(world_size, rank_fn, timeout_s=20, collective_timeout_s=10)
    for rank, (exc, seconds) in enumerate(outcomes[:silent]):
        assert isinstance(exc, CollectiveTimeoutError), f"rank {rank}: {exc!r}"
        assert exc.peer == silent and f"peer rank {silent}" in str(exc), str(exc)
        assert TIMEOUT_S - 0.05 <= seconds <= TIMEOUT_S + 2, f"rank {rank} took {seconds:.2f} s"


KILLED_AT_CELL = 5
CELL_BYTES = 64 * 2**10


def _killed_mid_pipeline(victim):
    """Every rank runs one pipelined shm all_reduce of 16 cells; ``victim`` SIGKILLs itself after copying its
    fifth cell in (patched in its own process only); the others report what they raise."""
    comm = gradsync.Communicator(default_communicator().transport, 20.0, options=[ShmState(cell_bytes=CELL_BYTES)])
    numel = 16 * CELL_BYTES // 4
    gradsync.all_reduce(torch.ones(numel), algorithm="shm", group=comm)
    if gradsync.rank() == victim:
        original, copied = shm_pipeline.reduce_cell, [0]

        def dying(part, call, segment, set_index, after_barrier=None):
            copied[0] += 1
            if copied[0] == KILLED_AT_CELL:
                os.kill(os.getpid(), signal.SIGKILL)
            original(part, call, segment, set_index, after_barrier)

        shm_pipeline.reduce_cell = dying
    exc, seconds = capture(lambda: gradsync.all_reduce(torch.ones(numel), algorithm="shm", group=comm))
    return type(exc).__name__, str(exc), getattr(exc, "peer", None), seconds


@pytest.mark.timeout(60)
def test_rank_killed_mid_pipeline_is_named_dead_by_every_survivor():
    outcomes = run_world(3, _killed_mid_pipeline, 1, timeout_s=45, may_exit=[1])
    for rank in (0, 2):
        name, message, peer, seconds = outcomes[rank]
        assert name == "CollectiveTimeoutError" and peer == 1, f"rank {rank}: {name}: {message}"
        assert "peer rank 1" in message and "died" in message and "cell" in message, message
        assert seconds < 2.0, f"rank {rank} took {seconds:.2f} s"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6])
def test_cell_boundaries_match_reference(world_size):
    """numel one below, at and one above multiples of a 4 KiB cell (1024 float32 / 512 float64 elements), in
    float32, float64, bfloat16 (staged to float32) and int64, equal to the reference on every rank (tiny
    cells on small messages: the "shm-tiny-cells" variant of test_algorithms_properties)."""
    cell_bytes = 4096
    cases = [(dtype, numel) for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64)
             for numel in (5119, 5120, 5121, 10239, 10241)]  # above LEAN_MAX_BYTES for every dtype once staged

    def rank_fn(comm):
        cells = gradsync.Communicator(comm.transport, 10.0, options=[ShmState(cell_bytes=cell_bytes)])
        return [gradsync.all_reduce(closed_form_input(numel, comm.rank, world_size, dtype), algorithm="shm",
                                    group=cells) for dtype, numel in cases]

    per_rank = run_threads(world_size, rank_fn, **THREAD_RUN)
    for index, (dtype, numel) in enumerate(cases):
        expected = reference_all_reduce([closed_form_input(numel, r, world_size, dtype)
                                         for r in range(world_size)], "sum")
        for rank, out in enumerate(per_rank):
            if dtype == torch.bfloat16:
                torch.testing.assert_close(out[index], expected, msg=f"rank {rank} {dtype} n={numel}")
            else:
                assert_bitwise_equal(out[index], expected, f"rank {rank} {dtype} n={numel}")
            assert_bitwise_equal(out[index], per_rank[0][index], f"rank {rank} vs rank 0 {dtype} n={numel}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["shm", "auto"])
def test_data_parallel_buckets_live_in_the_arena_without_bucket_views(algorithm):
    """DataParallel without gradient_as_bucket_view still places its shm buckets in the shared arena (the
    gradients' copy into the bucket is the copy in), and its gradients are the average of the ranks'."""
    import copy

    from torch import nn

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(200, 300), nn.ReLU(), nn.Linear(300, 10))
    inputs = [torch.randn(8, 200, generator=torch.Generator().manual_seed(1 + rank)) for rank in range(2)]

    def rank_fn(comm):  # thread ranks share torch's global generator: nothing random in here
        model = gradsync.DataParallel(copy.deepcopy(reference), algorithm=algorithm, group=comm, bucket_cap_mb=0.1)
        state = comm.options(ShmState)
        placed = [state.find(bucket.flat) is not None for bucket in model._reducer.buckets]
        model(inputs[comm.rank]).square().sum().backward()
        return placed, [param.grad.clone() for param in model.parameters()]

    per_rank = run_threads(2, rank_fn, **THREAD_RUN)
    grads = []
    for rank in range(2):
        reference.zero_grad()
        reference(inputs[rank]).square().sum().backward()
        grads.append([param.grad.clone() for param in reference.parameters()])
    for rank, (placed, got) in enumerate(per_rank):
        assert any(placed), f"rank {rank}: no bucket in the arena: {placed}"
        for index, grad in enumerate(got):
            torch.testing.assert_close(grad, (grads[0][index] + grads[1][index]) / 2, msg=f"rank {rank} param {index}")


@pytest.mark.parametrize("kwargs,error", [({"cell_bytes": 0}, ValueError), ({"cell_bytes": 32}, ValueError),
                                          ({"cell_bytes": 1.5e6}, TypeError), ({"cell_bytes": True}, TypeError),
                                          ({"region_bytes": 8}, ValueError), ({"region_bytes": 100}, ValueError),
                                          ({"region_bytes": "4M"}, TypeError)])
def test_shm_state_rejects_bad_sizes(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        ShmState(**kwargs)


def test_default_cell_bytes_follows_the_l2_cache(tmp_path):
    """Twice the L2 size sysfs reports (K or M), at least MIN_CELL_BYTES; the fallback when unreadable."""
    for text, expected in (("1024K", 2 * 2**20), ("512K", 2**20), ("2M", 4 * 2**20), ("64K", shm_setup.MIN_CELL_BYTES),
                           ("garbage", shm_setup.FALLBACK_CELL_BYTES)):
        path = tmp_path / "size"
        path.write_text(text + "\n")
        assert shm_setup.default_cell_bytes(str(path)) == expected, text
    assert shm_setup.default_cell_bytes(str(tmp_path / "missing")) == shm_setup.FALLBACK_CELL_BYTES


# rank 1's call, skipping the layout check, against rank 0's (kind -> (rank 0's call, rank 1's call)).
UNCHECKED = {
    "checked-small-vs-unchecked-large": (
        lambda comm: gradsync.all_reduce(torch.ones(4), algorithm="shm", group=comm),
        lambda comm: collectives_api.all_reduce(torch.ones(100_000), comm, op="avg", algorithm="shm", verify=False)),
    "checked-large-vs-unchecked-large": (
        lambda comm: gradsync.all_reduce(torch.ones(1_000_000), algorithm="shm", group=comm),
        lambda comm: collectives_api.all_reduce(torch.ones(1_000_000), comm, algorithm="shm", verify=False)),
    "unchecked-float32-vs-int32": (
        lambda comm: collectives_api.all_reduce(torch.ones(100_000), comm, algorithm="shm", verify=False),
        lambda comm: collectives_api.all_reduce(torch.ones(100_000, dtype=torch.int32), comm, algorithm="shm",
                                                verify=False)),
    "small-vs-unchecked-broadcast": (
        lambda comm: gradsync.all_reduce(torch.ones(4), algorithm="shm", group=comm),
        lambda comm: collectives_api.broadcast(torch.ones(50_000), comm, src=0, algorithm="shm", verify=False)),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(UNCHECKED))
def test_a_call_that_skips_the_layout_check_never_returns_data_not_meant_for_it(kind):
    """Every shared-memory round carries a word of its operation and step, so a rank whose call skipped the
    layout check (verify=False) and meets a peer's check or another layout raises CollectiveMismatchError,
    as the peer does, at once: never a wrong result (it used to pair barriers and return garbage)."""
    calls = UNCHECKED[kind]

    def rank_fn(comm):
        _warm(comm)
        return capture(lambda: calls[comm.rank](comm))

    for rank, (exc, seconds) in enumerate(run_threads(2, rank_fn, timeout_s=30, collective_timeout_s=5)):
        assert type(exc) is CollectiveMismatchError, f"rank {rank}: {exc!r}"
        assert seconds < 2.0, f"rank {rank} took {seconds:.2f} s"
