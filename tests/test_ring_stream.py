"""The ring's sum order, segment cuts and buffers at every world size 2-5, pinned bitwise (its AllReduce,
and its reduce-scatter and all-gather on their own).

Every element must be added in the ring's order whatever the segment cut (chunk c starts at rank
c+1, each next rank adds its own), segment boundaries fall anywhere in a chunk and across hops
(odd sizes, one to a few elements per segment), and buffers stay safe when data moves as early
or as late as a network may (``_strict_transport``). The reference is computed here from the
inputs; any change to how ``collectives/ring.py`` posts and awaits its segments must keep it."""

from __future__ import annotations

import pytest
import torch

import gradsync
from _dist import run_threads
from _reference import ALL_DTYPES, FLOAT_DTYPES, assert_bitwise_equal
from _strict_transport import MODES, StrictWorld

WORLD_SIZES = (2, 3, 4, 5)
NUMELS = (1, 7, 101)  # odd: chunks of unequal size, some empty at numel 1
SEGMENT_BYTES = (4, 12, 2**20)  # one element, a few elements, the whole chunk per segment


def ring_order_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Chunk c summed as the ring adds it: it starts at rank c+1 and each next rank r adds its own
    (x_r + incoming), ending at rank c; chunks as ``torch.tensor_split``. float16/bfloat16 in float32."""
    world_size, dtype = len(inputs), inputs[0].dtype
    wide = [tensor.float() if dtype in (torch.float16, torch.bfloat16) else tensor for tensor in inputs]
    pieces = []
    for chunk, parts in enumerate(zip(*(torch.tensor_split(tensor, world_size) for tensor in wide))):
        total = parts[(chunk + 1) % world_size].clone()
        for step in range(2, world_size + 1):
            total = parts[(chunk + step) % world_size] + total
        pieces.append(total)
    return torch.cat(pieces).to(dtype)


def random_inputs(world_size: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if dtype in FLOAT_DTYPES:
        return [torch.randn(numel, generator=generator).to(dtype) for _ in range(world_size)]
    low, high = (0, 50) if dtype == torch.uint8 else (-20, 20)  # sums stay in range: exact
    return [torch.randint(low, high, (numel,), generator=generator).to(dtype) for _ in range(world_size)]


def _cases(world_size: int) -> list[tuple[int, torch.dtype, list[torch.Tensor]]]:
    return [(numel, dtype, random_inputs(world_size, numel, dtype, seed=numel * 31 + index))
            for numel in NUMELS for index, dtype in enumerate(ALL_DTYPES)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ("thread",) + MODES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_adds_in_ring_order_at_every_segment_cut(world_size, transport):
    """Random values of every dtype, odd numel, segments of 1 element to a whole chunk: every rank
    holds bitwise the ring-order sum (hence the same result as before the stream, and on every rank),
    over threads and over a transport moving data as early or as late as a network may."""
    cases = _cases(world_size)
    for segment_bytes in SEGMENT_BYTES:
        def rank_fn(comm):
            return [gradsync.all_reduce(inputs[comm.rank].clone(), algorithm="ring", group=comm)
                    for _, _, inputs in cases]

        world = None if transport == "thread" else StrictWorld(world_size, transport)
        outcomes = run_threads(world_size, rank_fn, timeout_s=20, collective_timeout_s=5,
                               segment_bytes=segment_bytes, world=world)
        for (numel, dtype, inputs), *results in zip(cases, *outcomes):
            expected = ring_order_sum(inputs)
            for rank, result in enumerate(results):
                assert_bitwise_equal(result, expected, f"rank {rank} numel={numel} {dtype} "
                                                       f"segment_bytes={segment_bytes}")


def test_ring_order_reference_is_the_plain_sum_on_exact_values():
    """The reference itself: on integers (exact) it is the plain sum, whatever the world size."""
    for world_size in WORLD_SIZES:
        inputs = random_inputs(world_size, 11, torch.int64, seed=world_size)
        assert torch.equal(ring_order_sum(inputs), torch.stack(inputs).sum(0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", MODES)
@pytest.mark.parametrize("world_size", (3, 4))
def test_ring_phases_on_their_own_keep_the_order_and_the_buffers(world_size, transport):
    """The registry's ring reduce-scatter and all-gather, each a stream of its own: the reduce-scatter's chunk
    is bitwise the ring-order sum's, the all-gather returns every rank's tensor exactly, segments of one and
    three elements, over a transport moving data as early or as late as a network may."""
    numel = 101
    inputs = random_inputs(world_size, numel, torch.float32, seed=7 * world_size)
    expected = torch.tensor_split(ring_order_sum(inputs), world_size)
    for segment_bytes in (4, 12):
        def rank_fn(comm):
            mine = gradsync.reduce_scatter(inputs[comm.rank].clone(), algorithm="ring", group=comm)
            return mine, gradsync.all_gather(inputs[comm.rank].clone(), algorithm="ring", group=comm)

        outcomes = run_threads(world_size, rank_fn, timeout_s=20, collective_timeout_s=5,
                               segment_bytes=segment_bytes, world=StrictWorld(world_size, transport))
        for rank, (mine, gathered) in enumerate(outcomes):
            assert_bitwise_equal(mine, expected[rank], f"rank {rank} reduce_scatter segment_bytes={segment_bytes}")
            for peer, part in enumerate(gathered):
                assert torch.equal(part, inputs[peer]), (rank, peer, segment_bytes)
