"""GradsyncStrategy under Lightning's Trainer: the same parameters as Lightning's DDPStrategy, no_sync under
gradient accumulation, the summary in the logger, one-line refusals (gradsync[lightning]).

One 2-process launch (Lightning's subprocess launcher runs the script file) fits with DDPStrategy and
GradsyncStrategy in turn; the longer runs (spawn, torchrun, resume, pytorch_lightning) are in
tests/test_integration_lightning_slow.py.
"""

import csv
import doctest
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradsync.integrations import lightning_summary

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="the Lightning strategy needs gradsync[lightning] (pip install 'gradsync[lightning]')")

SAMPLES, BATCH, DEVICES = 64, 8, 2  # lightning_demo's defaults: 4 batches per rank and epoch

SCRIPT = """
import json, os, sys
from gradsync.integrations import lightning_demo
from gradsync.integrations.lightning import GradsyncStrategy

out = sys.argv[1]
if "LOCAL_RANK" not in os.environ:  # the launching process (rank 0), before Lightning starts rank 1
    cases = {"unknown": {"foo": 1}, "algorithm": {"algorithm": "bogus"},
             "ddp_only": {"find_unused_parameters": True}, "compression": {"compression": "zip"},
             "shard_combination": {"compression": "topk", "shard": "optimizer"},
             "zero3": {"shard": "parameters"}, "shard": {"shard": "everything"}}
    errors = {}
    for label, kwargs in cases.items():
        try:
            GradsyncStrategy(**kwargs)
            errors[label] = None
        except (TypeError, ValueError) as exc:
            errors[label] = [type(exc).__name__, str(exc)]
    import lightning.pytorch as pl  # the registered names (no process starts before fit)
    named = pl.Trainer(strategy="gradsync", accelerator="cpu", devices=2, logger=False).strategy
    errors["registry"] = [type(named).__name__, pl.strategies.StrategyRegistry["gradsync_spawn"]["init_params"]]
    with open(os.path.join(out, "errors.json"), "w") as file:
        json.dump(errors, file)
lightning_demo.main(["--strategy", "ddp,gradsync", "--epochs", "3", "--csv-dir", out + "/csv", "--out", out + "/plain"])
lightning_demo.main(["--strategy", "ddp,gradsync", "--epochs", "2", "--accumulate", "2", "--out", out + "/accumulate"])
"""


def run_script(tmp_path: Path, script: str, timeout: float, launcher: list[str] | None = None) -> Path:
    """Write ``script`` to a file, run it (``launcher`` before it, e.g. torchrun) and return its output folder."""
    path = tmp_path / "fit.py"
    path.write_text(script)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(Path(__file__).parents[1] / "src"),
                                                                    os.environ.get("PYTHONPATH", "")] if p),
           "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    command = (launcher or [sys.executable]) + [str(path), str(out)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def assert_same_fit(folder: Path) -> tuple[dict, dict]:
    """GradsyncStrategy's final parameters are allclose to DDPStrategy's (rtol 1e-5, atol 1e-6)."""
    gradsync_run = torch.load(folder / "gradsync.pt", weights_only=False)
    ddp_run = torch.load(folder / "ddp.pt", weights_only=False)
    assert gradsync_run["global_step"] == ddp_run["global_step"]  # 0 in the spawn launcher's main process
    assert gradsync_run["state"].keys() == ddp_run["state"].keys()
    for name, tensor in gradsync_run["state"].items():
        torch.testing.assert_close(tensor, ddp_run["state"][name], rtol=1e-5, atol=1e-6, msg=name)
    torch.manual_seed(0)  # the demo module's initialisation (seed 0): the runs moved away from it
    initial = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).state_dict()
    assert all((gradsync_run["state"]["net." + name] - initial[name]).abs().max() > 1e-3 for name in initial)
    return gradsync_run, ddp_run


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_lightning_fit_equals_ddp_strategy(tmp_path):
    """One subprocess-launcher run: fits equal DDPStrategy's, accumulation syncs once per optimizer step, the
    CSV logger gets gradsync's summary, bad options are refused in one line."""
    out = run_script(tmp_path, SCRIPT, timeout=140)

    plain, _ = assert_same_fit(out / "plain")
    steps_per_epoch = SAMPLES // (BATCH * DEVICES)
    assert plain["global_step"] == 3 * steps_per_epoch
    assert plain["bucket_collectives"] == plain["global_step"]  # one bucket (a 0.0 MiB MLP), once per step

    accumulated, _ = assert_same_fit(out / "accumulate")
    micro_batches = 2 * steps_per_epoch
    assert accumulated["global_step"] == micro_batches // 2
    assert accumulated["bucket_collectives"] == micro_batches // 2  # no_sync: only every second backward reduces

    metrics_file = out / "csv" / "gradsync" / "version_0" / "metrics.csv"
    rows = [row for row in csv.DictReader(metrics_file.open()) if row.get("gradsync/comm_share")]
    assert len(rows) == 3  # one per epoch
    for row in rows:
        assert 0.0 < float(row["gradsync/comm_share"]) < 1.0
        assert 0.0 <= float(row["gradsync/exposed_comm_share"]) <= float(row["gradsync/comm_share"])
        assert float(row["gradsync/step_seconds"]) > 0 and float(row["gradsync/bytes_sent"]) >= 0  # shm: none on a wire
    hparams = (out / "csv" / "gradsync" / "version_0" / "hparams.yaml").read_text()
    assert "gradsync/bucket_algorithms" in hparams and "KiB" in hparams

    errors = json.loads((out / "errors.json").read_text())
    expected = {"unknown": ("TypeError", "'foo'"), "algorithm": ("ValueError", "'bogus'"),
                "ddp_only": ("ValueError", "'find_unused_parameters'"), "compression": ("ValueError", "'zip'"),
                "shard_combination": ("ValueError", "'topk'"), "zero3": ("ValueError", "'parameters'"),
                "shard": ("ValueError", "'everything'")}
    for label, (kind, named) in expected.items():
        assert errors[label] is not None, label
        assert errors[label][0] == kind and named in errors[label][1] and "\n" not in errors[label][1], errors[label]
    assert "accepted:" in errors["unknown"][1] and "compression" in errors["unknown"][1]
    assert errors.pop("registry") == ["GradsyncStrategy", {"start_method": "spawn"}]  # Trainer(strategy="gradsync")


@pytest.mark.parametrize("module", ["gradsync.integrations.lightning", "gradsync.integrations.fabric"])
def test_a_process_group_backend_gradsync_cannot_use_is_refused_at_construction(module):
    """Lightning's and Fabric's strategy: "mpi" (or any other name) is refused in one line when the strategy is
    built, before any process starts; gradsync's backends ("gloo", "nccl") and None are accepted."""
    strategy = importlib.import_module(module).GradsyncStrategy
    for backend in ("mpi", "auto", "ucc"):
        with pytest.raises(ValueError) as caught:
            strategy(process_group_backend=backend)
        message = str(caught.value)
        assert f"process_group_backend {backend!r}" in message and "'gloo'" in message and "\n" not in message
    for backend in ("gloo", "nccl", None):
        assert strategy(process_group_backend=backend).gradsync_options["algorithm"] == "auto"


def test_missing_extra_names_it(monkeypatch):
    """Without Lightning installed, importing the strategy says which extra to install, in one line."""
    import gradsync

    for name in [name for name in sys.modules if name == "lightning" or name.startswith("lightning.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.delitem(sys.modules, "gradsync.integrations.lightning", raising=False)
    with pytest.raises(gradsync.errors.MissingExtraError, match=r"gradsync\[lightning\]") as raised:
        importlib.import_module("gradsync.integrations.lightning")
    assert "\n" not in str(raised.value)


def test_summary_doctests():
    """The summary's formatting examples hold."""
    result = doctest.testmod(lightning_summary, verbose=False)
    assert result.attempted > 0 and result.failed == 0


# -- the strategies' adoption of Lightning's group, in this process (a one-process Gloo group made by hand) ----

STRATEGY_MODULES = ["gradsync.integrations.lightning", "gradsync.integrations.fabric"]


def one_process_strategy(module: str, **kwargs):
    """``module``'s GradsyncStrategy for rank 0 of 1 on the CPU, and its set-up of the process group."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    strategy = importlib.import_module(module).GradsyncStrategy(
        parallel_devices=[torch.device("cpu")], cluster_environment=LightningEnvironment(), **kwargs)
    return strategy, getattr(strategy, "setup_distributed", None) or strategy._setup_distributed


@pytest.fixture
def gloo_group(tmp_path):
    """torch.distributed's default group, Gloo, rank 0 of 1 (Lightning's set-up then finds it initialised)."""
    import torch.distributed as dist

    import gradsync

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        if gradsync.is_initialized():
            gradsync.shutdown()
        dist.destroy_process_group()


@pytest.mark.parametrize("module", STRATEGY_MODULES)
def test_a_strategy_timeout_gradsync_already_has_otherwise_is_refused(module, gloo_group):
    """gradsync initialised by hand (or by an earlier fit) with 7.5 s: a strategy asking for 300 s is refused in
    one line naming both, not silently run with 7.5 s; asking for 7.5 s, or for no timeout, adopts the group."""
    import gradsync
    from gradsync.process_group import default_communicator

    gradsync.init(timeout=7.5)
    _, setup = one_process_strategy(module, timeout=300)
    with pytest.raises(ValueError) as refused:
        setup()
    message = str(refused.value)
    assert "initialised with timeout 7.5 s" in message and "GradsyncStrategy(timeout=300)" in message
    assert "\n" not in message
    for kwargs in ({"timeout": 7.5}, {}):  # the same timeout, or none given: no refusal
        one_process_strategy(module, **kwargs)[1]()
        assert default_communicator().timeout_s == 7.5


@pytest.mark.parametrize("module", STRATEGY_MODULES)
def test_a_strategy_timeout_initialises_gradsync(module, gloo_group):
    """gradsync not yet initialised: the strategy's timeout (a timedelta here) becomes gradsync's."""
    import datetime

    from gradsync.process_group import default_communicator

    one_process_strategy(module, timeout=datetime.timedelta(seconds=12))[1]()
    assert default_communicator().timeout_s == 12.0


@pytest.mark.parametrize("module", STRATEGY_MODULES)
def test_gradsync_is_initialised_with_the_backend_lightning_chose(module, gloo_group, monkeypatch):
    """process_group_backend="gloo" on a machine with CUDA: gradsync.init gets "gloo" (the group's backend),
    not "auto" (which would make gradsync take the run for NCCL and pick a CUDA device)."""
    import gradsync

    calls = []
    real_init = gradsync.init

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real_init(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gradsync, "init", spy)
    one_process_strategy(module, process_group_backend="gloo")[1]()
    assert len(calls) == 1
    args, kwargs = calls[0]
    assert (args[0] if args else kwargs.get("backend")) == "gloo"
