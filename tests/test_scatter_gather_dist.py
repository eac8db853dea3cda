"""reduce_scatter and all_gather in real processes over Gloo: every algorithm, native, hierarchical on fake hosts.

One world of three ranks (halving_doubling folds, unequal chunks) runs every
case (``_rank_cases``) and returns its results; the parent compares them bitwise with ``torch.tensor_split`` of the
closed-form sum, or with every rank's input. Native runs Gloo's own calls
(its all_reduce for the reduce-scatter, its all_gather of padded parts for
unequal chunks); hierarchical runs on injected hosts of unequal sizes with
native across them (Gloo subgroups) and the ring or shared memory inside. Mismatches and ``tree`` raise on
every rank and the group stays usable.
"""

from __future__ import annotations

import functools

import pytest
import torch

import gradsync
from _dist import run_world
from _reference import bitwise_difference, closed_form_input, closed_form_result
from gradsync.collectives import Communicator, HierarchicalOptions
from gradsync.collectives.scatter_gather import all_gather_flat, reduce_scatter_flat
from gradsync.process_group import default_communicator
from gradsync.transport.locality import Locality

pytestmark = pytest.mark.dist

COLLECTIVE_TIMEOUT_S = 15.0
CARRIERS = ("ring", "halving_doubling", "hierarchical", "shm", "native", "auto")
CASES = [("float32", numel) for numel in (0, 1, 2, 1001, 20_003)] + [("bfloat16", 7), ("int16", 5), ("int8", 9)]
FLAT_CASES = [("float32", 1001), ("float16", 9), ("int64", 6)]
FAKE_HOSTS = (0, 1, 0)  # host 0 = ranks (0, 2), host 1 = (1,): rank 2 is beyond the smallest host


def _attempt(call):
    try:
        return "ok", call()
    except Exception as exc:  # noqa: BLE001 - reported with the case id by the parent
        return "error", f"{type(exc).__name__}: {exc}"


def _flat_pair(comm, algorithm, dtype, numel, world_size):
    flat = closed_form_input(numel, comm.rank, world_size, getattr(torch, dtype))
    start, stop = reduce_scatter_flat(flat, comm, algorithm=algorithm)
    gathered = torch.zeros_like(flat)
    gathered[start:stop] = flat[start:stop]
    all_gather_flat(gathered, comm, algorithm=algorithm)
    return gathered


def _cases_on(comm, label, algorithms, world_size, cases=CASES):
    """Every case of ``algorithms`` on ``comm`` (None: the default group), keyed by id."""
    rank, results = gradsync.rank(), {}
    for algorithm in algorithms:
        for dtype, numel in cases:
            values = closed_form_input(numel, rank, world_size, getattr(torch, dtype))
            results[f"rs-{label}-{algorithm}-{dtype}-n{numel}"] = _attempt(
                lambda: gradsync.reduce_scatter(values, algorithm=algorithm, group=comm))
            results[f"ag-{label}-{algorithm}-{dtype}-n{numel}"] = _attempt(
                lambda: gradsync.all_gather(values, algorithm=algorithm, group=comm))
        for dtype, numel in FLAT_CASES:
            results[f"flat-{label}-{algorithm}-{dtype}-n{numel}"] = _attempt(
                lambda: _flat_pair(comm or default_communicator(), algorithm, dtype, numel, world_size))
    return results


def _refusals(world_size):
    """(exception name, message) per case: tree everywhere, tree on one rank, a numel mismatch (native)."""
    rank, out = gradsync.rank(), {}
    for case, call in {
        "tree-everywhere": lambda: gradsync.reduce_scatter(torch.ones(4), algorithm="tree"),
        "tree-on-rank-1": lambda: gradsync.all_gather(torch.ones(4), algorithm="tree" if rank == 1 else "ring"),
        "numel-native": lambda: gradsync.reduce_scatter(torch.ones(5 if rank == 1 else 4), algorithm="native"),
    }.items():
        exc = _attempt(call)
        out[case] = exc[1].split(":")[0] if exc[0] == "error" else "no error", exc[1]
    out["follow-up"] = gradsync.reduce_scatter(torch.ones(world_size), algorithm="native")
    return out


def _rank_cases():
    world_size = gradsync.world_size()
    results = _cases_on(None, "default", CARRIERS, world_size)
    base = default_communicator().transport
    for intra in ("auto", "ring"):
        hosts = Communicator(base, COLLECTIVE_TIMEOUT_S, options=[HierarchicalOptions(
            inter_node_algorithm="native", intra_node_algorithm=intra)])
        hosts.locality = Locality(FAKE_HOSTS)
        results.update(_cases_on(hosts, f"hosts-native-{intra}", ("hierarchical",), world_size, CASES[:4]))
        hosts.close()
    return results, _refusals(world_size)


@pytest.fixture(scope="module")
def world():
    world_size = len(FAKE_HOSTS)
    return world_size, run_world(world_size, _rank_cases, timeout_s=100, collective_timeout_s=COLLECTIVE_TIMEOUT_S)


@functools.lru_cache(maxsize=None)
def _expected(case_id, world_size, rank):
    kind, *_, dtype, numel = case_id.split("-")
    dtype, numel = getattr(torch, dtype), int(numel[1:])
    if kind == "rs":
        return torch.tensor_split(closed_form_result(numel, world_size, dtype, "sum"), world_size)[rank]
    if kind == "ag":
        return [closed_form_input(numel, source, world_size, dtype) for source in range(world_size)]
    return closed_form_result(numel, world_size, dtype, "sum")


@pytest.mark.timeout(120)
def test_every_algorithm_matches_the_closed_form_in_real_processes(world):
    """Every carrier on the default group (numel 0..20003, bf16, int16, int8; the in-place pair), and
    hierarchical on fake hosts of unequal sizes with Gloo subgroups across them."""
    world_size, per_rank = world
    failures = []
    for rank, (results, _) in enumerate(per_rank):
        for case_id, (status, value) in results.items():
            if status != "ok":
                failures.append(f"{case_id} rank {rank} raised {value}")
                continue
            expected = _expected(case_id, world_size, rank)
            pairs = zip(value, expected) if isinstance(expected, list) else [(value, expected)]
            if isinstance(expected, list) and len(value) != world_size:
                failures.append(f"{case_id} rank {rank}: {len(value)} parts")
            failures += [f"{case_id} rank {rank}: {difference}" for actual, wanted in pairs
                         if (difference := bitwise_difference(actual, wanted))]
    assert not failures, f"{len(failures)} failing case(s):\n" + "\n".join(failures)


@pytest.mark.timeout(120)
def test_refusals_and_mismatches_raise_on_every_rank(world):
    """tree everywhere: ValueError on every rank; tree on rank 1: ValueError there, CollectiveMismatchError
    naming it elsewhere; one rank's odd numel under native: CollectiveMismatchError everywhere."""
    world_size, per_rank = world
    for rank, (_, refusals) in enumerate(per_rank):
        assert refusals["tree-everywhere"][0] == "ValueError", refusals["tree-everywhere"]
        assert "algorithm 'tree' has no reduce_scatter" in refusals["tree-everywhere"][1]
        want = "ValueError" if rank == 1 else "CollectiveMismatchError"
        assert refusals["tree-on-rank-1"][0] == want, (rank, refusals["tree-on-rank-1"])
        assert refusals["numel-native"][0] == "CollectiveMismatchError", (rank, refusals["numel-native"])
        assert not bitwise_difference(refusals["follow-up"], torch.full((1,), float(world_size))), refusals
