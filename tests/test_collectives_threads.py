"""broadcast, all_gather and reduce_scatter over in-process thread ranks: values, layouts, dtypes.

Broadcast from every src into every rank, also into strided views;
all_gather returns every rank's tensor by rank; reduce_scatter gives rank r
chunk r (torch.tensor_split order) of the exact sum; no collective returns
autograd history. Errors and timeouts of these collectives are in
``test_algorithms_errors.py``; all_reduce is in ``test_algorithms_*.py``.
"""

from __future__ import annotations

import pytest
import torch

import gradsync
from _dist import run_threads
from _reference import (SENTINEL, assert_bitwise_equal, closed_form_input, reference_all_reduce,
                        strided_column_view)
from _variants import WORLD_SIZES, bitwise_failures, numels_for


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

    failures = bitwise_failures(run_threads(world_size, rank_fn), dict(enumerate(inputs)), "broadcast from src")
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
