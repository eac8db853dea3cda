"""``gradsync train``'s learning rate: --lr-scaling, the warm-up and --lr-schedule at their edges, the scheduler
through a ShardedOptimizer and across a resume, and the bad option lines (all in this process)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradsync
from gradsync.cli import main
from gradsync.train import data, resume
from gradsync.train.config import TrainConfig
from gradsync.train.schedule import LrSchedule
from gradsync.train.setup import make_optimizer, make_scheduler
from gradsync.train.validation import validate, validate_against_data
from _dist import run_threads

NUM_SAMPLES = 1000  # 800 training samples


def _lrs(scheduler, steps: int) -> list[float]:
    """The lr the optimizer steps with at steps 0 .. steps-1 (as the trainer reads it before each step)."""
    seen = []
    for _ in range(steps):
        seen.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return seen


def test_warmup_then_cosine_at_its_edges():
    """lr 0.1 x 4 (linear 128 -> 512), 5 warm-up steps of 20: step 0 = 0.4/5, step 4 (the last warm-up step) =
    0.4, step 5 (the first after) = 0.4 (cosine at 0), then the cosine over the 15 remaining steps."""
    config = TrainConfig(optimizer="sgd", lr=0.1, lr_scaling="linear", base_batch_size=128, batch_size=64,
                         accumulate=2, warmup_steps=5, lr_schedule="cosine")
    scheduler = make_scheduler(make_optimizer([nn.Parameter(torch.zeros(2))], config), config, 20, workers=4)
    lrs = _lrs(scheduler, 20)
    peak = 0.1 * (64 * 2 * 4) / 128
    assert lrs[0] == pytest.approx(peak / 5) and lrs[1] == pytest.approx(2 * peak / 5)
    assert lrs[4] == pytest.approx(peak) and lrs[5] == pytest.approx(peak)
    assert lrs[6] == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi / 15)))
    assert lrs[19] == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi * 14 / 15)))


def test_linear_and_sqrt_scaling_of_the_global_batch():
    """G = batch x accumulate x workers, or --global-batch-size; elastic: the fixed global batch whatever the
    membership; async: one worker's batch x accumulate; none: 1."""
    assert TrainConfig(lr_scaling="linear", base_batch_size=32, batch_size=16, accumulate=2).lr_scale(4) == 4.0
    assert TrainConfig(lr_scaling="sqrt", base_batch_size=32, batch_size=16, accumulate=2).lr_scale(4) == 2.0
    assert TrainConfig(lr_scaling="linear", base_batch_size=24, global_batch_size=96).lr_scale(3) == 4.0
    elastic = TrainConfig(lr_scaling="linear", base_batch_size=32, nproc=4, elastic=True)
    assert elastic.lr_scale(1) == elastic.lr_scale(3) == 4.0  # 32 x 4 workers started, kept when members change
    assert TrainConfig(lr_scaling="linear", base_batch_size=8, mode="async", accumulate=2).lr_scale(9) == 8.0
    assert TrainConfig().lr_scale(8) == 1.0


def test_step_schedule_drops_tenfold_at_goyal_et_al_s_fractions():
    """--lr-schedule step over 90 steps: x0.1 at steps 30, 60 and 80 (Goyal et al.'s epochs of 90)."""
    schedule = LrSchedule(scale=1.0, warmup_steps=0, total_steps=90, kind="step")
    assert [schedule(t) for t in (0, 29, 30, 59, 60, 79, 80, 89)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01, 0.01, 0.001, 0.001])
    assert [LrSchedule(2.0, 3, 10, "constant")(t) for t in (0, 2, 3, 9)] == pytest.approx([2 / 3, 2, 2, 2])


def test_warmup_epochs_are_the_epochs_share_of_the_steps():
    assert TrainConfig(epochs=3, warmup_epochs=1.5).warmup_steps_of(30) == 15
    assert TrainConfig(epochs=3, warmup_epochs=0.1).warmup_steps_of(25) == 1  # rounded up
    assert TrainConfig(warmup_steps=7).warmup_steps_of(30) == 7 and TrainConfig().warmup_steps_of(30) == 0


def test_the_schedule_resumes_from_its_state_dict_and_stretches_without_a_jump():
    """A scheduler rebuilt and loaded from step 7's state dict gives the uninterrupted lrs; a resume at another
    world size (the run now 40 steps, not 20) continues from the current lr down to 0 at the new end."""
    config = TrainConfig(optimizer="sgd", lr=0.1, warmup_steps=4, lr_schedule="cosine")
    fresh = lambda: make_scheduler(make_optimizer([nn.Parameter(torch.zeros(2))], config), config, 20)  # noqa: E731
    uninterrupted = _lrs(fresh(), 20)
    first = fresh()
    _lrs(first, 7)
    state = first.state_dict()
    second = fresh()
    second.load_state_dict(state)
    assert _lrs(second, 13) == pytest.approx(uninterrupted[7:])
    third = fresh()
    third.load_state_dict(state)
    resume.stretch_schedule(third, 40)
    stretched = _lrs(third, 33)
    assert stretched[0] == pytest.approx(uninterrupted[7]) and stretched[-1] < 0.01 * uninterrupted[7]
    assert all(a >= b for a, b in zip(stretched, stretched[1:]))


def test_the_scheduler_drives_a_sharded_optimizer():
    """make_scheduler over a ZeRO-1 ShardedOptimizer (2 thread ranks) sets the lr the pieces step with."""
    config = TrainConfig(optimizer="lars", lr=2.0, warmup_steps=2, lr_schedule="constant")

    def rank_fn(comm):
        model = gradsync.DataParallel(nn.Linear(3, 2), group=comm, shard="optimizer", algorithm="ring")
        optimizer = model.shard_optimizer(make_optimizer(model.parameters(), config))
        scheduler = make_scheduler(optimizer, config, 10, workers=2)
        return [group["lr"] for group in optimizer.param_groups], _lrs(scheduler, 3)

    for groups, lrs in run_threads(2, rank_fn):
        assert groups == [1.0] and lrs == pytest.approx([1.0, 2.0, 2.0])


def test_adam_is_an_alias_of_adamw():
    assert TrainConfig(optimizer="adam").optimizer == "adamw" == TrainConfig().optimizer
    assert isinstance(make_optimizer([nn.Parameter(torch.zeros(1))], TrainConfig(optimizer="adam")),
                      torch.optim.AdamW)


@pytest.mark.parametrize("options,needle", [
    ({"optimizer": "adagrad"}, "unknown --optimizer 'adagrad'; choose one of sgd, adamw, lars, lamb (adam = adamw)"),
    ({"warmup_steps": 50}, "--warmup-steps 50 is longer than the run: 25 optimizer steps (1 epochs)"),
    ({"warmup_epochs": 2.0}, "--warmup-epochs 2.0 is longer than the run's --epochs 1"),
    ({"warmup_steps": 3, "warmup_epochs": 0.5}, "--warmup-steps 3 and --warmup-epochs 0.5 exclude each other"),
    ({"lr_scaling": "linear"}, "--lr-scaling linear needs --base-batch-size B"),
    ({"base_batch_size": 64}, "--base-batch-size applies to --lr-scaling linear or sqrt"),
    ({"lr_scaling": "cube", "base_batch_size": 64}, "unknown --lr-scaling 'cube'; choose one of none, linear, sqrt"),
    ({"lr_schedule": "exp"}, "unknown --lr-schedule 'exp'; choose one of cosine, constant, step"),
], ids=["optimizer", "warmup-steps-too-long", "warmup-epochs-too-long", "both-warmups", "scaling-alone",
        "base-alone", "scaling", "schedule"])
def test_bad_lr_options_are_refused_in_one_line(options, needle):
    config = TrainConfig(num_samples=NUM_SAMPLES, epochs=1, **options)
    with pytest.raises(ValueError) as raised:
        validate(config)
        validate_against_data(config, 1, data.num_train_samples(NUM_SAMPLES))
    assert needle in str(raised.value) and "\n" not in str(raised.value)


def test_the_command_line_refuses_lr_scaling_without_a_base_batch(capsys):
    assert main(["train", "--lr-scaling", "sqrt", "--nproc", "1"]) == 2
    assert "--lr-scaling sqrt needs --base-batch-size B" in capsys.readouterr().err
