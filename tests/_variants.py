"""Shared pieces of the thread-rank collective suites (``test_algorithms_*.py``, ``test_collectives_threads.py``).

A *variant* is an algorithm plus the settings that select one of its internal
paths: ``halving_doubling`` on its short (recursive doubling) or long
(Rabenseifner halving + doubling) path by overriding ``SHORT_MESSAGE_BYTES``;
``hierarchical`` on pretend nodes of ``ranks_per_node`` ranks; ring and tree
with a tiny ``segment_bytes`` so that every chunk is cut into many pipelined
segments (Gloo's ``maxSegmentSize`` override); shm with small regions or tiny
cells. Also here: the world sizes and numel cases of the grids, the hypothesis
strategies and the closed-form check the property and value suites share.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st

import gradsync
from _dist import run_threads
from _reference import (ALL_DTYPES, FLOAT_DTYPES, assert_bitwise_equal, bitwise_difference,
                        closed_form_input, closed_form_result, reference_all_reduce)
from gradsync.collectives import ops as collectives_api
from gradsync.collectives import halving_doubling, shm_setup
from gradsync.transport import shm_segment as shm_transport


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
    "double_binary_tree": Variant("double_binary_tree"),
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
                      "double_binary_tree": Variant("double_binary_tree"),
                      "hierarchical-rpn2": Variant("hierarchical", ranks_per_node=2),
                      "hierarchical-rpn3": Variant("hierarchical", ranks_per_node=3)}


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


# Property tests re-run a failing example many times while shrinking it, so a
# hang must fail fast: a few seconds, far above the milliseconds a call takes.
PROPERTY_COLLECTIVE_TIMEOUT_S = 3.0
PROPERTY_RUN = {"timeout_s": 3 * PROPERTY_COLLECTIVE_TIMEOUT_S,
                "collective_timeout_s": PROPERTY_COLLECTIVE_TIMEOUT_S}


def check_closed_form(variant, world_size, numel, dtype, op, segment_bytes=None, **run_options):
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


ALGORITHMS = gradsync.ALGORITHMS
WORLD_SIZES = (1, 2, 3, 4, 5, 7)


def numels_for(world_size):
    """The numel cases: empty, one element, fewer than world_size, not divisible, large."""
    return sorted({0, 1, max(world_size - 1, 0), world_size + 1, 1000})


def bitwise_failures(outcomes, expected, what):
    """Every (rank, case) whose result differs bitwise from ``expected[case]``, one line each."""
    lines = []
    for rank, results in enumerate(outcomes):
        for case, result in results.items():
            difference = bitwise_difference(result, expected[case])
            if difference:
                lines.append(f"rank {rank} {what} {case}: {difference}")
    return lines


# message sizes for auto's cases
SMALL = 4 * 2**20  # a message well into the bandwidth-bound range at these world sizes
PAIR_SMALL = 2**20
