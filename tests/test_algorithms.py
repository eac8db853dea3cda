"""Every AllReduce algorithm over the in-process thread transport: values, bytes, errors.

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
from hypothesis import given, settings
from hypothesis import strategies as st

import gradsync
from _dist import capture, run_threads
from _reference import (ALL_DTYPES, FLOAT_DTYPES, SENTINEL, assert_bitwise_equal, closed_form_input,
                        closed_form_result, reference_all_reduce, strided_column_view, transposed_view)
from _strict_transport import MODES, StrictWorld
from gradsync import CollectiveMismatchError, CollectiveTimeoutError, Communicator
from gradsync.collectives import ops as collectives_api
from gradsync.collectives import HierarchicalOptions, SegmentOptions, auto, halving_doubling
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
        yield


def run_variant(variant: Variant, world_size: int, fn, *, segment_bytes: int | None = None, **kwargs):
    """``run_threads(world_size, fn)`` on communicators configured for ``variant``."""
    with selected_path(variant):
        return run_threads(world_size, fn, segment_bytes=segment_bytes or variant.segment_bytes,
                           ranks_per_node=variant.ranks_per_node,
                           intra_node_algorithm=variant.intra_node_algorithm, **kwargs)


def variant_names_for(world_size: int, table=VARIANTS) -> list[str]:
    """Names of the variants of ``table`` that can run on ``world_size`` ranks."""
    return [name for name, variant in table.items() if variant.fits(world_size)]


@st.composite
def world_and_variant(draw, table=VARIANTS, max_world_size=6):
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
def test_algorithms_match_closed_form_on_every_rank(world_variant, numel, dtype_op):
    """Every variant, p 1..6, numel 0..5000, every dtype, sum/avg: each rank holds the exact closed form."""
    (world_size, name), (dtype, op) = world_variant, dtype_op
    _check_closed_form(VARIANTS[name], world_size, numel, dtype, op, **PROPERTY_RUN)


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


NON_CONTIGUOUS_VARIANTS = dict(VARIANTS, **{"ring-segmented": Variant("ring", segment_bytes=8),
                                            "tree-segmented": Variant("tree", segment_bytes=8)})


@pytest.mark.parametrize("layout", [strided_column_view, transposed_view], ids=["strided-column", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64], ids=str)
@pytest.mark.parametrize("name", sorted(NON_CONTIGUOUS_VARIANTS))
def test_algorithms_write_result_through_non_contiguous_view(name, dtype, layout):
    """A non-contiguous input gets the exact sum written back through the view; other storage is untouched."""
    variant = NON_CONTIGUOUS_VARIANTS[name]
    world_size, numel = smallest_world(variant, at_least=4), 30
    expected = closed_form_result(numel, world_size, dtype, "sum")

    def rank_fn(comm):
        base, view = layout(closed_form_input(numel, comm.rank, world_size, dtype))
        assert not view.is_contiguous()
        gradsync.all_reduce(view, algorithm=variant.algorithm, group=comm)
        return base, view

    for rank, (base, view) in enumerate(run_variant(variant, world_size, rank_fn)):
        if layout is strided_column_view:
            assert_bitwise_equal(view, expected, f"rank {rank} view")
            assert (base[:, 0] == SENTINEL).all() and (base[:, 2] == SENTINEL).all(), f"rank {rank}"
        else:
            assert_bitwise_equal(base, expected.reshape(3, -1), f"rank {rank} storage")


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


@pytest.mark.parametrize("segment_bytes", [8, 100, 2**20])
@pytest.mark.parametrize("numel", [840, 1001, 2])
@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_ring_all_reduce_payload_bytes_do_not_depend_on_segment_bytes(world_size, numel, segment_bytes):
    """Segmented ring sends 2n - c_r - c_(r+1) elements per rank, one message per segment, 2(p-1)n in total."""
    all_stats = payload_stats(Variant("ring"), world_size, numel, segment_bytes=segment_bytes)
    segment_numel = max(1, segment_bytes // 4)
    chunks = split_numels(numel, world_size)
    for rank, stats in enumerate(all_stats):
        assert stats["bytes_sent"] == 4 * ring_sent_numel(numel, world_size, rank), f"rank {rank}: {stats}"
        sent_chunks = [c for index, c in enumerate(chunks) if index != rank] + \
                      [c for index, c in enumerate(chunks) if index != (rank + 1) % world_size]
        segments = sum(math.ceil(c / segment_numel) for c in sent_chunks)
        assert stats["messages_sent"] == segments, f"rank {rank}: {stats}, expected {segments} segments"
    assert sum(s["bytes_sent"] for s in all_stats) == 4 * 2 * (world_size - 1) * numel
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
    all_stats = payload_stats(VARIANTS[name], 4, 0)
    for rank, stats in enumerate(all_stats):
        assert stats["bytes_sent"] == 0 and stats["bytes_received"] == 0, f"rank {rank}: {stats}"
    assert_conserved(all_stats)


# ---------------------------------------------------------------- mismatches across ranks

MISMATCHES = {  # kind -> tensor for (odd rank?)
    "numel": lambda odd: torch.ones(5 if odd else 4),
    "shape-same-numel": lambda odd: torch.ones((3, 2) if odd else (2, 3)),
    "dtype": lambda odd: torch.ones(4, dtype=torch.float64 if odd else torch.float32),
}


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_algorithms_mismatch_raises_on_every_rank_and_group_recovers(name, kind):
    """One rank's odd layout raises CollectiveMismatchError everywhere; tensors untouched; the next call works."""
    variant = VARIANTS[name]
    world_size = smallest_world(variant)
    odd_rank = world_size - 1

    def rank_fn(comm):
        tensor = MISMATCHES[kind](comm.rank == odd_rank) * (comm.rank + 2)
        before = tensor.clone()
        exc, _ = capture(lambda: gradsync.all_reduce(tensor, algorithm=variant.algorithm, group=comm))
        follow_up = gradsync.all_reduce(torch.full((7,), comm.rank + 1.0), algorithm=variant.algorithm,
                                        group=comm)
        return exc, tensor, before, follow_up

    expected_follow_up = torch.full((7,), world_size * (world_size + 1) / 2)
    for rank, (exc, tensor, before, follow_up) in enumerate(run_variant(variant, world_size, rank_fn)):
        assert isinstance(exc, CollectiveMismatchError), f"rank {rank}: {exc!r}"
        assert_bitwise_equal(tensor, before, f"rank {rank} tensor after the failed call")
        assert_bitwise_equal(follow_up, expected_follow_up, f"rank {rank} follow-up all_reduce")


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

SMALL = auto.SMALL_MESSAGE_BYTES


PAIR_SMALL = auto.PAIR_SMALL_MESSAGE_BYTES


@pytest.mark.parametrize("nbytes,world_size,ranks_per_node,expected", [
    (0, 1, 1, "ring"),
    (2**40, 1, 1, "ring"),
    (0, 2, 2, "halving_doubling"),
    (PAIR_SMALL, 2, 2, "halving_doubling"),
    (PAIR_SMALL + 1, 2, 2, "ring"),
    (2**30, 2, 1, "ring"),
    (0, 3, 3, "tree"),
    (SMALL, 3, 3, "tree"),
    (SMALL + 1, 3, 3, "ring"),
    (SMALL, 8, 4, "tree"),
    (SMALL + 1, 8, 4, "hierarchical"),
    (SMALL + 1, 4, 2, "hierarchical"),
    (SMALL + 1, 4, 1, "ring"),
    (SMALL + 1, 4, 4, "ring"),
])
def test_auto_choose_follows_documented_thresholds(nbytes, world_size, ranks_per_node, expected):
    """choose without shared memory: p = 2 -> halving_doubling then ring; p >= 3 small -> tree;
    large -> hierarchical across nodes, else ring."""
    assert auto.choose(nbytes, world_size, ranks_per_node, shm_available=False) == expected


@pytest.mark.parametrize("nbytes,world_size,ranks_per_node,shm_available,expected", [
    (4, 2, 2, None, "shm"), (2**30, 4, 4, True, "shm"), (4, 1, 1, None, "ring"),
    (4, 4, 2, None, "tree"), (4, 2, 2, False, "halving_doubling"),
])
def test_auto_prefers_shm_when_all_ranks_share_a_node(nbytes, world_size, ranks_per_node, shm_available,
                                                       expected):
    assert auto.choose(nbytes, world_size, ranks_per_node, shm_available) == expected


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


@pytest.mark.parametrize("inter_node", ["ring", "tree", "halving_doubling"])
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


def test_communicator_rejects_unknown_inter_node_algorithm():
    """inter_node_algorithm must be one hierarchical can run across nodes (not native, not itself)."""
    with pytest.raises(ValueError, match="ring, tree, halving_doubling"):
        Communicator(ThreadWorld(2).transport(0), options=[HierarchicalOptions(inter_node_algorithm="native")])
