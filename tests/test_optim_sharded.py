"""LARS and LAMB under ZeRO-1/2/3 (thread ranks): the trust ratio is the whole parameter's.

Each rank steps pieces of parameters cut between ranks (odd element counts, padded buckets); the norms
of each parameter's weight and update are reduced across the ranks (``ShardNorms``), so training at
world size 2 and 4 must match a single plain-torch process on the concatenated batches (allclose). A
ratio taken per piece would not: the last test shows that the reference tells the two apart.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync
from gradsync.optim import LAMB, LARS
from gradsync.parallel.shard_norms import ShardNorms
from _dist import run_threads

torch.set_num_threads(1)
STEPS = 4


def _build() -> nn.Module:  # 35 + 7 + 21 + 3 elements: every bucket padded, parameters cut between ranks
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


torch.manual_seed(0)
_INITIAL = _build().state_dict()
_GEN = torch.Generator().manual_seed(1)
_BATCHES = [(torch.randn(8, 5, generator=_GEN), torch.randn(8, 3, generator=_GEN)) for _ in range(STEPS)]
OPTIMIZERS = {"lars": lambda params: LARS(params, lr=2.0, weight_decay=1e-3),
              "lamb": lambda params: LAMB(params, lr=0.02, weight_decay=0.01)}


def _model() -> nn.Module:
    model = _build()
    model.load_state_dict(_INITIAL)  # threads share torch's RNG: the same initial model from outside
    return model


def _reference(name: str) -> list[torch.Tensor]:
    model = _model()
    optimizer = OPTIMIZERS[name](model.parameters())
    for x, y in _BATCHES:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _train(comm, shard: str, name: str) -> list[torch.Tensor]:
    model = gradsync.DataParallel(_model(), group=comm, shard=shard, algorithm="ring", bucket_cap_mb=25.0)
    optimizer = model.shard_optimizer(OPTIMIZERS[name](model.parameters()))
    per_rank = len(_BATCHES[0][0]) // comm.world_size
    rows = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
    for x, y in _BATCHES:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    with model.full_parameters():
        return [p.detach().clone() for p in model.module.parameters()]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero_1_2_3_steps_as_one_process_with_whole_parameter_trust_ratios(name):
    reference = _reference(name)
    for world_size, shard in ((2, "optimizer"), (4, "gradients"), (2, "parameters"), (4, "parameters")):
        for params in run_threads(world_size, lambda comm: _train(comm, shard, name)):
            for got, want in zip(params, reference):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{name} {shard} ws {world_size}")


def test_shard_norms_sum_pieces_across_ranks_float_and_exact():
    """Two ranks each hold a piece of parameter 0 (and rank 1 all of parameter 1): every rank gets the whole
    parameters' sums of squares, float64 (to its rounding) and exact (equal to the exact sum here)."""
    whole = [torch.tensor([3.0, 1.0, -2.0, 0.5]), torch.tensor([[1.5, -0.25]])]
    want = torch.tensor([[float(whole[0].double().square().sum())], [float(whole[1].double().square().sum())]],
                        dtype=torch.float64)

    def rank_fn(comm, exact):
        mine = [whole[0][:2]] if comm.rank == 0 else [whole[0][2:], whole[1].reshape(-1)]
        segments = {id(tensor): index for tensor, index in zip(mine, [0] if comm.rank == 0 else [0, 1])}
        norms = ShardNorms(segments, [1, 2], [4, 2], comm, exact=exact)
        return norms.sums_of_squares(mine, [mine]), [norms.ndim(t) for t in mine]

    for exact in (False, True):
        (sums0, dims0), (sums1, dims1) = run_threads(2, lambda comm: rank_fn(comm, exact))
        assert dims0 == [1] and dims1 == [1, 2]
        torch.testing.assert_close(sums0, want[:1], rtol=0 if exact else 1e-15, atol=0)
        torch.testing.assert_close(sums1, want, rtol=0 if exact else 1e-15, atol=0)


def test_a_per_piece_trust_ratio_would_differ_from_the_reference():
    """The check above has teeth: LARS stepping each rank's pieces with local norms (plain TensorNorms)
    moves the parameters away from the one-process run by more than the tolerance."""

    def local_norms(comm):
        model = gradsync.DataParallel(_model(), group=comm, shard="optimizer", algorithm="ring")
        optimizer = model.shard_optimizer(OPTIMIZERS["lars"](model.parameters()))
        optimizer.optimizer.use_norms(gradsync.optim.TensorNorms())
        per_rank = len(_BATCHES[0][0]) // comm.world_size
        rows = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
        for x, y in _BATCHES:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
        with model.full_parameters():
            return [p.detach().clone() for p in model.module.parameters()]

    reference = _reference("lars")
    params = run_threads(2, local_norms)[0]
    assert not all(torch.allclose(got, want, rtol=1e-5, atol=1e-6) for got, want in zip(params, reference))


def test_exact_norms_have_the_same_bits_however_the_parameter_is_split():
    """[1e8, 1, 1]: the float64 sums of squares depend on the split (a whole tensor's norm rounds the 2 away:
    1e16; two pieces give 1e16 + 2), the exact ones do not (1e16 + 2, on one rank or spread over two):
    what keeps --deterministic bitwise at any world size with LARS and LAMB."""
    whole = torch.tensor([1e8, 1.0, 1.0])

    def split(comm, exact):
        mine = whole[:1] if comm.rank == 0 else whole[1:]
        return ShardNorms({id(mine): 0}, [1], [3], comm, exact=exact).sums_of_squares([mine], [[mine]])

    one = {exact: ShardNorms(exact=exact).sums_of_squares([whole], [[whole]]) for exact in (False, True)}
    two = {exact: run_threads(2, lambda comm: split(comm, exact)) for exact in (False, True)}
    assert float(one[True]) == 1e16 + 2 and all(torch.equal(sums, one[True]) for sums in two[True])
    assert float(one[False]) == 1e16 and float(two[False][0]) == 1e16 + 2


def test_with_fp16_compression_sharded_lamb_steps_as_unsharded():
    """--compression fp16 under LAMB: ZeRO-2 (reduce-scattered fp16 buckets) gives the unsharded run's parameters,
    and both stay near the uncompressed one-process run (fp16 gradients)."""

    def train(comm, shard):
        model = gradsync.DataParallel(_model(), group=comm, shard=shard, algorithm="ring",
                                      compression=gradsync.compression.FP16())
        optimizer = model.shard_optimizer(OPTIMIZERS["lamb"](model.parameters()))
        rows = slice(comm.rank * 4, (comm.rank + 1) * 4)
        for x, y in _BATCHES:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
        with model.full_parameters():
            return [p.detach().clone() for p in model.module.parameters()]

    unsharded = run_threads(2, lambda comm: train(comm, "none"))[0]
    sharded = run_threads(2, lambda comm: train(comm, "gradients"))[0]
    for got, want, exact in zip(sharded, unsharded, _reference("lamb")):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)  # fp16 sums in another order
        torch.testing.assert_close(got, exact, rtol=0, atol=1e-3)
