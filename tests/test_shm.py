"""Algorithm "shm" (shared memory on one machine) beyond test_algorithms_properties (all_reduce).

* broadcast / all_gather / reduce_scatter with ``algorithm="shm"`` on thread
  ranks (world sizes 1-5, every dtype, numel 0 / 1 / < p / not divisible /
  thousands, strided and transposed views), with the default region and with
  4 KiB regions so that messages go through many slices and both buffer sets;
* ranks that disagree on the layout raise CollectiveMismatchError on every
  rank, and the group (and its segment) stays usable;
* real processes over Gloo: large all_reduces, the segment's name leaving
  ``/dev/shm`` at once, two jobs at the same time, a killed rank, and
  DataParallel training;
* ``remove_leftovers``: names of dead creators go, names of live ones stay.

Expected values come from plain torch (``_reference``), never from gradsync.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradsync
from _dist import capture, run_threads, run_world
from _reference import (ALL_DTYPES, FLOAT_DTYPES, SENTINEL, assert_bitwise_equal, bitwise_difference,
                        closed_form_input, closed_form_result, reference_all_reduce, strided_column_view,
                        transposed_view)
from gradsync import CollectiveMismatchError, CollectiveTimeoutError
from gradsync.collectives import HierarchicalOptions, ShmState
from gradsync.collectives import ops as collectives_api
from gradsync.process_group import default_communicator
from gradsync.transport import shm_segment as shm_transport

SHM_DIR = "/dev/shm"
WORLD_SIZES = (1, 2, 3, 4, 5)
SMALL_REGION_BYTES = 4096
REGIONS = {"default-region": None, "region-4096": SMALL_REGION_BYTES}
LARGE_NUMEL = 9003  # divisible by 3 (transposed view), not by 2, 4 or 5; 4..18 slices of 4 KiB
THREAD_RUN = {"timeout_s": 30, "collective_timeout_s": 10}


def numels_for(world_size):
    """Empty, one element, fewer than world_size, not divisible by it, thousands."""
    return sorted({0, 1, max(world_size - 1, 0), world_size + 1, LARGE_NUMEL})


def run_shm_threads(world_size, fn, region_bytes=None, **kwargs):
    """``run_threads`` whose communicators' shm segments have ``region_bytes`` regions (None: default)."""
    with pytest.MonkeyPatch.context() as patch:
        if region_bytes is not None:
            patch.setattr(shm_transport, "DEFAULT_REGION_BYTES", region_bytes)
        return run_threads(world_size, fn, **{**THREAD_RUN, **kwargs})


def _dtype_id(dtype):
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- broadcast / all_gather / reduce_scatter grid


def _broadcast_cases(world_size):
    """(case id, dtype, numel, src, layout) for every dtype and numel; every src contiguous."""
    cases = []
    for dtype in ALL_DTYPES:
        for numel in numels_for(world_size):
            cases += [(f"{_dtype_id(dtype)}-n{numel}-src{src}-contiguous", dtype, numel, src, "contiguous")
                      for src in range(world_size)]
            cases.append((f"{_dtype_id(dtype)}-n{numel}-strided", dtype, numel, world_size - 1, "strided"))
            if numel and numel % 3 == 0:
                cases.append((f"{_dtype_id(dtype)}-n{numel}-transposed", dtype, numel, world_size // 2,
                              "transposed"))
    return cases


def _run_broadcast_grid(world_size, region_bytes):
    cases = _broadcast_cases(world_size)
    inputs = {(dtype, numel): [closed_form_input(numel, rank, world_size, dtype) for rank in range(world_size)]
              for _, dtype, numel, _, _ in cases}

    def rank_fn(comm):
        results = {}
        for case_id, dtype, numel, src, layout in cases:
            mine = inputs[(dtype, numel)][comm.rank]
            if layout == "contiguous":
                base = view = mine.clone()
            elif layout == "strided":
                base, view = strided_column_view(mine)
            else:
                base, view = transposed_view(mine)
            returned = gradsync.broadcast(view, src=src, group=comm, algorithm="shm")
            assert returned is view, f"{case_id}: broadcast must return its argument"
            results[case_id] = base
        return results

    per_rank = run_shm_threads(world_size, rank_fn, region_bytes)
    for case_id, dtype, numel, src, layout in cases:
        expected = inputs[(dtype, numel)][src]
        for rank, results in enumerate(per_rank):
            base = results[case_id]
            what = f"broadcast {case_id} rank {rank}"
            if layout == "contiguous":
                assert_bitwise_equal(base, expected, what)
            elif layout == "strided":
                assert_bitwise_equal(base[:, 1].contiguous(), expected, what)
                assert (base[:, 0] == SENTINEL).all() and (base[:, 2] == SENTINEL).all(), \
                    f"{what}: storage outside the view was written"
            else:
                assert_bitwise_equal(base, expected.reshape(3, -1), what)


def _run_all_gather_grid(world_size, region_bytes):
    cases = [(f"{_dtype_id(dtype)}-n{numel}", dtype, numel)
             for dtype in ALL_DTYPES for numel in numels_for(world_size)]
    cases.append(("float32-2x3x5", torch.float32, (2, 3, 5)))
    inputs = {case_id: [closed_form_input(torch.Size(numel if isinstance(numel, tuple) else (numel,)).numel(),
                                          rank, world_size, dtype).reshape(numel)
                        for rank in range(world_size)]
              for case_id, dtype, numel in cases}

    def rank_fn(comm):
        results = {}
        for case_id, _, _ in cases:
            tensor = inputs[case_id][comm.rank].clone()
            results[case_id] = gradsync.all_gather(tensor, group=comm, algorithm="shm")
            assert_bitwise_equal(tensor, inputs[case_id][comm.rank], f"{case_id}: input after all_gather")
        return results

    per_rank = run_shm_threads(world_size, rank_fn, region_bytes)
    for case_id, _, _ in cases:
        for rank, results in enumerate(per_rank):
            gathered = results[case_id]
            assert len(gathered) == world_size, f"all_gather {case_id} rank {rank}: {len(gathered)} parts"
            for source, part in enumerate(gathered):
                assert_bitwise_equal(part, inputs[case_id][source],
                                     f"all_gather {case_id} rank {rank} part {source}")


def _run_reduce_scatter_grid(world_size, region_bytes):
    cases = [(f"{_dtype_id(dtype)}-{op}-n{numel}", dtype, numel, op)
             for dtype in ALL_DTYPES for op in (("sum", "avg") if dtype in FLOAT_DTYPES else ("sum",))
             for numel in numels_for(world_size)]
    inputs = {case_id: [closed_form_input(numel, rank, world_size, dtype) for rank in range(world_size)]
              for case_id, dtype, numel, _ in cases}

    def rank_fn(comm):
        results = {}
        for case_id, _, _, op in cases:
            tensor = inputs[case_id][comm.rank].clone()
            results[case_id] = gradsync.reduce_scatter(tensor, op=op, group=comm, algorithm="shm")
            assert_bitwise_equal(tensor, inputs[case_id][comm.rank], f"{case_id}: input after reduce_scatter")
        return results

    per_rank = run_shm_threads(world_size, rank_fn, region_bytes)
    for case_id, dtype, numel, op in cases:
        total = reference_all_reduce(inputs[case_id], op)
        assert_bitwise_equal(total, closed_form_result(numel, world_size, dtype, op),
                             f"{case_id}: stacked reference vs closed form")
        chunks = torch.tensor_split(total, world_size)
        for rank, results in enumerate(per_rank):
            assert_bitwise_equal(results[case_id], chunks[rank], f"reduce_scatter {case_id} rank {rank}")


GRIDS = {"broadcast": _run_broadcast_grid, "all_gather": _run_all_gather_grid,
         "reduce_scatter": _run_reduce_scatter_grid}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("region", sorted(REGIONS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("collective", sorted(GRIDS))
def test_shm_collective_grid_matches_torch_reference(collective, world_size, region):
    """Every dtype and numel (and every src / strided and transposed views for broadcast, sum and avg for
    reduce_scatter) through one communicator: each rank holds the torch reference, bitwise."""
    GRIDS[collective](world_size, REGIONS[region])


RANDOM_FLOAT_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
                          torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _random_input(numel, dtype, generator):
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator).to(dtype)
    info = torch.iinfo(dtype)
    low, high = (-2**40, 2**40) if dtype == torch.int64 else (info.min, info.max + 1)  # narrow sums wrap
    return torch.randint(low, high, (numel,), generator=generator, dtype=torch.int64).to(dtype)


@settings(max_examples=20, deadline=None)
@given(world_size=st.integers(min_value=1, max_value=5), collective=st.sampled_from(sorted(GRIDS)),
       numel=st.integers(min_value=0, max_value=5000), dtype=st.sampled_from(ALL_DTYPES),
       small_region=st.booleans(), seed=st.integers(min_value=0, max_value=2**31 - 1), data=st.data())
def test_shm_collectives_random_inputs(world_size, collective, numel, dtype, small_region, seed, data):
    """Random values: broadcast and all_gather copy bitwise; reduce_scatter's chunks match the float64 /
    int64 sum (bitwise for integers, which wrap the same way; within summation tolerance for floats)."""
    src = data.draw(st.integers(min_value=0, max_value=world_size - 1), label="src")
    op = data.draw(st.sampled_from(("sum", "avg")), label="op") if dtype.is_floating_point else "sum"
    generator = torch.Generator().manual_seed(seed)
    inputs = [_random_input(numel, dtype, generator) for _ in range(world_size)]

    def rank_fn(comm):
        tensor = inputs[comm.rank].clone()
        if collective == "broadcast":
            return gradsync.broadcast(tensor, src=src, group=comm, algorithm="shm")
        if collective == "all_gather":
            return gradsync.all_gather(tensor, group=comm, algorithm="shm")
        return gradsync.reduce_scatter(tensor, op=op, group=comm, algorithm="shm")

    per_rank = run_shm_threads(world_size, rank_fn, SMALL_REGION_BYTES if small_region else None)
    if collective == "broadcast":
        for rank, result in enumerate(per_rank):
            assert_bitwise_equal(result, inputs[src], f"broadcast rank {rank}")
    elif collective == "all_gather":
        for rank, gathered in enumerate(per_rank):
            assert len(gathered) == world_size
            for source, part in enumerate(gathered):
                assert_bitwise_equal(part, inputs[source], f"all_gather rank {rank} part {source}")
    else:
        if dtype.is_floating_point:
            total = torch.stack([tensor.double() for tensor in inputs]).sum(0)
            if op == "avg":
                total /= world_size
        else:
            total = reference_all_reduce(inputs, "sum")
        for rank, (chunk, expected) in enumerate(zip(per_rank, torch.tensor_split(total, world_size))):
            assert chunk.dtype == dtype and chunk.shape == expected.shape, f"rank {rank}"
            if dtype.is_floating_point:
                rtol, atol = RANDOM_FLOAT_TOLERANCE[dtype]
                torch.testing.assert_close(chunk.double(), expected, rtol=rtol, atol=atol)
            else:
                assert_bitwise_equal(chunk, expected, f"reduce_scatter rank {rank}")


def test_shm_collectives_interleaved_on_one_communicator_use_both_buffer_sets():
    """all_reduce, broadcast, all_gather and reduce_scatter alternating on one group of 4 KiB regions,
    odd slice counts included, each equal to its torch reference."""
    world_size, rounds = 3, 6
    numels = [1, 513, 1024, 1025, 2049]  # float32: 1, 1, 1, 2, 3 slices of 1024 elements

    def rank_fn(comm):
        out = []
        for round_index in range(rounds):
            numel = numels[round_index % len(numels)]
            values = closed_form_input(numel, comm.rank, world_size, torch.float32) + round_index
            out.append(("all_reduce", gradsync.all_reduce(values.clone(), algorithm="shm", group=comm)))
            out.append(("broadcast", gradsync.broadcast(values.clone(), src=round_index % world_size,
                                                        group=comm, algorithm="shm")))
            out.append(("all_gather", torch.cat(gradsync.all_gather(values, group=comm, algorithm="shm"))))
            out.append(("reduce_scatter", gradsync.reduce_scatter(values, group=comm, algorithm="shm")))
        return out

    per_rank = run_shm_threads(world_size, rank_fn, SMALL_REGION_BYTES)
    for round_index in range(rounds):
        numel = numels[round_index % len(numels)]
        inputs = [closed_form_input(numel, rank, world_size, torch.float32) + round_index
                  for rank in range(world_size)]
        total = reference_all_reduce(inputs, "sum")
        for rank, out in enumerate(per_rank):
            expected = {"all_reduce": total, "broadcast": inputs[round_index % world_size],
                        "all_gather": torch.cat(inputs),
                        "reduce_scatter": torch.tensor_split(total, world_size)[rank]}
            for name, result in out[4 * round_index:4 * round_index + 4]:
                assert_bitwise_equal(result, expected[name], f"round {round_index} {name} rank {rank}")


# ---------------------------------------------------------------- mismatches

# kind -> (tensor factory(odd), call(tensor, comm, odd)); rank 1 of 3 is the odd one.
SHM_MISMATCHES = {
    "all_reduce-numel": (lambda odd: torch.ones(5 if odd else 4),
                         lambda t, comm, odd: gradsync.all_reduce(t, algorithm="shm", group=comm)),
    "all_reduce-shape-same-numel": (lambda odd: torch.ones((3, 2) if odd else (2, 3)),
                                    lambda t, comm, odd: gradsync.all_reduce(t, algorithm="shm", group=comm)),
    "all_reduce-dtype": (lambda odd: torch.ones(4, dtype=torch.float64 if odd else torch.float32),
                         lambda t, comm, odd: gradsync.all_reduce(t, algorithm="shm", group=comm)),
    "all_reduce-large-vs-small": (lambda odd: torch.ones(5000 if odd else 3),
                                  lambda t, comm, odd: gradsync.all_reduce(t, algorithm="shm", group=comm)),
    "all_reduce-shm-vs-ring": (lambda odd: torch.ones(4),
                               lambda t, comm, odd: gradsync.all_reduce(
                                   t, algorithm="ring" if odd else "shm", group=comm)),
    "broadcast-numel": (lambda odd: torch.ones(5 if odd else 4),
                        lambda t, comm, odd: gradsync.broadcast(t, src=0, group=comm, algorithm="shm")),
    "broadcast-dtype": (lambda odd: torch.ones(4, dtype=torch.int32 if odd else torch.float32),
                        lambda t, comm, odd: gradsync.broadcast(t, src=0, group=comm, algorithm="shm")),
    "broadcast-src": (lambda odd: torch.ones(4),
                      lambda t, comm, odd: gradsync.broadcast(t, src=1 if odd else 0, group=comm,
                                                              algorithm="shm")),
    "broadcast-shm-vs-tree": (lambda odd: torch.ones(4),
                              lambda t, comm, odd: gradsync.broadcast(t, src=0, group=comm,
                                                                      algorithm=None if odd else "shm")),
    "all_gather-shape": (lambda odd: torch.ones((4, 1) if odd else (4,)),
                         lambda t, comm, odd: gradsync.all_gather(t, group=comm, algorithm="shm")),
    "all_gather-dtype": (lambda odd: torch.ones(4, dtype=torch.bfloat16 if odd else torch.float16),
                         lambda t, comm, odd: gradsync.all_gather(t, group=comm, algorithm="shm")),
    "reduce_scatter-numel": (lambda odd: torch.ones(7 if odd else 6),
                             lambda t, comm, odd: gradsync.reduce_scatter(t, group=comm, algorithm="shm")),
    "reduce_scatter-dtype": (lambda odd: torch.ones(6, dtype=torch.int32 if odd else torch.int64),
                             lambda t, comm, odd: gradsync.reduce_scatter(t, group=comm, algorithm="shm")),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("warm", [False, True], ids=["first-shm-call", "segment-exists"])
@pytest.mark.parametrize("kind", sorted(SHM_MISMATCHES))
def test_shm_mismatch_raises_on_every_rank_and_group_stays_usable(kind, warm):
    """Ranks disagreeing on layout (or on the algorithm) raise CollectiveMismatchError on every rank, tensors
    untouched, before or after the segment exists; the next shm all_reduce and broadcast are right."""
    world_size, odd_rank = 3, 1
    make_tensor, call = SHM_MISMATCHES[kind]

    def rank_fn(comm):
        odd = comm.rank == odd_rank
        if warm:
            gradsync.all_reduce(torch.ones(3), algorithm="shm", group=comm)
        tensor = make_tensor(odd) * (comm.rank + 2)
        before = tensor.clone()
        exc, _ = capture(lambda: call(tensor, comm, odd))
        follow_up = gradsync.all_reduce(torch.full((2049,), comm.rank + 1.0), algorithm="shm", group=comm)
        follow_bcast = gradsync.broadcast(torch.full((5,), float(comm.rank)), src=2, group=comm, algorithm="shm")
        return exc, tensor, before, follow_up, follow_bcast

    per_rank = run_shm_threads(world_size, rank_fn, SMALL_REGION_BYTES, timeout_s=20, collective_timeout_s=5)
    expected_sum = torch.full((2049,), float(sum(range(1, world_size + 1))))
    for rank, (exc, tensor, before, follow_up, follow_bcast) in enumerate(per_rank):
        assert isinstance(exc, CollectiveMismatchError), f"rank {rank}: {exc!r}"
        assert_bitwise_equal(tensor, before, f"rank {rank} tensor after the failed call")
        assert_bitwise_equal(follow_up, expected_sum, f"rank {rank} follow-up shm all_reduce")
        assert_bitwise_equal(follow_bcast, torch.full((5,), 2.0), f"rank {rank} follow-up shm broadcast")


# ---------------------------------------------------------------- remove_leftovers


def _dead_pid():
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_remove_leftovers_removes_only_names_of_dead_creators():
    """A gradsync name whose creator pid is gone is unlinked and reported; one of a live pid stays."""
    dead_pid = _dead_pid()
    dead = f"gradsync-{dead_pid}-{secrets.token_hex(12)}"
    live = f"gradsync-{os.getpid()}-{secrets.token_hex(12)}"
    paths = [os.path.join(SHM_DIR, name) for name in (dead, live)]
    try:
        for path in paths:
            with open(path, "wb") as handle:
                handle.write(b"\0" * 64)
        removed = shm_transport.remove_leftovers()
        assert dead in removed, removed
        assert live not in removed, removed
        assert not os.path.exists(paths[0]), "the dead creator's name is still in /dev/shm"
        assert os.path.exists(paths[1]), "the live creator's name was removed"
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


def test_remove_leftovers_ignores_names_not_in_gradsync_format(tmp_path):
    """Only ``gradsync-<digits>-<token>`` names are candidates; other names of dead pids stay."""
    dead_pid = _dead_pid()
    kept = ["gradsync-abc-ff", f"gradsync-{dead_pid}", f"other-{dead_pid}-ff", f"gradsync-{dead_pid}-ff-x",
            f"gradsync-{os.getpid()}-ff"]
    gone = f"gradsync-{dead_pid}-0123abcd"
    for name in kept + [gone]:
        (tmp_path / name).write_bytes(b"x")
    assert shm_transport.remove_leftovers(str(tmp_path)) == [gone]
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


# ---------------------------------------------------------------- real processes

DIST = pytest.mark.dist
COLLECTIVE_TIMEOUT_S = 15.0
PROCESS_NUMELS = (1, 3_000_001)  # 3 M float32 = 12 MB: three slices of the default 4 MiB region
JOB_ROUNDS = 10
JOB_NUMEL = 30_011
IN_FEATURES, HIDDEN, OUT_FEATURES = 4, 8, 2
DP_BATCH, DP_STEPS, DP_LR = 6, 4, 0.1


def _shm_names_of(pids, names):
    prefixes = tuple(f"gradsync-{pid}-" for pid in pids)
    return sorted(name for name in names if name.startswith(prefixes))


def _digest(tensor):
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _large_input(numel, rank):
    """``x[j] = j + rank``: distinct values, and sums over <= 3 ranks below 2**24, so exact in float32."""
    return torch.arange(numel, dtype=torch.float32) + rank


def _large_result(numel, world_size):
    """The exact sum of ``_large_input`` over ``world_size`` ranks, computed in float64."""
    return (torch.arange(numel, dtype=torch.float64) * world_size
            + world_size * (world_size - 1) / 2).to(torch.float32)


def _job_input(job, round_index, rank, numel):
    """Integers below 2**18 (exact float32 sums), different for every job, round and rank."""
    return torch.arange(numel, dtype=torch.float32) * (job + 1) + (1000 * job + 7 * round_index + 13 * rank)


def _make_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT_FEATURES))


def _make_data(global_batch):
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(DP_STEPS, global_batch, IN_FEATURES, generator=generator),
            torch.randn(DP_STEPS, global_batch, OUT_FEATURES, generator=generator))


def _train_shm_data_parallel(rank, world_size):
    model = gradsync.DataParallel(_make_mlp(), algorithm="shm")
    optimizer = torch.optim.SGD(model.parameters(), lr=DP_LR)
    inputs, targets = _make_data(world_size * DP_BATCH)
    rows = slice(rank * DP_BATCH, (rank + 1) * DP_BATCH)
    step_grads = []
    for step in range(DP_STEPS):
        optimizer.zero_grad()
        F.mse_loss(model(inputs[step][rows]), targets[step][rows]).backward()
        step_grads.append([param.grad.clone() for param in model.module.parameters()])
        optimizer.step()
    return [param.detach().clone() for param in model.module.parameters()], step_grads


def _rank_shm_job(job, data_parallel):
    """One job: pids through shm all_gather, large all_reduces, JOB_ROUNDS rounds of job-specific data,
    optionally DataParallel training. Large results come back as digests."""
    rank, world_size = gradsync.rank(), gradsync.world_size()
    pids = [int(pid) for pid in gradsync.all_gather(torch.tensor([os.getpid()]), algorithm="shm")]
    own_names_after_setup = _shm_names_of([os.getpid()], os.listdir(SHM_DIR))  # rank 0 created and unlinked
    segment_name = default_communicator().options(ShmState).segment.name
    large = {}
    for numel in PROCESS_NUMELS:
        tensor = _large_input(numel, rank)
        returned = gradsync.all_reduce(tensor, algorithm="shm")
        large[numel] = (returned is tensor, _digest(tensor))
    rounds = []
    for round_index in range(JOB_ROUNDS):
        tensor = _job_input(job, round_index, rank, JOB_NUMEL)
        gradsync.all_reduce(tensor, algorithm="shm")
        rounds.append(_digest(tensor))
    training = _train_shm_data_parallel(rank, world_size) if data_parallel else None
    return {"pid": os.getpid(), "pids": pids, "own_names_after_setup": own_names_after_setup,
            "segment_name": segment_name, "large": large, "rounds": rounds, "training": training}


JOBS = {"job0-2ranks": (0, 2, True), "job1-3ranks": (1, 3, False)}  # name -> (job, world_size, data_parallel)


@pytest.fixture(scope="module")
def concurrent_jobs():
    """Both JOBS run at the same time (two run_world calls on two threads); /dev/shm listed around them."""
    before = os.listdir(SHM_DIR)
    outcomes = {}

    def run(name):
        job, world_size, data_parallel = JOBS[name]
        try:
            outcomes[name] = ("ok", run_world(world_size, _rank_shm_job, job, data_parallel, timeout_s=60,
                                              collective_timeout_s=COLLECTIVE_TIMEOUT_S))
        except BaseException as exc:  # noqa: BLE001 - reported by the tests
            outcomes[name] = ("error", exc)

    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(name,), daemon=True) for name in JOBS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(75)
    return {"before": before, "after": os.listdir(SHM_DIR), "outcomes": outcomes,
            "seconds": time.monotonic() - started}


def _job_results(concurrent_jobs, name):
    status, value = concurrent_jobs["outcomes"].get(name, ("error", "did not finish"))
    if status != "ok":
        raise AssertionError(f"{name} failed: {value!r}") from (value if isinstance(value, BaseException)
                                                                 else None)
    return value


@DIST
@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", sorted(JOBS))
def test_shm_all_reduce_in_processes_matches_reference(concurrent_jobs, name):
    """2 and 3 Gloo processes: shm all_reduce of 1 and 3,000,001 float32 equals the exact sum on every
    rank, bitwise (compared as SHA-256 of the bytes); shm all_gather returns every rank's pid."""
    job, world_size, _ = JOBS[name]
    per_rank = _job_results(concurrent_jobs, name)
    pids = [result["pid"] for result in per_rank]
    for numel in PROCESS_NUMELS:
        expected = _digest(_large_result(numel, world_size))
        for rank, result in enumerate(per_rank):
            in_place, digest = result["large"][numel]
            assert in_place, f"rank {rank}: all_reduce did not return its argument"
            assert digest == expected, f"{name} rank {rank} numel {numel}: result differs from the exact sum"
    for rank, result in enumerate(per_rank):
        assert result["pids"] == pids, f"rank {rank}: shm all_gather of pids {result['pids']} != {pids}"


@DIST
@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", sorted(JOBS))
def test_shm_segment_name_leaves_dev_shm(concurrent_jobs, name):
    """The segment is named after rank 0's pid, is gone from /dev/shm right after setup (checked by rank 0)
    and no name of the job's pids is in /dev/shm after the run."""
    per_rank = _job_results(concurrent_jobs, name)
    pids = [result["pid"] for result in per_rank]
    segment_name = per_rank[0]["segment_name"]
    assert segment_name.startswith(f"gradsync-{pids[0]}-"), segment_name
    assert all(result["segment_name"] == segment_name for result in per_rank)
    assert per_rank[0]["own_names_after_setup"] == [], per_rank[0]["own_names_after_setup"]
    assert _shm_names_of(pids, concurrent_jobs["before"]) == []
    assert _shm_names_of(pids, concurrent_jobs["after"]) == [], "segment names left in /dev/shm"


@DIST
@pytest.mark.timeout(90)
def test_shm_concurrent_jobs_do_not_cross_talk(concurrent_jobs):
    """Two jobs running at the same time use different segments and each gets its own sums every round."""
    results = {name: _job_results(concurrent_jobs, name) for name in JOBS}
    names = {name: per_rank[0]["segment_name"] for name, per_rank in results.items()}
    assert len(set(names.values())) == len(JOBS), names
    for name, per_rank in results.items():
        job, world_size, _ = JOBS[name]
        for round_index in range(JOB_ROUNDS):
            inputs = [_job_input(job, round_index, rank, JOB_NUMEL) for rank in range(world_size)]
            expected = _digest(reference_all_reduce(inputs, "sum"))
            for rank, result in enumerate(per_rank):
                assert result["rounds"][round_index] == expected, f"{name} rank {rank} round {round_index}"


def _reference_training():
    model = _make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=DP_LR)
    inputs, targets = _make_data(JOBS["job0-2ranks"][1] * DP_BATCH)
    step_grads = []
    for step in range(DP_STEPS):
        optimizer.zero_grad()
        F.mse_loss(model(inputs[step]), targets[step]).backward()
        step_grads.append([param.grad.clone() for param in model.parameters()])
        optimizer.step()
    return [param.detach().clone() for param in model.parameters()], step_grads


@DIST
@pytest.mark.timeout(90)
def test_shm_data_parallel_matches_single_process_full_batch(concurrent_jobs):
    """DataParallel(algorithm="shm"), 2 ranks x batch 6, equals 1 process x batch 12 (rtol 1e-5, atol 1e-6)
    at every step, and the replicas' gradients and parameters are bitwise equal."""
    per_rank = [result["training"] for result in _job_results(concurrent_jobs, "job0-2ranks")]
    expected_params, expected_grads = _reference_training()
    for rank, (params, step_grads) in enumerate(per_rank):
        for index, (got, want) in enumerate(zip(params, expected_params, strict=True)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} final param {index}: {m}")
        for step, grads in enumerate(step_grads):
            for index, (got, want) in enumerate(zip(grads, expected_grads[step], strict=True)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} step {step} grad {index}: {m}")
    params0, grads0 = per_rank[0]
    for rank, (params, step_grads) in enumerate(per_rank[1:], start=1):
        for index, (got, want) in enumerate(zip(params, params0)):
            assert not bitwise_difference(got, want), f"rank {rank} final param {index} differs from rank 0"
        for step, (grads, first) in enumerate(zip(step_grads, grads0)):
            for index, (got, want) in enumerate(zip(grads, first)):
                assert not bitwise_difference(got, want), f"rank {rank} step {step} grad {index} != rank 0"


# ---------------------------------------------------------------- a killed rank

KILL_TIMEOUT_S = 20.0
KILL_DETECTED_S = 2.0  # a dead peer's process is checked every 50 ms: seen long before the timeout


def _timed(call):
    exc, elapsed = capture(call)
    if exc is None:
        return "no error", "", None, elapsed
    return type(exc).__name__, str(exc), getattr(exc, "peer", None), elapsed


def _rank_killed_after_shm(victim, timeout_s):
    """All ranks share pids and all_reduce through shm; ``victim`` SIGKILLs itself; the others call shm
    all_reduce twice: through the shm barrier alone (verify=False) and through the public API."""
    pids = [int(pid) for pid in gradsync.all_gather(torch.tensor([os.getpid()]), algorithm="shm")]
    gradsync.all_reduce(torch.ones(1000), algorithm="shm")
    gradsync.all_reduce(torch.ones(1), algorithm="ring")  # every rank is past the shm call
    if gradsync.rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    barrier_only = _timed(lambda: collectives_api.all_reduce(
        torch.ones(1000), default_communicator(), algorithm="shm", timeout=timeout_s, verify=False))
    public = _timed(lambda: gradsync.all_reduce(torch.ones(1000), algorithm="shm", timeout=timeout_s))
    return {"pids": pids, "barrier_only": barrier_only, "public": public}


@DIST
@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [0, 2], ids=["creator-rank0", "rank2"])
def test_shm_killed_rank_raises_timeout_naming_it_and_leaves_no_name(victim):
    """3 ranks, one SIGKILLed after an shm all_reduce (rank 0 created the segment): the survivors' next shm
    all_reduce raises CollectiveTimeoutError naming that peer rank as dead long before the timeout, both through the
    shm barrier alone and through the public API, and no gradsync name of these processes is left in /dev/shm."""
    world_size = 3
    outcomes = run_world(world_size, _rank_killed_after_shm, victim, KILL_TIMEOUT_S, timeout_s=45,
                         collective_timeout_s=COLLECTIVE_TIMEOUT_S, may_exit=[victim])
    assert outcomes[victim] is None
    survivors = [outcome for rank, outcome in enumerate(outcomes) if rank != victim]
    pids = survivors[0]["pids"]
    assert len(pids) == world_size and all(outcome["pids"] == pids for outcome in survivors)
    for rank, outcome in enumerate(outcomes):
        if rank == victim:
            continue
        for path in ("barrier_only", "public"):
            exc_type, message, peer, elapsed_s = outcome[path]
            what = f"rank {rank} {path}: {exc_type}: {message}"
            assert exc_type == CollectiveTimeoutError.__name__, what
            assert f"peer rank {victim}" in message and "died" in message and peer == victim, what
            assert elapsed_s <= KILL_DETECTED_S, f"{what} after {elapsed_s:.2f} s"
    assert _shm_names_of(pids, os.listdir(SHM_DIR)) == [], "segment names left in /dev/shm"


HIERARCHICAL_SHM_NUMELS = (5, 1_000_003)


def _hierarchical_shm_scenario(numels):
    """4 ranks as 2 pretend nodes of 2: shared memory inside a node, Gloo point-to-point across.

    One communicator per numel (made as the job would make it), all in one world: numel -> (digest, bytes sent).
    """
    base = default_communicator()
    results = {}
    for numel in numels:
        comm = gradsync.Communicator(base.transport, base.timeout_s,
                                     options=[HierarchicalOptions(ranks_per_node=2, intra_node_algorithm="shm")])
        try:
            before = comm.stats.bytes_sent
            tensor = torch.arange(numel, dtype=torch.float32) * (comm.rank + 1)
            collectives_api.all_reduce(tensor, comm, algorithm="hierarchical")
            results[numel] = hashlib.sha256(tensor.numpy().tobytes()).hexdigest(), comm.stats.bytes_sent - before
        finally:
            comm.close()
    return results


@pytest.fixture(scope="module")
def hierarchical_shm_world():
    """Every numel of :data:`HIERARCHICAL_SHM_NUMELS` in one 4-process world (a world start costs seconds)."""
    return run_world(4, _hierarchical_shm_scenario, HIERARCHICAL_SHM_NUMELS, timeout_s=100)


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("numel", HIERARCHICAL_SHM_NUMELS)
def test_hierarchical_with_shm_inside_nodes_in_real_processes(hierarchical_shm_world, numel):
    """hierarchical with intra_node_algorithm="shm": exact sums, and only 1/L of the data goes point-to-point."""
    results = [per_rank[numel] for per_rank in hierarchical_shm_world]
    expected = torch.arange(numel, dtype=torch.float32) * sum(range(1, 5))
    digest = hashlib.sha256(expected.numpy().tobytes()).hexdigest()
    assert [result[0] for result in results] == [digest] * 4
    if numel > 1000:  # across 2 nodes each rank all-reduces half the vector with its peer: numel/2 floats
        assert all(result[1] <= 4 * numel for result in results), [result[1] for result in results]
