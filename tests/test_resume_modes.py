"""Resuming from a checkpoint continues exactly: every mode and compressor ends bitwise equal to the run without a stop.

One world trains to the end, checkpointing every K steps and keeping all of
them; the checkpoints after step ``RESUME_STEP`` are then removed, as if the
job had died just before writing them, and a second world with the same
options resumes from ``RESUME_STEP``. Both worlds are Gloo processes
(:func:`_dist.run_world`), so this tests what a checkpoint holds (optimizer
state, local-SGD replicas, error feedback, warm-up counters, accumulation,
data position, RNG), not the restart mechanics (``test_fault_tolerance``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gradsync.fault import checkpoint
from gradsync.train import data
from gradsync.train.config import TrainConfig
from _dist import run_world

pytestmark = pytest.mark.dist

NUM_SAMPLES, EPOCHS, BATCH_SIZE = 1280, 2, 32  # 2 workers: 16 steps per epoch
STEPS_PER_EPOCH = 16
# Resume 5 steps into the second epoch, at a multiple of local SGD's H = 3 and after onebit's warm-up.
CHECKPOINT_EVERY, RESUME_STEP = 7, 21


def _rank_train(options: dict, data_path: str, out_dir: str) -> dict:
    from gradsync.train.loop import Trainer

    trainer = Trainer(TrainConfig(**options), Path(data_path), Path(out_dir))
    trainer.run()
    resumed_from = trainer.resumed_from.step if trainer.resumed_from else None
    return {"params": {name: tensor.clone() for name, tensor in trainer.model.module.state_dict().items()},
            "resumed_from": resumed_from, "step": trainer.state.step}


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> str:
    return str(data.prepare(tmp_path_factory.mktemp("mnist1d"), NUM_SAMPLES))


def _step_records(out_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("step", "epoch", "loss", "lr")} for r in records if r["kind"] == "step"]


def _epoch_records(out_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("epoch", "train_loss", "test_loss", "test_accuracy")}
            for r in records if r["kind"] == "epoch"]


@pytest.mark.parametrize("extra", [
    {"mode": "local-sgd", "sync_every": 3},
    # fragment 0 is sent after step 21 (its offset 3 of H = 6) and applied after 22: in flight at the checkpoint
    {"mode": "local-sgd", "sync_every": 6, "outer_optimizer": "nesterov", "outer_compression": "int8",
     "outer_fragments": 2},
    {"compression": "onebit", "compression_warmup_steps": 5},
    {"compression": "powersgd", "powersgd_rank": 1},
    {"accumulate": 2, "optimizer": "sgd", "lr_schedule": "constant", "lr": 0.05},
    {"deterministic": True, "global_batch_size": 64, "micro_shards": 4},
], ids=["local-sgd", "diloco-int8-fragments", "onebit", "powersgd", "accumulate-sgd", "deterministic"])
@pytest.mark.timeout(120)
def test_resumed_world_ends_bitwise_equal_to_the_uninterrupted_one(extra, data_path, tmp_path):
    batch_size = BATCH_SIZE // extra.get("accumulate", 1)
    checkpoints = tmp_path / "checkpoints"
    options = {"nproc": 2, "num_samples": NUM_SAMPLES, "epochs": EPOCHS, "batch_size": batch_size,
               "progress": False, "checkpoint_dir": str(checkpoints), "checkpoint_every": CHECKPOINT_EVERY,
               "keep_checkpoints": 100, **extra}
    whole_dir, resumed_dir = tmp_path / "whole", tmp_path / "resumed"
    whole_dir.mkdir(), resumed_dir.mkdir()
    whole = run_world(2, _rank_train, options, data_path, str(whole_dir), timeout_s=90)
    assert [r["resumed_from"] for r in whole] == [None, None]
    for step, folder in checkpoint._step_folders(checkpoints):
        if step > RESUME_STEP:
            shutil.rmtree(folder)
    resumed = run_world(2, _rank_train, options, data_path, str(resumed_dir), timeout_s=90)

    assert [r["resumed_from"] for r in resumed] == [RESUME_STEP, RESUME_STEP]
    assert resumed[0]["step"] == whole[0]["step"] == EPOCHS * STEPS_PER_EPOCH
    for rank in range(2):
        for name, tensor in whole[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], tensor), (rank, name)
    whole_steps, resumed_steps = _step_records(whole_dir), _step_records(resumed_dir)
    assert [r["step"] for r in resumed_steps] == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    assert resumed_steps == whole_steps  # the same losses and lrs, each step once
    assert _epoch_records(resumed_dir) == _epoch_records(whole_dir)  # the same train and test losses
