"""DataParallel in real processes over Gloo: parity with single-process training (PyTorch's DDP parity tests).

One 2-rank world runs every scenario (spawning costs seconds) and returns
each rank's parameters and gradients; the parent recomputes the same
training in one process with the full batch and compares. Each scenario is
isolated by a try/except inside the ranks, so one failing scenario shows up
in its own test.
"""

import contextlib
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from _dist import run_world
from _reference import bitwise_difference

pytestmark = pytest.mark.dist

WORLD_SIZE = 2
IN_FEATURES, HIDDEN, OUT_FEATURES = 4, 8, 2
BATCH = 6  # per worker
STEPS = 4
LR = 0.1
MICRO_BATCHES = 4
MICRO_BATCH = 3
TINY_BUCKET_CAP_MB = 100 / 2**20  # 100 bytes: every parameter gets a bucket of its own
COLLECTIVE_TIMEOUT_S = 15.0


def make_mlp(seed, hidden=HIDDEN, dtype=torch.float32):
    """A 4 -> hidden -> 2 tanh MLP initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, OUT_FEATURES)).to(dtype)


class TwoHeads(nn.Module):
    """A trunk with two heads; ``head_b`` joins the output only when asked."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(IN_FEATURES, HIDDEN)
        self.head_a = nn.Linear(HIDDEN, OUT_FEATURES)
        self.head_b = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x, use_b):
        hidden = torch.tanh(self.trunk(x))
        out = self.head_a(hidden)
        return out + self.head_b(hidden) if use_b else out


def make_two_heads(seed):
    torch.manual_seed(seed)
    return TwoHeads().double()


def make_data(seed, steps, global_batch, dtype):
    """Inputs (steps, global_batch, 4) and targets (steps, global_batch, 2) from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(steps, global_batch, IN_FEATURES, generator=generator, dtype=dtype)
    targets = torch.randn(steps, global_batch, OUT_FEATURES, generator=generator, dtype=dtype)
    return inputs, targets


def _shard(tensor, rank, per_rank):
    return tensor[rank * per_rank:(rank + 1) * per_rank]


def _params(module):
    return [param.detach().clone() for param in module.parameters()]


def _grads(module):
    return [None if param.grad is None else param.grad.clone() for param in module.parameters()]


# ---------------------------------------------------------------- scenarios run inside the ranks


def _train_equivalence(rank, algorithm, bucket_cap_mb):
    """STEPS SGD steps of the MLP on this rank's BATCH rows; returns final params and each step's grads."""
    model = gradsync.DataParallel(make_mlp(0), bucket_cap_mb=bucket_cap_mb, algorithm=algorithm)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    inputs, targets = make_data(1, STEPS, WORLD_SIZE * BATCH, torch.float32)
    step_grads = []
    for step in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(model(_shard(inputs[step], rank, BATCH)), _shard(targets[step], rank, BATCH)).backward()
        step_grads.append(_grads(model.module))
        optimizer.step()
    return _params(model.module), step_grads


def _train_accumulation(rank):
    """Steps of MICRO_BATCHES micro-batches, all but the last under no_sync, loss scaled by 1/MICRO_BATCHES."""
    model = gradsync.DataParallel(make_mlp(0, dtype=torch.float64))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    per_rank = MICRO_BATCHES * MICRO_BATCH
    inputs, targets = make_data(2, STEPS, WORLD_SIZE * per_rank, torch.float64)
    step_grads = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = _shard(inputs[step], rank, per_rank), _shard(targets[step], rank, per_rank)
        for micro in range(MICRO_BATCHES):
            last = micro == MICRO_BATCHES - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = F.mse_loss(model(_shard(x, micro, MICRO_BATCH)), _shard(y, micro, MICRO_BATCH))
                (loss / MICRO_BATCHES).backward()
        step_grads.append(_grads(model.module))
        optimizer.step()
    return _params(model.module), step_grads


def _earlier_micro_batch_only(rank):
    """head_b is used only by micro-batch 0 (under no_sync); returns grads after the synced backward."""
    model = gradsync.DataParallel(make_two_heads(3))
    per_rank = MICRO_BATCHES * MICRO_BATCH
    inputs, targets = make_data(4, 1, WORLD_SIZE * per_rank, torch.float64)
    x, y = _shard(inputs[0], rank, per_rank), _shard(targets[0], rank, per_rank)
    for micro in range(MICRO_BATCHES):
        last = micro == MICRO_BATCHES - 1
        with contextlib.nullcontext() if last else model.no_sync():
            out = model(_shard(x, micro, MICRO_BATCH), use_b=micro == 0)
            (F.mse_loss(out, _shard(y, micro, MICRO_BATCH)) / MICRO_BATCHES).backward()
    return _grads(model.module)


def _unused_on_one_rank(rank):
    """Rank 0 uses head_b, rank 1 does not; returns grads after one synced backward."""
    model = gradsync.DataParallel(make_two_heads(5))
    inputs, targets = make_data(6, 1, WORLD_SIZE * BATCH, torch.float64)
    out = model(_shard(inputs[0], rank, BATCH), use_b=rank == 0)
    F.mse_loss(out, _shard(targets[0], rank, BATCH)).backward()
    return _grads(model.module)


def _construction_broadcast(rank):
    """Each rank initialises from its own seed; returns params before and after wrapping."""
    module = make_mlp(100 + rank)
    before = _params(module)
    gradsync.DataParallel(module)
    return before, _params(module)


def _buffers_follow_rank0(rank):
    """BatchNorm first: ranks start with different running stats and see different data.

    Returns the buffers after STEPS training steps and one eval-mode forward.
    """
    torch.manual_seed(7 + rank)
    module = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 1))
    module[0].running_mean.fill_(rank + 1.0)
    model = gradsync.DataParallel(module, broadcast_buffers=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(_bn_batch(rank, step)).pow(2).mean().backward()
        optimizer.step()
    model.eval()
    model(_bn_batch(rank, STEPS))
    return [buffer.clone() for buffer in module.buffers()]


def _bn_batch(rank, step):
    """Rank- and step-dependent (BATCH, 3) inputs with rank-dependent mean and scale."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, 3, generator=generator) * (rank + 1) + rank


def _sync_decided_at_backward(rank):
    """(grads when forward is under no_sync but backward is not, grads when only backward is under no_sync)."""
    inputs, targets = make_data(8, 2, WORLD_SIZE * BATCH, torch.float64)
    model = gradsync.DataParallel(make_mlp(9, dtype=torch.float64))
    with model.no_sync():
        loss = F.mse_loss(model(_shard(inputs[0], rank, BATCH)), _shard(targets[0], rank, BATCH))
    loss.backward()
    synced = _grads(model.module)
    model.zero_grad()
    loss = F.mse_loss(model(_shard(inputs[1], rank, BATCH)), _shard(targets[1], rank, BATCH))
    with model.no_sync():
        loss.backward()
    return synced, _grads(model.module)


def _mismatched_models(rank):
    """Rank 1 builds a wider hidden layer; returns (exception type, message, follow-up all_reduce)."""
    try:
        gradsync.DataParallel(make_mlp(0, hidden=HIDDEN + 1 if rank == 1 else HIDDEN))
        outcome = ("no error", "")
    except Exception as exc:  # noqa: BLE001 - the parent checks the type
        outcome = (type(exc).__name__, str(exc))
    return (*outcome, gradsync.all_reduce(torch.ones(2)))


SCENARIOS = {
    "equivalence-ring": lambda rank: _train_equivalence(rank, "ring", 25.0),
    "equivalence-ring-tiny-buckets": lambda rank: _train_equivalence(rank, "ring", TINY_BUCKET_CAP_MB),
    "equivalence-native": lambda rank: _train_equivalence(rank, "native", 25.0),
    "accumulation": _train_accumulation,
    "earlier-micro-batch-only": _earlier_micro_batch_only,
    "unused-on-one-rank": _unused_on_one_rank,
    "construction-broadcast": _construction_broadcast,
    "buffers": _buffers_follow_rank0,
    "sync-decided-at-backward": _sync_decided_at_backward,
    "mismatched-models": _mismatched_models,  # last: it exercises the error path
}


def _rank_data_parallel_scenarios():
    """Run every scenario on this rank; a failing one is reported as ("error", traceback)."""
    results = {}
    for name, scenario in SCENARIOS.items():
        try:
            results[name] = ("ok", scenario(gradsync.rank()))
        except Exception:  # noqa: BLE001 - reported by that scenario's test
            results[name] = ("error", traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def scenario_results():
    """Every rank's results of every scenario, from one 2-rank world."""
    return run_world(WORLD_SIZE, _rank_data_parallel_scenarios, timeout_s=60,
                     collective_timeout_s=COLLECTIVE_TIMEOUT_S)


def _per_rank(scenario_results, name):
    outcomes = [results[name] for results in scenario_results]
    for rank, (status, value) in enumerate(outcomes):
        assert status == "ok", f"scenario {name} failed on rank {rank}:\n{value}"
    return [value for _, value in outcomes]


def _assert_bitwise_equal_lists(per_rank_tensors, what):
    for rank, tensors in enumerate(per_rank_tensors[1:], start=1):
        for index, (tensor, first) in enumerate(zip(tensors, per_rank_tensors[0])):
            difference = bitwise_difference(tensor, first)
            assert not difference, f"{what}, tensor {index}: rank {rank} vs rank 0: {difference}"


def _assert_close_lists(actual, expected, what, rtol=1e-5, atol=1e-6):
    assert len(actual) == len(expected), what
    for index, (got, want) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}, tensor {index}: {m}")


# ---------------------------------------------------------------- single-process references


def _reference_training(model, inputs, targets):
    """Full-batch SGD in one process; returns final params and each step's grads."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    step_grads = []
    for step in range(inputs.shape[0]):
        optimizer.zero_grad()
        F.mse_loss(model(inputs[step]), targets[step]).backward()
        step_grads.append(_grads(model))
        optimizer.step()
    return _params(model), step_grads


# ---------------------------------------------------------------- tests


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", ["equivalence-ring", "equivalence-ring-tiny-buckets", "equivalence-native"])
def test_data_parallel_matches_single_process_full_batch(scenario_results, name):
    """2 workers x batch B train to the parameters of 1 process x batch 2B (allclose rtol 1e-5, atol 1e-6)."""
    per_rank = _per_rank(scenario_results, name)
    inputs, targets = make_data(1, STEPS, WORLD_SIZE * BATCH, torch.float32)
    expected_params, expected_grads = _reference_training(make_mlp(0), inputs, targets)
    for rank, (params, step_grads) in enumerate(per_rank):
        _assert_close_lists(params, expected_params, f"{name} rank {rank} final params")
        for step, grads in enumerate(step_grads):
            _assert_close_lists(grads, expected_grads[step], f"{name} rank {rank} step {step} grads")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", ["equivalence-ring", "equivalence-ring-tiny-buckets", "equivalence-native",
                                  "accumulation"])
def test_data_parallel_grads_bitwise_equal_across_ranks(scenario_results, name):
    """After every synced backward each parameter's .grad is bitwise the same on every rank."""
    per_rank = _per_rank(scenario_results, name)
    for step in range(STEPS):
        _assert_bitwise_equal_lists([step_grads[step] for _, step_grads in per_rank], f"{name} step {step}")
    _assert_bitwise_equal_lists([params for params, _ in per_rank], f"{name} final params")


@pytest.mark.timeout(90)
def test_data_parallel_no_sync_accumulation_matches_large_batch(scenario_results):
    """4 micro-batches (3 under no_sync, loss / 4) then a synced one equal one batch 4x as large."""
    per_rank = _per_rank(scenario_results, "accumulation")
    per_rank_rows = MICRO_BATCHES * MICRO_BATCH
    inputs, targets = make_data(2, STEPS, WORLD_SIZE * per_rank_rows, torch.float64)
    expected_params, expected_grads = _reference_training(make_mlp(0, dtype=torch.float64), inputs, targets)
    for rank, (params, step_grads) in enumerate(per_rank):
        _assert_close_lists(params, expected_params, f"rank {rank} final params")
        for step, grads in enumerate(step_grads):
            _assert_close_lists(grads, expected_grads[step], f"rank {rank} step {step} grads")


def _reference_two_heads_grads(model, loss_terms):
    """Grads of sum(loss_terms(model)) computed in one process."""
    model.zero_grad()
    sum(loss_terms(model)).backward()
    return _grads(model)


@pytest.mark.timeout(90)
def test_data_parallel_syncs_params_used_only_in_earlier_no_sync_micro_batches(scenario_results):
    """A head used only in micro-batch 0 (under no_sync) is averaged across ranks at the synced backward."""
    per_rank = _per_rank(scenario_results, "earlier-micro-batch-only")
    per_rank_rows = MICRO_BATCHES * MICRO_BATCH
    inputs, targets = make_data(4, 1, WORLD_SIZE * per_rank_rows, torch.float64)

    def loss_terms(model):
        for rank in range(WORLD_SIZE):
            x, y = _shard(inputs[0], rank, per_rank_rows), _shard(targets[0], rank, per_rank_rows)
            for micro in range(MICRO_BATCHES):
                out = model(_shard(x, micro, MICRO_BATCH), use_b=micro == 0)
                yield F.mse_loss(out, _shard(y, micro, MICRO_BATCH)) / MICRO_BATCHES / WORLD_SIZE

    expected = _reference_two_heads_grads(make_two_heads(3), loss_terms)
    _assert_bitwise_equal_lists(per_rank, "grads")
    for rank, grads in enumerate(per_rank):
        _assert_close_lists(grads, expected, f"rank {rank} grads")


@pytest.mark.timeout(90)
def test_data_parallel_unused_param_on_one_rank_counts_as_zero(scenario_results):
    """A head only rank 0 uses gets grad (g0 + 0) / 2 on both ranks, and nothing hangs."""
    per_rank = _per_rank(scenario_results, "unused-on-one-rank")
    inputs, targets = make_data(6, 1, WORLD_SIZE * BATCH, torch.float64)

    def loss_terms(model):
        for rank in range(WORLD_SIZE):
            out = model(_shard(inputs[0], rank, BATCH), use_b=rank == 0)
            yield F.mse_loss(out, _shard(targets[0], rank, BATCH)) / WORLD_SIZE

    expected = _reference_two_heads_grads(make_two_heads(5), loss_terms)
    _assert_bitwise_equal_lists(per_rank, "grads")
    for rank, grads in enumerate(per_rank):
        _assert_close_lists(grads, expected, f"rank {rank} grads")


@pytest.mark.timeout(90)
def test_data_parallel_construction_broadcasts_rank0_params(scenario_results):
    """Ranks seeded differently hold rank 0's initial parameters after wrapping."""
    per_rank = _per_rank(scenario_results, "construction-broadcast")
    expected = _params(make_mlp(100))
    assert any(bitwise_difference(a, b) for a, b in zip(per_rank[1][0], expected)), \
        "test setup: rank 1 should start from different parameters"
    for rank, (_, after) in enumerate(per_rank):
        for index, (param, want) in enumerate(zip(after, expected)):
            assert not bitwise_difference(param, want), f"rank {rank} param {index} is not rank 0's"


@pytest.mark.timeout(90)
def test_data_parallel_buffers_follow_rank0(scenario_results):
    """With broadcast_buffers=True every rank's BatchNorm statistics are rank 0's, as if rank 0 trained alone."""
    per_rank = _per_rank(scenario_results, "buffers")
    reference = nn.BatchNorm1d(3)
    reference.running_mean.fill_(1.0)  # rank 0's starting value
    with torch.no_grad():
        for step in range(STEPS):
            reference(_bn_batch(0, step))
    expected = list(reference.buffers())
    for rank, buffers in enumerate(per_rank):
        for index, (buffer, want) in enumerate(zip(buffers, expected)):
            torch.testing.assert_close(buffer, want, rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"rank {rank} buffer {index}: {m}")
    _assert_bitwise_equal_lists(per_rank, "buffers")


@pytest.mark.timeout(90)
def test_data_parallel_no_sync_state_at_backward_time_decides(scenario_results):
    """Forward under no_sync + backward outside syncs; forward outside + backward under no_sync stays local."""
    per_rank = _per_rank(scenario_results, "sync-decided-at-backward")
    inputs, targets = make_data(8, 2, WORLD_SIZE * BATCH, torch.float64)

    def grads_of(losses):
        model = make_mlp(9, dtype=torch.float64)
        sum(loss(model) for loss in losses).backward()
        return _grads(model)

    def rank_loss(step, rank, scale):
        return lambda model: F.mse_loss(model(_shard(inputs[step], rank, BATCH)),
                                        _shard(targets[step], rank, BATCH)) * scale

    expected_synced = grads_of([rank_loss(0, rank, 1 / WORLD_SIZE) for rank in range(WORLD_SIZE)])
    _assert_bitwise_equal_lists([synced for synced, _ in per_rank], "synced grads")
    for rank, (synced, local) in enumerate(per_rank):
        _assert_close_lists(synced, expected_synced, f"rank {rank} synced grads")
        _assert_close_lists(local, grads_of([rank_loss(1, rank, 1.0)]), f"rank {rank} local grads")


@pytest.mark.timeout(90)
def test_data_parallel_mismatched_models_raise_on_every_rank(scenario_results):
    """A different layer width on one rank raises CollectiveMismatchError on every rank naming the parameter."""
    per_rank = _per_rank(scenario_results, "mismatched-models")
    for rank, (exc_type, message, follow_up) in enumerate(per_rank):
        assert exc_type == "CollectiveMismatchError", f"rank {rank}: {exc_type} {message}"
        assert "0.weight" in message, f"rank {rank} does not name the first differing parameter: {message}"
        assert not bitwise_difference(follow_up, torch.full((2,), float(WORLD_SIZE))), \
            f"rank {rank}: group unusable after the mismatch: {follow_up}"
