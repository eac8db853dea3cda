"""One real run per placement carrying every honoured option at once (``make test-slow``).

Each run sets, together, the options a trainer component carries (``--trace``,
``--check-replicas-every``, ``--straggler``, ``--gradient-as-bucket-view``,
``--debug``) and a handful of plain ones (model, optimizer, schedule,
algorithm, bucket size, seed, checkpoints), then looks for each one's mark in
the run folder: the trace file, the replica-check records, the algorithm
used, the checkpoints kept, the configuration echoed in ``summary.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.jobs.job import run_job
from gradsync.train.config import TrainConfig
from gradsync.train.metrics import METRICS_FILE, SUMMARY_FILE, read_metrics

COMMON = {"epochs": 1, "num_samples": 1200, "model": "mlp", "optimizer": "lars", "lr": 0.05, "lr_schedule": "step",
          "lr_scaling": "linear", "base_batch_size": 32, "warmup_steps": 2,
          "weight_decay": 0.001, "seed": 3, "timeout": 60.0, "algorithm": "ring", "bucket_cap_mb": 0.01,
          "trace": "trace.json", "check_replicas_every": 3, "straggler": "1:1.2", "gradient_as_bucket_view": True,
          "debug": True, "progress": False}


def _argv(options: dict) -> list[str]:
    argv = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + name.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


def _check_run(folder: Path, options: dict) -> dict:
    summary = json.loads((folder / SUMMARY_FILE).read_text())
    for name in ("model", "optimizer", "lr", "seed", "algorithm", "straggler", "check_replicas_every",
                 "gradient_as_bucket_view", "debug", "bucket_cap_mb"):
        assert summary["config"][name] == options[name], name
    assert {entry["algorithm"] for entry in summary["algorithms"]} == {"ring"}
    lr = summary["lr"]  # two workers of 32 samples: the global batch 64 is twice --base-batch-size 32
    assert (lr["scaled"], lr["global_batch_size"], lr["warmup_steps"]) == (2 * options["lr"], 64, 2)
    assert len(summary["algorithms"]) > 1  # --bucket-cap-mb 0.01: the mlp's gradients in several buckets
    checks = [r["step"] for r in read_metrics(folder / METRICS_FILE) if r.get("kind") == "replica_check"]
    assert checks and all(step % 3 == 0 for step in checks), checks
    trace = json.loads(Path(options["trace"]).read_text())
    assert {event.get("pid") for event in trace["traceEvents"] if "pid" in event} >= {0, 1}
    return summary


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_a_local_run_honours_every_option_at_once(tmp_path, elastic):
    options = {**COMMON, "trace": str(tmp_path / "trace.json"), "checkpoint_dir": str(tmp_path / "ckpt"),
               "checkpoint_every": 4, "keep_checkpoints": 1}
    if elastic:
        options.update(min_nproc=1, max_nproc=2, max_relaunches=1)
    config = TrainConfig(nproc=2, out=str(tmp_path / "run"), elastic=elastic, data_dir=str(tmp_path), **options)
    run_job(config)
    summary = _check_run(tmp_path / "run", options)
    assert summary.get("elastic", False) is elastic
    kept = list((tmp_path / "ckpt").rglob("step-*.pt" if elastic else "MANIFEST.json"))
    assert len(kept) == 1, kept  # --keep-checkpoints 1


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(240)
def test_a_torchrun_run_honours_every_option_at_once(tmp_path):
    options = {**COMMON, "trace": str(tmp_path / "trace.json")}
    env = {**os.environ, "GRADSYNC_DATA_DIR": str(tmp_path)}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "gradsync", "train", "--out", str(tmp_path / "run"), *_argv(options)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=220, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _check_run(tmp_path / "run", options)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_test_hosts_run_honours_every_option_at_once(tmp_path):
    from gradsync.hosts.netns import unavailable_reason

    if unavailable_reason():
        pytest.skip(unavailable_reason())
    options = {**COMMON, "trace": str(tmp_path / "trace.json")}
    config = TrainConfig(nproc=1, hosts=2, out=str(tmp_path / "run"), data_dir=str(tmp_path), **options)
    summary = run_job(config)
    assert summary["hosts"] == 2
    _check_run(tmp_path / "run", options)
