"""The double binary tree AllReduce against a reference that adds in the trees' order, over thread ranks.

The reference is built here from the definition, not from the module: the
positions 1..p form an in-order tree in which the root of any contiguous
range is the position with the most trailing zero bits; rank r sits at
position r + 1 in tree 1 and, in tree 2, at p - r (p even, the mirror) or
(r + 1) mod p + 1 (p odd, the shift by one). Tree 1 sums the first half of
the elements (``torch.tensor_split(flat, 2)``), tree 2 the second; a node
adds own + left subtree + right subtree, in the reduced dtype (float32 for
fp16 / bf16, as every algorithm does).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import gradsync
from _dist import run_threads
from _reference import assert_bitwise_equal
from gradsync.collectives import double_binary_tree

WORLD_SIZES = range(1, 10)
NUMELS = (1, 2, 7, 33, 1001)  # odd element counts, fewer than the ranks, halves of unequal length
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int32)
WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _trailing_zeros(position: int) -> int:
    return (position & -position).bit_length() - 1


def _tree(lo: int, hi: int):
    """(root, left, right) of positions lo..hi (None when empty): the root has the most trailing zeros."""
    if lo > hi:
        return None
    root = max(range(lo, hi + 1), key=_trailing_zeros)
    return root, _tree(lo, root - 1), _tree(root + 1, hi)


def _rank_of(position: int, world_size: int, tree: int) -> int:
    if tree == 0:
        return position - 1
    if world_size % 2 == 0:
        return world_size - position
    return next(rank for rank in range(world_size) if (rank + 1) % world_size + 1 == position)


def _subtree_sum(node, values: dict[int, torch.Tensor]) -> torch.Tensor:
    position, left, right = node
    total = values[position].clone()
    for child in (left, right):
        if child is not None:
            total += _subtree_sum(child, values)
    return total


def reference(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Sum ``inputs`` (one ``(numel,)`` tensor per rank) in the two trees' order."""
    world_size, dtype = len(inputs), inputs[0].dtype
    wide = [tensor.to(WIDER.get(dtype, dtype)) for tensor in inputs]
    numel = inputs[0].numel()
    parts = []
    for tree, (start, stop) in enumerate(((0, (numel + 1) // 2), ((numel + 1) // 2, numel))):
        values = {position: wide[_rank_of(position, world_size, tree)][start:stop]
                  for position in range(1, world_size + 1)}
        parts.append(_subtree_sum(_tree(1, world_size), values))
    return torch.cat(parts).to(dtype)


def _inputs(world_size: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:  # spread exponents: a different order of adding gives different bits
        return [(torch.randn(numel, generator=generator, dtype=torch.float64)
                 * 10.0 ** torch.randint(-3, 4, (numel,), generator=generator)).to(dtype)
                for _ in range(world_size)]
    return [torch.randint(-1000, 1000, (numel,), generator=generator, dtype=dtype) for _ in range(world_size)]


def _all_reduce_everywhere(inputs, segment_bytes=None):
    def rank_fn(comm):
        return gradsync.all_reduce(inputs[comm.rank].clone(), algorithm="double_binary_tree", group=comm)

    return run_threads(len(inputs), rank_fn, segment_bytes=segment_bytes)


def _check(world_size, numel, dtype, segment_bytes=None, seed=0):
    inputs = _inputs(world_size, numel, dtype, seed)
    expected = reference(inputs)
    for rank, result in enumerate(_all_reduce_everywhere(inputs, segment_bytes)):
        assert_bitwise_equal(result, expected, f"p={world_size} numel={numel} {dtype} rank {rank}")


def test_reference_differs_from_a_plain_sum_so_the_order_is_checked():
    """The inputs are spread enough that adding in another order changes bits (else the order goes unchecked)."""
    inputs = _inputs(7, 1001, torch.float32, 0)
    plain = torch.stack(inputs).sum(0)
    assert not torch.equal(reference(inputs), plain)
    assert torch.allclose(reference(inputs).double(), torch.stack(inputs).double().sum(0), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_matches_tree_order_reference_on_every_rank(world_size):
    """p = 1..9, odd and small numel, four dtypes: every rank holds bitwise the tree-order reference."""
    for numel in NUMELS:
        for dtype in DTYPES:
            _check(world_size, numel, dtype, seed=world_size * 100 + numel)


@pytest.mark.parametrize("world_size", [3, 5, 8, 9])
def test_tiny_segments_pipeline_without_changing_the_bits(world_size):
    """Segments of one to a few elements (many in flight per tree) give the same bits as one segment."""
    for segment_bytes in (4, 12):
        _check(world_size, 77, torch.float32, segment_bytes=segment_bytes, seed=world_size)
    _check(world_size, 77, torch.float64, segment_bytes=8, seed=world_size)


def test_empty_tensor_is_returned_unchanged():
    results = _all_reduce_everywhere([torch.empty(0) for _ in range(4)])
    assert all(result.numel() == 0 for result in results)


@pytest.mark.parametrize("world_size", range(1, 65))
def test_every_rank_is_inner_in_at_most_one_tree_and_trees_span_all_ranks(world_size):
    """Both trees are binary, span every rank with one root, match the definition, and share no inner rank."""
    inner = []
    for tree in (0, 1):
        parents = {}
        for rank in range(world_size):
            parent, children = double_binary_tree.links(rank, world_size, tree)
            assert len(children) <= 2
            parents[rank] = parent
            for child in children:
                assert double_binary_tree.links(child, world_size, tree)[0] == rank
        assert sum(parent is None for parent in parents.values()) == 1
        for rank in range(world_size):  # every rank reaches the root: one tree, no cycle
            seen, node = set(), rank
            while parents[node] is not None:
                assert node not in seen
                seen.add(node)
                node = parents[node]
        expected_root = _rank_of(_tree(1, world_size)[0], world_size, tree)
        assert parents[expected_root] is None
        inner.append({rank for rank in range(world_size) if double_binary_tree.links(rank, world_size, tree)[1]})
    assert not inner[0] & inner[1], f"p={world_size}: inner in both trees: {inner[0] & inner[1]}"
    assert inner == list(double_binary_tree.inner_ranks(world_size))
    if world_size > 1:
        assert inner[0] and inner[1] or world_size == 2


def test_links_rejects_a_rank_outside_the_group():
    with pytest.raises(ValueError, match="rank"):
        double_binary_tree.links(4, 4, 0)


def test_data_parallel_averages_gradients_with_double_binary_tree():
    """DataParallel(algorithm="double_binary_tree") on 3 ranks: bitwise equal gradients, equal to the
    single-process gradient of the whole batch (float64)."""
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    target = torch.randn(6, 3, generator=generator, dtype=torch.float64)
    single = nn.Linear(5, 3).double()  # built once: the thread ranks share torch's global generator

    def rank_fn(comm):
        model = gradsync.DataParallel(copy.deepcopy(single), group=comm, algorithm="double_binary_tree")
        rows = slice(2 * comm.rank, 2 * comm.rank + 2)
        nn.functional.mse_loss(model(data[rows]), target[rows]).backward()
        return [parameter.grad.clone() for parameter in model.parameters()]

    per_rank = run_threads(3, rank_fn, timeout_s=60)
    nn.functional.mse_loss(single(data), target).backward()
    for rank, grads in enumerate(per_rank):
        for grad, first, expected in zip(grads, per_rank[0], single.parameters()):
            assert_bitwise_equal(grad, first, f"rank {rank}")
            torch.testing.assert_close(grad, expected.grad, rtol=1e-12, atol=1e-12)


def _reference_links(world_size: int, tree: int) -> dict[int, int]:
    """rank -> number of tree links (parent + children), from the definition above."""
    links = {rank: 0 for rank in range(world_size)}

    def walk(node, parent):
        if node is None:
            return
        position, left, right = node
        if parent is not None:  # one link each way: child -> parent up, parent -> child down
            links[_rank_of(position, world_size, tree)] += 1
            links[_rank_of(parent, world_size, tree)] += 1
        walk(left, position)
        walk(right, position)

    walk(_tree(1, world_size), None)
    return links


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8, 9])
def test_each_rank_sends_its_links_share_and_at_most_the_message(world_size):
    """Rank r sends half t once per link (parent, children) of tree t, one message per segment: 2(p-1)·n in all,
    and at most about n·2 per rank, where a single tree's inner rank sends 3n."""
    numel, segment_bytes = 1001, 40
    halves = ((numel + 1) // 2, numel // 2)

    def rank_fn(comm):
        before = comm.stats.as_dict()
        gradsync.all_reduce(torch.ones(numel), algorithm="double_binary_tree", group=comm)
        return {key: value - before[key] for key, value in comm.stats.as_dict().items()}

    all_stats = run_threads(world_size, rank_fn, segment_bytes=segment_bytes)
    links = [_reference_links(world_size, tree) for tree in (0, 1)]
    for rank, stats in enumerate(all_stats):
        sent = sum(halves[tree] * links[tree][rank] for tree in (0, 1))
        segments = sum(math.ceil(halves[tree] / 10) * links[tree][rank] for tree in (0, 1))
        assert stats["bytes_sent"] == 4 * sent and stats["bytes_received"] == 4 * sent, f"rank {rank}: {stats}"
        assert stats["messages_sent"] == segments, f"rank {rank}: {stats}"
        assert sent <= 2 * numel + 1, f"rank {rank} sends {sent} elements"
    assert sum(stats["bytes_sent"] for stats in all_stats) == 4 * 2 * (world_size - 1) * numel
