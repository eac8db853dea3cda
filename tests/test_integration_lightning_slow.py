"""GradsyncStrategy's longer runs: spawn and torchrun launchers, the pytorch_lightning package, a resumed fit
equal to an uninterrupted one (compression with error feedback; a shard level), norm clipping over shards."""

import importlib.util
import sys

import pytest
import torch

from tests._dist import free_port
from tests.test_integration_lightning import assert_same_fit, run_script

pytestmark = [pytest.mark.slow, pytest.mark.dist,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason="the Lightning strategy needs gradsync[lightning] (pip install 'gradsync[lightning]')")]

MAIN = """
import sys
from gradsync.integrations import lightning_demo

out = sys.argv[1]
"""


def fits(*runs: str) -> str:
    """A script calling ``lightning_demo.main`` once per argument string (``{out}`` is the output folder)."""
    return MAIN + "".join(call(run) for run in runs)


def call(run: str) -> str:
    return f"lightning_demo.main({run!r}.replace('{{out}}', out).split())\n"


STRIP = """
import os, torch
saved = torch.load(out + "/ckpt/last.ckpt", weights_only=False)
del saved["gradsync"]  # each rank writes and reads its own copy: no race between the ranks
torch.save(saved, out + "/stripped-" + os.environ["LOCAL_RANK"] + ".ckpt")
"""


@pytest.mark.timeout(120)
def test_spawn_launcher(tmp_path):
    """start_method="spawn": Lightning's multiprocessing launcher; the same parameters as DDPStrategy's."""
    script = MAIN + 'if __name__ == "__main__":  # spawned children import this file\n    ' + \
        call("--strategy ddp,gradsync --start-method spawn --epochs 2 --out {out}/spawn")
    out = run_script(tmp_path, script, timeout=110)
    assert_same_fit(out / "spawn")  # the children's weights, which Lightning brings back to the main process


@pytest.mark.timeout(120)
def test_torchrun(tmp_path):
    """Under torchrun (Lightning's TorchElasticEnvironment: the processes are started outside Lightning)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port())]
    out = run_script(tmp_path, fits("--strategy ddp,gradsync --epochs 2 --out {out}/torchrun"), timeout=110,
                     launcher=launcher)
    assert_same_fit(out / "torchrun")


@pytest.mark.timeout(120)
def test_pytorch_lightning_package(tmp_path):
    """The separate pytorch_lightning package's Trainer with gradsync.integrations.pytorch_lightning's strategy."""
    pytest.importorskip("pytorch_lightning", reason="needs gradsync[lightning] (pytorch-lightning)")
    out = run_script(tmp_path, fits("--package pytorch_lightning --strategy ddp,gradsync --epochs 2 --out {out}/pl"),
                     timeout=110)
    assert_same_fit(out / "pl")


def resume_script(options: str) -> str:
    """An uninterrupted 4-epoch fit; a 2-epoch fit saving checkpoints; a fit of a differently initialised
    module resumed from the 2-epoch checkpoint to epoch 4; the same resumed from a copy of the checkpoint
    without gradsync's entry (the control: each rank's compressor state lost)."""
    runs = [f"--strategy gradsync --epochs 4 {options} --out {{out}}/whole",
            f"--strategy gradsync --epochs 2 {options} --checkpoint-dir {{out}}/ckpt --out {{out}}/first",
            f"--strategy gradsync --epochs 4 {options} --seed 7 --resume {{out}}/ckpt/last.ckpt --out {{out}}/resumed"]
    control = call(f"--strategy gradsync --epochs 4 {options} --seed 7 --resume {{out}}/stripped-RANK.ckpt "
                   f"--out {{out}}/control").replace(".split()", ".replace('RANK', os.environ['LOCAL_RANK']).split()")
    return fits(*runs) + STRIP + control


@pytest.mark.timeout(150)
@pytest.mark.parametrize("options", ["--compression topk --optimizer sgd",
                                     "--compression fp16 --shard optimizer --optimizer adam",
                                     "--shard gradients --optimizer adam --clip 0.5 --validate",
                                     "--fabric --compression topk --optimizer sgd",
                                     "--fabric --shard optimizer --optimizer adam --accumulate 2"],
                         ids=["topk-error-feedback", "zero1-adam", "zero2-adam-clip-validate", "fabric-topk", "fabric-zero1"])
def test_resumed_fit_equals_uninterrupted(tmp_path, options):
    """Stop after epoch 2, ``fit(ckpt_path=...)`` to epoch 4: the parameters equal the uninterrupted fit's,
    which needs each rank's error feedback (top-k) and every rank's optimizer shard (ZeRO) restored."""
    out = run_script(tmp_path, resume_script(options), timeout=140)
    whole = torch.load(out / "whole" / "gradsync.pt", weights_only=False)
    resumed = torch.load(out / "resumed" / "gradsync.pt", weights_only=False)
    first = torch.load(out / "first" / "gradsync.pt", weights_only=False)
    steps = 16 // (2 if "--accumulate 2" in options else 1)
    assert whole["global_step"] == resumed["global_step"] == 2 * first["global_step"] == steps
    for name, tensor in whole["state"].items():
        torch.testing.assert_close(resumed["state"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.allclose(first["state"][name], tensor) for name, tensor in whole["state"].items())
    control = torch.load(out / "control" / "gradsync.pt", weights_only=False)
    if "topk" in options:  # without each rank's residuals the resumed fit goes elsewhere
        assert any(not torch.allclose(control["state"][name], tensor, rtol=1e-5, atol=1e-6)
                   for name, tensor in whole["state"].items())
    saved = torch.load(out / "ckpt" / "last.ckpt", weights_only=False)
    entry = saved["gradsync"]
    assert entry["world_size"] == 2 and len(entry["ranks"]) == 2
    if "topk" in options:  # each rank's own residuals: they differ between the ranks
        residuals = [rank["compression"] for rank in entry["ranks"]]
        assert residuals[0].keys() == residuals[1].keys() and _tensors(residuals)[0]
        assert any(not torch.equal(a, b) for a, b in zip(*_tensors(residuals)))
    if "shard" in options:  # the whole Adam state, consolidated from both ranks' shards
        state = saved["optimizer"]["state"] if "--fabric" in options else saved["optimizer_states"][0]["state"]
        assert sorted(state) == [0, 1, 2, 3] and state[0]["exp_avg"].shape == (32, 16)


def _tensors(states: list[dict]) -> list[list[torch.Tensor]]:
    """Every tensor in each rank's compressor state, in key order."""
    def walk(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                yield from walk(value[key])
    return [list(walk(state)) for state in states]


@pytest.mark.timeout(120)
def test_manual_optimization(tmp_path):
    """automatic_optimization=False (manual_backward and optimizer.step in training_step), unsharded and
    ZeRO-1: the same parameters as DDPStrategy's."""
    out = run_script(tmp_path, fits("--manual --strategy ddp,gradsync --epochs 2 --out {out}/manual",
                                    "--manual --strategy ddp,gradsync --shard optimizer --optimizer adam --epochs 2 "
                                    "--out {out}/manual-zero1"), timeout=110)
    assert_same_fit(out / "manual")
    assert_same_fit(out / "manual-zero1")


@pytest.mark.timeout(120)
def test_fabric_equals_ddp_strategy(tmp_path):
    """Lightning Fabric with gradsync's Fabric strategy: sharded, accumulating under no_backward_sync, clipping
    by the global norm; the same parameters as Fabric's DDPStrategy, one bucket collective per step."""
    out = run_script(tmp_path, fits("--fabric --strategy ddp,gradsync --shard gradients --optimizer sgd --clip 1.0 "
                                    "--accumulate 2 --epochs 4 --out {out}/fabric"), timeout=110)
    gradsync_run, _ = assert_same_fit(out / "fabric")
    assert gradsync_run["global_step"] == 8
    assert gradsync_run["bucket_collectives"] == 8 * 2  # a sharded bucket: reduce-scatter, then all-gather


@pytest.mark.timeout(120)
def test_sharded_clipping_equals_ddp(tmp_path):
    """gradient_clip_val under shard="gradients" clips by the global norm over every shard, as DDP does."""
    out = run_script(tmp_path, fits("--strategy ddp,gradsync --shard gradients --optimizer sgd --clip 0.05 "
                                    "--epochs 2 --out {out}/clip"), timeout=110)
    assert_same_fit(out / "clip")
