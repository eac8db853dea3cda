"""The trainer's explicit state, the default algorithm and the summary's algorithm names (no processes)."""

from __future__ import annotations

import dataclasses
import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import gradsync
from gradsync.parallel.sync_round import SLOTS_PER_RANK
from gradsync.cli import build_parser
from gradsync.parallel.staleness import StalenessStats
from gradsync.train import resume
from gradsync.train.config import TrainConfig
from gradsync.train.validation import validate
from gradsync.train.meter import StepTimes
from gradsync.train.setup import make_optimizer, make_scheduler
from gradsync.train.state import TrainState
from gradsync.train.summary import algorithm_line
from _dist import run_threads


def _busy_state() -> TrainState:
    staleness = StalenessStats()
    for value in (0, 2, 1, 2):
        staleness.record(value)
    return TrainState(step=37, epoch=1, steps_in_epoch=12, epoch_loss_sum=13.25, epoch_loss_steps=12,
                      times=StepTimes(1.5, 2.25, 0.75, 0.5, 0.125, 0.0625), staleness=staleness,
                      step_bytes_sent=123_456, bytes_sent_offset=-40, bytes_received_offset=17,
                      epoch_records=[{"kind": "epoch", "epoch": 0, "test_accuracy": 0.5}], eval_s=0.3,
                      elapsed_before_s=9.5)


def _replica(local_sgd: bool, bytes_counted: tuple[int, int]) -> resume.Replica:
    module = nn.Linear(3, 2)
    config = TrainConfig()
    optimizer = make_optimizer(module.parameters(), config)
    model = SimpleNamespace(module=module, bucket_layout=[[0, 1]], local_steps=2,
                            comm=SimpleNamespace(stats=SimpleNamespace(bytes_sent=bytes_counted[0],
                                                                       bytes_received=bytes_counted[1])))
    return resume.Replica(model, optimizer, make_scheduler(optimizer, config, 100), local_sgd)


def _through_file(part: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(part, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # the checkpoint's promise: plain data only


@pytest.mark.parametrize("local_sgd", [False, True], ids=["sync", "local-sgd"])
def test_train_state_round_trips_through_a_checkpoint(local_sgd):
    state = _busy_state()
    saved = _replica(local_sgd, (1000, 2000))
    shared = _through_file(resume.shared_state(state, saved, TrainConfig(), "{}\n", elapsed_s=11.0))
    own = _through_file(resume.rank_state(state, saved))
    assert own["bytes_sent"] == 960 and own["bytes_received"] == 2017  # run totals, not this attempt's
    # a new attempt whose transport has counted (10, 20) bytes so far continues the totals
    restored = resume.state_from(shared, own, bytes_counted=(10, 20))
    expected = dataclasses.replace(state, bytes_sent_offset=950, bytes_received_offset=1997,
                                   elapsed_before_s=11.0, resumed_from_step=37)
    assert restored == expected
    assert restored != state
    fresh = _replica(local_sgd, (10, 20))
    resume.restore_replica(fresh, shared, own)
    for name, tensor in saved.model.module.state_dict().items():
        assert torch.equal(fresh.model.module.state_dict()[name], tensor)
    assert fresh.scheduler.state_dict() == saved.scheduler.state_dict()


def test_train_state_moves_to_the_next_epoch():
    state = TrainState(epoch=2, steps_in_epoch=5)
    state.add_step_loss(0.5)
    state.add_step_loss(0.25)
    assert torch.equal(state.epoch_loss(), torch.tensor([0.75, 2.0], dtype=torch.float64))
    state.next_epoch()
    assert (state.epoch, state.steps_in_epoch, state.epoch_loss_steps, state.epoch_loss_sum) == (3, 0, 0, 0.0)


def test_the_default_algorithm_is_auto_and_resume_pins_it():
    assert TrainConfig().algorithm == "auto"
    assert build_parser().parse_args(["train"]).algorithm == "auto"
    validate(TrainConfig())
    validate(TrainConfig(mode="async"))  # the default is no --algorithm choice of its own
    with pytest.raises(ValueError, match="--algorithm 'ring' there, 'auto' here"):
        resume.check_compatible(resume.config_fields(TrainConfig(algorithm="ring")), TrainConfig(), 4, 4, "ckpt")


def test_bucket_algorithms_name_what_auto_chose_per_bucket():
    def wrap(comm):
        module = nn.Sequential(nn.Linear(40, 64), nn.Linear(64, 10))
        model = gradsync.DataParallel(module, group=comm, algorithm="auto", bucket_cap_mb=10_000 / 2**20)
        model(torch.randn(4, 40)).sum().backward()
        return model.bucket_algorithms(), gradsync.LocalSGD(nn.Linear(4, 2), sync_every=2, group=comm,
                                                            algorithm="tree")
    (buckets, local_sgd), _ = run_threads(2, wrap)
    # the gradients, one used-flag per parameter (4) and the status slots of each rank (2) in the last bucket
    assert sum(nbytes for nbytes, _ in buckets) == 4 * (40 * 64 + 64 + 64 * 10 + 10 + 4 + 2 * SLOTS_PER_RANK)
    assert len(buckets) >= 2 and all(name in gradsync.ALGORITHMS and name != "auto" for _, name in buckets)
    assert local_sgd.bucket_algorithms() == [(4 * (4 * 2 + 2), "tree")]


def test_the_end_of_run_line_names_the_algorithm_per_bucket_size():
    summary = {"mode": "sync", "config": {"algorithm": "auto"},
               "algorithms": [{"bucket_nbytes": 20_840, "algorithm": "shm"}]}
    assert algorithm_line(summary) == "gradsync: AllReduce algorithm: auto chose shm for 1 bucket of 20.4 KiB"
    summary = {"mode": "sync", "config": {"algorithm": "auto"},
               "algorithms": [{"bucket_nbytes": 8 * 2**20, "algorithm": "ring"},
                              {"bucket_nbytes": 2**20, "algorithm": "tree"},
                              {"bucket_nbytes": 25 * 2**20, "algorithm": "ring"}]}
    assert algorithm_line(summary) == ("gradsync: AllReduce algorithm: auto chose ring for 2 buckets of "
                                       "8.0 MiB to 25.0 MiB; tree for 1 bucket of 1.0 MiB")
    local = {"mode": "local-sgd", "config": {"algorithm": "ring"},
             "algorithms": [{"bucket_nbytes": 1024, "algorithm": "ring"}]}
    assert algorithm_line(local) == "gradsync: AllReduce algorithm: ring for 1 parameter average of 1.0 KiB"
    sharded = {"mode": "sync", "shard": "gradients", "config": {"algorithm": "auto"},
               "algorithms": [{"bucket_nbytes": 1024, "algorithm": "shm reduce_scatter"}]}
    assert algorithm_line(sharded) == ("gradsync: --shard gradients: reduce-scatter (gradients) and all-gather "
                                       "(parameters) algorithm: auto chose shm for 1 bucket of 1.0 KiB")
    pushed = {"mode": "async", "algorithms": [{"bucket_nbytes": 20_840, "algorithm": "parameter_server"}]}
    assert "parameter server" in algorithm_line(pushed)
