"""``gradsync bench bitwise``: the hash of a state dict, the settings, the table, the JSON rows and the exit status.

No training runs here (each ``gradsync train`` process tree costs ~10 s on this machine): the runner is replaced
by a stand-in, and the real runs are the bench's own (``make bench``) and tests/test_train_sharding.py's.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct

import pytest
import torch

from gradsync.bench import bitwise
from gradsync.cli import build_parser
from gradsync.train.config import TrainConfig, default_lr
from _cli import run_cli


def _file_sha256(state: dict) -> str:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def test_the_hash_is_sha256_of_name_dtype_shape_and_bytes():
    """One float32 1.0: sha256 of the layout the docstring states, its bytes written by struct, not by torch."""
    expected = hashlib.sha256(b"w\0torch.float32\0(1,)\0" + struct.pack("<f", 1.0)).hexdigest()
    assert bitwise.state_dict_sha256({"w": torch.tensor([1.0])}) == expected


def test_equal_tensors_hash_equal_whatever_their_storage_while_the_files_differ():
    """Views of one flat buffer (a sharded run's model.pt) and separate tensors (an unsharded one), inserted in
    another order: one hash, two different files."""
    torch.manual_seed(0)
    separate = {"a.weight": torch.randn(3, 4), "a.bias": torch.randn(3), "b.weight": torch.randn(2, 3)}
    flat = torch.cat([separate[name].reshape(-1) for name in ("a.weight", "a.bias", "b.weight")])
    views = {"b.weight": flat[15:].view(2, 3), "a.bias": flat[12:15], "a.weight": flat[:12].view(3, 4)}
    assert bitwise.state_dict_sha256(views) == bitwise.state_dict_sha256(separate)
    assert _file_sha256(views) != _file_sha256(separate)


def test_any_other_bit_dtype_or_shape_changes_the_hash():
    """-0.0 against 0.0 (torch.equal calls them equal), one ulp, the same bytes as int32, another shape."""
    base = torch.tensor([0.0, 1.0, 2.0, 3.0])
    changed = [torch.tensor([-0.0, 1.0, 2.0, 3.0]),
               torch.cat([base[:1], torch.nextafter(base[1:2], torch.tensor(2.0)), base[2:]]),
               base.view(torch.int32), base.view(2, 2)]
    assert torch.equal(changed[0], base)
    hashes = {bitwise.state_dict_sha256({"w": tensor}) for tensor in [base, *changed]}
    assert len(hashes) == 5
    with pytest.raises(TypeError, match="'step' is a int, not a tensor"):
        bitwise.state_dict_sha256({"step": 3})


def test_the_reference_runs_first_and_every_argv_parses_to_its_config():
    """(1, none) first even when not asked for; each run's argv parses (gradsync train's own parser) to the
    TrainConfig the options were validated as."""
    assert bitwise.settings_matrix([2, 4], ["gradients"]) == [(1, "none"), (2, "gradients"), (4, "gradients")]
    assert bitwise.settings_matrix([1, 2], ["none", "optimizer"]) == [(1, "none"), (1, "optimizer"), (2, "none"),
                                                                     (2, "optimizer")]
    _, _, _, train = bitwise.parse_options(nproc="1,2", shard_levels="gradients", models="mlp", clip_grad_norm=1.0,
                                           epochs=1, num_samples=400, global_batch_size=32, micro_shards=4,
                                           optimizer="sgd")
    argv = bitwise.train_argv("mlp", 2, "gradients", train, bitwise.Path("/run"))
    parsed = {k: v for k, v in vars(build_parser().parse_args(argv)).items() if k != "command"}
    parsed["lr"] = default_lr(parsed["model"]) if parsed["lr"] is None else parsed["lr"]  # as gradsync train does
    assert TrainConfig(**parsed) == TrainConfig(**{**bitwise.train_config("mlp", 2, "gradients", train).to_dict(),
                                                   "out": "/run"})
    _, _, _, train = bitwise.parse_options(nproc="1", shard_levels="none", models="cnn", clip_grad_norm=0.0,
                                           epochs=1, num_samples=400, global_batch_size=32, micro_shards=4,
                                           optimizer="adam")
    assert "--clip-grad-norm" not in bitwise.train_argv("cnn", 1, "none", train, bitwise.Path("/run"))


def _fake_runs(monkeypatch, hashes: dict) -> list:
    """Replace the training runs by rows whose sha256 is ``hashes[(model, world_size, shard)]`` (None: failed)."""
    calls = []

    def run_one(model, world_size, shard, train, folder):
        calls.append((model, world_size, shard))
        sha = hashes[model, world_size, shard]
        return {"world_size": world_size, "shard": shard, "model": model, "sha256": sha, "steps": 12,
                "clipped_steps": 5, "wall_s": 1.25, "error": None if sha else "exit 1: boom"}

    monkeypatch.setattr(bitwise, "run_one", run_one)
    monkeypatch.setattr(bitwise.data, "prepare", lambda *args: None)
    return calls


def test_the_bench_exits_1_naming_the_rows_that_differ_and_writes_its_json(monkeypatch, capsys, tmp_path):
    """A differing hash and a failed run: both rows say NO, the verdict counts them, the exit status is 1."""
    same, other = "ab" * 32, "cd" * 32
    hashes = {("mlp", 1, "none"): same, ("mlp", 1, "gradients"): same, ("mlp", 2, "none"): same,
              ("mlp", 2, "gradients"): other, ("cnn", 1, "none"): other, ("cnn", 1, "gradients"): other,
              ("cnn", 2, "none"): None, ("cnn", 2, "gradients"): other}
    calls = _fake_runs(monkeypatch, hashes)
    path = tmp_path / "rows.json"
    result = run_cli(["bench", "bitwise", "--nproc", "1,2", "--shard-levels", "none,gradients", "--model",
                      "mlp,cnn", "--num-samples", "400", "--json", str(path)], capsys)
    assert result.returncode == 1, result.stderr
    assert calls == list(hashes)
    rows = json.loads(path.read_text())
    assert [(r["model"], r["world_size"], r["shard"], r["equal_to_reference"]) for r in rows] == [
        (model, size, shard, (model, size, shard) not in {("mlp", 2, "gradients"), ("cnn", 2, "none")})
        for model, size, shard in hashes]
    assert {"world_size", "shard", "model", "sha256", "equal_to_reference", "wall_s"} <= set(rows[0])
    lines = result.stdout.splitlines()
    assert "  mlp          2 gradients    12       5 cdcdcdcdcdcdcdcd          NO    1.2" in lines
    assert "  cnn          2      none    12       5                -          NO    1.2" in lines
    assert "# cnn world size 2 shard none failed: exit 1: boom" in lines
    assert lines[-1] == "# 2 of 8 runs differ from (1, none)"
    assert bitwise.format_table(rows) in result.stdout  # what docs/benchmarks.md renders from the JSON


def test_the_bench_exits_0_when_every_run_has_the_references_bits(monkeypatch, capsys):
    _fake_runs(monkeypatch, {("mlp", size, shard): "ef" * 32 for size in (1, 2, 4)
                             for shard in ("none", "optimizer", "gradients", "parameters")})
    result = run_cli(["bench", "bitwise", "--model", "mlp"], capsys)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "# all 12 runs bitwise equal to their model's (1, none) run"
    assert "  mlp          4 parameters    12       5 efefefefefefefef         yes    1.2" in lines  # widened


@pytest.mark.parametrize("args, line", [
    (["--shard-levels", "none,zero3"], "unknown 'zero3' in --shard-levels; choose from none, optimizer, "
                                       "gradients, parameters"),
    (["--shard-levels", "parameters", "--nproc", "3"], "--deterministic --shard parameters needs --micro-shards a "
                                                       "multiple of the world size 3, got 4"),
    (["--nproc", "1,8"], "--deterministic with --micro-shards 4 runs at most 4 workers"),
    (["--nproc", "0"], "--nproc takes comma-separated world sizes >= 1, got '0'"),
    (["--clip-grad-norm", "-1"], "--clip-grad-norm must be >= 0 (0: no clipping), got -1.0"),
    (["--model", "resnet"], "unknown 'resnet' in --model; choose from"),
], ids=["level", "parameters-uneven", "micro-shards", "nproc", "clip", "model"])
def test_bad_options_are_one_line_before_any_run(args, line, monkeypatch, capsys):
    calls = _fake_runs(monkeypatch, {})
    result = run_cli(["bench", "bitwise", *args], capsys)
    assert result.returncode == 2 and not calls
    assert result.stderr.startswith(f"gradsync bench: error: {line}") and result.stderr.count("\n") == 1
