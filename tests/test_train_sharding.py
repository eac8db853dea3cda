"""``gradsync train --shard``: the same training as unsharded, its checkpoints resumed at another world size and
shard level, and what sharding cannot honour refused before any process starts.

Two early jobs (``_early.py``: started with the session) train the MLP on 400 MNIST-1D samples (10 steps of
a global batch of 32, SGD with momentum, global-norm clipping at 0.5) at 2 workers, with ``--shard gradients``
and with ``--shard none``, checkpointing every 4 steps. The sharded run's checkpoints are then resumed from
step 4 by worlds of other sizes and levels (:func:`_dist.run_world`, the trainer in Gloo processes). Three more
early jobs run ``--deterministic`` at (2, none), (2, gradients), (1, optimizer) and (2, parameters): the same
bits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gradsync.fault import checkpoint
from gradsync.train import data, sharded_checkpoint
from gradsync.train.config import TrainConfig
from gradsync.train.models import build_model
from _cli import run_cli
from _dist import run_world
from _early import early_job

JOB = {"model": "mlp", "epochs": 1, "num_samples": 400, "global_batch_size": 32, "optimizer": "sgd", "lr": 0.05,
       "lr_schedule": "constant", "bucket_cap_mb": 0.01, "algorithm": "ring", "clip_grad_norm": 0.5,
       "checkpoint_every": 4, "keep_checkpoints": 10}
STEPS = 10  # 320 training samples / 32


def _args(shard: str) -> list[str]:
    args = ["train", "--nproc", "2", "--shard", shard, "--out", "{folder}/run", "--checkpoint-dir",
            "{folder}/checkpoints", "--no-progress", "--timeout", "30"]
    for name, value in JOB.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    return args


GRADIENTS_RUN = early_job("shard-gradients", _args("gradients"), env={"GRADSYNC_DATA_DIR": "{folder}"})
NONE_RUN = early_job("shard-none", _args("none"), env={"GRADSYNC_DATA_DIR": "{folder}"})


def _finished(job) -> Path:
    result = job.wait(170)
    assert result.returncode == 0, result.stderr
    return job.folder


@pytest.mark.dist
@pytest.mark.early_job(GRADIENTS_RUN)
@pytest.mark.early_job(NONE_RUN)
@pytest.mark.timeout(180)
def test_sharded_run_trains_as_the_unsharded_one_and_exports_its_whole_state(_early_jobs, capsys, tmp_path):
    """--shard gradients at 2 workers: model.pt allclose to --shard none's, the same clipped norms; its last
    checkpoint keeps one optimizer shard per rank file, and `gradsync checkpoint export` consolidates them into
    the unsharded run's optimizer state."""
    sharded, unsharded = _finished(_early_jobs[GRADIENTS_RUN]), _finished(_early_jobs[NONE_RUN])
    got, want = torch.load(sharded / "run" / "model.pt"), torch.load(unsharded / "run" / "model.pt")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6)
    summaries = [json.loads((folder / "run" / "summary.json").read_text()) for folder in (sharded, unsharded)]
    assert [s["shard"] for s in summaries] == ["gradients", "none"] and summaries[0]["steps"] == STEPS
    norms = [[r["grad_norm"] for r in map(json.loads, (folder / "run" / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "step"] for folder in (sharded, unsharded)]
    assert len(norms[0]) == STEPS and max(norms[0]) > JOB["clip_grad_norm"]  # it did clip
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)

    last = checkpoint.latest(sharded / "checkpoints")
    shared = last.load_shared()
    assert last.step == STEPS and shared["shard"] == "gradients" and "optimizer" not in shared
    result = run_cli(["checkpoint", "export", str(sharded / "checkpoints"), str(tmp_path / "whole.pt")], capsys)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (f"wrote {tmp_path / 'whole.pt'}: step {STEPS}, model and optimizer whole "
                                     "(written by 2 ranks, --shard gradients)")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    reference = checkpoint.latest(unsharded / "checkpoints").load_shared()["optimizer"]
    assert whole["optimizer"]["param_groups"] == reference["param_groups"]
    for position, entry in reference["state"].items():
        torch.testing.assert_close(whole["optimizer"]["state"][position]["momentum_buffer"],
                                   entry["momentum_buffer"], rtol=1e-5, atol=1e-7)
    model = build_model("mlp")  # plain torch loads both, no gradsync wrapper
    model.load_state_dict(whole["model"])
    torch.optim.SGD(model.parameters(), lr=JOB["lr"], momentum=0.9).load_state_dict(whole["optimizer"])


def _rank_resume(options: dict, data_path: str, out_dir: str) -> dict:
    from gradsync.train.loop import Trainer

    trainer = Trainer(TrainConfig(**options), Path(data_path), Path(out_dir))
    trainer.run()
    return {"params": {name: tensor.clone() for name, tensor in trainer.model.module.state_dict().items()},
            "resumed_from": trainer.resumed_from.step if trainer.resumed_from else None,
            "step": trainer.state.step}


@pytest.mark.dist
@pytest.mark.early_job(GRADIENTS_RUN)
@pytest.mark.timeout(180)
def test_a_sharded_checkpoint_resumes_at_another_world_size_and_level(_early_jobs, tmp_path):
    """The (2 workers, gradients) run's checkpoint of step 4, resumed by (1 worker, none): its shards
    consolidated; and by (2 workers, parameters): its units' shards cut from the consolidated state. Both end allclose to the run that was
    never stopped."""
    sharded = _finished(_early_jobs[GRADIENTS_RUN])
    uninterrupted = torch.load(sharded / "run" / "model.pt")
    data_path = str(data.prepare(tmp_path / "data", JOB["num_samples"]))
    for world_size, shard in ((1, "none"), (2, "parameters")):
        folder = tmp_path / f"{world_size}-{shard}"
        shutil.copytree(sharded / "checkpoints" / "step-000000004", folder / "checkpoints" / "step-000000004")
        (folder / "run").mkdir()
        options = {**JOB, "nproc": world_size, "shard": shard, "checkpoint_dir": str(folder / "checkpoints"),
                   "progress": False}
        results = run_world(world_size, _rank_resume, options, data_path, str(folder / "run"), timeout_s=90)
        assert [(r["resumed_from"], r["step"]) for r in results] == [(4, STEPS)] * world_size
        for result in results:
            for name, tensor in uninterrupted.items():
                torch.testing.assert_close(result["params"][name], tensor, rtol=1e-5, atol=1e-6)
        resumed = checkpoint.latest(folder / "checkpoints")  # written at the resumed run's level
        assert resumed.step == STEPS and resumed.load_shared()["shard"] == shard
        assert (sharded_checkpoint.SHARD_KEY in resumed.load_rank(0)) == (shard != "none")


DETERMINISTIC = ["train", "--deterministic", "--global-batch-size", "32", "--micro-shards", "2", "--model", "mlp",
                 "--epochs", "1", "--num-samples", "400", "--lr-schedule", "constant", "--clip-grad-norm", "0.5",
                 "--out", "{folder}/run", "--no-progress", "--timeout", "30"]
DETERMINISTIC_RUNS = {(world_size, shard): early_job(f"deterministic-{world_size}-{shard}",
                                                     [*DETERMINISTIC, "--nproc", str(world_size), "--shard", shard],
                                                     env={"GRADSYNC_DATA_DIR": "{folder}"})
                      for world_size, shard in ((2, "none"), (2, "gradients"), (1, "optimizer"), (2, "parameters"))}


@pytest.mark.dist
@pytest.mark.early_job(DETERMINISTIC_RUNS[2, "none"])
@pytest.mark.early_job(DETERMINISTIC_RUNS[2, "gradients"])
@pytest.mark.early_job(DETERMINISTIC_RUNS[1, "optimizer"])
@pytest.mark.early_job(DETERMINISTIC_RUNS[2, "parameters"])
@pytest.mark.timeout(240)
def test_deterministic_model_pt_is_bitwise_the_same_at_every_shard_level_and_world_size(_early_jobs):
    """--deterministic (AdamW, clipping at 0.5): model.pt of (2 workers, gradients), of (1 worker, optimizer)
    and of (2 workers, parameters) is torch.equal to (2 workers, none)'s on every tensor; the ZeRO-3 run's
    summary counts the whole model's parameters (they are gathered for it)."""
    folders = {key: _finished(_early_jobs[name]) / "run" for key, name in DETERMINISTIC_RUNS.items()}
    summaries = {key: json.loads((folder / "summary.json").read_text()) for key, folder in folders.items()}
    for (world_size, shard), summary in summaries.items():
        assert (summary["world_size"], summary["shard"], summary["steps"]) == (world_size, shard, STEPS)
    models = {key: torch.load(folder / "model.pt") for key, folder in folders.items()}
    reference = models[2, "none"]
    assert summaries[2, "parameters"]["num_parameters"] == sum(t.numel() for t in reference.values()) > 0
    for key in ((2, "gradients"), (1, "optimizer"), (2, "parameters")):
        assert models[key].keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(models[key][name], tensor), (key, name)


@pytest.mark.parametrize("args, line", [
    (["--shard", "unknown"], "unknown --shard 'unknown'; choose one of none, optimizer, gradients, "
                                   "parameters"),
    (["--shard", "gradients", "--compression", "onebit"], "--shard gradients cannot combine with --compression "
                                                          "onebit: a reduce-scatter sums"),
    (["--shard", "optimizer", "--elastic"], "--shard is not honoured with --mode sync --elastic: ZeRO shards"),
    (["--shard", "optimizer", "--mode", "local-sgd"], "--shard is not honoured with --mode local-sgd: ZeRO shards"),
    (["--clip-grad-norm", "1", "--mode", "async"], "--clip-grad-norm is not honoured with --mode async: a "
                                                   "parameter server"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be a finite number > 0, got 0.0"),
    (["--shard", "gradients", "--algorithm", "tree"], "--shard gradients cannot combine with --algorithm tree: the "
                                                      "buckets are reduce-scattered, and algorithm 'tree' has no"),
], ids=["unknown", "onebit", "elastic", "local-sgd", "clip-async", "clip-zero", "tree"])
def test_what_sharding_cannot_honour_is_refused_in_one_line_before_any_process(args, line, capsys, tmp_path):
    result = run_cli(["train", *args, "--out", str(tmp_path / "run")], capsys)
    assert result.returncode == 2
    assert result.stderr.startswith(f"gradsync train: error: {line}"), result.stderr
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()  # refused before the run folder or any worker
