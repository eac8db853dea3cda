"""A checkpoint resumes at another world size: no sample of the epoch lost or used twice, and
``--deterministic`` ends bitwise equal to the run without a stop.

One world trains to the end, checkpointing every few steps and keeping them
all; the checkpoints after ``resume_step`` are removed (the job "died" just
before writing them) and a world of another size resumes. Each rank records
the sample ids of every step it trains (wrapping ``Trainer._step``), so the
test counts, per epoch, what the first world did up to the checkpoint plus
what the resumed one did, against the epoch's permutation drawn here.
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

NUM_SAMPLES, NUM_TRAIN = 1000, 800


def _rank_train(options: dict, data_path: str, out_dir: str) -> dict:
    from gradsync.train.loop import Trainer

    trainer = Trainer(TrainConfig(**options), Path(data_path), Path(out_dir))
    steps, train_step = [], trainer._step

    def recording_step(micro_batches):
        steps.append((trainer.state.epoch, trainer.state.step + 1, torch.cat(list(micro_batches)).tolist()))
        return train_step(micro_batches)

    trainer._step = recording_step
    summary = trainer.run()
    return {"params": {name: tensor.clone() for name, tensor in trainer.model.module.state_dict().items()},
            "steps": steps, "step": trainer.state.step, "samples": summary["samples"] if summary else None,
            "resumed_from": trainer.resumed_from.step if trainer.resumed_from else None}


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> str:
    return str(data.prepare(tmp_path_factory.mktemp("mnist1d"), NUM_SAMPLES))


def _stop_and_resume(options: dict, first: int, then: int, resume_step: int, data_path: str, tmp_path: Path):
    """The whole run at ``first`` workers, then a resume at ``then`` from step ``resume_step``."""
    checkpoints = tmp_path / "checkpoints"
    options = {"num_samples": NUM_SAMPLES, "progress": False, "checkpoint_dir": str(checkpoints),
               "keep_checkpoints": 100, **options}
    whole_dir, resumed_dir = tmp_path / "whole", tmp_path / "resumed"
    whole_dir.mkdir(), resumed_dir.mkdir()
    whole = run_world(first, _rank_train, {**options, "nproc": first}, data_path, str(whole_dir), timeout_s=90)
    for step, folder in checkpoint._step_folders(checkpoints):
        if step > resume_step:
            shutil.rmtree(folder)
    resumed = run_world(then, _rank_train, {**options, "nproc": then}, data_path, str(resumed_dir), timeout_s=90)
    assert [r["resumed_from"] for r in resumed] == [resume_step] * then
    events = [json.loads(line) for line in (resumed_dir / "events.jsonl").read_text().splitlines()]
    return whole, resumed, [e for e in events if e["event"] == "resumed"]


def _samples_by_epoch(results: list[dict], steps: range) -> dict[int, list[int]]:
    """Every sample id the ranks trained on in ``steps`` (1-based run steps), by epoch."""
    used: dict[int, list[int]] = {}
    for result in results:
        for epoch, step, ids in result["steps"]:
            if step in steps:
                used.setdefault(epoch, []).extend(ids)
    return used


@pytest.mark.timeout(120)
def test_shrinking_from_3_to_2_workers_loses_and_repeats_no_sample(data_path, tmp_path):
    """3 workers (batch 8 x accumulate 2, TopK residuals), stopped 4 steps into epoch 1, resumed by 2.

    Per epoch the samples trained are a prefix of the epoch's permutation without repeats, short of
    the end by less than one global batch; epoch 1 has 4 steps of 48 samples and 19 of 32.
    """
    options = {"epochs": 2, "batch_size": 8, "accumulate": 2, "compression": "topk", "checkpoint_every": 5}
    # 800 / 3 -> 267 per rank (DistributedSampler pads to 801): 16 steps of 48 samples per epoch
    whole, resumed, announced = _stop_and_resume(options, 3, 2, 20, data_path, tmp_path)
    assert whole[0]["step"] == 32 and resumed[0]["step"] == 16 + 4 + 19  # 608 samples left: 19 steps of 32
    used = _samples_by_epoch(whole, range(1, 21))
    for epoch, ids in _samples_by_epoch(resumed, range(21, 100)).items():
        used.setdefault(epoch, []).extend(ids)
    for epoch, ids in used.items():
        permutation = torch.randperm(NUM_TRAIN, generator=torch.Generator().manual_seed(0 + epoch)).tolist()
        assert len(set(ids)) == len(ids), f"epoch {epoch}: a sample was used twice"
        assert sorted(ids) == sorted(permutation[:len(ids)]), f"epoch {epoch}: not a prefix of the permutation"
        assert NUM_TRAIN - len(ids) < 48, (epoch, len(ids))
    assert len(used[1]) == 4 * 48 + 19 * 32
    assert resumed[0]["samples"] == 16 * 48 + len(used[1])  # the summary counts each step's own global batch
    (event,) = announced
    assert (event["world_size_from"], event["world_size_to"], event["sample"]) == (3, 2, 192)
    line = event["line"]
    assert line.startswith("written by 3 workers, now 2: data position kept (sample 192 of 800 in epoch 1")
    assert "global batch now 32 samples, was 48" in line and "that of rank 2 is dropped" in line
    assert "mean of the 3 old ranks'" in line


@pytest.mark.timeout(120)
def test_deterministic_run_resumed_at_another_world_size_is_bitwise_the_uninterrupted_one(data_path, tmp_path):
    """--deterministic, 4 micro-shards: written by 4 workers at step 6 of 10, resumed by 2: the same bits."""
    options = {"epochs": 1, "global_batch_size": 80, "deterministic": True, "micro_shards": 4,
               "checkpoint_every": 3}
    whole, resumed, announced = _stop_and_resume(options, 4, 2, 6, data_path, tmp_path)
    assert whole[0]["step"] == resumed[0]["step"] == 10
    for rank in range(2):
        for name, tensor in whole[0]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], tensor), (rank, name)
    assert sorted(_samples_by_epoch(resumed, range(7, 11))[0]) == sorted(
        torch.randperm(NUM_TRAIN, generator=torch.Generator().manual_seed(0)).tolist()[480:800])
    (event,) = announced
    assert "written by 4 workers, now 2: data position kept (sample 480 of 800 in epoch 0" in event["line"]
    assert "the trajectory is unchanged" in event["line"]


@pytest.mark.timeout(120)
def test_local_sgd_grown_from_2_to_3_workers_continues_the_epoch(data_path, tmp_path):
    """Local SGD (H = 3), written by 2 workers at step 10 (sample 320), resumed by 3: 480 samples left make
    10 steps of 48; no sample twice; the third rank starts from the replicas' mean and all end equal."""
    options = {"epochs": 1, "batch_size": 16, "mode": "local-sgd", "sync_every": 3, "checkpoint_every": 5}
    whole, resumed, announced = _stop_and_resume(options, 2, 3, 10, data_path, tmp_path)
    assert whole[0]["step"] == 25 and resumed[0]["step"] == 20
    used = _samples_by_epoch(whole, range(1, 11))[0] + _samples_by_epoch(resumed, range(11, 21))[0]
    permutation = torch.randperm(NUM_TRAIN, generator=torch.Generator().manual_seed(0)).tolist()
    assert sorted(used) == sorted(permutation)  # all 800, each once
    for rank in (1, 2):  # the epoch's end averages the replicas
        for name, tensor in resumed[0]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], tensor), (rank, name)
    line = announced[0]["line"]
    assert "global batch now 48 samples, was 32" in line and "rank 2 starts a fresh one from (seed, rank)" in line
    assert "local-SGD replicas averaged over the 2 old ones; optimizer states: ranks 0-1 keep theirs, rank 2 gets" \
        in line
