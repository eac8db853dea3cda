"""all_reduce values per algorithm and variant over in-process thread ranks: fixed grids, not properties.

Every algorithm x world size 1..7 x dtype/op x numel (0, 1, p-1, p+1, 1000);
any shape; results written through non-contiguous views; data moved as early
or as late as a network may (``StrictWorld``); about a million elements; every
algorithm back to back on one group; fp16/bf16 accumulated in float32;
hierarchical with each algorithm across nodes. Expected values are closed
forms (``_reference``). The variants are in ``_variants.py``; the random
(hypothesis) cases are in ``test_algorithms_properties.py``.
"""

from __future__ import annotations

import pytest
import torch

import gradsync
from _dist import run_threads
from _reference import (ALL_DTYPES, FLOAT_DTYPES, SENTINEL, assert_bitwise_equal, closed_form_input,
                        closed_form_result, reference_all_reduce, strided_column_view, transposed_view)
from _strict_transport import MODES, StrictWorld
from _variants import (ALGORITHMS, VARIANTS, WORLD_SIZES, Variant, bitwise_failures, check_closed_form,
                       numels_for, run_variant, selected_path, smallest_world)
from gradsync import Communicator
from gradsync.collectives import HierarchicalOptions
from gradsync.transport.thread import ThreadWorld


def test_variants_cover_every_algorithm():
    """The variant table names every algorithm in gradsync.ALGORITHMS (a new one must be added here)."""
    assert {variant.algorithm for variant in VARIANTS.values()} == set(gradsync.ALGORITHMS)


DTYPE_OPS = [(dtype, "sum") for dtype in ALL_DTYPES] + [(dtype, "avg") for dtype in FLOAT_DTYPES]
# ring and native run the whole dtype grid; the other algorithms share the
# dtype plumbing of the public layer, so a float, a float32-accumulated and an
# integer dtype (plus avg) keep the grid's runtime reasonable.
FULL_DTYPE_ALGORITHMS = ("ring", "native")
REDUCED_DTYPE_OPS = [(torch.float32, "sum"), (torch.float32, "avg"), (torch.float16, "sum"),
                     (torch.int64, "sum")]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_grid_matches_reference_sum(world_size, algorithm):
    """Every algorithm x dtype/op x numel (0, 1, p-1, p+1, 1000) on one group: the exact stacked sum, in place.

    One thread world per (world size, algorithm) runs every case in turn (the
    cases of the old one-test-per-case grid), so the group is also reused.
    """
    cases = [(numel, dtype, op) for numel in numels_for(world_size)
             for dtype, op in (DTYPE_OPS if algorithm in FULL_DTYPE_ALGORITHMS else REDUCED_DTYPE_OPS)]
    inputs, expected = {}, {}
    for case in cases:
        numel, dtype, op = case
        inputs[case] = [closed_form_input(numel, rank, world_size, dtype) for rank in range(world_size)]
        expected[case] = reference_all_reduce(inputs[case], op)
        assert_bitwise_equal(expected[case], closed_form_result(numel, world_size, dtype, op), f"reference {case}")

    def rank_fn(comm):
        results = {}
        for case in cases:
            tensor = inputs[case][comm.rank].clone()
            returned = gradsync.all_reduce(tensor, op=case[2], algorithm=algorithm, group=comm)
            assert returned is tensor, "all_reduce must return the tensor it was given"
            results[case] = tensor
        return results

    failures = bitwise_failures(run_threads(world_size, rank_fn), expected, algorithm)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_reduce_keeps_any_shape(algorithm):
    """0-dim, multi-dimensional and empty tensors are reduced in place and keep their shape (p = 3, one group)."""
    world_size = 3
    shapes = {"scalar": (), "3d": (2, 3, 4), "empty-2d": (0, 3)}
    numels = {name: int(torch.tensor(shape).prod()) if shape else 1 for name, shape in shapes.items()}
    inputs = {name: [closed_form_input(numels[name], rank, world_size, torch.float32).reshape(shape)
                     for rank in range(world_size)] for name, shape in shapes.items()}
    expected = {name: closed_form_result(numels[name], world_size, torch.float32, "sum").reshape(shape)
                for name, shape in shapes.items()}

    def rank_fn(comm):
        return {name: gradsync.all_reduce(inputs[name][comm.rank].clone(), algorithm=algorithm, group=comm)
                for name in shapes}

    failures = bitwise_failures(run_threads(world_size, rank_fn), expected, algorithm)
    assert not failures, "\n".join(failures)


NON_CONTIGUOUS_VARIANTS = dict(VARIANTS, **{"ring-segmented": Variant("ring", segment_bytes=8),
                                            "tree-segmented": Variant("tree", segment_bytes=8)})
NON_CONTIGUOUS_CASES = [(name, world_size) for name, variant in sorted(NON_CONTIGUOUS_VARIANTS.items())
                        for world_size in sorted({smallest_world(variant, at_least) for at_least in (2, 3, 4)})]
LAYOUTS = {"strided-column": strided_column_view, "transposed": transposed_view}


@pytest.mark.parametrize("name,world_size", NON_CONTIGUOUS_CASES)
def test_algorithms_write_result_through_non_contiguous_view(name, world_size):
    """A non-contiguous input gets the exact sum written back through the view; other storage is untouched.

    Every layout x dtype (float32, float16, int32, int64) x numel (12, 30) runs on one group per world size.
    """
    variant = NON_CONTIGUOUS_VARIANTS[name]
    cases = [(layout, dtype, numel) for layout in sorted(LAYOUTS)
             for dtype in (torch.float32, torch.float16, torch.int32, torch.int64) for numel in (12, 30)]

    def rank_fn(comm):
        results = []
        for layout, dtype, numel in cases:
            base, view = LAYOUTS[layout](closed_form_input(numel, comm.rank, world_size, dtype))
            assert not view.is_contiguous()
            gradsync.all_reduce(view, algorithm=variant.algorithm, group=comm)
            results.append((base, view))
        return results

    for rank, results in enumerate(run_variant(variant, world_size, rank_fn)):
        for (layout, dtype, numel), (base, view) in zip(cases, results):
            expected = closed_form_result(numel, world_size, dtype, "sum")
            what = f"rank {rank} {layout} {dtype} numel={numel}"
            if layout == "strided-column":
                assert_bitwise_equal(view, expected, f"{what} view")
                assert (base[:, 0] == SENTINEL).all() and (base[:, 2] == SENTINEL).all(), what
            else:
                assert_bitwise_equal(base, expected.reshape(3, -1), f"{what} storage")


STRICT_VARIANTS = dict({name: variant for name, variant in NON_CONTIGUOUS_VARIANTS.items()
                        if variant.algorithm != "native"},
                       **{"hierarchical-rpn2-segmented": Variant("hierarchical", ranks_per_node=2,
                                                                 segment_bytes=8)})
STRICT_CASES = [(world_size, name, mode) for name, variant in sorted(STRICT_VARIANTS.items())
                for world_size in sorted({smallest_world(variant, 3), smallest_world(variant, 4)})
                for mode in MODES]


@pytest.mark.parametrize("world_size,name,mode", STRICT_CASES)
def test_algorithms_exact_when_data_moves_as_early_or_late_as_a_network_may(world_size, name, mode):
    """Receive buffers filled right after posting, or send buffers read only at completion: still exact."""
    variant = STRICT_VARIANTS[name]
    cases = [(numel, dtype) for numel in (1, world_size + 1, 97, 300) for dtype in (torch.float32, torch.int64)]

    def rank_fn(comm):
        results = []
        for numel, dtype in cases:
            tensor = closed_form_input(numel, comm.rank, world_size, dtype)
            results.append(gradsync.all_reduce(tensor, algorithm=variant.algorithm, group=comm))
        return results

    with selected_path(variant):
        outcomes = run_threads(world_size, rank_fn, segment_bytes=variant.segment_bytes,
                               ranks_per_node=variant.ranks_per_node, world=StrictWorld(world_size, mode),
                               collective_timeout_s=5)
    for rank, results in enumerate(outcomes):
        for (numel, dtype), result in zip(cases, results):
            assert_bitwise_equal(result, closed_form_result(numel, world_size, dtype, "sum"),
                                 f"rank {rank} numel={numel} {dtype}")


MILLION = 1_000_003
LARGE_CASES = {  # a few, not a grid: each case moves megabytes through every rank
    "ring-p4": (Variant("ring"), 4, torch.float32),
    "ring-p3-64KiB-segments": (Variant("ring", segment_bytes=64 * 2**10), 3, torch.float32),
    "tree-p5": (Variant("tree"), 5, torch.float32),
    "halving_doubling-p4": (Variant("halving_doubling"), 4, torch.float32),
    "halving_doubling-p6-fold": (Variant("halving_doubling"), 6, torch.float64),
    "hierarchical-p4-rpn2": (Variant("hierarchical", ranks_per_node=2), 4, torch.float16),
}


@pytest.mark.parametrize("case", sorted(LARGE_CASES))
def test_algorithms_match_closed_form_for_a_million_elements(case):
    """About a million elements (odd numel) are reduced exactly by ring, tree, halving_doubling and hierarchical."""
    variant, world_size, dtype = LARGE_CASES[case]
    check_closed_form(variant, world_size, MILLION, dtype, "sum")


def test_algorithms_run_back_to_back_on_one_communicator():
    """One group runs every algorithm in turn on varying numel and dtype; reused scratch space never leaks."""
    world_size = 4
    # halving_doubling picks its path by size here: 40 KB float64 and 280 KB float32 go long.
    variants = [Variant(algorithm) for algorithm in gradsync.ALGORITHMS] + \
        [Variant("hierarchical", ranks_per_node=1), Variant("hierarchical", ranks_per_node=2)]
    calls = [(variant, numel, dtype) for numel, dtype in ((5000, torch.float64), (7, torch.float16),
                                                          (70_001, torch.float32), (3, torch.int8))
             for variant in variants]

    def rank_fn(comm):
        # Pretend-node variants get their own communicator on the same transport, kept for every call.
        comms = {None: comm, **{nodes: Communicator(comm.transport, comm.timeout_s,
                                                    options=[HierarchicalOptions(ranks_per_node=nodes)])
                                for nodes in (1, 2)}}
        results = []
        for variant, numel, dtype in calls:
            tensor = closed_form_input(numel, comm.rank, world_size, dtype)
            results.append(gradsync.all_reduce(tensor, algorithm=variant.algorithm,
                                               group=comms[variant.ranks_per_node]))
        return results

    for rank, results in enumerate(run_threads(world_size, rank_fn)):
        for (variant, numel, dtype), result in zip(calls, results):
            assert_bitwise_equal(result, closed_form_result(numel, world_size, dtype, "sum"),
                                 f"rank {rank} {variant} numel={numel} {dtype}")


# ---------------------------------------------------------------- all_reduce: fp16/bf16 accumulation

ACCUMULATION_CASES = {  # name -> (dtype, op, the 4 ranks' values, expected value)
    # 4 ranks of fp16 60000 averaged give 60000: the 240000 partial sum lives in float32.
    "fp16-avg-does-not-overflow": (torch.float16, "avg", [60000.0] * 4, 60000.0),
    # +60000, +60000, -60000, -60000 in fp16 sum to 0 whatever the ring order (no inf/nan).
    "fp16-sum-survives-overflowing-partial-sums": (torch.float16, "sum", [60000.0, 60000.0, -60000.0, -60000.0],
                                                   0.0),
    # bf16 256 + 1 + 1 + 1 is the float32 sum 259 rounded once to bf16, not a bf16 running sum.
    "bf16-rounds-once-from-float32-sum": (torch.bfloat16, "sum", [256.0, 1.0, 1.0, 1.0], 259.0),
}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_reduce_16_bit_floats_accumulate_in_float32(algorithm):
    """fp16 avg of 60000s, fp16 +-60000 partial sums and bf16 256+1+1+1 (one group of 4): float32 accumulation."""
    def rank_fn(comm):
        return {name: gradsync.all_reduce(torch.full((8,), values[comm.rank], dtype=dtype), op=op,
                                          algorithm=algorithm, group=comm)
                for name, (dtype, op, values, _) in ACCUMULATION_CASES.items()}

    expected = {name: torch.full((8,), value).to(dtype) for name, (dtype, _, _, value) in ACCUMULATION_CASES.items()}
    failures = bitwise_failures(run_threads(4, rank_fn), expected, algorithm)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("inter_node", ["auto", "ring", "tree", "halving_doubling"])
@pytest.mark.parametrize("world_size,ranks_per_node", [(4, 2), (6, 2), (6, 3)])
def test_hierarchical_any_inter_node_algorithm_matches_reference(world_size, ranks_per_node, inter_node):
    """hierarchical with each inner algorithm across nodes (2x2, 3x2, 2x3 nodes) gives the exact sum everywhere."""
    numel = 1001
    inputs = [closed_form_input(numel, rank, world_size, torch.float32) for rank in range(world_size)]
    expected = reference_all_reduce(inputs, "sum")
    world = ThreadWorld(world_size)

    def rank_fn(comm):
        comm = Communicator(comm.transport, 10.0, options=[HierarchicalOptions(ranks_per_node, inter_node)])
        tensor = inputs[comm.rank].clone()
        gradsync.all_reduce(tensor, algorithm="hierarchical", group=comm)
        return tensor

    for rank, result in enumerate(run_threads(world_size, rank_fn, world=world)):
        assert_bitwise_equal(result, expected, f"rank {rank} ({inter_node})")
