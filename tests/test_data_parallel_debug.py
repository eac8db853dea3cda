"""DataParallel's debug mode: each check fires on the mistake it names, on every rank, with its evidence,
and stays quiet on a correct loop (DistributedSampler + set_epoch, loss / k under no_sync, clipping).

The loops run on in-process thread ranks (``run_threads``); ``gradsync train --debug``'s trainer runs in
this process as a one-rank group.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradsync
from gradsync.cli import build_parser
from gradsync.errors import CollectiveMismatchError, DebugCheckError, EpochOrderWarning
from gradsync.parallel.debug_findings import MASK64, Report, ce_loss_scale, checksum, decide
from gradsync.train.config import TrainConfig
from gradsync.train.validation import validate
from _dist import capture_error, run_threads

NUM_SAMPLES, BATCH_SIZE = 96, 8  # 2 ranks: 6 batches per rank per epoch
SPLITS = (("train", 160), ("test", 40))  # the trainer's data file in test_gradsync_train_debug_...
NOT_DIVIDED = ("loss_not_divided", "grads_divided_instead")  # mistakes whose loss is not divided by k


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(NUM_SAMPLES, 6, generator=generator),
                         torch.randint(0, 4, (NUM_SAMPLES,), generator=generator))


def _hex(value: int) -> str:
    return f"{value & MASK64:016x}"


def _grads(model) -> list:
    return [param.grad for param in model.parameters()]


def _mistake_before_step(model, comm, mistake: str | None) -> None:
    if mistake == "all_reduce_grads":  # the user's own sum on top of DataParallel's average
        for param in model.parameters():
            gradsync.all_reduce(param.grad, group=comm)
    elif mistake == "untracked_all_reduce":  # as torch.distributed.all_reduce: the sum, .grad's version kept
        for param in model.parameters():
            summed = gradsync.all_reduce(param.grad.clone(), group=comm)
            param.grad.data.copy_(summed)  # .data: autograd's version counter does not see the write
    elif mistake == "grad_written_per_rank":
        for param in model.parameters():
            param.grad = param.grad + 0.01 * (comm.rank + 1)


def _loop(comm, mistake: str | None = None, epochs: int = 1, accumulate: int = 1, clip: bool = False,
          **options) -> dict:
    """A training loop with at most one ``mistake``; what it raised, its step checksums, the checks' counts."""
    model = gradsync.DataParallel(_net(), group=comm, debug=True, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = _dataset()
    sampler = None if mistake == "no_sampler" else DistributedSampler(
        dataset, num_replicas=comm.world_size, rank=comm.rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)
    step_sums = []  # what each step used, as debug mode's checksum

    def train() -> None:
        for epoch in range(epochs):
            if sampler is not None and mistake != "no_set_epoch":
                sampler.set_epoch(epoch)
            batches = list(loader)
            for start in range(0, len(batches) - accumulate + 1, accumulate):
                window = batches[start:start + accumulate]
                for index, (x, y) in enumerate(window):
                    synced = index == len(window) - 1 and mistake != "no_sync_never_exited"
                    with nullcontext() if synced else model.no_sync():
                        loss = F.cross_entropy(model(x), y)
                        (loss if mistake in NOT_DIVIDED else loss / len(window)).backward()
                _mistake_before_step(model, comm, mistake)
                if mistake == "grads_divided_instead":  # as good as loss / k
                    for param in model.parameters():
                        param.grad.div_(len(window))
                if clip:  # scales .grad in place: legitimate, never "reduced twice"
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                step_sums.append(checksum(_grads(model)))
                optimizer.step()
                optimizer.zero_grad()

    error = capture_error(train)
    return {"error": error, "step_sums": step_sums, "forwards": model._debug.forwards, "steps": model._debug.steps}


def _errors(results: list[dict], check: str) -> list[DebugCheckError]:
    """Each rank's DebugCheckError (asserted to be one, naming ``check``)."""
    for rank, result in enumerate(results):
        assert isinstance(result["error"], DebugCheckError), (rank, result["error"])
        assert check in result["error"].checks, (rank, result["error"].checks, str(result["error"]))
        assert f"(on rank {rank})" in str(result["error"])
    return [result["error"] for result in results]


# -------------------------------------------------------------------------- each check provoked


def test_debug_same_input_on_every_rank_names_the_missing_distributed_sampler():
    """Without a DistributedSampler every rank gets the same batch: raised at forward #1 with its checksum."""
    results = run_threads(2, lambda comm: _loop(comm, mistake="no_sampler"))
    expected = _hex(checksum([_dataset().tensors[0][:BATCH_SIZE]]))  # the loader's first batch, unshuffled
    for error in _errors(results, "same_input"):
        assert "at forward #1 every rank's input batch is bitwise identical" in str(error)
        assert f"checksum {expected} on ranks 0, 1" in str(error)
        assert "is a DistributedSampler missing?" in str(error)


def test_debug_missing_set_epoch_warns_on_every_rank_where_the_order_repeats():
    """Without set_epoch epoch 2 repeats epoch 1's order: a warning from forward #(batches per epoch + 1)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_threads(2, lambda comm: _loop(comm, mistake="no_set_epoch", epochs=2))
    assert all(result["error"] is None for result in results), [result["error"] for result in results]
    order = [w for w in caught if issubclass(w.category, EpochOrderWarning)]
    assert sorted(str(w.message).split("(on rank ")[1][0] for w in order) == ["0", "1"]
    batches_per_epoch = NUM_SAMPLES // 2 // BATCH_SIZE
    for w in order:
        assert f"from forward #{batches_per_epoch + 1} on, the input batches repeat" in str(w.message)
        assert "on ranks 0, 1" in str(w.message) and "set_epoch(epoch) missing" in str(w.message)


@pytest.mark.parametrize("mistake", ["all_reduce_grads", "untracked_all_reduce"])
def test_debug_own_all_reduce_of_grads_is_reported_as_reduced_twice(mistake):
    """A user's all_reduce (sum) of p.grad after backward makes .grad world_size x the average: raised,
    also when the write does not move .grad's version counter (Gloo's torch.distributed.all_reduce)."""
    world_size = 2
    results = run_threads(world_size, lambda comm: _loop(comm, mistake=mistake, epochs=1))
    num_params = len(list(_net().parameters()))
    for error in _errors(results, "reduced_twice"):
        assert (f"on ranks 0, 1 at optimizer step 1 .grad was {world_size:.4f}x what DataParallel wrote "
                f"after averaging ({num_params} of the {num_params} parameter(s) with a gradient, "
                f"first '0.weight'), world size {world_size}") in str(error)
        assert "the gradients were reduced twice" in str(error) and "grads_differ" not in error.checks


@pytest.mark.parametrize("mistake, cause", [
    ("no_sync_never_exited", "ranks 0, 1 stepped with the gradients of 4 parameter(s) (first '0.weight') "
                             "accumulated under no_sync()"),
    ("grad_written_per_rank", "was written or changed per rank after backward"),
])
def test_debug_gradients_not_synchronised_differ_across_ranks_at_the_step(mistake, cause):
    """Gradients that DataParallel did not average differ across ranks at the step: each rank's checksum."""
    results = run_threads(2, lambda comm: _loop(comm, mistake=mistake))
    sums = [_hex(result["step_sums"][0]) for result in results]  # what each rank stepped with
    assert sums[0] != sums[1]
    for error in _errors(results, "grads_differ"):
        assert f"at optimizer step 1 the gradients differ across ranks (checksum of every .grad: rank 0 " \
               f"{sums[0]}, rank 1 {sums[1]})" in str(error)
        assert cause in str(error)


@pytest.mark.parametrize("world_size", [1, 2])
def test_debug_loss_not_divided_by_the_accumulation_steps_is_raised(world_size):
    """k = 4 micro-batches whose CE loss is not divided by 4: scale 1 each, 4x the mean-loss gradient."""
    k = 4
    results = run_threads(world_size, lambda comm: _loop(comm, mistake="loss_not_divided", epochs=2,
                                                         accumulate=k))
    for error in _errors(results, "loss_not_divided"):
        assert f"{k} micro-batches were accumulated under no_sync() and each one's loss had scale 1.0000" \
               in str(error)
        assert f"the accumulated gradient is {k:.3f}x the gradient of the mean loss" in str(error)


# -------------------------------------------------------------------------- correct code stays quiet


def test_debug_accepts_gradients_divided_by_k_instead_of_the_loss():
    """Loss not divided, but every .grad divided by k before the step: correct, so no error."""
    for result in run_threads(2, lambda comm: _loop(comm, mistake="grads_divided_instead", epochs=2,
                                                    accumulate=4)):
        assert result["error"] is None, result["error"]
        assert result["steps"] == 2


@pytest.mark.parametrize("options", [{}, {"compression": "onebit"}, {"gradient_as_bucket_view": True}],
                         ids=["exact", "onebit", "bucket_view"])
def test_debug_stays_quiet_on_a_correct_loop(options):
    """DistributedSampler + set_epoch, loss / 2 over 2 micro-batches, clipping, 3 epochs: no error, no
    warning, and every forward and step was checked."""
    epochs, accumulate = 3, 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_threads(2, lambda comm: _loop(comm, epochs=epochs, accumulate=accumulate, clip=True,
                                                    **options))
    batches_per_epoch = NUM_SAMPLES // 2 // BATCH_SIZE
    for result in results:
        assert result["error"] is None, result["error"]
        assert result["forwards"] == epochs * batches_per_epoch
        assert result["steps"] == epochs * batches_per_epoch // accumulate
    assert not [w for w in caught if issubclass(w.category, EpochOrderWarning)]


def _rank_join(comm) -> tuple:
    """Uneven inputs under join(): rank r has 2 + 2r batches; debug mode must not hang or misfire."""
    model = gradsync.DataParallel(_net(), group=comm, debug=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(comm.rank)
    with model.join():
        for _ in range(2 + 2 * comm.rank):
            F.cross_entropy(model(torch.randn(4, 6, generator=generator)), torch.tensor([0, 1, 2, 3])).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model._debug.steps, [param.detach().clone() for param in model.parameters()]


def test_debug_under_join_shadows_the_exchange_and_stays_quiet():
    """Ranks that left join() shadow the debug exchange: no hang, no error, replicas equal at the end."""
    results = run_threads(3, _rank_join)
    assert [steps for steps, _ in results] == [2, 4, 6]
    for _, params in results[1:]:
        for mine, first in zip(params, results[0][1]):
            assert torch.equal(mine, first)


def _rank_join_same_batches(comm):
    """Rank 0 leaves join() after one batch; ranks 1 and 2 then train on the same batches."""
    model = gradsync.DataParallel(_net(), group=comm, debug=True)
    generator = torch.Generator().manual_seed(min(comm.rank, 1))  # ranks 1 and 2: one stream
    first = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + comm.rank))

    def train():
        with model.join():
            for x in [first] + [torch.randn(4, 6, generator=generator) for _ in range(2 if comm.rank else 0)]:
                F.cross_entropy(model(x), torch.tensor([0, 1, 2, 3])).backward()
    return capture_error(train)


def test_debug_under_join_a_rank_that_left_raises_with_the_others():
    """Identical batches on the ranks still in join() raise on them and on the rank that left (no hang)."""
    for rank, error in enumerate(run_threads(3, _rank_join_same_batches)):
        assert isinstance(error, DebugCheckError) and error.checks == ("same_input",), (rank, error)
        assert "at forward #2 the input batches of every rank still in join() are bitwise identical" in str(error)
        assert "on ranks 1, 2" in str(error)


# -------------------------------------------------------------------------- turning it on


def test_gradsync_debug_env_turns_it_on_and_an_explicit_argument_wins(monkeypatch):
    """GRADSYNC_DEBUG=1 enables the checks (same batch everywhere raises); debug=False overrides it."""
    monkeypatch.setenv("GRADSYNC_DEBUG", "1")

    def body(comm):
        on, off = gradsync.DataParallel(_net(), group=comm), gradsync.DataParallel(_net(), group=comm, debug=False)
        x = torch.ones(2, 6)
        off(x).sum().backward()  # the same batch on both ranks: not checked
        return on.debug, off.debug, capture_error(lambda: on(x))

    for on, off, error in run_threads(2, body):
        assert on is True and off is False
        assert isinstance(error, DebugCheckError) and error.checks == ("same_input",)


def test_gradsync_debug_env_with_a_bad_value_and_ranks_that_disagree_raise(monkeypatch):
    """GRADSYNC_DEBUG=maybe is a ValueError naming it; debug on one rank only is a mismatch on every rank."""
    monkeypatch.setenv("GRADSYNC_DEBUG", "maybe")
    for error in run_threads(2, lambda comm: capture_error(lambda: gradsync.DataParallel(_net(), group=comm))):
        assert isinstance(error, ValueError) and "GRADSYNC_DEBUG" in str(error) and "'maybe'" in str(error)
    monkeypatch.delenv("GRADSYNC_DEBUG")
    errors = run_threads(2, lambda comm: capture_error(
        lambda: gradsync.DataParallel(_net(), group=comm, debug=comm.rank == 0)))
    for error in errors:
        assert isinstance(error, CollectiveMismatchError) and "debug" in str(error), error


@pytest.mark.timeout(60)
def test_gradsync_train_debug_sets_it_and_the_real_loop_stays_quiet(tmp_path, single_process):
    """``gradsync train --debug`` parses into the config, is sync-only, and the trainer's loop
    (DistributedSampler, set_epoch, loss / --accumulate) runs 2 epochs with every check on, none firing."""
    from gradsync.train.loop import Trainer

    assert build_parser().parse_args(["train", "--debug"]).debug is True
    assert build_parser().parse_args(["train"]).debug is False
    with pytest.raises(ValueError, match="--debug applies to --mode sync"):
        validate(TrainConfig(debug=True, mode="local-sgd"))
    config = TrainConfig(nproc=1, num_samples=200, epochs=2, batch_size=16, accumulate=2, debug=True,
                         progress=False)
    generator = np.random.default_rng(0)  # MNIST-1D's arrays (x (N, 40) float32, y (N,) int64), random
    arrays = {f"x_{split}": generator.standard_normal((n, 40)).astype(np.float32) for split, n in SPLITS}
    arrays.update({f"y_{split}": generator.integers(0, 10, n) for split, n in SPLITS})
    np.savez(tmp_path / "data.npz", **arrays)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EpochOrderWarning)
        trainer = Trainer(config, tmp_path / "data.npz", tmp_path)
        summary = trainer.run()
    batches = SPLITS[0][1] // config.batch_size
    assert trainer.model.debug is True and summary["config"]["debug"] is True
    assert trainer.model._debug.forwards == batches * config.epochs
    assert trainer.model._debug.steps == batches // config.accumulate * config.epochs


# -------------------------------------------------------------------------- the pure parts


def test_decide_names_the_ranks_that_share_a_batch_among_three():
    """Ranks 0 and 2 with one batch, rank 1 with another: the pair is named, not 'every rank'."""
    reports = [Report(present=1, forward=3, has_input=1, input_sum=value) for value in (7, 8, 7)]
    error, checks, warning = decide(reports, ["w"], rank=1)
    assert checks == ("same_input",) and warning is None
    assert f"at forward #3 some ranks received bitwise-identical input batches (ranks 0, 2 share checksum " \
           f"{_hex(7)})" in error
    reports[1] = Report(present=0)  # rank 1 has left join(): its (stale) input does not count
    assert "the input batches of every rank still in join() are bitwise identical (checksum " \
           f"{_hex(7)} on ranks 0, 2)" in decide(reports, ["w"], rank=1)[0]


def test_checksum_sees_one_flipped_bit_and_two_swapped_elements():
    """The checksum is over bits and positions, not a float sum."""
    x = torch.randn(100)
    flipped = x.clone()
    flipped.view(torch.int32)[17] ^= 1
    swapped = x.clone()
    swapped[[3, 4]] = x[[4, 3]]
    assert len({checksum([x]), checksum([flipped]), checksum([swapped])}) == 3
    assert checksum([x]) == checksum([x.clone()])


@pytest.mark.parametrize("divide_by", [1, 3])
def test_ce_loss_scale_reads_the_scale_and_refuses_other_losses(divide_by):
    """c of c * CE (weighted too) to 1e-5; label smoothing and MSE give None."""
    z = torch.randn(16, 5, requires_grad=True)
    y = torch.arange(16) % 5
    losses = {"ce": F.cross_entropy(z, y), "weighted": F.cross_entropy(z, y, weight=torch.rand(5) + 0.1),
              "smoothing": F.cross_entropy(z, y, label_smoothing=0.1), "mse": F.mse_loss(z, torch.randn(16, 5))}
    for name, loss in losses.items():
        (grad,) = torch.autograd.grad(loss / divide_by, z)
        scale = ce_loss_scale(z.detach(), grad)
        if name in ("ce", "weighted"):
            assert scale == pytest.approx(1 / divide_by, rel=1e-5), name
        else:
            assert scale is None, (name, scale)


def test_a_debug_model_collected_during_an_optimizer_step_does_not_break_it():
    """CI: a parameter-server thread's ``optimizer.step()`` raised "OrderedDict mutated during iteration":
    a debug DataParallel of an earlier test was garbage-collected (in another thread, at any moment)
    while torch iterated its global step pre-hooks, and its finalizer removed its hook from that dict.
    Here the collection happens inside the iteration, deterministically."""
    import gc

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def body(comm):
        models = [gradsync.DataParallel(_net(), group=comm, debug=True)]

        def drop_and_collect(*args) -> None:
            models.clear()
            gc.collect()

        collect = register_optimizer_step_pre_hook(drop_and_collect)
        models.append(gradsync.DataParallel(_net(), group=comm, debug=True))  # its hook after `collect`
        param = nn.Parameter(torch.zeros(2))
        param.grad = torch.ones(2)
        try:
            torch.optim.SGD([param], lr=1.0).step()
        finally:
            collect.remove()
        return param.detach().tolist()

    assert run_threads(1, body) == [[-1.0, -1.0]]
