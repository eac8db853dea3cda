"""DataParallel's engine: overlap, bucket rebuild, unused/shared parameters, BatchNorm, bucket views, join.

Most scenarios run on in-process thread ranks (``run_threads``), each checked
against a single-process computation of the same training written out here:
the average of every rank's local gradient, a parameter no rank used keeping
``grad is None``, and under ``join()`` the average over the ranks that still
had data. Overlap and the timeout of a rank that skips backward run in real
Gloo processes.
"""

import contextlib
import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from _dist import run_threads, run_world
from _reference import bitwise_difference
from gradsync.transport.thread import ThreadWorld

_SEED_LOCK = threading.Lock()  # thread ranks share torch's global RNG
LR = 0.05
STEPS = 4
BATCH = 5  # per rank
FEATURES, HIDDEN, CLASSES = 6, 16, 3


def seeded(seed, build):
    """``build()`` right after ``torch.manual_seed(seed)``, safe across thread ranks."""
    with _SEED_LOCK:
        torch.manual_seed(seed)
        return build()


def lists_differ(actual, expected):
    """"" when two lists of tensors are bitwise equal, else the first difference."""
    for index, (a, b) in enumerate(zip(actual, expected)):
        difference = bitwise_difference(a, b)
        if difference:
            return f"tensor {index}: {difference}"
    return "" if len(actual) == len(expected) else f"lengths {len(actual)} != {len(expected)}"


def _close(actual, expected, what, rtol=1e-9, atol=1e-12):
    assert (actual is None) == (expected is None), f"{what}: {actual} vs {expected}"
    if actual is not None:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


class Branchy(nn.Module):
    """Shared (tied) weights, a branch chosen per call, a frozen head and BatchNorm, in float64."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, HIDDEN, bias=False)
        self.norm = nn.BatchNorm1d(HIDDEN)
        self.branch_a = nn.Linear(HIDDEN, HIDDEN)
        self.branch_b = nn.Linear(HIDDEN, HIDDEN)
        self.never_used = nn.Linear(HIDDEN, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, CLASSES)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(HIDDEN, CLASSES)
        self.decode = nn.Linear(HIDDEN, FEATURES, bias=False)
        self.decode.weight = self.embed.weight  # tied: used twice in forward, reduced once

    def forward(self, x, branch):
        hidden = torch.tanh(self.norm(self.embed(x)))
        hidden = torch.tanh((self.branch_a if branch == "a" else self.branch_b)(hidden))
        recon = F.linear(hidden, self.decode.weight.t())  # (batch, FEATURES)
        return self.out(hidden) + self.frozen(hidden), recon


def make_branchy(seed=0):
    return seeded(seed, lambda: Branchy().double())


def branch_of(rank, step):
    return "a" if (rank + step) % 3 else "b"  # differs by rank and by step


def branchy_data(world_size, steps=STEPS):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(steps, world_size, BATCH, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (steps, world_size, BATCH), generator=generator)
    return x, y


def branchy_loss(module, x, y, branch):
    logits, recon = module(x, branch)
    return F.cross_entropy(logits, y) + 0.1 * F.mse_loss(recon, x)


def _make_optimizer(params):
    # weight decay and momentum make "no gradient" (None) differ from "zero gradient"
    return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.01)


def _train_branchy(comm, view, bucket_cap_mb=100 / 2**20, algorithm="ring"):
    world_size, rank = comm.world_size, comm.rank
    model = gradsync.DataParallel(make_branchy(), bucket_cap_mb=bucket_cap_mb, group=comm,
                                  gradient_as_bucket_view=view, algorithm=algorithm)
    if algorithm == "shm" and view:
        assert all(bucket.shared for bucket in model._reducer.buckets)  # zero-copy buckets
    optimizer = _make_optimizer(model.parameters())
    x, y = branchy_data(world_size)
    grads = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        branchy_loss(model, x[step, rank], y[step, rank], branch_of(rank, step)).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.module.parameters()])
        optimizer.step()
    buffers = [b.clone() for b in model.module.buffers()]
    return [p.detach().clone() for p in model.module.parameters()], grads, buffers


def reference_branchy(world_size):
    """One process: average of per-rank gradients, rank 0's BatchNorm statistics kept (broadcast_buffers)."""
    module = make_branchy()
    optimizer = _make_optimizer(module.parameters())
    x, y = branchy_data(world_size)
    grads = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        start = copy.deepcopy(module.norm.state_dict())
        rank0_after = None
        for rank in range(world_size):
            module.norm.load_state_dict(start)
            (branchy_loss(module, x[step, rank], y[step, rank], branch_of(rank, step)) / world_size).backward()
            if rank == 0:
                rank0_after = copy.deepcopy(module.norm.state_dict())
        module.norm.load_state_dict(rank0_after)
        grads.append([None if p.grad is None else p.grad.clone() for p in module.parameters()])
        optimizer.step()
    return ([p.detach().clone() for p in module.parameters()], grads,
            [b.clone() for b in module.buffers()])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
@pytest.mark.parametrize("algorithm", ["ring", "shm"])
def test_unused_shared_batchnorm_match_single_process(world_size, view, algorithm):
    """Branches that differ by rank and step, a never-used layer, a frozen head, tied weights and
    BatchNorm: every rank ends with the single-process parameters, gradients and buffers
    (shm with bucket views: zero-copy buckets in shared memory)."""
    per_rank = run_threads(world_size, lambda comm: _train_branchy(comm, view, algorithm=algorithm), timeout_s=60)
    expected_params, expected_grads, expected_buffers = reference_branchy(world_size)
    names = [name for name, _ in make_branchy().named_parameters()]
    for rank, (params, grads, buffers) in enumerate(per_rank):
        for step in range(STEPS):
            for name, actual, expected in zip(names, grads[step], expected_grads[step]):
                _close(actual, expected, f"rank {rank} step {step} grad of {name}")
        for name, actual, expected in zip(names, params, expected_params):
            _close(actual, expected, f"rank {rank} parameter {name}")
        if rank == 0:  # the others adopt rank 0's buffers at their next forward
            for actual, expected in zip(buffers, expected_buffers):
                _close(actual, expected, "rank 0 buffer")
    never_used = names.index("never_used.weight")
    assert all(grads[step][never_used] is None for _, grads, _ in per_rank for step in range(STEPS))
    for rank in range(1, world_size):
        assert not lists_differ(per_rank[rank][0], per_rank[0][0]), f"rank {rank} drifted from rank 0"


def test_bucket_view_grads_live_in_the_buckets():
    """gradient_as_bucket_view: every .grad is a view into a bucket, so gradients exist once in memory."""
    def body(comm):
        model = gradsync.DataParallel(make_branchy(), group=comm, gradient_as_bucket_view=True)
        x, y = branchy_data(comm.world_size)
        branchy_loss(model, x[0, comm.rank], y[0, comm.rank], "a").backward()
        buckets = [bucket.flat for bucket in model._reducer.buckets]
        inside = []
        for param in model.module.parameters():
            if param.grad is None:
                continue
            ptr = param.grad.data_ptr()
            inside.append(any(b.data_ptr() <= ptr < b.data_ptr() + b.numel() * b.element_size()
                              for b in buckets))
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.grad is not None)
        return inside, grad_bytes
    for inside, grad_bytes in run_threads(2, body):
        assert inside and all(inside), inside
        assert grad_bytes > 0


def test_bucket_view_zero_grad_in_place_keeps_views():
    """zero_grad(set_to_none=False) zeroes the bucket in place; the next step accumulates into it correctly."""
    def body(comm, view):
        model = gradsync.DataParallel(seeded(1, lambda: nn.Linear(4, 3).double()), group=comm,
                                      gradient_as_bucket_view=view)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(2)
        for _ in range(3):
            x = torch.randn(comm.world_size, 5, 4, generator=generator, dtype=torch.float64)
            optimizer.zero_grad(set_to_none=False)
            model(x[comm.rank]).square().mean().backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]
    with_views = run_threads(2, lambda comm: body(comm, True))
    with_copies = run_threads(2, lambda comm: body(comm, False))
    assert not lists_differ(with_views[0], with_copies[0])
    assert not lists_differ(with_views[1], with_views[0])


class Reordered(nn.Module):
    """Registers ``late`` first but uses it last in forward, so backward produces its gradient first."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(64, 4)
        self.early = nn.Linear(8, 64)

    def forward(self, x):
        return self.late(torch.relu(self.early(x)))


def test_buckets_rebuilt_in_observed_order_after_first_iteration():
    """Buckets start in reverse registration order and are rebuilt from the ready order seen in iteration 1."""
    cap_mb = 300 * 4 / 2**20  # 300 float32 per bucket

    def body(comm):
        model = gradsync.DataParallel(seeded(0, Reordered), bucket_cap_mb=cap_mb, group=comm)
        names = [name for name, _ in model.module.named_parameters()]
        before = [[names[i] for i in bucket] for bucket in model._reducer.assignment]
        order = []
        for name, param in model.module.named_parameters():
            param.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
        model(torch.randn(3, 8)).sum().backward()
        after = [[names[i] for i in bucket] for bucket in model._reducer.assignment]
        return before, order, after
    for before, order, after in run_threads(2, body):
        # registration: late.weight(256) late.bias(4) early.weight(512) early.bias(64)
        assert before == [["early.bias"], ["early.weight"], ["late.bias", "late.weight"]]
        assert order[:2] == ["late.bias", "late.weight"] or order[:2] == ["late.weight", "late.bias"]
        expected, filled, current = [], 0, []
        numel = {"late.weight": 256, "late.bias": 4, "early.weight": 512, "early.bias": 64}
        for name in order:  # the same greedy packing, written out
            if current and filled + numel[name] > 300:
                expected.append(current)
                current, filled = [], 0
            current.append(name)
            filled += numel[name]
        expected.append(current)
        assert after == expected and after != before


class MaybeSkip(nn.Module):
    """Returns ``2 * x`` without touching its parameters when ``skip``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x, skip):
        return 2 * x if skip else self.linear(x)


def test_rank_whose_backward_reaches_no_parameter_still_syncs():
    """A rank whose backward reaches the output but no parameter still joins the sync with zeros."""
    def body(comm):
        model = gradsync.DataParallel(seeded(0, lambda: MaybeSkip().double()), group=comm)
        x = torch.ones(4, 3, dtype=torch.float64, requires_grad=True)
        model(x, skip=comm.rank == 1).sum().backward()
        return [p.grad.clone() for p in model.parameters()]
    per_rank = run_threads(2, body)
    expected_weight = torch.full((3, 3), 4.0, dtype=torch.float64) / 2  # rank 0's grad, rank 1 adds zeros
    torch.testing.assert_close(per_rank[0][0], expected_weight)
    assert not lists_differ(per_rank[0], per_rank[1])


# ---------------------------------------------------------------- join: uneven inputs


BATCHES_PER_RANK = [3, 5, 8]


def _join_data():
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(len(BATCHES_PER_RANK), max(BATCHES_PER_RANK), BATCH, FEATURES, generator=generator,
                    dtype=torch.float64)
    y = torch.randn(len(BATCHES_PER_RANK), max(BATCHES_PER_RANK), BATCH, CLASSES, generator=generator,
                    dtype=torch.float64)
    return x, y


def _join_model():
    return seeded(5, lambda: nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Tanh(),
                                           nn.Linear(HIDDEN, CLASSES)).double())


@pytest.mark.parametrize("algorithm, view", [("ring", False), ("shm", True)], ids=["ring", "shm-zero-copy"])
def test_join_with_3_5_8_batches_averages_over_ranks_with_data(algorithm, view):
    """Ranks with 3, 5 and 8 batches finish without a hang; each step averages the ranks that had a batch."""
    x, y = _join_data()

    def body(comm):
        model = gradsync.DataParallel(_join_model(), group=comm, bucket_cap_mb=100 / 2**20, algorithm=algorithm,
                                      gradient_as_bucket_view=view)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        with model.join():
            for step in range(BATCHES_PER_RANK[comm.rank]):
                optimizer.zero_grad()
                F.mse_loss(model(x[comm.rank, step]), y[comm.rank, step]).backward()
                optimizer.step()
        return [p.detach().clone() for p in model.parameters()], [b.clone() for b in model.module.buffers()]

    per_rank = run_threads(3, body, timeout_s=60)
    reference = _join_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(max(BATCHES_PER_RANK)):
        active = [rank for rank, count in enumerate(BATCHES_PER_RANK) if step < count]
        optimizer.zero_grad()
        start = copy.deepcopy(reference[1].state_dict())
        first_after = None
        for rank in active:  # buffers follow the lowest active rank
            reference[1].load_state_dict(start)
            (F.mse_loss(reference(x[rank, step]), y[rank, step]) / len(active)).backward()
            first_after = first_after or copy.deepcopy(reference[1].state_dict())
        reference[1].load_state_dict(first_after)
        optimizer.step()
    expected_params = [p.detach() for p in reference.parameters()]
    for rank, (params, buffers) in enumerate(per_rank):
        for actual, expected in zip(params, expected_params):
            _close(actual, expected, f"rank {rank} parameter")
        assert not lists_differ(params, per_rank[2][0]), f"rank {rank} differs from the last joiner"
        assert not lists_differ(buffers, per_rank[2][1]), f"rank {rank} buffers differ"


def test_join_with_accumulation_and_zero_batches():
    """A rank with no batch at all and no_sync micro-batches on the others still finishes correctly."""
    x, y = _join_data()
    counts = [0, 2, 4]

    def body(comm):
        model = gradsync.DataParallel(seeded(5, lambda: nn.Linear(FEATURES, CLASSES).double()), group=comm)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        with model.join():
            for step in range(counts[comm.rank]):
                optimizer.zero_grad()
                with model.no_sync():
                    (F.mse_loss(model(x[comm.rank, step, :2]), y[comm.rank, step, :2]) / 2).backward()
                (F.mse_loss(model(x[comm.rank, step, 2:4]), y[comm.rank, step, 2:4]) / 2).backward()
                optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    per_rank = run_threads(3, body, timeout_s=60)
    torch.manual_seed(5)
    reference = nn.Linear(FEATURES, CLASSES).double()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(max(counts)):
        active = [rank for rank, count in enumerate(counts) if step < count]
        optimizer.zero_grad()
        for rank in active:
            for rows in (slice(0, 2), slice(2, 4)):
                (F.mse_loss(reference(x[rank, step, rows]), y[rank, step, rows]) / 2 / len(active)).backward()
        optimizer.step()
    for rank, params in enumerate(per_rank):
        for actual, expected in zip(params, reference.parameters()):
            _close(actual, expected.detach(), f"rank {rank} parameter")


def test_join_disagreeing_no_sync_raises_on_every_rank():
    """Under join(), ranks that disagree on no_sync in one iteration get a clear error, not a hang."""
    def body(comm):
        model = gradsync.DataParallel(nn.Linear(3, 2), group=comm)
        try:
            with model.join():
                with model.no_sync() if comm.rank == 1 else contextlib.nullcontext():
                    model(torch.ones(2, 3)).sum().backward()
        except gradsync.GradsyncError as exc:
            return str(exc)
        return "no error"
    for message in run_threads(2, body):
        assert "no_sync" in message, message


def test_join_cannot_nest():
    def body(comm):
        model = gradsync.DataParallel(nn.Linear(3, 2), group=comm)
        with pytest.raises(gradsync.GradsyncError, match="nested"):
            with model.join():
                with model.join():
                    pass
    run_threads(2, body)


# ---------------------------------------------------------------- real processes


def _overlap_scenario():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Linear(384, 384) for _ in range(8)]
    model = gradsync.DataParallel(nn.Sequential(*layers), bucket_cap_mb=0.6)
    ready = {}
    layers[0].weight.register_post_accumulate_grad_hook(
        lambda p: ready.__setitem__("first_layer", time.perf_counter()))
    results = []
    for step in range(3):
        model(torch.randn(512, 384)).square().mean().backward()
        spans = model.last_bucket_spans
        results.append((len(spans), spans[0][1], spans[-1][2], ready["first_layer"]))
        model.zero_grad(set_to_none=True)
    return results


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_first_bucket_allreduce_starts_before_backward_of_first_layer_ends():
    """Overlap really happens: bucket 0's AllReduce starts before the last gradient (layer 0) is ready."""
    for rank, steps in enumerate(run_world(2, _overlap_scenario, timeout_s=80)):
        for step, (num_buckets, first_start, last_end, first_layer_ready) in enumerate(steps):
            assert num_buckets >= 4, f"rank {rank}: expected several buckets, got {num_buckets}"
            assert first_start < first_layer_ready, (
                f"rank {rank} step {step}: bucket 0 started {1e3 * (first_start - first_layer_ready):.2f} ms "
                f"after layer 0's gradient was ready")
            assert last_end >= first_layer_ready


def _skip_backward_scenario():
    model = gradsync.DataParallel(nn.Linear(3, 2))
    out = model(torch.ones(2, 3))
    if gradsync.rank() == 1:
        time.sleep(8)  # never calls backward
        return "skipped"
    try:
        out.sum().backward()
    except gradsync.CollectiveTimeoutError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_rank_skipping_backward_gives_clear_error_naming_it():
    """A rank that never runs backward makes the other raise CollectiveTimeoutError naming it, within the timeout."""
    started = time.monotonic()
    results = run_world(2, _skip_backward_scenario, timeout_s=60, collective_timeout_s=3.0)
    assert results[1] == "skipped"
    assert results[0].startswith("CollectiveTimeoutError") and "peer rank 1" in results[0], results[0]
    assert time.monotonic() - started < 40


def test_silent_peer_costs_one_timeout_not_one_per_bucket():
    """With many buckets and a peer that never runs backward, backward raises within the timeout plus 2 s."""
    timeout_s = 1.5

    def body(comm):
        model = gradsync.DataParallel(seeded(0, lambda: nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])),
                                      group=comm, bucket_cap_mb=100 / 2**20)
        out = model(torch.ones(2, 8))
        if comm.rank == 1:
            time.sleep(3 * timeout_s)
            return None
        started = time.monotonic()
        with pytest.raises(gradsync.CollectiveTimeoutError, match="peer rank 1"):
            out.sum().backward()
        return time.monotonic() - started, len(model.bucket_numels)

    elapsed, num_buckets = run_threads(2, body, timeout_s=30, collective_timeout_s=timeout_s)[0]
    assert num_buckets >= 6
    assert elapsed < timeout_s + 2, f"backward took {elapsed:.1f} s to report a silent peer"


class _PauseInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a stretch of backward with no gradient ready."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.05)
        return grad


class PausingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.last = nn.Linear(16, 600)  # 9,600 + 600 floats, ~40 KB

    def forward(self, x):
        return self.last(_PauseInBackward.apply(torch.relu(self.first(x))))


def test_rebuild_ends_a_bucket_where_backward_pauses(monkeypatch):
    """After iteration 1, a pause in backward longer than PAUSE_S splits a bucket that already holds
    MIN_SPLIT_BYTES, so its AllReduce starts during the pause; without a pause the bucket stays whole."""
    from gradsync.parallel import rebuild
    monkeypatch.setattr(rebuild, "MIN_SPLIT_BYTES", 1024)

    def body(comm):
        model = gradsync.DataParallel(seeded(0, PausingNet), group=comm)
        assert len(model.bucket_numels) == 1, model.bucket_numels  # 40 KB: one bucket at first
        model(torch.ones(2, 8)).sum().backward()
        return [[model._reducer.names[i] for i in bucket] for bucket in model._reducer.assignment]

    for assignment in run_threads(2, body):
        assert [sorted(bucket) for bucket in assignment] == [["last.bias", "last.weight"],
                                                              ["first.bias", "first.weight"]], assignment


def test_module_without_trainable_parameters_is_a_no_op():
    """All parameters frozen: forward and backward (through the input) work and nothing is communicated."""
    def body(comm):
        net = seeded(0, lambda: nn.Linear(3, 2).double())
        net.requires_grad_(False)
        model = gradsync.DataParallel(net, group=comm)
        x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
        model(x).sum().backward()
        return x.grad.clone(), [p.grad for p in model.parameters()], model.bucket_numels
    for x_grad, grads, numels in run_threads(2, body):
        assert grads == [None, None] and numels == []
        torch.testing.assert_close(x_grad, seeded(0, lambda: nn.Linear(3, 2).double()).weight.sum(0).expand(2, 3))


def test_uneven_evaluation_under_no_grad_does_not_communicate():
    """Ranks may evaluate different numbers of batches under no_grad (buffers only sync in training forwards)."""
    def body(comm):
        model = gradsync.DataParallel(seeded(0, lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))),
                                      group=comm)
        model.eval()
        before = comm.stats.bytes_sent
        with torch.no_grad():
            outputs = [model(torch.ones(2, 4) * step) for step in range(3 + comm.rank)]
        return len(outputs), comm.stats.bytes_sent - before
    (count0, sent0), (count1, sent1) = run_threads(2, body, timeout_s=30, collective_timeout_s=5)
    assert (count0, count1) == (3, 4)
    assert sent0 == sent1 == 0


class WithBuffer(nn.Module):
    def __init__(self, buffer_numel, frozen=False):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.linear.bias.requires_grad_(not frozen)
        self.register_buffer("table", torch.zeros(buffer_numel))


@pytest.mark.parametrize("differs, needles", [
    ("buffer", ["'table'", "shape (5,)", "shape (6,)"]),
    ("requires_grad", ["'linear.bias'", "requires_grad=True", "requires_grad=False"]),
])
def test_construction_names_differing_buffer_or_requires_grad(differs, needles):
    """Construction compares every parameter and buffer, requires_grad included, and names the first difference."""
    def body(comm):
        odd = comm.rank == 1
        module = WithBuffer(6 if odd and differs == "buffer" else 5,
                            frozen=odd and differs == "requires_grad")
        with pytest.raises(gradsync.CollectiveMismatchError) as caught:
            gradsync.DataParallel(module, group=comm)
        return str(caught.value)
    for message in run_threads(2, body):
        for needle in needles:
            assert needle in message, message


@pytest.mark.parametrize("bucket_cap_mb", [0, -1, float("inf"), float("nan"), 1e-12, "25", True])
def test_bad_bucket_cap_mb_names_the_argument(bucket_cap_mb):
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        gradsync.DataParallel(nn.Linear(2, 2), bucket_cap_mb=bucket_cap_mb,
                              group=gradsync.Communicator(ThreadWorld(1).transport(0)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero_copy_buckets_reduce_in_place_and_match_single_process(world_size, monkeypatch):
    """shm + bucket views: buckets above the small-message size are reduced in the shared arena
    (no copy in), and training still equals the single-process average of per-rank gradients."""
    from gradsync.collectives import shm as shm_collectives
    calls = []
    real = shm_collectives._all_reduce_in_arena
    monkeypatch.setattr(shm_collectives, "_all_reduce_in_arena",
                        lambda *args: calls.append(args[0].numel()) or real(*args))
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS, world_size, BATCH, 128, generator=generator, dtype=torch.float64)
    y = torch.randn(STEPS, world_size, BATCH, 8, generator=generator, dtype=torch.float64)
    build = lambda: nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 8)).double()  # noqa: E731

    def body(comm):
        model = gradsync.DataParallel(seeded(4, build), group=comm, algorithm="shm", gradient_as_bucket_view=True,
                                      bucket_cap_mb=0.1)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            F.mse_loss(model(x[step, comm.rank]), y[step, comm.rank]).backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()], [b.shared for b in model._reducer.buckets]

    per_rank = run_threads(world_size, body, timeout_s=60)
    reference = seeded(4, build)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(world_size):
            (F.mse_loss(reference(x[step, rank]), y[step, rank]) / world_size).backward()
        optimizer.step()
    for rank, (params, shared) in enumerate(per_rank):
        assert all(shared), shared
        for actual, expected in zip(params, reference.parameters()):
            _close(actual, expected.detach(), f"rank {rank} parameter")
        assert not lists_differ(params, per_rank[0][0])
    assert calls and max(calls) * 8 > 64 * 2**10, calls  # the in-place path ran on the big bucket


def test_dropped_model_is_freed_with_its_buckets():
    """Parameters keep their hooks in C++, out of the cycle collector's sight: the hooks must not hold
    the reducer, or every DataParallel (buckets, compressor state) would live forever."""
    import gc
    import weakref

    def body(comm):
        model = gradsync.DataParallel(torch.nn.Linear(8, 4), group=comm, compression="onebit")
        model(torch.randn(3, 8)).sum().backward()
        return [weakref.ref(model), weakref.ref(model._reducer), weakref.ref(model.compression)]

    refs = run_threads(2, body)
    gc.collect()  # here, not in the rank threads: a collection already running in another thread is skipped
    assert [[ref() is None for ref in rank_refs] for rank_refs in refs] == [[True, True, True]] * 2
