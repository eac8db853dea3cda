"""Collectives in real processes over Gloo (torch.distributed point-to-point).

Starting a world costs seconds, so one world per world size runs a list of
cases (gloo's ``MultipleAlgorithms`` idea) and returns every rank's results;
the parent compares them with closed forms, naming the case id in each
failure. Every algorithm runs on the default communicator; extra
communicators on the same transport add a tiny ``segment_bytes`` (many
pipelined segments) and pretend nodes (``ranks_per_node``). Fault tests (a
silent and a dead rank), leaving and joining again, and the harness's own
error reporting get worlds of their own.
"""

import os
import subprocess
import sys
import time

import pytest
import torch

import gradsync
from _dist import RankError, communicator_options, free_port, run_world
from _reference import bitwise_difference, closed_form_input, closed_form_result, reference_all_reduce
from gradsync.collectives import HierarchicalOptions
from gradsync.process_group import default_communicator

pytestmark = pytest.mark.dist

ALGORITHMS = gradsync.ALGORITHMS
FULL_GRID_ALGORITHMS = ("ring", "native")  # the others share the public layer's dtype plumbing
LARGE_NUMEL = 1_000_003
MEDIUM_NUMEL = 100_003
SMALL_NUMEL = 17
SMALL_DTYPES = ("float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64")
REDUCED_SMALL_DTYPES = ("float16", "bfloat16", "int8", "int64")
COLLECTIVE_TIMEOUT_S = 15.0
MISMATCH_ODD_NUMEL = 5
TINY_SEGMENT_BYTES = 64  # 16 float32 elements: every chunk is cut into many pipelined segments


def _algorithm_cases(world_size, algorithm):
    """(dtype name, numel, op, strided) cases of one algorithm on the default communicator."""
    full = algorithm in FULL_GRID_ALGORITHMS
    cases = [("float32", numel, "sum", False)
             for numel in sorted({0, 1, max(world_size - 1, 0), world_size + 1, LARGE_NUMEL})]
    cases += [("float32", numel, "avg", False) for numel in ((world_size + 1, LARGE_NUMEL) if full
                                                             else (world_size + 1,))]
    for dtype in SMALL_DTYPES if full else REDUCED_SMALL_DTYPES:
        ops = ("sum", "avg") if getattr(torch, dtype).is_floating_point else ("sum",)
        cases.extend((dtype, SMALL_NUMEL, op, False) for op in ops)
    cases += [(dtype, 10, "sum", True) for dtype in ("float32", "float16", "int32")]
    return cases


def _communicator_cases(world_size):
    """(algorithm, Communicator options, (dtype name, numel, op, strided) cases) on extra communicators."""
    segmented = (("segment_bytes", TINY_SEGMENT_BYTES),)
    small = [("float32", 1001, "sum", False), ("float16", 1001, "avg", False), ("int64", 1001, "sum", False),
             ("float32", 10, "sum", True)]
    groups = [(algorithm, segmented, small) for algorithm in ("ring", "tree", "hierarchical")]
    groups += [(algorithm, (("segment_bytes", 4096),), [("float32", MEDIUM_NUMEL, "sum", False)])
               for algorithm in ("ring", "tree")]
    groups.append(("hierarchical", (("ranks_per_node", 1),), [("float32", 1001, "sum", False)]))
    if world_size == 4:  # two pretend nodes of two ranks
        for options in ((("ranks_per_node", 2),), (("ranks_per_node", 2),) + segmented):
            groups.append(("hierarchical", options, small))
        groups.append(("hierarchical", (("ranks_per_node", 2),), [("float32", LARGE_NUMEL, "sum", False)]))
    return groups


def _options_suffix(options):
    names = {"segment_bytes": "seg", "ranks_per_node": "rpn"}
    return "".join(f"-{names[key]}{value}" for key, value in options)


def all_reduce_cases(world_size):
    """(case_id, dtype name, numel, op, algorithm, strided, communicator options) for every all_reduce case."""
    groups = [(algorithm, (), _algorithm_cases(world_size, algorithm)) for algorithm in ALGORITHMS]
    groups += _communicator_cases(world_size)
    return [(f"all_reduce-{algorithm}{_options_suffix(options)}-{dtype}-{op}-n{numel}"
             f"{'-strided' if strided else ''}", dtype, numel, op, algorithm, strided, options)
            for algorithm, options, cases in groups for dtype, numel, op, strided in cases]


def _strided_column(values):
    """Column 1 of a (numel, 3) tensor of -1: a non-contiguous view."""
    base = torch.full((values.numel(), 3), -1, dtype=values.dtype)
    base[:, 1] = values
    return base, base[:, 1]


def _attempt(call):
    """("ok", value) or ("error", "Type: message"): one failing case must not hide the others."""
    try:
        return "ok", call()
    except Exception as exc:  # noqa: BLE001 - reported with the case id by the parent
        return "error", f"{type(exc).__name__}: {exc}"


def _all_reduce_case(rank, world_size, dtype, numel, op, algorithm, strided, comm):
    values = closed_form_input(numel, rank, world_size, getattr(torch, dtype))
    base, tensor = _strided_column(values) if strided else (values, values)
    returned = gradsync.all_reduce(tensor, op=op, algorithm=algorithm, group=comm)
    return returned is tensor, base


def _communicator(comms, options):
    """The default communicator (no options), else one on the default transport with ``options``, made once."""
    if not options:
        return None
    if options not in comms:
        transport = default_communicator().transport
        comms[options] = gradsync.Communicator(transport, COLLECTIVE_TIMEOUT_S,
                                               options=communicator_options(**dict(options)))
    return comms[options]


def _run_all_reduce_cases(world_size, rank):
    comms = {}
    return {case_id: _attempt(lambda: _all_reduce_case(rank, world_size, *spec,
                                                       comm=_communicator(comms, options)))
            for case_id, *spec, options in all_reduce_cases(world_size)}


def _strided_broadcast(rank, world_size):
    base, view = _strided_column(closed_form_input(7, rank, world_size, torch.int8))
    gradsync.broadcast(view, src=world_size - 1)
    return base


def _run_other_collectives(world_size, rank):
    results = {}
    for src in range(world_size):
        tensor = torch.arange(5, dtype=torch.float32) * 10 + rank
        results[f"broadcast-float32-src{src}"] = _attempt(lambda: gradsync.broadcast(tensor, src=src))
    results[f"broadcast-int8-strided-src{world_size - 1}"] = _attempt(lambda: _strided_broadcast(rank, world_size))
    results["all_gather-float32-2x3"] = _attempt(lambda: gradsync.all_gather(
        (torch.arange(6, dtype=torch.float32) * world_size + rank).reshape(2, 3)))
    for dtype, numel in (("float32", world_size + 1), ("int64", 10), ("float16", 1)):
        values = closed_form_input(numel, rank, world_size, getattr(torch, dtype))
        results[f"reduce_scatter-{dtype}-n{numel}"] = _attempt(lambda: gradsync.reduce_scatter(values))
    return results


def _run_mismatches(world_size, rank):
    """Each mismatch: (exception type name, message, tensor unchanged, follow-up all_reduce result)."""
    odd = rank == world_size - 1
    calls = {
        f"mismatch-all_reduce-shape-{algorithm}":
            (torch.ones(MISMATCH_ODD_NUMEL if odd else 4) * (rank + 2),
             lambda tensor, algorithm=algorithm: gradsync.all_reduce(tensor, algorithm=algorithm))
        for algorithm in ALGORITHMS
    }
    if world_size == 4:
        two_nodes = gradsync.Communicator(default_communicator().transport, COLLECTIVE_TIMEOUT_S,
                                          options=[HierarchicalOptions(ranks_per_node=2)])
        calls["mismatch-all_reduce-shape-hierarchical-rpn2"] = (
            torch.ones(MISMATCH_ODD_NUMEL if odd else 4) * (rank + 2),
            lambda tensor: gradsync.all_reduce(tensor, algorithm="hierarchical", group=two_nodes))
    calls["mismatch-all_reduce-dtype"] = (torch.ones(4, dtype=torch.float64 if odd else torch.float32),
                                          gradsync.all_reduce)
    calls["mismatch-broadcast-src"] = (torch.ones(4) * rank,
                                       lambda tensor: gradsync.broadcast(tensor, src=1 if odd else 0))
    results = {}
    for case_id, (tensor, call) in calls.items():
        before = tensor.clone()
        try:
            call(tensor)
            outcome = ("no error", "")
        except Exception as exc:  # noqa: BLE001 - the parent checks the type
            outcome = (type(exc).__name__, str(exc))
        follow_up = gradsync.all_reduce(torch.full((3,), rank + 1.0))
        results[case_id] = (*outcome, torch.equal(tensor, before), follow_up)
    return results


def _rank_collective_cases():
    """Every case of this world, by family; rank r's results."""
    world_size, rank = gradsync.world_size(), gradsync.rank()
    results = {"all_reduce": _run_all_reduce_cases(world_size, rank),
               "other": _run_other_collectives(world_size, rank),
               "mismatch": _run_mismatches(world_size, rank) if world_size > 1 else {}}
    return results


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda p: f"ws{p}")
def world(request):
    """(world_size, per-rank results of ``_rank_collective_cases``): one spawned world per world size."""
    world_size = request.param
    return world_size, run_world(world_size, _rank_collective_cases, timeout_s=50,
                                 collective_timeout_s=COLLECTIVE_TIMEOUT_S)


def _values(failures, case_id, per_rank, family):
    """Each rank's value for ``case_id``; a rank that raised is recorded in ``failures`` (value None)."""
    values = []
    for rank, results in enumerate(per_rank):
        status, value = results[family][case_id]
        if status != "ok":
            failures.append(f"{case_id} rank {rank} raised {value}")
            value = None
        values.append(value)
    return values


def _check_same_on_every_rank(failures, case_id, values, expected):
    for rank, actual in enumerate(values):
        if actual is not None and (difference := bitwise_difference(actual, expected)):
            failures.append(f"{case_id} rank {rank}: {difference}")


@pytest.mark.timeout(60)
def test_all_reduce_dist_cases_match_closed_form(world):
    """Every all_reduce case (all algorithms, numel 0..1000003, dtypes, avg, strided, segments, nodes) is exact."""
    world_size, per_rank = world
    failures = []
    for case_id, dtype_name, numel, op, _, strided, _ in all_reduce_cases(world_size):
        expected = closed_form_result(numel, world_size, getattr(torch, dtype_name), op)
        if strided:
            expected = _strided_column(expected)[0]
        values = _values(failures, case_id, per_rank, "all_reduce")
        for rank, value in enumerate(values):
            if value is not None and not value[0]:
                failures.append(f"{case_id} rank {rank}: did not return the tensor it was given")
        _check_same_on_every_rank(failures, case_id, [value and value[1] for value in values], expected)
    assert not failures, f"{len(failures)} failing case(s):\n" + "\n".join(failures)


@pytest.mark.timeout(60)
def test_broadcast_all_gather_reduce_scatter_dist_match_reference(world):
    """broadcast from every src, all_gather and reduce_scatter give the reference values on every rank."""
    world_size, per_rank = world
    failures = []
    for src in range(world_size):
        case_id = f"broadcast-float32-src{src}"
        _check_same_on_every_rank(failures, case_id, _values(failures, case_id, per_rank, "other"),
                                  torch.arange(5, dtype=torch.float32) * 10 + src)
    case_id = f"broadcast-int8-strided-src{world_size - 1}"
    _check_same_on_every_rank(failures, case_id, _values(failures, case_id, per_rank, "other"),
                              _strided_column(closed_form_input(7, world_size - 1, world_size, torch.int8))[0])
    expected_parts = [(torch.arange(6, dtype=torch.float32) * world_size + source).reshape(2, 3)
                      for source in range(world_size)]
    case_id = "all_gather-float32-2x3"
    for rank, gathered in enumerate(_values(failures, case_id, per_rank, "other")):
        if gathered is not None and len(gathered) != world_size:
            failures.append(f"{case_id} rank {rank}: {len(gathered)} parts")
        elif gathered is not None:
            failures += [f"{case_id} rank {rank} part {source}: {difference}"
                         for source, (part, want) in enumerate(zip(gathered, expected_parts))
                         if (difference := bitwise_difference(part, want))]
    for dtype_name, numel in (("float32", world_size + 1), ("int64", 10), ("float16", 1)):
        case_id = f"reduce_scatter-{dtype_name}-n{numel}"
        inputs = [closed_form_input(numel, rank, world_size, getattr(torch, dtype_name))
                  for rank in range(world_size)]
        chunks = torch.tensor_split(reference_all_reduce(inputs, "sum"), world_size)
        for rank, chunk in enumerate(_values(failures, case_id, per_rank, "other")):
            if chunk is not None and (difference := bitwise_difference(chunk, chunks[rank])):
                failures.append(f"{case_id} rank {rank}: {difference}")
    assert not failures, f"{len(failures)} failing case(s):\n" + "\n".join(failures)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3, 4], indirect=True, ids=lambda p: f"ws{p}")
def test_collectives_dist_mismatch_raises_on_every_rank(world):
    """Shape, dtype or src disagreement raises CollectiveMismatchError on every rank; the group stays usable."""
    world_size, per_rank = world
    failures = []
    expected_follow_up = torch.full((3,), world_size * (world_size + 1) / 2)
    for case_id in per_rank[0]["mismatch"]:
        for rank, results in enumerate(per_rank):
            exc_type, message, unchanged, follow_up = results["mismatch"][case_id]
            if exc_type != "CollectiveMismatchError":
                failures.append(f"{case_id} rank {rank}: got {exc_type} {message}")
            if not unchanged:
                failures.append(f"{case_id} rank {rank}: tensor was modified")
            if difference := bitwise_difference(follow_up, expected_follow_up):
                failures.append(f"{case_id} rank {rank}: follow-up all_reduce {difference}")
    assert not failures, f"{len(failures)} failing case(s):\n" + "\n".join(failures)


# ---------------------------------------------------------------- faults: a silent and a dead peer

FAULT_TIMEOUT_S = 2.0


def _rank_silent_peer(silent_rank, timeout_s):
    """All ranks all_reduce once; then ``silent_rank`` sleeps while the others all_reduce again."""
    gradsync.all_reduce(torch.ones(8))
    if gradsync.rank() == silent_rank:
        time.sleep(timeout_s + 1.5)
        return None
    started = time.monotonic()
    try:
        gradsync.all_reduce(torch.ones(8), timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - the parent checks the type
        return type(exc).__name__, isinstance(exc, TimeoutError), str(exc), getattr(exc, "peer", None), \
            time.monotonic() - started
    return "no error", False, "", None, time.monotonic() - started


def _rank_dead_peer(dead_rank, timeout_s):
    """All ranks all_reduce once; then ``dead_rank`` exits abruptly while the others all_reduce again."""
    gradsync.all_reduce(torch.ones(8))
    if gradsync.rank() == dead_rank:
        os._exit(1)
    started = time.monotonic()
    try:
        gradsync.all_reduce(torch.ones(8), algorithm="ring", timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - the parent checks the type
        return type(exc).__name__, isinstance(exc, TimeoutError), str(exc), getattr(exc, "peer", None), \
            time.monotonic() - started
    return "no error", False, "", None, time.monotonic() - started


def _check_fault_outcomes(outcomes, culprit, world_size):
    for rank, outcome in enumerate(outcomes):
        if rank == culprit:
            continue
        exc_type, is_timeout_error, message, peer, elapsed_s = outcome
        assert exc_type == "CollectiveTimeoutError" and is_timeout_error, f"rank {rank}: {exc_type} {message}"
        assert elapsed_s <= FAULT_TIMEOUT_S + 2, f"rank {rank} took {elapsed_s:.2f} s: {message}"
        assert peer is not None and peer != rank and f"peer rank {peer}" in message, f"rank {rank}: {message}"
        # The layout check waits on every peer directly, so every survivor names the culprit.
        assert peer == culprit and f"peer rank {culprit}" in message, f"rank {rank}: {message}"


@pytest.mark.timeout(40)
def test_all_reduce_dist_silent_rank_times_out_naming_peer():
    """A live rank that stops calling makes the others raise CollectiveTimeoutError naming a peer in timeout+2 s."""
    world_size, silent_rank = 3, 1
    outcomes = run_world(world_size, _rank_silent_peer, silent_rank, FAULT_TIMEOUT_S, timeout_s=30,
                         collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    _check_fault_outcomes(outcomes, silent_rank, world_size)


@pytest.mark.timeout(40)
def test_all_reduce_dist_dead_rank_raises_naming_peer():
    """A rank that exits mid-job makes the survivors raise CollectiveTimeoutError naming it within timeout+2 s."""
    world_size, dead_rank = 2, 1
    outcomes = run_world(world_size, _rank_dead_peer, dead_rank, FAULT_TIMEOUT_S, timeout_s=30,
                         collective_timeout_s=COLLECTIVE_TIMEOUT_S, may_exit=[dead_rank])
    assert outcomes[dead_rank] is None
    _check_fault_outcomes(outcomes, dead_rank, world_size)


_NATIVE_SILENT_PEER = """
import sys, time, torch, gradsync
gradsync.init(backend="gloo", timeout=2.0)
if gradsync.rank() == 1:
    time.sleep(60)  # silent, its socket open
try:
    gradsync.all_reduce(torch.ones(8), algorithm="native")
except gradsync.CollectiveTimeoutError as exc:
    print(exc.peer, exc, flush=True)
"""


@pytest.mark.timeout(60)
def test_native_timeout_names_the_silent_rank_and_the_process_exits_promptly(tmp_path):
    """The backend's own all_reduce names no peer; the hang detector still names the silent rank."""
    script = tmp_path / "native_silent_peer.py"
    script.write_text(_NATIVE_SILENT_PEER)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    silent = subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": "1"})
    try:
        started = time.monotonic()
        waiting = subprocess.run([sys.executable, str(script)], env={**env, "RANK": "0"}, capture_output=True,
                                 text=True, timeout=50)
        elapsed_s = time.monotonic() - started
    finally:
        silent.kill()
        silent.wait()
    peer, _, message = waiting.stdout.strip().partition(" ")
    assert peer == "1" and "peer rank 1 stopped responding" in message, waiting.stdout + waiting.stderr
    assert "rank -1" not in message, message
    assert elapsed_s < 20, f"rank 0 took {elapsed_s:.1f} s to time out and exit (timeout 2 s)"


# ---------------------------------------------------------------- leaving and joining again

REINIT_TIMEOUT_S = 2.0


def _rank_reinit(slow_rank, delay_s):
    """all_reduce, leave the group (``slow_rank`` ``delay_s`` later than the others), join again, all_reduce."""
    rank = gradsync.rank()
    first = gradsync.all_reduce(torch.full((2,), rank + 1.0))
    if rank == slow_rank:
        time.sleep(delay_s)
    gradsync.shutdown()
    try:
        gradsync.init(backend="gloo", timeout=REINIT_TIMEOUT_S)
        second = gradsync.all_reduce(torch.full((2,), rank + 1.0), algorithm="native")
        third = gradsync.all_reduce(torch.full((2,), rank + 1.0), algorithm="ring")
        return "ok", (gradsync.rank(), gradsync.world_size()), first, second, third
    except Exception as exc:  # noqa: BLE001 - reported per rank by the parent
        return "error", f"{type(exc).__name__}: {str(exc).splitlines()[0]}", first, None, None


@pytest.mark.timeout(60)
def test_init_after_shutdown_works_in_same_process():
    """gradsync.init() after gradsync.shutdown() gives a working group, even when ranks leave at different times."""
    world_size, slow_rank = 2, 0
    outcomes = run_world(world_size, _rank_reinit, slow_rank, 1.0, timeout_s=45,
                         collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    expected = torch.full((2,), world_size * (world_size + 1) / 2)
    for rank, (status, detail, first, second, third) in enumerate(outcomes):
        assert not bitwise_difference(first, expected), f"rank {rank} before shutdown: {first}"
        assert status == "ok", f"rank {rank}: re-init failed: {detail}"
        assert detail == (rank, world_size), f"rank {rank}: {detail}"
        for result in (second, third):
            assert not bitwise_difference(result, expected), f"rank {rank} after re-init: {result}"


# ---------------------------------------------------------------- the harness itself


def _rank_fail_or_hang():
    """Rank 0 hangs (sleeps past the deadline); rank 1 raises."""
    if gradsync.rank() == 0:
        time.sleep(60)
    raise KeyError("boom from rank 1")


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_run_world_reports_failing_rank_traceback_and_hung_rank():
    """run_world re-raises rank 1's exception with its traceback and names rank 0, which hung and was terminated."""
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        run_world(2, _rank_fail_or_hang, timeout_s=8, collective_timeout_s=5)
    message = str(info.value)
    assert info.value.rank == 1 and "KeyError" in message and "boom from rank 1" in message, message
    assert "_rank_fail_or_hang" in message, "the rank's traceback text is missing"
    assert "ranks [0] did not finish" in message, message
    assert time.monotonic() - started < 20
