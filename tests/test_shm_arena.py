"""Zero-copy buckets in the shared arena: every caller its own region, mappings outlive the group.

* real processes (2 ranks; a segfault must fail the test, not pytest): two
  equal models on one group, then a larger one, keep their own correct
  averages; after ``gradsync.shutdown()`` their ``.grad`` stays readable and
  ``optimizer.step()`` works; after ``init`` again a new group's traffic does
  not overwrite them;
* thread ranks: ``shared_buffer`` regions are disjoint, ranks asking for
  different sizes raise on every rank, and so do ranks all-reducing tensors
  at different places of the arena;
* one rank: a closed segment stays mapped while a view lives, then is freed.

Expected gradients are computed here with plain torch (mean of per-rank gradients).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import gradsync
from _dist import capture_error, free_port, run_threads, run_world
from gradsync import CollectiveMismatchError
from gradsync.collectives import ShmState, ops
from gradsync.process_group import default_communicator

WORLD_SIZE = 2
FEATURES = {"G": 128, "D": 128, "L": 192, "E": 128}  # Linear(n, n): above the 64 KiB small-message size
LR = 0.5


def _build(name):
    torch.manual_seed(sorted(FEATURES).index(name) + 1)
    return nn.Linear(FEATURES[name], FEATURES[name])


def _batch(name, stage, rank):
    generator = torch.Generator().manual_seed(1000 * stage + 10 * rank + sorted(FEATURES).index(name))
    return torch.randn(3, FEATURES[name], generator=generator)


def _loss(module, x):
    return (module(x) ** 2).sum()


def _backward(model, name, stage):
    model.zero_grad(set_to_none=False)
    _loss(model, _batch(name, stage, gradsync.rank())).backward()


def _grads(model):
    return [param.grad.detach().clone() for param in model.parameters()]


def _zero_copy(module):
    return gradsync.DataParallel(module, algorithm="shm", gradient_as_bucket_view=True, bucket_cap_mb=4)


def _rank_arena_lifecycle():
    """(a) G and D of equal size; (b) a larger L after them; (c) shutdown; (d) init again and a new E."""
    rank = gradsync.rank()
    port = int(gradsync.broadcast(torch.tensor([free_port() if rank == 0 else 0]), src=0))
    out = {}
    models = {name: _zero_copy(_build(name)) for name in ("G", "D")}
    for name in ("G", "D"):
        _backward(models[name], name, 1)
    out["a"] = {name: _grads(models[name]) for name in ("G", "D")}
    models["L"] = _zero_copy(_build("L"))
    for name in ("G", "L", "D"):
        _backward(models[name], name, 2)
    out["b"] = {name: _grads(models[name]) for name in ("G", "L", "D")}
    out["shared"] = all(bucket.shared for model in models.values() for bucket in model._reducer.buckets)
    region = default_communicator().options(ShmState).segment.region(0, rank, torch.float32, 4).fill_(7.0)
    gradsync.shutdown()
    out["c_region"] = region.tolist()  # a view of the copy-through segment outlives it too
    out["c_grads"] = _grads(models["G"])
    torch.optim.SGD(models["G"].parameters(), lr=LR).step()
    out["c_params"] = [param.detach().clone() for param in models["G"].parameters()]
    os.environ["MASTER_PORT"] = str(port)
    gradsync.init(backend="gloo", timeout=15)
    new = _zero_copy(_build("E"))
    for stage in (3, 4):
        _backward(new, "E", stage)
    out["d_new"] = _grads(new)
    out["d_old"] = _grads(models["G"])
    return out


def _reference(name, stage):
    """The mean over ranks of each rank's gradient of ``_loss`` at ``stage``, from a fresh ``_build(name)``."""
    module = _build(name)
    for rank in range(WORLD_SIZE):
        (_loss(module, _batch(name, stage, rank)) / WORLD_SIZE).backward()
    return [param.grad.clone() for param in module.parameters()]


def _close(actual, expected, what):
    for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} tensor {index}: {m}")


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_zero_copy_models_keep_their_own_grads_through_growth_shutdown_and_reinit():
    """2 processes, shm + bucket views. (a) G, D of equal size: each .grad is its own average (it was the
    other model's). (b) a larger L: G, D, L all right (G segfaulted). (c) after shutdown G's .grad reads and
    SGD steps (segfault). (d) after init again, a new model's backward leaves G's .grad as it was."""
    per_rank = run_world(WORLD_SIZE, _rank_arena_lifecycle, timeout_s=45, collective_timeout_s=15)
    for rank, out in enumerate(per_rank):
        assert out["shared"], f"rank {rank}: a bucket is not in the shared arena (zero-copy not exercised)"
        for name in ("G", "D"):
            _close(out["a"][name], _reference(name, 1), f"rank {rank} (a) {name}")
        for name in ("G", "L", "D"):
            _close(out["b"][name], _reference(name, 2), f"rank {rank} (b) {name}")
        g_grads = _reference("G", 2)
        assert out["c_region"] == [7.0] * 4, f"rank {rank}: {out['c_region']}"
        _close(out["c_grads"], g_grads, f"rank {rank} (c) G after shutdown")
        _close(out["c_params"], [(param - LR * grad).detach() for param, grad in
                                 zip(_build("G").parameters(), g_grads)], f"rank {rank} (c) G after step")
        _close(out["d_new"], _reference("E", 4), f"rank {rank} (d) new model")
        _close(out["d_old"], g_grads, f"rank {rank} (d) G after re-init")


def test_shared_buffers_are_disjoint():
    """Thread ranks: two shared_buffer calls of equal size get disjoint storage on every rank, and both
    reduce to their own sums (they were one buffer). Growth is in the process test (it segfaulted)."""
    def rank_fn(comm):
        buffers = [ops.shared_buffer(comm, nbytes, "shm") for nbytes in (2**17, 2**17)]
        floats = [buffer.view(torch.float32) for buffer in buffers]
        for index, tensor in enumerate(floats):
            tensor.fill_(comm.rank + 10.0 * index)
        for tensor in floats:
            gradsync.all_reduce(tensor, algorithm="shm", group=comm)
        spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers]
        return [(float(t.min()), float(t.max())) for t in floats], spans

    for rank, (values, spans) in enumerate(run_threads(WORLD_SIZE, rank_fn, timeout_s=30)):
        assert values == [(1.0 + 20.0 * i, 1.0 + 20.0 * i) for i in range(2)], f"rank {rank}: {values}"
        spans.sort()
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), f"rank {rank}: overlap"


def test_shared_buffer_of_different_sizes_raises_on_every_rank():
    """Rank 1 asks for more bytes than rank 0: both raise ValueError naming the sizes and ranks, no hang."""
    def rank_fn(comm):
        try:
            ops.shared_buffer(comm, 4096 * (comm.rank + 1), "shm")
        except ValueError as exc:
            return str(exc)
        return "no error"

    for rank, message in enumerate(run_threads(WORLD_SIZE, rank_fn, timeout_s=30)):
        assert "rank 0" in message and "rank 1" in message and "4096" in message and "8192" in message, \
            f"rank {rank}: {message}"


def test_all_reduce_of_tensors_at_different_places_of_the_arena_raises_on_every_rank():
    """Equal layouts, but rank 0's tensor lies at another arena offset than rank 1's, then in the arena
    on rank 0 only: CollectiveMismatchError on both ranks (a wrong sum, then a hang), and the group still
    reduces right afterwards."""
    numel = 2**15  # 128 KiB of float32: above the small-message size, so the in-arena path

    def rank_fn(comm):
        buffers = [ops.shared_buffer(comm, 4 * numel, "shm").view(torch.float32) for _ in range(2)]
        cases = (buffers[comm.rank], buffers[0] if comm.rank == 0 else torch.ones(numel))
        messages = []
        for tensor in cases:
            try:
                gradsync.all_reduce(tensor, algorithm="shm", group=comm)
                messages.append("no error")
            except CollectiveMismatchError as exc:
                messages.append(str(exc))
        follow_up = gradsync.all_reduce(buffers[1].fill_(comm.rank + 1.0), algorithm="shm", group=comm)
        return messages, (float(follow_up.min()), float(follow_up.max()))

    for rank, (messages, follow_up) in enumerate(run_threads(WORLD_SIZE, rank_fn, timeout_s=30,
                                                             collective_timeout_s=5)):
        assert follow_up == (3.0, 3.0), f"rank {rank}: {follow_up}"
        for message in messages:
            assert f"rank {rank}:" in message and "rank 0: arena 0 offset 0" in message, f"rank {rank}: {message}"
        assert "rank 1: arena 0 offset 131072" in messages[0] and "rank 1: not in the arena" in messages[1]


def test_closed_segment_stays_mapped_while_viewed_then_goes():
    """One rank, no peers: after close() a view still reads and writes its memory; once the last view is
    dropped the mapping is freed (nothing leaks until exit)."""
    import gc
    import weakref

    from gradsync.transport.shm_segment import ShmSegment

    segment = ShmSegment.create(1, 4096, sets=1)
    segment.unlink()
    view = segment.at_offset(0, 64, torch.float64, 8).fill_(2.5)
    mapping = weakref.ref(segment._words.obj)  # the mmap
    segment.close()
    del segment
    gc.collect()
    assert view.add_(1.0).tolist() == [3.5] * 8
    assert mapping() is not None
    del view
    gc.collect()
    assert mapping() is None, "the mapping outlived its last view"


def test_a_rank_arriving_after_its_peer_gave_up_raises_too():
    """Trigger (issue 16 trial): rank 1 reached a shm all_reduce after rank 0 had timed out there and
    raised; rank 1 found rank 0's data, returned a sum and stepped on alone (replicas diverged). A rank
    that gives up now says so in the segment (naming whom it waited for), and a late rank raises."""
    def rank_fn(comm):
        gradsync.all_reduce(torch.ones(4), algorithm="shm", group=comm)  # the segment exists
        if comm.rank == 1:
            time.sleep(0.6)
        tensor = torch.full((4,), float(comm.rank + 1))
        # unverified, as DataParallel's buckets: straight to the segment
        error = capture_error(lambda: ops.all_reduce(tensor, comm, algorithm="shm", verify=False, timeout=0.3))
        return type(error).__name__, str(error)

    (kind0, _), (kind1, message1) = run_threads(2, rank_fn, timeout_s=20)
    assert kind0 == "CollectiveTimeoutError"
    assert kind1 == "CollectiveTimeoutError", message1
    assert "peer rank 0 gave up waiting for this rank (it came too late)" in message1, message1
