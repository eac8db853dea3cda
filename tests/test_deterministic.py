"""DeterministicDataParallel and its exact sums: the same bits for any placement of the micro-shards.

Thread ranks (:func:`_dist.run_threads`) run the library API; the reference
is the same micro-shards on one rank (bitwise) and the plain full-batch
gradient (allclose). Misuse must raise the same error on every rank.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import gradsync
from gradsync.errors import CollectiveMismatchError
from gradsync.parallel.exact_sum import (add_fixed_point, add_fixed_point_many, exponent_code, from_fixed_point,
                                         precision_bits)
from _dist import capture_error, run_threads

NUM_SAMPLES, NUM_SHARDS = 24, 4


class _Net(nn.Module):
    """A small MLP, with dropout when asked (placement-independent only if the RNG follows the micro-shard), and an
    unused layer. Thread ranks share torch's global generator, so only one-rank tests use dropout."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(40, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 10))
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return self.net(x)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread, as --deterministic runs (the kernels' blocking follows the thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    """``|actual - expected| <= atol + rtol |expected|`` everywhere (torch.testing takes ~1.4 s to import)."""
    bound = atol + rtol * expected.abs()
    assert bool(((actual - expected).abs() <= bound).all()), (actual, expected)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(NUM_SAMPLES, 40, generator=generator), torch.randint(0, 10, (NUM_SAMPLES,), generator=generator)


def _initial(dropout: float) -> _Net:
    torch.manual_seed(0)
    return _Net(dropout)


_INITIAL = {dropout: _initial(dropout) for dropout in (0.0, 0.5)}  # built here: thread ranks share the RNG


def _wrap(comm, dropout: float = 0.0, num_shards: int = NUM_SHARDS, **kwargs):
    torch.set_num_threads(1)  # OpenMP's thread count is per thread: set it in every rank's thread
    return gradsync.DeterministicDataParallel(copy.deepcopy(_INITIAL[dropout]), num_shards, group=comm, **kwargs)


def _step(model, shards, divisor=NUM_SAMPLES, step=0):
    """Compute ``shards`` (indices, in that order) and synchronize; returns (loss, grads by name)."""
    x, y = _batch()
    bounds = model.shard_bounds(len(x))
    for index in shards:
        start, stop = bounds[index]
        with model.micro_shard(index, step) as shard:
            shard.backward(F.cross_entropy(model(x[start:stop]), y[start:stop], reduction="sum"))
    loss = model.synchronize(divisor)
    return loss, {name: None if p.grad is None else p.grad.clone() for name, p in model.module.named_parameters()}


def _placed(world_size: int, placement=None, **kwargs) -> list:
    def rank_fn(comm):
        model = _wrap(comm, **kwargs)
        return _step(model, placement[comm.rank] if placement else model.local_shards())
    options = {"ranks_per_node": 2} if kwargs.get("algorithm") == "hierarchical" else {}
    return run_threads(world_size, rank_fn, **options)


@pytest.fixture(scope="module")
def single_rank():
    """Every micro-shard on one rank: the bits every placement must reproduce."""
    torch.set_num_threads(1)
    return _placed(1)[0]


@pytest.mark.parametrize("world_size,placement,algorithm", [
    (2, None, "ring"), (3, None, "ring"), (4, None, "ring"), (4, None, "tree"), (4, None, "halving_doubling"),
    (4, None, "hierarchical"), (2, [[0], [3, 1, 2]], "ring"),
], ids=["2-ring", "3-uneven", "4-ring", "4-tree", "4-halving-doubling", "4-hierarchical", "2-any-order"])
def test_every_placement_and_algorithm_gives_the_single_rank_bits(single_rank, world_size, placement, algorithm):
    """1, 2, 3 (2+1+1 micro-shards), 4 ranks, any algorithm, any order inside a rank: torch.equal grads and loss
    on every rank; a parameter no micro-shard reached keeps grad None."""
    loss, grads = single_rank
    assert grads["unused.weight"] is None and grads["net.0.weight"] is not None
    for rank, (rank_loss, rank_grads) in enumerate(_placed(world_size, placement, algorithm=algorithm)):
        assert rank_loss == loss, rank
        for name, grad in grads.items():
            assert (grad is None and rank_grads[name] is None) or torch.equal(rank_grads[name], grad), (rank, name)


def test_dropout_masks_follow_the_micro_shard_not_the_order_it_ran_in():
    """With dropout, the micro-shards in another order (and another step's seed elsewhere) give the same bits: each
    micro-shard's RNG is seeded from (seed, step, index); a different step gives different masks."""
    def rank_fn(comm):
        forward, backward = _wrap(comm, dropout=0.5), _wrap(comm, dropout=0.5)
        torch.manual_seed(123)  # the caller's RNG state does not matter either
        first = _step(forward, [0, 1, 2, 3])
        torch.rand(5)
        second = _step(backward, [3, 1, 0, 2])
        backward.zero_grad()
        other_step = _step(backward, [0, 1, 2, 3], step=1)
        return first, second, other_step
    (loss, grads), (loss_again, grads_again), (other_loss, _) = run_threads(1, rank_fn)[0]
    assert loss == loss_again and all(torch.equal(grads[name], grads_again[name]) for name in grads
                                      if grads[name] is not None)
    assert other_loss != loss


def test_the_result_is_the_full_batch_average_gradient():
    """.grad and the loss equal one full-batch backward of the mean loss (allclose)."""
    def rank_fn(comm):
        model = _wrap(comm)
        return _step(model, model.local_shards())

    loss, grads = run_threads(2, rank_fn)[1]
    reference = copy.deepcopy(_INITIAL[0.0])
    x, y = _batch()
    expected = F.cross_entropy(reference(x), y)
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), rel=1e-6)
    for name, param in reference.named_parameters():
        if param.grad is not None:
            _assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7)


def _enter(model, index: int) -> None:
    """Enter micro_shard(index) with a forward and backward inside, then synchronize."""
    with model.micro_shard(index) as shard:
        shard.backward(model(torch.ones(2, 40)).sum())
    model.synchronize(2)


def _enter_without_backward(model, rank: int) -> None:
    """Rank 0 computes micro-shard 0; rank 1 enters micro-shard 1 and runs no backward (or two)."""
    with model.micro_shard(rank) as shard:
        if rank == 0:
            shard.backward(model(torch.ones(2, 40)).sum())
    model.synchronize(2)


def _enter_backward_twice(model, rank: int) -> None:
    with model.micro_shard(rank) as shard:
        for _ in range(2 if rank == 1 else 1):
            shard.backward(model(torch.ones(2, 40)).sum())
    model.synchronize(2)


def _errors(world_size: int, body) -> list[Exception | None]:
    """Run ``body(model, rank)`` on every rank; return each rank's exception (after checking a good step works)."""
    def rank_fn(comm):
        model = _wrap(comm, num_shards=2)
        error = capture_error(lambda: body(model, comm.rank))
        _step(model, model.local_shards())  # the failed step left nothing behind
        return error
    return run_threads(world_size, rank_fn)


@pytest.mark.parametrize("body,needle", [
    (lambda model, rank: _step(model, [0] if rank == 0 else []), "micro-shard 1 was computed by no rank"),
    (lambda model, rank: _step(model, [0]), "micro-shard 0 was computed by ranks 0, 1"),
    (lambda model, rank: _enter(model, rank if rank == 0 else 7), "rank 1 entered micro_shard(7), outside [0, 2)"),
    (lambda model, rank: _step(model, [rank, rank] if rank == 1 else [0]), "rank 1 entered micro_shard(1) twice"),
    (lambda model, rank: _step(model, [rank], divisor=4.0 * (rank + 1)),
     "different divisors: rank 0 has 4.0; rank 1 has 8.0"),
    (lambda model, rank: _step(model, [rank], divisor=float("nan") if rank else 1.0),
     "rank 1 passed a divisor that is not a finite number > 0"),
    (lambda model, rank: (rank == 0 and model(torch.ones(1, 40)).sum().backward(), _step(model, [rank])),
     "rank 0 had a gradient in parameter 'net.0.weight' before a micro_shard"),
    (_enter_without_backward, "rank 1 ran no backward in micro_shard(1)"),
    (_enter_backward_twice, "rank 1 called backward twice in micro_shard(1)"),
], ids=["missing", "twice-over-ranks", "out-of-range", "twice-on-a-rank", "divisors-differ", "bad-divisor",
        "stale-grad", "no-backward", "two-backwards"])
def test_misuse_raises_the_same_error_on_every_rank(body, needle):
    """A wrong step raises CollectiveMismatchError naming the ranks and micro-shards on every rank, never a hang."""
    errors = _errors(2, body)
    for rank, error in enumerate(errors):
        assert isinstance(error, CollectiveMismatchError), (rank, error)
        assert needle in str(error), (rank, str(error))
    assert str(errors[0]) == str(errors[1])


def test_construction_errors_name_the_argument():
    """Ranks that disagree on num_micro_shards learn it at construction; BatchNorm and bad arguments are refused."""
    def rank_fn(comm):
        return capture_error(lambda: gradsync.DeterministicDataParallel(_Net(), 2 + 2 * comm.rank, group=comm))
    for error in run_threads(2, rank_fn):
        assert isinstance(error, CollectiveMismatchError) and "num_micro_shards" in str(error), error
    world = gradsync.ThreadWorld(1)
    comm = gradsync.Communicator(world.transport(0))
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm1d\) updates running statistics"):
        gradsync.DeterministicDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), 2, group=comm)
    with pytest.raises(ValueError, match="num_micro_shards must be an int >= 1, got 0"):
        gradsync.DeterministicDataParallel(_Net(), 0, group=comm)
    with pytest.raises(ValueError, match="unknown algorithm 'fast'"):
        gradsync.DeterministicDataParallel(_Net(), 2, group=comm, algorithm="fast")


def test_a_nan_in_one_micro_shard_makes_every_rank_s_gradient_nan():
    """A non-finite value anywhere is not summed away: every rank's .grad of that parameter is all NaN."""
    def rank_fn(comm):
        model = _wrap(comm, num_shards=2)
        with model.micro_shard(comm.rank) as shard:
            x = torch.ones(3, 40) * (float("nan") if comm.rank else 1.0)
            shard.backward(model(x).sum())
        model.synchronize(6)
        return model.module.net[3].weight.grad
    for grad in run_threads(2, rank_fn):
        assert torch.isnan(grad).all()


@given(st.lists(st.lists(st.floats(-1e6, 1e6, width=32), min_size=3, max_size=3), min_size=1, max_size=8),
       st.randoms(use_true_random=False))
def test_fixed_point_sums_are_order_free_and_exact_to_float32(rows, random):
    """Any order and grouping of the contributions gives the same bits, equal to the float64 sum rounded to
    float32 (within one float32 ulp: the int64 sum keeps at least 55 bits of the largest element)."""
    values = [torch.tensor(row, dtype=torch.float32) for row in rows]
    exponent, bits = max(exponent_code(v) for v in values), precision_bits(len(values))
    shuffled = list(values)
    random.shuffle(shuffled)
    cut = random.randint(0, len(shuffled))
    parts = []
    for group in (values, shuffled[:cut], shuffled[cut:]):
        accumulator = torch.zeros(3, dtype=torch.int64)
        for value in group:
            add_fixed_point(accumulator, value, exponent, bits)
        parts.append(accumulator)
    whole, halves = parts[0], parts[1] + parts[2]
    assert torch.equal(whole, halves)
    result = from_fixed_point(whole, exponent, bits, divisor=1, dtype=torch.float32)
    exact = torch.tensor([math.fsum(column) for column in zip(*(v.tolist() for v in values))], dtype=torch.float64)
    _assert_close(result.double(), exact, rtol=2**-23, atol=2.0 ** (exponent - bits + 3))


@pytest.mark.parametrize("dtype,magnitude", [(torch.float32, 1e-30), (torch.float32, 1e-3), (torch.float32, 1e20),
                                             (torch.float16, 1e-3), (torch.float16, 100.0), (torch.bfloat16, 1e-30),
                                             (torch.bfloat16, 1e20)])
def test_the_float32_path_gives_the_float64_path_s_integers(dtype, magnitude):
    """Narrow values are scaled in float32 when the power of two fits it (float64 otherwise): the same integers."""
    values = (torch.randn(1000, generator=torch.Generator().manual_seed(3)) * magnitude).to(dtype)
    exponent, bits = exponent_code(values), precision_bits(12)
    narrow, many, wide = (torch.zeros(1000, dtype=torch.int64) for _ in range(3))
    add_fixed_point(narrow, values, exponent, bits)
    add_fixed_point_many(many, [(0, 600), (600, 1000)], [values[:600], values[600:]], [exponent] * 2, bits,
                         torch.empty(1000), torch.empty(1000, dtype=torch.int64))
    add_fixed_point(wide, values.double(), exponent, bits)
    assert torch.equal(narrow, wide) and torch.equal(many, wide) and bool(wide.abs().max() > 2**50)
