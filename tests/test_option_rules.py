"""Every ``gradsync train`` option means the same everywhere: honoured, or refused before any process starts.

The walk sets each :class:`TrainConfig` field to a value other than its
default (plus what its rule says it needs) under every mode x membership x
placement that ``gradsync train`` accepts, and runs the job's own checks in
this process (``jobs.job.check_options``: nothing is launched). Where the
table (``gradsync.jobs.option_rules.RULES``) says honoured, the checks must pass;
where it says refused, they must raise one line naming the option. The
honoured options that a trainer component carries (the tracer, the replica
checker, the straggler, the bucket views, debug) are then looked for on a
built one-rank trainer, static and elastic, not timed.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import gradsync
from gradsync.elastic.membership import StaticMembership, View
from gradsync.cli import main
from gradsync.jobs.job import check_options
from gradsync.jobs.option_rules import MEMBERSHIPS, MODES, PLACEMENTS, RULES, option, refusal
from gradsync.train import data
from gradsync.train.config import TrainConfig
from gradsync.train.loop import Trainer
from gradsync.train.metrics import METRICS_FILE, read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import options_table  # noqa: E402

AXES = {"mode", "elastic", "hosts"}  # the combination itself
SAMPLES = {
    "nproc": 2, "max_staleness": 1, "staleness_lr": False, "sync_every": 2, "outer_optimizer": "nesterov",
    "outer_lr": 0.5, "outer_momentum": 0.8, "outer_compression": "int8", "outer_fragments": 2, "straggler": "1:2.0", "model": "mlp",
    "gpt_width": 64, "gpt_depth": 2, "gpt_heads": 2, "gpt_context": 32,
    "epochs": 2, "batch_size": 16, "accumulate": 2, "global_batch_size": 64, "deterministic": True,
    "micro_shards": 4, "lr": 0.05, "lr_schedule": "constant", "optimizer": "sgd", "weight_decay": 0.01,
    "lr_scaling": "linear", "base_batch_size": 128, "warmup_steps": 2, "warmup_epochs": 1.0,
    "algorithm": "ring", "bucket_cap_mb": 1.0, "gradient_as_bucket_view": True, "debug": True,
    "compression": "fp16", "topk_ratio": 0.05, "powersgd_rank": 3, "compression_warmup_steps": 5,
    "shard": "gradients", "clip_grad_norm": 1.0,
    "trace": "trace.json", "tensorboard": "tb", "seed": 1, "timeout": 60.0, "memory_limit_mib": 512, "preflight": False, "max_restarts": 1, "checkpoint_dir": "ckpt",
    "checkpoint_every": 10, "keep_checkpoints": 3, "fail_at": "1:3", "hang_at": "1:3", "check_replicas_every": 5,
    "num_samples": 2000, "data_dir": "data", "out": "run", "progress": False, "inter_host_gbit": 1.0,
    "join_timeout": 20.0, "cut_link_at": "1:3", "kill_host_at": "1:3", "min_nproc": 1, "max_nproc": 16,
    "max_relaunches": 5, "join": "runs/other", "elastic_fault": "1:allreduce:3",
}
# written out by hand, not derived from the table: what gradsync train runs at all
ACCEPTED = {(mode, membership, placement) for mode, membership, placement
            in itertools.product(MODES, MEMBERSHIPS, PLACEMENTS)
            if not (membership == "elastic" and placement == "torchrun")
            and not (mode != "sync" and placement == "test hosts")
            and not (mode == "local-sgd" and membership == "elastic")
            and not (placement == "slurm" and (membership == "elastic" or mode == "async"))}


def _base(mode: str, membership: str, placement: str) -> dict:
    return {"mode": mode, "elastic": membership == "elastic", "hosts": 2 if placement == "test hosts" else None}


def _with_needs(name: str, fields: dict) -> dict:
    """``fields`` plus ``name``'s sample and what its rule needs (first choice), transitively; a need of
    an axis (``--hosts``, ``--elastic``) is left to the combination."""
    fields[name] = SAMPLES[name]
    for needed, value in RULES[name].needs[:1]:
        if needed not in AXES and needed not in fields:
            _with_needs(needed, fields)
            if value is not None:
                fields[needed] = value
    return fields


def _outcome(fields: dict, placement: str) -> str | None:
    try:
        check_options(TrainConfig(**fields), placement)
    except ValueError as exc:
        return str(exc)
    return None


def test_every_field_has_a_rule_and_a_sample():
    names = {item.name for item in dataclasses.fields(TrainConfig)}
    assert names == set(RULES), f"fields without a rule: {names - set(RULES)}; rules of no field: {set(RULES) - names}"
    assert names - AXES == set(SAMPLES) - AXES
    defaults = TrainConfig()
    assert all(SAMPLES[name] != getattr(defaults, name) for name in SAMPLES)


@pytest.mark.parametrize("where", sorted(itertools.product(MODES, MEMBERSHIPS, PLACEMENTS)))
def test_a_combination_is_accepted_exactly_when_gradsync_runs_it(where):
    problem = _outcome(_base(*where), where[2])
    assert (problem is None) == (where in ACCEPTED), problem
    if problem is not None:
        assert "\n" not in problem


@pytest.mark.parametrize("where", sorted(ACCEPTED))
def test_every_option_is_honoured_or_refused_in_one_line_naming_it(where):
    failures = []
    for name in sorted(set(SAMPLES) - AXES):
        fields = _with_needs(name, _base(*where))
        involved = [n for n in fields if n not in AXES]
        honoured = all(RULES[n].honoured_in(*where) for n in involved)
        problem = _outcome(fields, where[2])
        if honoured and problem is not None:
            failures.append(f"{option(name)}: the table says honoured, refused with {problem!r}")
        elif not honoured and problem is None:
            failures.append(f"{option(name)}: the table says refused, accepted")
        elif problem is not None and ("\n" in problem or not any(option(n) in problem for n in involved)):
            failures.append(f"{option(name)}: the refusal does not name it in one line: {problem!r}")
    assert not failures, f"under {where}:\n" + "\n".join(failures)


def test_the_table_in_docs_is_the_rules():
    """docs/training.md's option table is what ``make docs`` renders from RULES, one row per option."""
    page = options_table.DOC.read_text(encoding="utf-8")
    assert options_table.rewrite(page) == page, "docs/training.md's option table is out of date: run `make docs`"
    assert set(options_table.combinations()) == ACCEPTED
    assert all(f"`{option(name)}`" in page for name in RULES if name not in AXES)


def test_an_option_a_mode_cannot_use_names_it_and_the_combination():
    problem = _outcome({"elastic": True, "join_timeout": 20.0, "hosts": 2}, "test hosts")
    assert problem.startswith("--join-timeout is not honoured with --mode sync --elastic with --hosts")
    assert _outcome({"topk_ratio": 0.05}, "local") == "--topk-ratio needs --compression topk: it sets topk's share"
    assert _outcome({"nproc": 2}, "torchrun").startswith("--nproc is not honoured with --mode sync under torchrun")
    assert "leave out --lr" in _outcome({"elastic": True, "join": "runs/x", "lr": 0.5}, "local")
    assert _outcome({"gpt_width": 64}, "local") == ("--gpt-width needs --model gpt: it sizes the gpt (the other "
                                                    "models have fixed sizes)")
    assert _outcome({"model": "gpt", "num_samples": 400}, "local").startswith(
        "--num-samples is not honoured with --model gpt: ")
    assert _outcome({"model": "gpt", "gpt_width": 60, "gpt_heads": 8}, "local").startswith(
        "--gpt-width 60 must be divisible by --gpt-heads 8")


def test_an_option_named_at_its_default_value_is_checked_too(capsys):
    """``--nproc 4`` under torchrun, ``--topk-ratio 0.01`` without topk: named, so refused, though default."""
    assert refusal(TrainConfig(), "torchrun", {"nproc"}).startswith("--nproc is not honoured with --mode sync "
                                                                     "under torchrun")
    assert refusal(TrainConfig(), "torchrun") is None
    assert main(["train", "--topk-ratio", "0.01"]) == 2
    assert capsys.readouterr().err.strip() == ("gradsync train: error: --topk-ratio needs --compression topk: "
                                               "it sets topk's share")


# ---------------------------------------------------------------- honoured options reach the trainer


class _OneMemberElastic(StaticMembership):
    """An elastic membership of one member that never changes: the trainer's elastic path, in-process."""

    elastic = True

    def enter(self) -> View:
        record = SimpleNamespace(reason="start", members=[{"slot": 0}], record={})
        return View(0, 1, 1, record)

    def handover_fault(self, view):
        return None

    def arm(self, module) -> None:
        pass

    def summary_fields(self) -> dict:
        return {"elastic": True, "memberships": 1}


@pytest.fixture
def one_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    gradsync.init(timeout=30)
    yield
    gradsync.shutdown()


@pytest.mark.parametrize("elastic", [False, True])
def test_honoured_options_reach_the_built_trainer(tmp_path, one_rank, elastic):
    config = TrainConfig(nproc=1, epochs=1, num_samples=400, batch_size=32, elastic=elastic, progress=False,
                         trace=str(tmp_path / "trace.json"), check_replicas_every=2, straggler="0:1.5",
                         gradient_as_bucket_view=True, debug=True, clip_grad_norm=0.5, data_dir=str(tmp_path))
    data_path = data.prepare(config.data_dir, config.num_samples)
    membership = _OneMemberElastic() if elastic else None
    trainer = Trainer(config, data_path, tmp_path, membership)
    trainer.run()
    assert trainer.elastic is elastic
    assert trainer.timeline is not None and trainer.model.timeline is trainer.timeline
    assert trainer.straggler_factor == 1.5
    assert trainer.model.gradient_as_bucket_view is True
    assert trainer.model.debug is True
    steps = [r for r in read_metrics(tmp_path / METRICS_FILE) if r.get("kind") == "step"]
    assert steps and all(r["grad_norm"] > 0 for r in steps)  # --clip-grad-norm took each step's norm
    checks = [r for r in read_metrics(tmp_path / METRICS_FILE) if r.get("kind") == "replica_check"]
    assert [r["step"] for r in checks] == list(range(2, trainer.state.step + 1, 2))
    assert (tmp_path / "trace.json").exists()
