"""DataParallel used the way a hostile (or hurried) user would: every mistake raises on every rank.

All scenarios run on in-process thread ranks (``run_threads``): a parameter
replaced, added, removed, frozen or unfrozen after wrapping; a buffer
replaced; ``torch.autograd.grad`` through the wrapper; collectives issued from
inside backward (SimCLR's GatherLayer); an exception inside backward on one
rank; a bad argument on one rank; bool buffers; a group closed under a model.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import gradsync
from gradsync.collectives import ops as collectives
from gradsync.errors import CollectiveMismatchError, GradsyncError, GroupClosedError
from _dist import capture_error, run_threads, run_world



class Two(nn.Module):
    """Two parameter vectors ``a`` and ``b``; the output uses every parameter it has now."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.b = nn.Parameter(torch.ones(2, dtype=torch.float64))

    def forward(self, x):
        return sum((param * x).sum() for param in self.parameters())


def _replace(module):
    module.a = nn.Parameter(torch.ones(2, dtype=torch.float64))


def _add(module):
    module.c = nn.Parameter(torch.ones(2, dtype=torch.float64))


def _remove(module):
    del module.b


def _freeze(module):
    module.a.requires_grad_(False)


CHANGES = {"replaced": (_replace, "'a' was replaced"), "added": (_add, "'c' was added"),
           "removed": (_remove, "'b' was removed"), "frozen": (_freeze, "'a' was frozen")}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("changed_ranks", [(0, 1), (1,)])
def test_parameter_changed_after_wrapping_raises_on_every_rank(change, changed_ranks):
    """Before: the new parameter's gradient was never averaged and the replicas drifted, no error."""
    apply, words = CHANGES[change]

    def body(comm):
        model = gradsync.DataParallel(Two(), group=comm)
        if comm.rank in changed_ranks:
            apply(model.module)
        x = torch.full((2,), comm.rank + 1.0, dtype=torch.float64)
        return capture_error(lambda: model(x).backward())

    for rank, error in enumerate(run_threads(2, body)):
        assert isinstance(error, GradsyncError), (rank, error)
        assert "re-wrap the module in DataParallel after changing its parameters" in str(error)
        assert f"rank {changed_ranks[-1]}: its parameters or buffers changed" in str(error)
        if rank in changed_ranks:
            assert words in str(error)
        elif change != "added":  # the peers are told which wrapped parameter (an added one has no index)
            assert f"changed after wrapping (at {words.split()[0]})" in str(error), str(error)


def test_parameter_unfrozen_after_wrapping_raises_on_every_rank():
    def body(comm):
        module = Two()
        module.b.requires_grad_(False)
        model = gradsync.DataParallel(module, group=comm)
        model.module.b.requires_grad_(True)
        error = capture_error(lambda: model(torch.ones(2, dtype=torch.float64)).backward())
        again = capture_error(lambda: model(torch.ones(2, dtype=torch.float64)))  # broken until re-wrapped
        return error, again

    for error, again in run_threads(2, body):
        assert "'b' was unfrozen" in str(error) and "re-wrap" in str(error)
        assert isinstance(again, GradsyncError) and "reset_after_failure" in str(again)


class Counter(nn.Module):
    """A buffer replaced (not updated in place) at every forward, as ``self.buf = self.buf + 1``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.register_buffer("buf", torch.zeros(2, dtype=torch.float64))

    def forward(self, x):
        self.buf = self.buf + 1
        return (self.w * x * self.buf).sum()


def test_replaced_buffer_is_synchronised_by_name():
    def body(comm):
        model = gradsync.DataParallel(Counter(), group=comm)
        seen = []
        for step in range(3):
            if comm.rank == 1:  # rank 1 drifts; rank 0's value is broadcast at every forward
                model.module.buf = torch.full((2,), 100.0 * (step + 1), dtype=torch.float64)
            model(torch.ones(2, dtype=torch.float64)).backward()
            seen.append(model.module.buf.clone())
        return seen

    for seen in run_threads(2, body):
        assert [value.tolist() for value in seen] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


class Summed(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.register_buffer("buf", torch.zeros(2, dtype=torch.float64))

    def forward(self, x):
        return (self.w * x).sum() + self.buf.sum()


def test_buffer_reshaped_on_one_rank_raises_on_every_rank():
    """Before: the buffer broadcast sent messages of different sizes (Gloo aborts)."""
    def body(comm):
        model = gradsync.DataParallel(Summed(), group=comm)
        if comm.rank == 1:
            model.module.buf = torch.zeros(3, dtype=torch.float64)
        return capture_error(lambda: model(torch.ones(2, dtype=torch.float64)).backward())

    errors = run_threads(2, body)
    assert all("rank 1: its parameters or buffers changed" in str(error) for error in errors)
    assert "changed after wrapping (at 'buf')" in str(errors[0])
    assert "buffer 'buf' changed from shape (2,)" in str(errors[1])


def _linear(comm):
    module = nn.Linear(2, 1, bias=False).double()
    nn.init.zeros_(module.weight)
    return gradsync.DataParallel(module, group=comm)


@pytest.mark.parametrize("mixed", [False, True])
def test_autograd_grad_through_data_parallel_raises_on_every_rank(mixed):
    """Before: each rank got its own gradient ([[1, 1]] and [[2, 2]]), a round of zeros still went out."""
    def body(comm):
        model = _linear(comm)
        x = torch.full((1, 2), comm.rank + 1.0, dtype=torch.float64)
        if mixed and comm.rank == 0:
            error = capture_error(lambda: model(x).sum().backward())
        else:
            error = capture_error(lambda: torch.autograd.grad(model(x).sum(), list(model.parameters())))
        model.module.weight.grad = None
        model(x).sum().backward()  # the next backward is averaged as usual
        return error, model.module.weight.grad.clone()

    for error, grad in run_threads(2, body):
        assert isinstance(error, GradsyncError)
        assert "rank 1: it ran torch.autograd.grad" in str(error) and "use loss.backward()" in str(error)
        assert (not mixed) == ("rank 0: it ran torch.autograd.grad" in str(error))
        torch.testing.assert_close(grad, torch.full((1, 2), 1.5, dtype=torch.float64))


def test_autograd_grad_for_inputs_only_still_works():
    """An input gradient (a gradient penalty) is not a parameter gradient: no error, later backward averaged."""
    def body(comm):
        model = _linear(comm)
        x = torch.full((1, 2), comm.rank + 1.0, dtype=torch.float64, requires_grad=True)
        (x_grad,) = torch.autograd.grad(model(x).sum(), [x])
        model(x.detach()).sum().backward()
        return x_grad, model.module.weight.grad

    for x_grad, grad in run_threads(2, body):
        torch.testing.assert_close(x_grad, torch.zeros(1, 2, dtype=torch.float64))
        torch.testing.assert_close(grad, torch.full((1, 2), 1.5, dtype=torch.float64))


# ---------------------------------------------------------------- collectives inside backward


class GatherLayer(torch.autograd.Function):
    """SimCLR's GatherLayer: all_gather in forward; backward all_reduces the gradients, keeps its own part."""

    @staticmethod
    def forward(ctx, z, comm, backward_op):
        ctx.comm, ctx.backward_op = comm, backward_op
        return torch.cat(collectives.all_gather(z, comm))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.backward_op == "all_reduce":
            collectives.all_reduce(grad, ctx.comm, op="sum")
        else:  # the same sum, from every rank's gradient
            grad = torch.stack(collectives.all_gather(grad, ctx.comm)).sum(0)
        return grad.chunk(ctx.comm.world_size)[ctx.comm.rank], None, None


def _gather_net():
    body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16))
    head = nn.Sequential(nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    nets = nn.ModuleDict({"body": body, "head": head}).double()
    generator = torch.Generator().manual_seed(0)  # the global RNG is shared by the thread ranks
    with torch.no_grad():
        for param in nets.parameters():
            param.copy_(torch.randn(param.shape, dtype=torch.float64, generator=generator) * 0.3)
    return nets


def _gather_data(rank):
    return torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))


@pytest.mark.parametrize("backward_op", ["all_reduce", "all_gather"])
def test_gather_layer_inside_backward_matches_single_process(backward_op):
    """Before: the backward's all_reduce raced the bucket thread (Gloo: "size doesn't match")."""
    class Gathering(nn.Module):
        def __init__(self, comm):
            super().__init__()
            self.nets, self.comm = _gather_net(), comm

        def forward(self, x):
            return self.nets["head"](GatherLayer.apply(self.nets["body"](x), self.comm, backward_op))

    def through_forward(comm):
        model = gradsync.DataParallel(Gathering(comm), group=comm, bucket_cap_mb=300 * 8 / 2**20)
        for _ in range(3):
            for param in model.parameters():
                param.grad = None
            model(_gather_data(comm.rank)).pow(2).sum().backward()
        return len(model.bucket_numels), [param.grad.clone() for param in model.parameters()]

    reference = _gather_net()
    full = torch.cat([_gather_data(0), _gather_data(1)])
    reference["head"](reference["body"](full)).pow(2).sum().backward()
    expected = [param.grad for param in reference.parameters()]
    for num_buckets, grads in run_threads(2, through_forward, timeout_s=30):
        assert num_buckets >= 4
        for grad, want in zip(grads, expected):
            torch.testing.assert_close(grad, want)


class FailOnce(torch.autograd.Function):
    """Identity whose backward raises when ``fail`` is set (a user bug on one rank)."""

    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise RuntimeError("boom in a user backward")
        return grad, None


class Failing(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(2, 8).double(), nn.Linear(8, 1).double()
        self.fail = False
        generator = torch.Generator().manual_seed(0)  # the global RNG is shared by the thread ranks
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, dtype=torch.float64, generator=generator))

    def forward(self, x):
        return self.second(FailOnce.apply(self.first(x), self.fail))


def test_exception_in_backward_on_one_rank_breaks_every_rank_until_reset():
    """Before: the next iteration was out of step (one rank's bucket paired with the other's next message)."""
    def body(comm):
        model = gradsync.DataParallel(Failing(), group=comm, bucket_cap_mb=20 * 8 / 2**20)
        x = torch.full((1, 2), comm.rank + 1.0, dtype=torch.float64)
        model.module.fail = comm.rank == 1
        first = capture_error(lambda: model(x).sum().backward())
        model.module.fail = False
        second = capture_error(lambda: model(x))
        model.reset_after_failure()
        model.zero_grad()
        model(x).sum().backward()
        return first, second, [param.grad.clone() for param in model.parameters()]

    started = time.monotonic()
    per_rank = run_threads(2, body, timeout_s=30, collective_timeout_s=10)
    assert time.monotonic() - started < 5  # no rank waited for a timeout
    (first0, second0, grads0), (first1, second1, grads1) = per_rank
    assert "boom in a user backward" in str(first1)
    assert isinstance(first0, GradsyncError) and "rank 1: its backward raised" in str(first0)
    for second in (second0, second1):
        assert isinstance(second, GradsyncError) and "reset_after_failure" in str(second)
    reference = Failing()
    for rank in range(2):
        reference(torch.full((1, 2), rank + 1.0, dtype=torch.float64)).sum().backward()
    for grad0, grad1, want in zip(grads0, grads1, reference.parameters()):
        torch.testing.assert_close(grad0, want.grad / 2)
        assert torch.equal(grad0, grad1)


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize("argument, value", [("bucket_cap_mb", -1), ("algorithm", "bogus"),
                                             ("compression", "bogus")])
def test_bad_argument_on_one_rank_raises_at_once_on_every_rank(argument, value):
    """Before: the other ranks waited the whole timeout, then blamed the rank as "never reached this call"."""
    def body(comm):
        kwargs = {argument: value} if comm.rank == 1 else {}
        return capture_error(lambda: gradsync.DataParallel(nn.Linear(2, 1), group=comm, **kwargs))

    started = time.monotonic()
    error0, error1 = run_threads(2, body, timeout_s=30, collective_timeout_s=10)
    assert time.monotonic() - started < 5
    assert isinstance(error1, (ValueError, TypeError)) and not isinstance(error1, GradsyncError)
    assert isinstance(error0, CollectiveMismatchError)
    assert "rank 1 has arguments=rejected" in str(error0) and repr(value) in str(error0)


class Masked(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, dtype=torch.float64))
        self.register_buffer("mask", torch.tensor([True, False, rank == 0]))

    def forward(self, x):
        return (self.w * x * self.mask).sum()


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_bool_buffer_is_accepted_and_broadcast(broadcast_buffers):
    """Before: wrapping raised in ``broadcast`` (bool unsupported), naming no buffer."""
    def body(comm):
        model = gradsync.DataParallel(Masked(comm.rank), group=comm, broadcast_buffers=broadcast_buffers)
        model(torch.ones(3, dtype=torch.float64)).backward()
        return model.module.mask.tolist(), model.module.w.grad.tolist()

    for mask, grad in run_threads(2, body):
        assert mask == [True, False, True] and grad == [1.0, 0.0, 1.0]


def test_buffer_without_plain_bytes_is_named():
    def body(comm):
        module = nn.Linear(2, 1)
        module.register_buffer("table", torch.eye(2).to_sparse())
        return capture_error(lambda: gradsync.DataParallel(module, group=comm))

    for error in run_threads(2, body):
        assert isinstance(error, TypeError) and "'table'" in str(error)


def test_model_on_a_closed_group_raises_a_clear_error():
    """Before: the old communicator kept working (ring) or raised AttributeError (shm) after re-init."""
    def body(comm):
        model = gradsync.DataParallel(nn.Linear(2, 1), group=comm)
        comm.close()
        return (capture_error(lambda: model(torch.ones(1, 2))),
                capture_error(lambda: collectives.all_reduce(torch.ones(2), comm)))

    for forward_error, collective_error in run_threads(2, body):
        assert isinstance(forward_error, GroupClosedError)
        assert "wrap the module again after gradsync.init()" in str(forward_error)
        assert isinstance(collective_error, GroupClosedError)


def test_collective_after_a_failed_backward_raises_on_every_rank_until_reset():
    """The user's own collective after a caught backward failure must not pair with a peer's bucket."""
    def body(comm):
        model = gradsync.DataParallel(Failing(), group=comm, bucket_cap_mb=20 * 8 / 2**20)
        x = torch.full((1, 2), comm.rank + 1.0, dtype=torch.float64)
        model.module.fail = comm.rank == 1
        first = capture_error(lambda: model(x).sum().backward())
        model.module.fail = False
        loss = torch.tensor([comm.rank + 1.0])
        refused = capture_error(lambda: collectives.all_reduce(loss, comm))
        model.reset_after_failure()
        collectives.all_reduce(loss, comm)
        return first, refused, loss.item()

    per_rank = run_threads(2, body, timeout_s=30, collective_timeout_s=10)
    for rank, (first, refused, total) in enumerate(per_rank):
        assert isinstance(refused, GradsyncError) and "reset_after_failure" in str(refused), rank
        assert total == 3.0


def _rank_model_used_after_shutdown_and_init():
    results = []
    for algorithm in ("ring", "shm"):
        model = gradsync.DataParallel(nn.Linear(2, 1), algorithm=algorithm, gradient_as_bucket_view=True)
        model(torch.ones(1, 2)).sum().backward()
        gradsync.shutdown()
        gradsync.init(backend="gloo", timeout=10)
        error = capture_error(lambda: model(torch.ones(1, 2)))
        results.append((type(error).__name__, str(error)))
    return results


def test_model_built_before_shutdown_raises_after_init():
    """Before: it kept the old communicator (ring: worked silently; shm: AttributeError)."""
    for per_rank in run_world(2, _rank_model_used_after_shutdown_and_init, timeout_s=60):
        for name, message in per_rank:
            assert name == "GroupClosedError", message
            assert "wrap the module again after gradsync.init()" in message
