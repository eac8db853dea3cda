"""Every collective over the in-process thread transport: values, bytes, errors.

(This file also holds what was ``test_collectives_threads.py``: the public
layer's all_reduce grid, broadcast / all_gather / reduce_scatter, argument
errors and mismatches; one suite for collectives over thread ranks.)

Each algorithm runs as the public layer runs it. A *variant* also selects an
algorithm's internal path: ``halving_doubling`` on its short (recursive
doubling) or long (Rabenseifner halving + doubling) path by overriding
``SHORT_MESSAGE_BYTES``; ``hierarchical`` on pretend nodes of
``ranks_per_node`` ranks; ring and tree with a tiny ``segment_bytes`` so
that every chunk is cut into many pipelined segments (Gloo's
``maxSegmentSize`` override). Expected values are closed forms
(``_reference``) and byte counts come from the algorithms' published costs
(Thakur, Rabenseifner & Gropp 2005), written here without the code under test.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gradsync
from _dist import RankError, capture, run_threads
from _reference import (ALL_DTYPES, FLOAT_DTYPES, INT_DTYPES, SENTINEL, assert_bitwise_equal, bitwise_difference,
                        closed_form_input, closed_form_result, reference_all_reduce, strided_column_view,
                        transposed_view)
from _strict_transport import MODES, StrictWorld
from gradsync import CollectiveMismatchError, CollectiveTimeoutError, Communicator
from gradsync.collectives import ops as collectives_api
from gradsync.collectives import HierarchicalOptions, SegmentOptions, auto, halving_doubling, shm_setup
from gradsync.collectives.cost.formulas import predict_s
from gradsync.collectives.cost.profile import Link, Profile
from gradsync.collectives.cost.profiles import get_profile
from gradsync.collectives.cost.topology import Topology
from gradsync.transport import shm_segment as shm_transport
from gradsync.transport.thread import ThreadWorld


@dataclass(frozen=True)
class Variant:
    """An algorithm plus the settings that select one of its paths."""

    algorithm: str
    ranks_per_node: int | None = None  # HierarchicalOptions(ranks_per_node=...)
    short_message_bytes: int | None = None  # override of halving_doubling.SHORT_MESSAGE_BYTES
    segment_bytes: int | None = None  # SegmentOptions(segment_bytes=...)
    shm_region_bytes: int | None = None  # override of gradsync.transport.shm_segment.DEFAULT_REGION_BYTES
    intra_node_algorithm: str = "ring"  # HierarchicalOptions(intra_node_algorithm=...)
    shm_cell_bytes: int | None = None  # override of gradsync.collectives.shm_setup.DEFAULT_CELL_BYTES
    warm_shm: bool = False  # one shm all_reduce first: the segment exists, small calls take the lean path
    # property tests draw numel modulo max_numel + 1 (None: as drawn); tiny cells cost a few barriers each
    max_numel: int | None = None

    def numel(self, drawn: int) -> int:
        return drawn if self.max_numel is None else drawn % (self.max_numel + 1)

    def fits(self, world_size: int) -> bool:
        return self.ranks_per_node is None or world_size % self.ranks_per_node == 0


ALWAYS_SHORT = 2**62
VARIANTS = {
    "ring": Variant("ring"),
    "tree": Variant("tree"),
    "halving_doubling-short": Variant("halving_doubling", short_message_bytes=ALWAYS_SHORT),
    "halving_doubling-long": Variant("halving_doubling", short_message_bytes=0),
    "hierarchical-one-node": Variant("hierarchical"),
    "hierarchical-rpn1": Variant("hierarchical", ranks_per_node=1),
    "hierarchical-rpn2": Variant("hierarchical", ranks_per_node=2),
    "hierarchical-rpn3": Variant("hierarchical", ranks_per_node=3),
    "hierarchical-shm-rpn2": Variant("hierarchical", ranks_per_node=2, intra_node_algorithm="shm"),
    "hierarchical-shm-rpn3": Variant("hierarchical", ranks_per_node=3, intra_node_algorithm="shm"),
    "shm": Variant("shm"),
    "shm-small-regions": Variant("shm", shm_region_bytes=4096),  # several slices, both buffer sets
    # pipelined cells of a few elements each; at most ~200 cells a call (~1 ms each at 8 thread ranks here)
    "shm-tiny-cells": Variant("shm", shm_cell_bytes=24, max_numel=600),
    "shm-lean": Variant("shm", warm_shm=True),  # up to LEAN_MAX_BYTES through the mailboxes, checked there
    "native": Variant("native"),
    "auto": Variant("auto"),
}
# segment_bytes of 1..24 bytes: one to a few elements per segment for every dtype.
TINY_SEGMENT_BYTES = (1, 4, 8, 12, 24)
PIPELINED_VARIANTS = {"ring": Variant("ring"), "tree": Variant("tree"),
                      "hierarchical-rpn2": Variant("hierarchical", ranks_per_node=2),
                      "hierarchical-rpn3": Variant("hierarchical", ranks_per_node=3)}


def test_variants_cover_every_algorithm():
    """The variant table names every algorithm in gradsync.ALGORITHMS (a new one must be added here)."""
    assert {variant.algorithm for variant in VARIANTS.values()} == set(gradsync.ALGORITHMS)


def smallest_world(variant: Variant, at_least: int = 3) -> int:
    """The smallest world size >= ``at_least`` with at least two pretend nodes for ``variant``."""
    nodes_needed = 2 if variant.ranks_per_node else 1
    world_size = at_least
    while not (variant.fits(world_size) and world_size // (variant.ranks_per_node or 1) >= nodes_needed):
        world_size += 1
    return world_size


@contextmanager
def selected_path(variant: Variant):
    """Apply ``variant``'s module-level override for the duration of a run."""
    with pytest.MonkeyPatch.context() as patch:
        if variant.short_message_bytes is not None:
            patch.setattr(halving_doubling, "SHORT_MESSAGE_BYTES", variant.short_message_bytes)
        if variant.shm_region_bytes is not None:
            patch.setattr(shm_transport, "DEFAULT_REGION_BYTES", variant.shm_region_bytes)
        if variant.shm_cell_bytes is not None:
            patch.setattr(shm_setup, "DEFAULT_CELL_BYTES", variant.shm_cell_bytes)
        yield


def _warmed(fn):
    """``fn(comm)`` after one shm all_reduce on ``comm`` (its segment then exists)."""
    def run(comm):
        collectives_api.all_reduce(torch.zeros(1), comm, algorithm="shm")
        return fn(comm)
    return run


def run_variant(variant: Variant, world_size: int, fn, *, segment_bytes: int | None = None, **kwargs):
    """``run_threads(world_size, fn)`` on communicators configured for ``variant``."""
    with selected_path(variant):
        return run_threads(world_size, _warmed(fn) if variant.warm_shm else fn, segment_bytes=segment_bytes or variant.segment_bytes,
                           ranks_per_node=variant.ranks_per_node,
                           intra_node_algorithm=variant.intra_node_algorithm, **kwargs)


def variant_names_for(world_size: int, table=VARIANTS) -> list[str]:
    """Names of the variants of ``table`` that can run on ``world_size`` ranks."""
    return [name for name, variant in table.items() if variant.fits(world_size)]


@st.composite
def world_and_variant(draw, table=VARIANTS, max_world_size=8):
    """(world_size, variant name): the variant first, so every variant is drawn about equally often."""
    name = draw(st.sampled_from(sorted(table)))
    world_size = draw(st.sampled_from([p for p in range(1, max_world_size + 1) if table[name].fits(p)]))
    return world_size, name


@st.composite
def dtype_and_op(draw, dtypes=ALL_DTYPES):
    dtype = draw(st.sampled_from(dtypes))
    op = draw(st.sampled_from(("sum", "avg"))) if dtype in FLOAT_DTYPES else "sum"
    return dtype, op


# ---------------------------------------------------------------- values


# Property tests re-run a failing example many times while shrinking it, so a
# hang must fail fast: a few seconds, far above the milliseconds a call takes.
PROPERTY_COLLECTIVE_TIMEOUT_S = 3.0
PROPERTY_RUN = {"timeout_s": 3 * PROPERTY_COLLECTIVE_TIMEOUT_S,
                "collective_timeout_s": PROPERTY_COLLECTIVE_TIMEOUT_S}


def _check_closed_form(variant, world_size, numel, dtype, op, segment_bytes=None, **run_options):
    """Run ``variant`` on closed-form inputs; every rank must hold the closed form, bitwise."""
    expected = closed_form_result(numel, world_size, dtype, op)
    inputs = [closed_form_input(numel, rank, world_size, dtype) for rank in range(world_size)]
    assert_bitwise_equal(reference_all_reduce(inputs, op), expected, "stacked reference vs closed form")

    def rank_fn(comm):
        tensor = inputs[comm.rank].clone()
        returned = gradsync.all_reduce(tensor, op=op, algorithm=variant.algorithm, group=comm)
        assert returned is tensor, "all_reduce must work in place and return its argument"
        return tensor

    results = run_variant(variant, world_size, rank_fn, segment_bytes=segment_bytes, **run_options)
    for rank, result in enumerate(results):
        assert_bitwise_equal(result, expected, f"rank {rank}")


@settings(max_examples=3 * settings().max_examples)
@given(world_variant=world_and_variant(), numel=st.integers(min_value=0, max_value=5000),
       dtype_op=dtype_and_op())
@example(world_variant=(8, "shm-tiny-cells"), numel=3459, dtype_op=(torch.float64, "sum"))  # CI: over 3 s
def test_algorithms_match_closed_form_on_every_rank(world_variant, numel, dtype_op):
    """Every variant, p 1..8, numel 0..5000 (a variant's max_numel), every dtype, sum/avg: each rank holds
    the exact closed form."""
    (world_size, name), (dtype, op) = world_variant, dtype_op
    _check_closed_form(VARIANTS[name], world_size, VARIANTS[name].numel(numel), dtype, op, **PROPERTY_RUN)


ALGORITHMS = gradsync.ALGORITHMS
WORLD_SIZES = (1, 2, 3, 4, 5, 7)
DTYPE_OPS = [(dtype, "sum") for dtype in ALL_DTYPES] + [(dtype, "avg") for dtype in FLOAT_DTYPES]
# ring and native run the whole dtype grid; the other algorithms share the
# dtype plumbing of the public layer, so a float, a float32-accumulated and an
# integer dtype (plus avg) keep the grid's runtime reasonable.
FULL_DTYPE_ALGORITHMS = ("ring", "native")
REDUCED_DTYPE_OPS = [(torch.float32, "sum"), (torch.float32, "avg"), (torch.float16, "sum"),
                     (torch.int64, "sum")]


def numels_for(world_size):
    """The numel cases: empty, one element, fewer than world_size, not divisible, large."""
    return sorted({0, 1, max(world_size - 1, 0), world_size + 1, 1000})


def _failures(outcomes, expected, what):
    """Every (rank, case) whose result differs bitwise from ``expected[case]``, one line each."""
    lines = []
    for rank, results in enumerate(outcomes):
        for case, result in results.items():
            difference = bitwise_difference(result, expected[case])
            if difference:
                lines.append(f"rank {rank} {what} {case}: {difference}")
    return lines


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

    failures = _failures(run_threads(world_size, rank_fn), expected, algorithm)
    assert not failures, "\n".join(failures)


@given(world_variant=world_and_variant(table=PIPELINED_VARIANTS),
       numel=st.integers(min_value=0, max_value=300), dtype_op=dtype_and_op(),
       segment_bytes=st.sampled_from(TINY_SEGMENT_BYTES))
def test_pipelined_algorithms_match_closed_form_with_tiny_segments(world_variant, numel, dtype_op,
                                                                   segment_bytes):
    """Ring, tree and hierarchical cut into segments of 1..24 bytes still give the exact closed form."""
    (world_size, name), (dtype, op) = world_variant, dtype_op
    _check_closed_form(PIPELINED_VARIANTS[name], world_size, numel, dtype, op, segment_bytes, **PROPERTY_RUN)


RANDOM_FLOAT_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
                          torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@given(world_variant=world_and_variant(), numel=st.integers(min_value=0, max_value=5000),
       dtype_op=dtype_and_op(dtypes=FLOAT_DTYPES), seed=st.integers(min_value=0, max_value=2**31 - 1),
       tiny_segments=st.booleans())
def test_algorithms_random_floats_bitwise_equal_across_ranks(world_variant, numel, dtype_op, seed,
                                                             tiny_segments):
    """Random floats: every variant's result is bitwise the same on every rank and close to the float64 sum."""
    (world_size, name), (dtype, op) = world_variant, dtype_op
    numel = VARIANTS[name].numel(numel)
    if tiny_segments:
        numel = numel % 301  # thousands of one-element messages would only slow the test down
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(numel, generator=generator).to(dtype) for _ in range(world_size)]
    reference = torch.stack([tensor.double() for tensor in inputs]).sum(0)
    if op == "avg":
        reference /= world_size

    def rank_fn(comm):
        return gradsync.all_reduce(inputs[comm.rank].clone(), op=op, algorithm=VARIANTS[name].algorithm,
                                   group=comm)

    results = run_variant(VARIANTS[name], world_size, rank_fn, segment_bytes=8 if tiny_segments else None,
                          **PROPERTY_RUN)
    for rank, result in enumerate(results):
        assert_bitwise_equal(result, results[0], f"rank {rank} vs rank 0")
    rtol, atol = RANDOM_FLOAT_TOLERANCE[dtype]
    torch.testing.assert_close(results[0].double(), reference, rtol=rtol, atol=atol)


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

    failures = _failures(run_threads(world_size, rank_fn), expected, algorithm)
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
    _check_closed_form(variant, world_size, MILLION, dtype, "sum")


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
    failures = _failures(run_threads(4, rank_fn), expected, algorithm)
    assert not failures, "\n".join(failures)


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


# ---------------------------------------------------------------- broadcast, all_gather, reduce_scatter


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast_copies_src_tensor_to_every_rank(world_size):
    """After broadcast from each src in turn (one group) every rank holds rank src's tensor, in place."""
    inputs = [torch.arange(6, dtype=torch.float32) * 10 + rank for rank in range(world_size)]

    def rank_fn(comm):
        results = {}
        for src in range(world_size):
            tensor = inputs[comm.rank].clone()
            assert gradsync.broadcast(tensor, src=src, group=comm) is tensor
            results[src] = tensor
        return results

    failures = _failures(run_threads(world_size, rank_fn), dict(enumerate(inputs)), "broadcast from src")
    assert not failures, "\n".join(failures)


def test_broadcast_handles_dtypes_numels_and_strided_views():
    """Broadcast from rank 2 of 4 into a strided view copies the data and leaves other storage alone."""
    world_size, src = 4, 2
    cases = [(dtype, numel) for dtype in (torch.int8, torch.uint8, torch.bfloat16, torch.float64)
             for numel in (0, 1, 7)]
    inputs = {case: [closed_form_input(case[1], rank, world_size, case[0]) for rank in range(world_size)]
              for case in cases}

    def rank_fn(comm):
        bases = {}
        for case in cases:
            base, view = strided_column_view(inputs[case][comm.rank])
            gradsync.broadcast(view, src=src, group=comm)
            bases[case] = base
        return bases

    for rank, bases in enumerate(run_threads(world_size, rank_fn)):
        for case, base in bases.items():
            assert_bitwise_equal(base[:, 1], inputs[case][src], f"rank {rank} {case}")
            assert (base[:, 0] == SENTINEL).all() and (base[:, 2] == SENTINEL).all(), f"rank {rank} {case}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 7])
def test_all_gather_returns_every_rank_tensor_by_rank(world_size):
    """all_gather returns world_size tensors, index k holding rank k's (2, 3) input, on every rank (3 dtypes)."""
    dtypes = (torch.float32, torch.int8, torch.bfloat16)
    inputs = {dtype: [(torch.arange(6).reshape(2, 3) * world_size + rank).to(dtype) for rank in range(world_size)]
              for dtype in dtypes}

    def rank_fn(comm):
        results = {}
        for dtype in dtypes:
            tensor = inputs[dtype][comm.rank].clone()
            results[dtype] = gradsync.all_gather(tensor, group=comm)
            assert_bitwise_equal(tensor, inputs[dtype][comm.rank], "input after all_gather")
        return results

    for rank, results in enumerate(run_threads(world_size, rank_fn)):
        for dtype, gathered in results.items():
            assert len(gathered) == world_size
            for source, part in enumerate(gathered):
                assert_bitwise_equal(part, inputs[dtype][source], f"rank {rank} {dtype}, part {source}")


@pytest.mark.parametrize("world_size", [1, 3])
def test_all_gather_of_empty_tensor_returns_empty_tensors(world_size):
    """all_gather of a (0, 2) tensor returns world_size empty (0, 2) tensors."""
    def rank_fn(comm):
        return gradsync.all_gather(torch.zeros(0, 2), group=comm)

    for gathered in run_threads(world_size, rank_fn):
        assert [tuple(part.shape) for part in gathered] == [(0, 2)] * world_size


RS_DTYPE_OPS = [(torch.float32, "sum"), (torch.float64, "avg"), (torch.float16, "sum"), (torch.int16, "sum")]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_returns_tensor_split_chunk_of_sum(world_size):
    """Rank r gets chunk r (torch.tensor_split order) of the exact sum; its input is not modified.

    Every numel (0, 1, p-1, p+1, 1000) x dtype/op runs on one group per world size.
    """
    cases = [(numel, dtype, op) for numel in numels_for(world_size) for dtype, op in RS_DTYPE_OPS]
    inputs = {case: [closed_form_input(case[0], rank, world_size, case[1]) for rank in range(world_size)]
              for case in cases}
    chunks = {case: torch.tensor_split(reference_all_reduce(inputs[case], case[2]), world_size) for case in cases}

    def rank_fn(comm):
        results = {}
        for case in cases:
            tensor = inputs[case][comm.rank].clone()
            results[case] = gradsync.reduce_scatter(tensor, op=case[2], group=comm)
            assert_bitwise_equal(tensor, inputs[case][comm.rank], f"input after reduce_scatter {case}")
        return results

    for rank, results in enumerate(run_threads(world_size, rank_fn)):
        for case, chunk in results.items():
            assert_bitwise_equal(chunk, chunks[case][rank], f"rank {rank} {case}")


def test_reduce_scatter_flattens_multidimensional_input():
    """A (3, 5) input is flattened before splitting: rank r gets tensor_split(sum.flatten(), p)[r]."""
    world_size = 4
    inputs = [closed_form_input(15, rank, world_size, torch.float32).reshape(3, 5) for rank in range(world_size)]
    chunks = torch.tensor_split(reference_all_reduce(inputs, "sum").flatten(), world_size)

    def rank_fn(comm):
        return gradsync.reduce_scatter(inputs[comm.rank].clone(), group=comm)

    for rank, chunk in enumerate(run_threads(world_size, rank_fn)):
        assert_bitwise_equal(chunk, chunks[rank], f"rank {rank}")


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


def test_run_threads_reports_failing_rank():
    """The helper re-raises a rank's exception naming that rank (so failures are attributable)."""
    def rank_fn(comm):
        if comm.rank == 1:
            raise KeyError("boom")
        return comm.rank

    with pytest.raises(RankError, match="rank 1 raised KeyError") as info:
        run_threads(2, rank_fn)
    assert info.value.rank == 1


# ---------------------------------------------------------------- payload bytes


def split_numels(numel: int, parts: int) -> list[int]:
    """Chunk sizes as torch.tensor_split cuts ``numel`` elements into ``parts``."""
    return [piece.numel() for piece in torch.tensor_split(torch.empty(numel), parts)]


def payload_stats(variant: Variant, world_size: int, numel: int, dtype=torch.float32, segment_bytes=None):
    """Each rank's TransportStats dict after one all_reduce of ``numel`` elements."""
    def rank_fn(comm):
        gradsync.all_reduce(torch.ones(numel, dtype=dtype), algorithm=variant.algorithm, group=comm)
        return comm.stats.as_dict()

    return run_variant(variant, world_size, rank_fn, segment_bytes=segment_bytes)


def assert_conserved(all_stats):
    """Every payload byte sent is received by someone, and the layout check counts as control."""
    assert sum(s["bytes_sent"] for s in all_stats) == sum(s["bytes_received"] for s in all_stats)
    assert all(s["control_bytes_sent"] > 0 for s in all_stats), all_stats


def ring_sent_numel(numel: int, world_size: int, rank: int) -> int:
    """Ring rank r sends every chunk but its own (reduce-scatter) and every chunk but r+1's (all-gather)."""
    chunks = split_numels(numel, world_size)
    return 2 * numel - chunks[rank] - chunks[(rank + 1) % world_size]


def payload_stats_per_call(variant: Variant, world_size: int, calls, segment_bytes=None):
    """Per rank, one TransportStats difference per ``(numel, dtype)`` all_reduce of ``calls``, run on one group."""
    def rank_fn(comm):
        differences = []
        for numel, dtype in calls:
            before = comm.stats.as_dict()
            gradsync.all_reduce(torch.ones(numel, dtype=dtype), algorithm=variant.algorithm, group=comm)
            differences.append({key: value - before[key] for key, value in comm.stats.as_dict().items()})
        return differences

    outcomes = run_variant(variant, world_size, rank_fn, segment_bytes=segment_bytes)
    return [[outcome[index] for outcome in outcomes] for index in range(len(calls))]


RING_PAYLOAD_CALLS = [(numel, dtype) for numel in (1, 2, 840, 1001) for dtype in (torch.float32, torch.float64)]


@pytest.mark.parametrize("segment_bytes", [8, 100, 2**20])
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 7])
def test_ring_all_reduce_payload_bytes_match_formula(world_size, segment_bytes):
    """Ring rank r sends (2n - c_r - c_(r+1)) elements and receives (2n - c_(r-1) - c_r), one message per
    segment whatever segment_bytes; 2(p-1)n in total (2(p-1)/p·n per rank when p divides n); the layout
    check goes to control bytes. numel 1, 2, 840, 1001 in float32 and float64, on one group."""
    per_call = payload_stats_per_call(Variant("ring"), world_size, RING_PAYLOAD_CALLS, segment_bytes)
    for (numel, dtype), all_stats in zip(RING_PAYLOAD_CALLS, per_call):
        element_nbytes = torch.tensor([], dtype=dtype).element_size()
        segment_numel = max(1, segment_bytes // element_nbytes)
        chunks = split_numels(numel, world_size)
        for rank, stats in enumerate(all_stats):
            what = f"rank {rank} numel={numel} {dtype}: {stats}"
            left, right = (rank - 1) % world_size, (rank + 1) % world_size
            assert stats["bytes_sent"] == element_nbytes * ring_sent_numel(numel, world_size, rank), what
            received = 2 * numel - chunks[left] - chunks[rank]
            assert stats["bytes_received"] == element_nbytes * received, what
            sent_chunks = [c for index, c in enumerate(chunks) if index != rank] + \
                          [c for index, c in enumerate(chunks) if index != right]
            segments = sum(math.ceil(c / segment_numel) for c in sent_chunks)
            assert stats["messages_sent"] == segments, f"{what}, expected {segments} segments"
            if numel % world_size == 0:
                assert stats["bytes_sent"] * world_size == 2 * (world_size - 1) * numel * element_nbytes, what
        assert sum(s["bytes_sent"] for s in all_stats) == element_nbytes * 2 * (world_size - 1) * numel
        assert_conserved(all_stats)


def tree_children(rank: int, world_size: int) -> list[int]:
    return [child for child in (2 * rank + 1, 2 * rank + 2) if child < world_size]


@pytest.mark.parametrize("segment_bytes", [40, 2**20])
@pytest.mark.parametrize("numel", [840, 1001])
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 8])
def test_tree_all_reduce_payload_bytes_match_formula(world_size, numel, segment_bytes):
    """Tree: a rank sends n to its parent (not the root) and n to each child; 2(p-1)n in total, per segment."""
    all_stats = payload_stats(Variant("tree"), world_size, numel, segment_bytes=segment_bytes)
    segments = math.ceil(numel / max(1, segment_bytes // 4))
    for rank, stats in enumerate(all_stats):
        links = (rank > 0) + len(tree_children(rank, world_size))  # parent + children
        assert stats["bytes_sent"] == 4 * numel * links, f"rank {rank}: {stats}"
        assert stats["bytes_received"] == 4 * numel * links, f"rank {rank}: {stats}"
        assert stats["messages_sent"] == segments * links, f"rank {rank}: {stats}"
    assert sum(s["bytes_sent"] for s in all_stats) == 4 * 2 * (world_size - 1) * numel
    assert_conserved(all_stats)


def fold_layout(world_size: int) -> tuple[int, int]:
    """(p', extra): the largest power of two <= p and the number of ranks folded into it."""
    core_size = 2 ** int(math.log2(world_size))
    return core_size, world_size - core_size


@pytest.mark.parametrize("path", ["short", "long"])
@pytest.mark.parametrize("numel", [840, 1001, 3])
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 7, 8])
def test_halving_doubling_payload_bytes_match_formula(world_size, numel, path):
    """Core ranks send log2(p')·n (short, or n < p') or 2(p'-1)/p'·n (long, p' | n); folds add n each way."""
    variant = VARIANTS[f"halving_doubling-{path}"]
    all_stats = payload_stats(variant, world_size, numel)
    core_size, extra = fold_layout(world_size)
    if numel < core_size:
        path = "short"  # fewer elements than core ranks: recursive doubling whatever the byte count
    log2_core = int(math.log2(core_size))
    core_total = core_size * log2_core * numel if path == "short" else 2 * (core_size - 1) * numel
    for rank, stats in enumerate(all_stats):
        folded_away = rank < 2 * extra and rank % 2 == 0  # sends n once, then waits for the result
        folded_into = rank < 2 * extra and rank % 2 == 1  # core member that also returns the result
        if folded_away:
            expected = numel
        elif path == "short":
            expected = log2_core * numel + folded_into * numel
        elif numel % core_size == 0:
            expected = 2 * (core_size - 1) * numel // core_size + folded_into * numel
        else:
            continue  # uneven halves: only the total has a closed form
        assert stats["bytes_sent"] == 4 * expected, f"rank {rank}: {stats}"
    assert sum(s["bytes_sent"] for s in all_stats) == 4 * (core_total + 2 * extra * numel)
    assert_conserved(all_stats)


def test_halving_doubling_power_of_two_paths_match_published_costs():
    """p = 8, n = 840: the long path sends 2(p-1)/p·n per rank, the short path log2(p)·n, as in Thakur et al."""
    long_path = payload_stats(VARIANTS["halving_doubling-long"], 8, 840)
    short_path = payload_stats(VARIANTS["halving_doubling-short"], 8, 840)
    assert [s["bytes_sent"] for s in long_path] == [4 * 2 * 7 * 840 // 8] * 8
    assert [s["bytes_sent"] for s in short_path] == [4 * 3 * 840] * 8


def hierarchical_sent_numel(numel: int, world_size: int, ranks_per_node: int, rank: int) -> int:
    """Intra-node ring reduce-scatter + inter-node ring all-reduce of chunk l + intra-node ring all-gather."""
    node, local_rank = divmod(rank, ranks_per_node)
    nodes = world_size // ranks_per_node
    local_chunks = split_numels(numel, ranks_per_node)
    reduce_scatter = numel - local_chunks[local_rank]  # every local chunk but its own
    all_gather = numel - local_chunks[(local_rank + 1) % ranks_per_node]  # every one but the right's
    return reduce_scatter + ring_sent_numel(local_chunks[local_rank], nodes, node) + all_gather


@pytest.mark.parametrize("numel", [840, 1001, 5])
@pytest.mark.parametrize("world_size,ranks_per_node", [(4, 1), (4, 2), (4, 4), (6, 2), (6, 3), (8, 2), (8, 4)])
def test_hierarchical_all_reduce_payload_bytes_match_phases(world_size, ranks_per_node, numel):
    """Hierarchical sends the sum of its three ring phases per rank, and 2(p-1)n in total like a flat ring."""
    all_stats = payload_stats(Variant("hierarchical", ranks_per_node=ranks_per_node), world_size, numel)
    for rank, stats in enumerate(all_stats):
        expected = hierarchical_sent_numel(numel, world_size, ranks_per_node, rank)
        assert stats["bytes_sent"] == 4 * expected, f"rank {rank}: {stats}"
    assert sum(s["bytes_sent"] for s in all_stats) == 4 * 2 * (world_size - 1) * numel
    assert_conserved(all_stats)


def test_hierarchical_sends_one_node_share_across_nodes():
    """2 nodes of 2 ranks, n elements: each rank sends only n/2 to the other node (a flat ring would send more)."""
    world_size, ranks_per_node, numel = 4, 2, 840
    inter_node_bytes = [0] * world_size

    def rank_fn(comm):
        transport = comm.transport
        plain_isend = transport.isend

        def counting_isend(tensor, peer):
            if peer // ranks_per_node != transport.rank // ranks_per_node:
                inter_node_bytes[transport.rank] += tensor.numel() * tensor.element_size()
            return plain_isend(tensor, peer)

        transport.isend = counting_isend
        collectives_api.all_reduce(torch.ones(numel), comm, algorithm="hierarchical", verify=False)

    run_threads(world_size, rank_fn, ranks_per_node=ranks_per_node)
    # Local chunk l (n/2 elements) is ring-all-reduced by the 2 ranks of local rank l: n/2 sent each.
    assert inter_node_bytes == [4 * numel // 2] * world_size


@pytest.mark.parametrize("name", sorted(variant_names_for(4)))
def test_algorithms_empty_tensor_sends_no_payload(name):
    """An empty all_reduce moves no payload bytes for any variant (the layout check is control traffic)."""
    variant = VARIANTS[name]
    if variant.warm_shm:  # the segment exists: the layout check goes through it, nothing point-to-point
        [all_stats] = payload_stats_per_call(variant, 4, [(0, torch.float32)])
        assert all(not any(stats.values()) for stats in all_stats), all_stats
        return
    all_stats = payload_stats(variant, 4, 0)
    for rank, stats in enumerate(all_stats):
        assert stats["bytes_sent"] == 0 and stats["bytes_received"] == 0, f"rank {rank}: {stats}"
    assert_conserved(all_stats)


def test_all_reduce_alone_sends_nothing():
    """p = 1: an empty or non-empty all_reduce sends no payload and no control bytes (there is no peer)."""
    for numel in (0, 10):
        [stats] = payload_stats(VARIANTS["ring"], 1, numel)
        assert stats["bytes_sent"] == stats["bytes_received"] == stats["control_bytes_sent"] == 0, stats


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
STEP_WORDS = {"ring": ("hop",), "tree": ("segment",), "halving_doubling": ("distance", "fold"),
              "hierarchical": ("hop",), "native": ("backend",)}
TIMEOUT_VARIANTS = {  # one per algorithm and path; hierarchical spans two nodes at p = 4
    "ring": lambda p: Variant("ring"),
    "tree": lambda p: Variant("tree"),
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


# ---------------------------------------------------------------- auto

SMALL = 4 * 2**20  # a message well into the bandwidth-bound range at these world sizes
PAIR_SMALL = 2**20


def _model_choice(nbytes, host_sizes, candidates, profile):
    """The candidate with the least predicted time, computed here from the formulas."""
    topology = Topology(tuple(host_sizes))
    return min(candidates, key=lambda name: predict_s(name, profile, topology, nbytes - nbytes % 4))


@pytest.mark.parametrize("profile_name", ["this-machine", "test-hosts", "h100-ib"])
@pytest.mark.parametrize("nbytes", [4, 4096, 65536, 2**20, 16 * 2**20, 2**28])
@pytest.mark.parametrize("host_sizes", [(2,), (3,), (4,), (8,), (2, 2), (1, 1, 1, 1), (4, 4)])
def test_auto_choose_follows_the_cost_model(nbytes, host_sizes, profile_name):
    """choose picks the algorithm whose formula predicts the least time on the group's topology."""
    profile = get_profile(profile_name)
    several = len(host_sizes) > 1
    if several and profile.inter is None:
        return
    world_size = sum(host_sizes)
    flat = ("ring", "tree", "halving_doubling")
    for shm_available in (None, False):
        candidates = flat + (("hierarchical",) if several else ()) + \
            (("shm",) if not several and shm_available is None and profile.shm else ())
        expected = _model_choice(nbytes, host_sizes, candidates, profile)
        chosen = auto.choose(nbytes, world_size, 1 if several else world_size, shm_available=shm_available,
                             host_sizes=host_sizes if several else None, profile=profile)
        assert chosen == expected, (nbytes, host_sizes, shm_available)


def test_auto_moves_from_latency_to_bandwidth_algorithms_as_messages_grow():
    """On a slow-start link the short messages go to a log-step algorithm and the long ones to the ring,
    whose per-link bytes are the least: the crossover the thresholds used to encode, now from the model."""
    profile = Profile("t", "", Link(1e-3, 1e9), None, 1e-10, 1e-10, ranks_per_host=8)
    picks = [auto.choose(nbytes, 8, 8, shm_available=False, profile=profile) for nbytes in (4096, 2**30)]
    assert picks[0] in ("tree", "halving_doubling") and picks[1] == "ring"
    assert auto.choose(2**30, 1, 1, profile=profile) == "ring"


@pytest.mark.parametrize("nbytes", [4, 2**20, 2**30])
def test_auto_never_picks_shm_where_it_cannot_run(nbytes):
    """shm only when every rank shares one node and shared memory is not known to be unavailable."""
    assert auto.choose(nbytes, 4, 4, shm_available=False) != "shm"
    assert auto.choose(nbytes, 4, 2) != "shm"  # pretend nodes
    assert auto.choose(nbytes, 4, 1, shm_available=False, host_sizes=(2, 2)) != "shm"
    assert auto.choose(nbytes, 1, 1) == "ring"


@given(nbytes=st.integers(min_value=0, max_value=2**40), world_size=st.integers(min_value=1, max_value=64),
       nodes=st.integers(min_value=1, max_value=8))
def test_auto_choose_returns_a_concrete_algorithm(nbytes, world_size, nodes):
    """choose always names a point-to-point algorithm in ALGORITHMS (never auto or native)."""
    ranks_per_node = max(world_size // nodes, 1)
    chosen = auto.choose(nbytes, world_size, ranks_per_node)
    assert chosen in gradsync.ALGORITHMS and chosen not in ("auto", "native")


AUTO_CASES = {  # id -> (world_size, ranks_per_node, numel): what auto should choose for it
    "small-p4": (4, None, 1000),
    "large-p4": (4, None, SMALL // 4 + 1),
    "large-p4-two-nodes": (4, 2, SMALL // 4 + 1),
    "large-p2": (2, None, PAIR_SMALL // 4 + 1),
    "small-p2": (2, None, 33),
    "small-p5": (5, None, 17),
}


@pytest.mark.parametrize("case", sorted(AUTO_CASES))
def test_auto_all_reduce_sums_and_moves_the_bytes_of_its_choice(case):
    """algorithm='auto' gives the exact sum and exactly the payload bytes of the algorithm choose() names."""
    world_size, ranks_per_node, numel = AUTO_CASES[case]
    chosen = auto.choose(numel * 4, world_size, ranks_per_node or world_size)
    expected = closed_form_result(numel, world_size, torch.float32, "sum")

    def rank_fn(algorithm):
        def run(comm):
            tensor = closed_form_input(numel, comm.rank, world_size, torch.float32)
            gradsync.all_reduce(tensor, algorithm=algorithm, group=comm)
            return tensor, comm.stats.bytes_sent
        return run

    auto_results = run_threads(world_size, rank_fn("auto"), ranks_per_node=ranks_per_node)
    chosen_results = run_threads(world_size, rank_fn(chosen), ranks_per_node=ranks_per_node)
    for rank, ((result, auto_bytes), (_, chosen_bytes)) in enumerate(zip(auto_results, chosen_results)):
        assert_bitwise_equal(result, expected, f"rank {rank}")
        assert auto_bytes == chosen_bytes, f"rank {rank}: auto sent {auto_bytes} B, {chosen} sends {chosen_bytes} B"


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


def test_inter_node_auto_is_halving_doubling_over_a_power_of_two_number_of_nodes_else_ring():
    """The default across nodes: halving_doubling at 1, 2, 4, 8 nodes; ring at 3, 5, 6; explicit choices kept."""
    options = HierarchicalOptions()
    assert options.inter_node_algorithm == "auto"
    assert [options.inter_for(nodes) for nodes in (1, 2, 3, 4, 5, 6, 8)] == [
        "halving_doubling", "halving_doubling", "ring", "halving_doubling", "ring", "ring", "halving_doubling"]
    assert HierarchicalOptions(inter_node_algorithm="tree").inter_for(4) == "tree"


def test_communicator_rejects_unknown_inter_node_algorithm():
    """inter_node_algorithm must be one hierarchical can run across nodes (not itself, not shm)."""
    for name in ("hierarchical", "shm"):
        with pytest.raises(ValueError, match="ring, tree, halving_doubling, native"):
            Communicator(ThreadWorld(2).transport(0), options=[HierarchicalOptions(inter_node_algorithm=name)])


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ["ring", "halving_doubling"])
def test_receives_are_posted_before_the_first_send(name, world_size):
    """Gloo moves a payload only into a posted receive: a send posted first costs a notify round trip
    that waits behind the link's queue (ring reached 59% of a shaped 1 Gbit/s link, 99% receive-first).
    Every rank posts a receive before its first payload send, for short and long messages."""
    orders = [[] for _ in range(world_size)]

    def rank_fn(comm):
        transport = comm.transport
        for method in ("isend", "irecv", "isend_tagged", "irecv_tagged"):
            plain = getattr(transport, method)

            def recording(*args, _plain=plain, _kind=method.startswith("isend")):
                orders[transport.rank].append("send" if _kind else "recv")
                return _plain(*args)

            setattr(transport, method, recording)
        for numel in (16, halving_doubling.SHORT_MESSAGE_BYTES // 4 + 64):
            start = len(orders[comm.rank])
            collectives_api.all_reduce(torch.ones(numel), comm, algorithm=name, verify=False)
            orders[comm.rank].append(orders[comm.rank][start:])

    run_threads(world_size, rank_fn)
    for rank, recorded in enumerate(orders):
        for order in (entry for entry in recorded if isinstance(entry, list)):
            assert order and order[0] == "recv", f"rank {rank} posted {order[:4]} first"
