"""Property tests (hypothesis) of all_reduce over in-process thread ranks: every variant, drawn inputs.

Every variant of ``_variants.VARIANTS`` at p 1..8 and numel 0..5000 gives the
exact closed form on every rank for every dtype and op; ring, tree and
hierarchical cut into segments of 1..24 bytes do too; random floats give
bitwise the same result on every rank, close to the float64 sum. A hang fails
within a few seconds (``PROPERTY_RUN``) so that shrinking stays quick.
"""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gradsync
from _reference import FLOAT_DTYPES, assert_bitwise_equal
from _variants import (PIPELINED_VARIANTS, PROPERTY_RUN, TINY_SEGMENT_BYTES, VARIANTS, check_closed_form,
                       dtype_and_op, run_variant, world_and_variant)


@settings(max_examples=3 * settings().max_examples)
@given(world_variant=world_and_variant(), numel=st.integers(min_value=0, max_value=5000),
       dtype_op=dtype_and_op())
@example(world_variant=(8, "shm-tiny-cells"), numel=3459, dtype_op=(torch.float64, "sum"))  # CI: over 3 s
def test_algorithms_match_closed_form_on_every_rank(world_variant, numel, dtype_op):
    """Every variant, p 1..8, numel 0..5000 (a variant's max_numel), every dtype, sum/avg: each rank holds
    the exact closed form."""
    (world_size, name), (dtype, op) = world_variant, dtype_op
    check_closed_form(VARIANTS[name], world_size, VARIANTS[name].numel(numel), dtype, op, **PROPERTY_RUN)


@given(world_variant=world_and_variant(table=PIPELINED_VARIANTS),
       numel=st.integers(min_value=0, max_value=300), dtype_op=dtype_and_op(),
       segment_bytes=st.sampled_from(TINY_SEGMENT_BYTES))
def test_pipelined_algorithms_match_closed_form_with_tiny_segments(world_variant, numel, dtype_op,
                                                                   segment_bytes):
    """Ring, tree and hierarchical cut into segments of 1..24 bytes still give the exact closed form."""
    (world_size, name), (dtype, op) = world_variant, dtype_op
    check_closed_form(PIPELINED_VARIANTS[name], world_size, numel, dtype, op, segment_bytes, **PROPERTY_RUN)


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
