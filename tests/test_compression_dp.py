"""Compression inside DataParallel (real Gloo processes) and on the ``gradsync train`` command line.

One 2-rank world and one 3-rank world run every scenario (spawning costs
seconds): a few SGD steps with each compressor, by name and as an instance,
with different data on each rank and small buckets (several buckets, rebuilt
after the first step); gradient accumulation under ``no_sync``; uneven batch
counts under ``join()``. The parent checks that the replicas end bitwise
equal, that 16-bit compression trains like exact averaging (the uncompressed
run is the reference) and that each compressor's state is keyed by the
module's parameter names. Construction errors run on a one-rank thread group;
the CLI checks run ``gradsync train``.
"""

import json
import math
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from _dist import run_world
from _early import early_job
from gradsync.cli import main
from gradsync.compression import OneBit, PowerSGD, TopK
from gradsync.transport.thread import ThreadWorld

FEATURES, HIDDEN, CLASSES = 40, 32, 10
BATCH, STEPS, LR = 16, 5, 0.5
SMALL_BUCKET_CAP_MB = 4096 / 2**20  # ~1000 floats: each weight matrix in a bucket of its own
COLLECTIVE_TIMEOUT_S = 15.0
# name -> the compression= argument, built inside the rank (instances are per model and per rank)
SPECS = {"none": lambda: None, "fp16": lambda: "fp16", "bf16": lambda: "bf16", "onebit": lambda: "onebit",
         "topk": lambda: "topk", "powersgd": lambda: "powersgd", "OneBit()": lambda: OneBit(),
         "TopK(0.2)": lambda: TopK(0.2), "PowerSGD(1, warmup 1)": lambda: PowerSGD(1, warmup_steps=1)}
KIND = {"none": None, "fp16": "FP16", "bf16": "BF16", "onebit": "OneBit", "topk": "TopK", "powersgd": "PowerSGD",
        "OneBit()": "OneBit", "TopK(0.2)": "TopK", "PowerSGD(1, warmup 1)": "PowerSGD"}
NO_SYNC_SPECS = ("none", "fp16", "onebit", "powersgd")
JOIN_SPECS = ("none", "fp16", "onebit", "topk", "powersgd")


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def make_data(world_size, batches):
    """(world_size, batches, BATCH) inputs labelled by a fixed linear teacher: different data per rank."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(world_size, batches, BATCH, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return x, (x @ teacher).argmax(-1)


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _loss(module, x, y):
    with torch.no_grad():
        return F.cross_entropy(module(x.reshape(-1, FEATURES)), y.reshape(-1)).item()


def _train(spec, rank, world_size):
    """STEPS synced SGD steps; returns final parameters, loss on all ranks' data before and after, state."""
    model = gradsync.DataParallel(make_model(), bucket_cap_mb=SMALL_BUCKET_CAP_MB, compression=SPECS[spec]())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_data(world_size, STEPS)
    before = _loss(model.module, x, y)
    for step in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(x[rank, step]), y[rank, step]).backward()
        optimizer.step()
    state = None if model.compression is None else model.compression.state_dict()
    return {"params": _params(model), "loss_before": before, "loss_after": _loss(model.module, x, y),
            "kind": type(model.compression).__name__ if model.compression is not None else None,
            "buckets": len(model._reducer.buckets), "state": state}


def _train_no_sync(spec, rank, world_size):
    """3 steps of 3 micro-batches, the first two under no_sync."""
    model = gradsync.DataParallel(make_model(), bucket_cap_mb=SMALL_BUCKET_CAP_MB, compression=SPECS[spec]())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_data(world_size, 9)
    for step in range(3):
        optimizer.zero_grad()
        for micro in range(3):
            batch = 3 * step + micro
            loss = F.cross_entropy(model(x[rank, batch]), y[rank, batch]) / 3
            if micro < 2:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        optimizer.step()
    return {"params": _params(model)}


def _train_join(spec, rank, world_size):
    """Rank r has 2 + r batches (ws 3: 2, 3, 4); the early ranks shadow the rest under join()."""
    model = gradsync.DataParallel(make_model(), bucket_cap_mb=SMALL_BUCKET_CAP_MB, compression=SPECS[spec]())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_data(world_size, 2 + world_size)
    with model.join():
        for step in range(2 + rank):
            optimizer.zero_grad()
            F.cross_entropy(model(x[rank, step]), y[rank, step]).backward()
            optimizer.step()
    return {"params": _params(model)}


def _rank_compression_scenarios(world_size, specs, no_sync_specs, join_specs):
    """Every scenario on this rank; a failing one is reported as ("error", traceback) for its own test."""
    rank, results = gradsync.rank(), {}
    scenarios = ([("train", spec, _train) for spec in specs] + [("no_sync", spec, _train_no_sync)
                                                                 for spec in no_sync_specs]
                 + [("join", spec, _train_join) for spec in join_specs])
    for kind, spec, scenario in scenarios:
        try:
            results[kind, spec] = ("ok", scenario(spec, rank, world_size))
        except Exception:  # noqa: BLE001 - reported by that scenario's test
            results[kind, spec] = ("error", traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def world2():
    return run_world(2, _rank_compression_scenarios, 2, list(SPECS), NO_SYNC_SPECS, JOIN_SPECS, timeout_s=60,
                     collective_timeout_s=COLLECTIVE_TIMEOUT_S)


@pytest.fixture(scope="module")
def world3():
    return run_world(3, _rank_compression_scenarios, 3, ["none", "onebit", "powersgd"], ["onebit"],
                     JOIN_SPECS, timeout_s=60, collective_timeout_s=COLLECTIVE_TIMEOUT_S)


def _per_rank(results, kind, spec):
    outcomes = [per_rank[kind, spec] for per_rank in results]
    for rank, (status, value) in enumerate(outcomes):
        assert status == "ok", f"{kind} {spec} failed on rank {rank}:\n{value}"
    return [value for _, value in outcomes]


def _assert_replicas_equal(per_rank, what):
    for rank, result in enumerate(per_rank[1:], start=1):
        assert torch.isfinite(result["params"]).all(), f"{what}: rank {rank} has non-finite parameters"
        assert torch.equal(result["params"], per_rank[0]["params"]), f"{what}: rank {rank} differs from rank 0"


# ---------------------------------------------------------------------------- training


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec", list(SPECS))
def test_training_keeps_replicas_identical(world2, spec):
    """5 SGD steps, different data per rank, several buckets: the parameters end bitwise equal on both
    ranks, the loss on the ranks' data went down, and model.compression is the compressor asked for;
    a name and the default instance it stands for train identically."""
    per_rank = _per_rank(world2, "train", spec)
    _assert_replicas_equal(per_rank, spec)
    assert all(result["kind"] == KIND[spec] for result in per_rank)
    assert per_rank[0]["buckets"] >= 3
    assert per_rank[0]["loss_after"] < per_rank[0]["loss_before"] - 0.02, per_rank[0]
    if spec == "OneBit()":
        assert torch.equal(per_rank[0]["params"], _per_rank(world2, "train", "onebit")[0]["params"])


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec, atol", [("fp16", 1e-4), ("bf16", 2e-3)])
def test_16_bit_training_follows_exact_averaging(world2, spec, atol):
    """fp16/bf16 end within their rounding of the uncompressed run's parameters, and the loss on
    the ranks' data goes down as much (within 0.1 %)."""
    exact = _per_rank(world2, "train", "none")[0]
    result = _per_rank(world2, "train", spec)[0]
    torch.testing.assert_close(result["params"], exact["params"], rtol=0, atol=atol)
    assert result["loss_after"] < result["loss_before"] - 0.05
    assert result["loss_after"] == pytest.approx(exact["loss_after"], rel=1e-3)


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec, key", [("onebit", "worker"), ("topk", "residual"), ("powersgd", "residual")])
def test_state_is_per_rank_and_keyed_by_parameter_name(world2, spec, key):
    """Error-feedback state after training holds the module's parameter names with their shapes,
    and it differs between ranks (each keeps its own residual)."""
    per_rank = _per_rank(world2, "train", spec)
    shapes = {name: p.shape for name, p in make_model().named_parameters()}
    for result in per_rank:
        assert set(result["state"]["steps"]) == set(shapes)
        residuals = result["state"][key]
        assert residuals and set(residuals) <= set(shapes)
        assert all(residuals[name].shape == shapes[name] for name in residuals)
    assert any(not torch.equal(per_rank[0]["state"][key][name], per_rank[1]["state"][key][name])
               for name in per_rank[0]["state"][key])


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec", NO_SYNC_SPECS)
def test_no_sync_accumulation(world2, spec):
    """Two micro-batches under no_sync and a synced one, 3 steps: replicas equal; fp16 within its
    rounding of exact averaging."""
    per_rank = _per_rank(world2, "no_sync", spec)
    _assert_replicas_equal(per_rank, f"no_sync {spec}")
    if spec == "fp16":
        exact = _per_rank(world2, "no_sync", "none")[0]["params"]
        torch.testing.assert_close(per_rank[0]["params"], exact, rtol=0, atol=1e-4)


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec", JOIN_SPECS)
def test_join_with_uneven_batches(world2, spec):
    """2 and 3 batches under join(): no hang, replicas equal; fp16 divides by the ranks with data
    (within its rounding of the uncompressed join)."""
    per_rank = _per_rank(world2, "join", spec)
    _assert_replicas_equal(per_rank, f"join {spec}")
    if spec == "fp16":
        exact = _per_rank(world2, "join", "none")[0]["params"]
        torch.testing.assert_close(per_rank[0]["params"], exact, rtol=0, atol=1e-4)


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_three_ranks(world3):
    """3 ranks: training, no_sync accumulation and join with 2, 3 and 4 batches keep replicas equal for
    each compressor; fp16 under join stays within its rounding of the uncompressed join."""
    for kind, specs in (("train", ["none", "onebit", "powersgd"]), ("no_sync", ["onebit"]), ("join", JOIN_SPECS)):
        for spec in specs:
            _assert_replicas_equal(_per_rank(world3, kind, spec), f"{kind} {spec}")
    torch.testing.assert_close(_per_rank(world3, "join", "fp16")[0]["params"],
                               _per_rank(world3, "join", "none")[0]["params"], rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------- construction errors


def _one_rank_group():
    return gradsync.Communicator(ThreadWorld(1).transport(0))


def test_data_parallel_rejects_bad_compression():
    """An unknown name is a ValueError listing the choices, a non-compressor a TypeError, and one
    compressor instance serving two models a ValueError."""
    with pytest.raises(ValueError, match="bogus.*none, fp16, bf16, onebit, topk, powersgd"):
        gradsync.DataParallel(nn.Linear(2, 2), compression="bogus", group=_one_rank_group())
    with pytest.raises(TypeError, match="int"):
        gradsync.DataParallel(nn.Linear(2, 2), compression=5, group=_one_rank_group())
    shared = OneBit()
    first = gradsync.DataParallel(nn.Linear(2, 2), compression=shared, group=_one_rank_group())
    assert first.compression is shared
    with pytest.raises(ValueError, match="another model"):
        gradsync.DataParallel(nn.Linear(2, 2), compression=shared, group=_one_rank_group())
    assert gradsync.DataParallel(nn.Linear(2, 2), compression="none", group=_one_rank_group()).compression is None


# ---------------------------------------------------------------------------- command line


def _main(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["--compression", "bogus"], "--compression"), (["--topk-ratio", "0"], "--topk-ratio"),
    (["--topk-ratio", "1.5"], "--topk-ratio"), (["--powersgd-rank", "0"], "--powersgd-rank"),
    (["--compression-warmup-steps", "-1"], "--compression-warmup-steps")])
def test_cli_rejects_bad_compression_options(args, needle, tmp_path, capsys, monkeypatch):
    """Exit code 2 and one error line naming the option, before any worker starts."""
    monkeypatch.setenv("GRADSYNC_DATA_DIR", str(tmp_path))
    code, err = _main(["train", *args, "--out", str(tmp_path / "run")], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], (code, err)
    assert "Traceback" not in err and not (tmp_path / "run").exists()


ONEBIT_RUN = early_job("onebit-run", [
    "train", "--nproc", "2", "--model", "mlp", "--epochs", "1", "--num-samples", "200", "--batch-size", "16",
    "--compression", "onebit", "--out", "{folder}/run", "--no-progress"], env={"GRADSYNC_DATA_DIR": "{folder}"})


@pytest.mark.dist
@pytest.mark.early_job(ONEBIT_RUN)
@pytest.mark.timeout(120)
def test_cli_onebit_run_sends_far_fewer_bytes(early):
    """A 2-worker onebit run records its compression, and each step's bytes_sent is below a tenth of
    what a float32 ring AllReduce of the model's gradients sends (4 bytes per parameter at 2 ranks);
    the summary's per-step average counts only the steps' traffic (not the start-up broadcast), so it
    is close to rank 0's step mean (ranks differ only by the one-off bucket-order broadcast of step 1,
    which rank 0 sends). The run is an early job (``_early.py``): started with the session, waited for here."""
    out = early.folder / "run"
    result = early.wait(110)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert summary["compression"] == "onebit" and summary["config"]["compression"] == "onebit"
    ring_bytes = 4 * summary["num_parameters"]  # 2 (p - 1) / p x 4 bytes per float at p = 2
    assert len(steps) == summary["steps"] >= 3
    assert all(0 < r["bytes_sent"] < ring_bytes / 10 for r in steps), [r["bytes_sent"] for r in steps]
    rank0_mean = sum(r["bytes_sent"] for r in steps) / len(steps)
    assert rank0_mean * 0.97 < summary["bytes_sent_per_step"] <= rank0_mean
    assert all(math.isfinite(r["loss"]) for r in steps)
