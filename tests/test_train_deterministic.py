"""``gradsync train --global-batch-size`` and ``--deterministic``: the trajectory does not depend on the world size.

Worlds of Gloo processes run the trainer (:func:`_dist.run_world`) on a tiny
job (800 training samples, one epoch of 8 steps of 96 samples); rank 0 writes
``model.pt`` as ``gradsync train`` does, and runs compare file against file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradsync.cli import main
from gradsync.train import data, resume
from gradsync.train.config import TrainConfig
from gradsync.train.validation import validate, validate_against_data
from _dist import run_world

pytestmark = pytest.mark.dist

NUM_SAMPLES, GLOBAL_BATCH = 1000, 96  # 800 training samples: 8 steps per epoch
JOB = {"num_samples": NUM_SAMPLES, "epochs": 1, "global_batch_size": GLOBAL_BATCH, "progress": False,
       "lr_schedule": "constant"}


def _rank_train(options: dict, data_path: str, out_dir: str) -> dict:
    from gradsync.train.loop import Trainer

    trainer = Trainer(TrainConfig(**options), Path(data_path), Path(out_dir))
    summary = trainer.run()
    return {"steps": trainer.state.step, "threads": torch.get_num_threads(),
            "samples": summary["samples"] if summary else None, "lr": summary["lr"] if summary else None}


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> str:
    return str(data.prepare(tmp_path_factory.mktemp("mnist1d"), NUM_SAMPLES))


def _train(world_size: int, options: dict, data_path: str, out: Path) -> tuple[dict, list]:
    out.mkdir()
    results = run_world(world_size, _rank_train, {**JOB, **options, "nproc": world_size}, data_path, str(out),
                        timeout_s=60)
    return torch.load(out / "model.pt"), results


def _records(out: Path, kind: str, keys: tuple[str, ...]) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{key: record[key] for key in keys} for record in records if record["kind"] == kind]


@pytest.mark.timeout(120)
def test_deterministic_model_pt_is_bitwise_equal_at_world_sizes_1_2_3_4(data_path, tmp_path):
    """--deterministic --global-batch-size 96 --micro-shards 4: model.pt of 2, 3 (2+1+1 micro-shards) and 4 workers
    is torch.equal to 1 worker's on every parameter (auto picks per world size; 1 torch thread each), and so are
    the step losses and the evaluation."""
    options = {"deterministic": True, "micro_shards": 4}
    reference, results = _train(1, options, data_path, tmp_path / "ws1")
    assert results[0]["steps"] == 8 and results[0]["threads"] == 1
    for world_size in (2, 3, 4):
        params, results = _train(world_size, options, data_path, tmp_path / f"ws{world_size}")
        assert params.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(params[name], tensor), (world_size, name)
        for kind, keys in (("step", ("step", "loss")), ("epoch", ("train_loss", "test_loss", "test_accuracy"))):
            assert _records(tmp_path / f"ws{world_size}", kind, keys) == _records(tmp_path / "ws1", kind, keys)
        assert [r["threads"] for r in results] == [1] * world_size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer,lr,world_size,shard", [
    ("lamb", 0.01, 2, "parameters"), pytest.param("lars", 2.0, 4, "optimizer", marks=pytest.mark.slow)])
def test_deterministic_lars_and_lamb_with_warmup_and_scaling_are_bitwise_at_any_world_size_and_shard(
        optimizer, lr, world_size, shard, data_path, tmp_path):
    """--deterministic --optimizer lamb (lars) with --lr-scaling linear, --warmup-steps 3 and --lr-schedule step:
    model.pt of 2 workers at ZeRO-3 (4 at ZeRO-1) is torch.equal to 1 unsharded worker's (the trust ratios' norms
    are exact sums across the pieces), and the summary records the lr scaled by 96 / 32."""
    options = {"deterministic": True, "micro_shards": 4, "optimizer": optimizer, "lr": lr, "lr_scaling": "linear",
               "base_batch_size": 32, "warmup_steps": 3, "lr_schedule": "step"}
    reference, _ = _train(1, options, data_path, tmp_path / "ws1")
    params, results = _train(world_size, {**options, "shard": shard}, data_path, tmp_path / "sharded")
    for name, tensor in reference.items():
        assert torch.equal(params[name], tensor), name
    got = results[0]["lr"]
    assert (got["base"], got["scaled"], got["global_batch_size"], got["warmup_steps"]) == (lr, 3 * lr, 96, 3)


@pytest.mark.timeout(120)
def test_global_batch_size_gives_the_same_samples_per_step_at_world_sizes_1_2_4(data_path, tmp_path):
    """--global-batch-size 96 without --deterministic: 96 samples per step at every world size (96, 48, 24 per
    worker), the same samples in each step, so the parameters agree with 1 worker's (allclose; not bitwise)."""
    reference, results = _train(1, {"optimizer": "sgd", "lr": 0.05}, data_path, tmp_path / "ws1")
    assert results[0]["samples"] == 8 * GLOBAL_BATCH
    for world_size in (2, 4):
        params, results = _train(world_size, {"optimizer": "sgd", "lr": 0.05}, data_path,
                                 tmp_path / f"ws{world_size}")
        assert results[0]["steps"] == 8 and results[0]["samples"] == 8 * GLOBAL_BATCH
        for name, tensor in reference.items():
            assert torch.allclose(params[name], tensor, rtol=1e-5, atol=1e-6), (world_size, name)


def _config(**options) -> TrainConfig:
    return TrainConfig(**{"num_samples": NUM_SAMPLES, **options})


@pytest.mark.parametrize("options,world_size,needle", [
    ({"global_batch_size": 96, "batch_size": 16}, 1, "--batch-size 16 and --global-batch-size 96 exclude each other"),
    ({"global_batch_size": 0}, 1, "--global-batch-size must be an int >= 1, got 0"),
    ({"global_batch_size": 100}, 3, "--global-batch-size 100 does not split evenly over world size 3 x "
                                    "--accumulate 1 = 3"),
    ({"global_batch_size": 96, "accumulate": 5}, 2, "world size 2 x --accumulate 5 = 10"),
    ({"global_batch_size": 96, "mode": "async"}, 2, "--global-batch-size applies to --mode sync and local-sgd"),
    ({"global_batch_size": 2000}, 1, "the 800 training samples are fewer than one --global-batch-size 2000"),
    ({"deterministic": True}, 1, "--deterministic needs --global-batch-size"),
    ({"micro_shards": 4}, 1, "--micro-shards applies to --deterministic"),
    ({"deterministic": True, "global_batch_size": 8, "micro_shards": 12}, 1, "--micro-shards 12 is more than"),
    ({"deterministic": True, "global_batch_size": 96, "micro_shards": 4}, 5, "runs at most 4 workers"),
    ({"deterministic": True, "global_batch_size": 96, "micro_shards": 4, "shard": "parameters"}, 3,
     "--deterministic --shard parameters needs --micro-shards a multiple of the world size 3, got 4"),
    ({"deterministic": True, "global_batch_size": 96, "mode": "local-sgd"}, 2,
     "--deterministic cannot be combined with --mode local-sgd"),
    ({"deterministic": True, "global_batch_size": 96, "compression": "onebit"}, 2,
     "--deterministic cannot be combined with --compression onebit"),
    ({"deterministic": True, "global_batch_size": 96, "accumulate": 2}, 2,
     "--deterministic cannot be combined with --accumulate"),
    ({"deterministic": True, "global_batch_size": 96, "gradient_as_bucket_view": True}, 2,
     "--deterministic cannot be combined with --gradient-as-bucket-view"),
], ids=["batch-size", "zero", "uneven", "uneven-accumulate", "async", "too-few-samples", "no-global",
        "shards-alone", "shards-over-batch", "too-many-workers", "zero3-uneven", "local-sgd", "compression", "accumulate",
        "bucket-view"])
def test_bad_trajectory_options_are_refused_naming_them(options, world_size, needle):
    """Every rank runs these checks (Trainer) as the launcher does (run_job): one ValueError naming the options."""
    config = _config(**options)
    with pytest.raises(ValueError) as raised:
        validate(config)
        validate_against_data(config, world_size, data.num_train_samples(NUM_SAMPLES))
    assert needle in str(raised.value)


def test_the_command_line_refuses_before_any_worker_starts(capsys):
    """gradsync train --deterministic --compression topk exits 2 with the one-line reason."""
    code = main(["train", "--deterministic", "--global-batch-size", "64", "--compression", "topk", "--nproc", "1"])
    assert code == 2
    assert "--deterministic cannot be combined with --compression topk" in capsys.readouterr().err


def test_resuming_with_another_trajectory_is_refused_and_old_checkpoints_still_resume():
    """A checkpoint of --global-batch-size 96 --deterministic does not resume a job without them (each option named);
    a checkpoint written before these options existed resumes a job that leaves them at their defaults."""
    saved = resume.config_fields(_config(global_batch_size=96, deterministic=True))
    with pytest.raises(ValueError) as raised:
        resume.check_compatible(saved, _config(), 1, 1, "ckpt")
    assert "--global-batch-size 96 there, None here" in str(raised.value)
    assert "--deterministic True there, False here" in str(raised.value)
    old = {name: value for name, value in resume.config_fields(_config()).items()
           if name not in ("global_batch_size", "deterministic", "micro_shards")}
    resume.check_compatible(old, _config(), 1, 1, "ckpt")
