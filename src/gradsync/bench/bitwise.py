"""``gradsync bench bitwise``: ``gradsync train --deterministic`` at every shard level and world size, the same bits.

``--deterministic`` promises bitwise the same parameters at any world size
and placement; with ZeRO sharding (``--shard optimizer|gradients|parameters``)
the exact int64 sum is reduce-scattered and each rank steps only its chunk, so
the promise has to hold at every level too (docs/sharding.md). This bench
checks it on the real command line: one ``gradsync train --deterministic``
process tree per (model, world size, shard level), the same seed, global
batch, micro-shards, optimizer and global-norm clipping in each, and the
final ``model.pt`` of each run hashed. The reference of a model is its run
at world size 1 without sharding, always run first; a row is equal when its
hash is the reference's. The exit status is 1 when any row differs or any
run failed: a bench that checks a promise.

The hash (:func:`state_dict_sha256`) is sha256 over the state dict's
tensors in name order (each tensor's name, dtype, shape and raw bytes), not
over the file's bytes: ``torch.save`` pickles storages, not tensors, so a
file's bytes depend on storage layout (a sharded run's parameters are views of
one flat buffer, which gradsync's checkpoint writer saves as copies) as well
as on the values. Each
setting runs once: the table compares bits, not times, so there is no ratio
and no ``--repeat``; ``wall s`` (the whole process tree, start-up included)
only says what the run cost.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping

import torch

from gradsync.bench.output import claim_json_path, comma_names, format_rows, optional, write_json
from gradsync.parallel.shard_layout import IMPLEMENTED_LEVELS
from gradsync.train import data
from gradsync.train.config import TrainConfig
from gradsync.train.metrics import METRICS_FILE, MODEL_FILE, SUMMARY_FILE
from gradsync.train.models import MODELS
from gradsync.train.validation import validate, validate_against_data

REFERENCE = (1, "none")   # (world size, shard level) every row is compared with
HASH_PREFIX = 16          # hex digits of the sha256 the table shows (the JSON has all 64)
RUN_TIMEOUT_S = 600.0     # one training run, start-up included
COLLECTIVE_TIMEOUT_S = 60.0  # gradsync train --timeout: a hung run fails in a minute, not in five


def state_dict_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """The sha256 (64 hex digits) of a state dict's tensors, in sorted name order.

    For each tensor: its name, dtype and shape (as text) and its raw bytes
    (row-major, on the CPU). Equal hashes mean the same names with the same
    bits: unlike ``torch.equal``, ``0.0`` and ``-0.0`` differ, and a NaN
    equals the NaN with the same bits.

    Raises:
        TypeError: a value is not a tensor (naming its key).
    """
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}\0{flat.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _world_sizes(text: str) -> list[int]:
    sizes = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--nproc takes comma-separated world sizes >= 1, got {item!r}")
        sizes.append(int(item))
    if not sizes:
        raise ValueError("--nproc needs at least one value")
    return sorted(set(sizes))


def settings_matrix(world_sizes: list[int], levels: list[str]) -> list[tuple[int, str]]:
    """(world size, shard level) of every run of one model: the reference first, then by world size and level."""
    rest = [(size, level) for size in world_sizes for level in levels if (size, level) != REFERENCE]
    return [REFERENCE, *rest]


def train_config(model: str, world_size: int, shard: str, train: dict) -> TrainConfig:
    """The TrainConfig of one run (what its command line parses to): ``train`` holds the shared options."""
    return TrainConfig(model=model, nproc=world_size, shard=shard, deterministic=True, progress=False,
                       timeout=COLLECTIVE_TIMEOUT_S, **train)


def train_argv(model: str, world_size: int, shard: str, train: dict, out: Path) -> list[str]:
    """``gradsync train ...`` arguments of one run (after ``python -m gradsync``)."""
    argv = ["train", "--deterministic", "--model", model, "--nproc", str(world_size), "--shard", shard,
            "--out", str(out), "--no-progress", "--timeout", f"{COLLECTIVE_TIMEOUT_S:g}"]
    for name, value in train.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def parse_options(*, nproc: str, shard_levels: str, models: str, clip_grad_norm: float, epochs: int,
                  num_samples: int, global_batch_size: int, micro_shards: int,
                  optimizer: str) -> tuple[list[int], list[str], list[str], dict]:
    """Checked world sizes, shard levels, models and the shared ``gradsync train`` options (a dict of
    TrainConfig fields), every run validated as ``gradsync train`` would before any process starts.

    Raises:
        ValueError: a bad option, named (``--clip-grad-norm`` must be >= 0; 0 turns clipping off).
    """
    world_sizes = _world_sizes(nproc)
    levels = comma_names(shard_levels, "--shard-levels", IMPLEMENTED_LEVELS)
    names = comma_names(models, "--model", tuple(name for name in MODELS if name != "gpt"))  # MNIST-1D's models
    if not clip_grad_norm >= 0:
        raise ValueError(f"--clip-grad-norm must be >= 0 (0: no clipping), got {clip_grad_norm}")
    train = {"epochs": epochs, "num_samples": num_samples, "global_batch_size": global_batch_size,
             "micro_shards": micro_shards, "optimizer": optimizer, "clip_grad_norm": clip_grad_norm or None}
    num_train = data.num_train_samples(num_samples) if num_samples >= 10 else 0
    for model in names:
        for world_size, shard in settings_matrix(world_sizes, levels):
            config = train_config(model, world_size, shard, train)
            validate(config)
            validate_against_data(config, world_size, num_train)
    return world_sizes, levels, names, train


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def _clipped_steps(folder: Path, clip: float | None) -> int | None:
    """Steps whose gradient norm (before clipping, metrics.jsonl) was above ``clip``; None without clipping."""
    if clip is None:
        return None
    records = [json.loads(line) for line in (folder / METRICS_FILE).read_text().splitlines() if line.strip()]
    return sum(1 for record in records if record.get("kind") == "step" and record.get("grad_norm", 0.0) > clip)


def run_one(model: str, world_size: int, shard: str, train: dict, folder: Path) -> dict:
    """Train one setting with ``python -m gradsync train`` and hash its model.pt.

    Returns the row: world_size, shard, model, sha256 (None when the run failed), steps, clipped_steps,
    wall_s (seconds of the whole process tree) and error (the run's last stderr line, or None).
    """
    argv = [sys.executable, "-m", "gradsync", *train_argv(model, world_size, shard, train, folder)]
    row = {"world_size": world_size, "shard": shard, "model": model, "sha256": None, "steps": None,
           "clipped_steps": None, "error": None}
    started = time.perf_counter()
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return {**row, "wall_s": time.perf_counter() - started, "error": f"timed out after {RUN_TIMEOUT_S:g} s"}
    row["wall_s"] = time.perf_counter() - started
    if result.returncode != 0:
        print(result.stderr, end="", file=sys.stderr, flush=True)
        return {**row, "error": f"exit {result.returncode}: {_last_line(result.stderr)}"}
    summary = json.loads((folder / SUMMARY_FILE).read_text())
    if (summary["world_size"], summary["shard"]) != (world_size, shard):
        return {**row, "error": f"ran world size {summary['world_size']}, shard {summary['shard']}"}
    state = torch.load(folder / MODEL_FILE, map_location="cpu", weights_only=True)
    return {**row, "sha256": state_dict_sha256(state), "steps": summary["steps"],
            "clipped_steps": _clipped_steps(folder, train["clip_grad_norm"])}


def compare(rows: list[dict]) -> list[dict]:
    """The rows with ``equal_to_reference``: the same sha256 as their model's (1, none) row (False when either
    failed)."""
    reference = {row["model"]: row["sha256"] for row in rows if (row["world_size"], row["shard"]) == REFERENCE}
    return [{**row, "equal_to_reference": row["sha256"] is not None and row["sha256"] == reference.get(row["model"])}
            for row in rows]


def format_table(rows: list[dict]) -> str:
    """The table ``gradsync bench bitwise`` prints (and docs/benchmarks.md shows), with its verdict line."""
    shard_width = max([9] + [len(row["shard"]) for row in rows])  # "parameters" widens it
    table = format_rows(rows, [
        ("model", 5, "{model}"), ("world_size", 10, "{world_size}"), ("shard", shard_width, "{shard}"),
        ("steps", 5, optional("steps", "d")), ("clipped", 7, optional("clipped_steps", "d")),
        ("sha256", HASH_PREFIX, lambda row: (row["sha256"] or "-")[:HASH_PREFIX]),
        ("= (1, none)", 11, lambda row: "yes" if row["equal_to_reference"] else "NO"),
        ("wall s", 6, "{wall_s:.1f}")])
    lines = [table, f"# sha256: of model.pt's tensors (name, dtype, shape, bytes; in name order), not of the file, "
             f"whose pickled bytes depend on storage layout; first {HASH_PREFIX} hex "
             f"digits shown", "# each setting runs once: bits are compared, no ratio, so there is no --repeat"]
    failed = [row for row in rows if row.get("error")]
    lines += [f"# {row['model']} world size {row['world_size']} shard {row['shard']} failed: {row['error']}"
              for row in failed]
    differ = [row for row in rows if not row["equal_to_reference"]]
    lines.append(f"# {len(differ)} of {len(rows)} runs differ from (1, none)" if differ else
                 f"# all {len(rows)} runs bitwise equal to their model's (1, none) run")
    return "\n".join(lines)


def _claim_out(out: str | None) -> tuple[Path, bool]:
    """The folder of the run folders and whether it is a temporary one (removed at the end)."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="gradsync-bench-bitwise-")), True
    folder = Path(out)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"--out {folder} is not an empty folder; choose another")
    folder.mkdir(parents=True, exist_ok=True)
    return folder, False


def run_bench(*, nproc: str = "1,2,4", shard_levels: str = ",".join(IMPLEMENTED_LEVELS), models: str = "mlp,cnn",
              clip_grad_norm: float = 1.0, epochs: int = 1, num_samples: int = 2000, global_batch_size: int = 32,
              micro_shards: int = 4, optimizer: str = "adam", out: str | None = None,
              json_path: str | None = None) -> list[dict]:
    """Run every setting, print the table, write the JSON rows; returns them (check ``equal_to_reference``)."""
    world_sizes, levels, names, train = parse_options(
        nproc=nproc, shard_levels=shard_levels, models=models, clip_grad_norm=clip_grad_norm, epochs=epochs,
        num_samples=num_samples, global_batch_size=global_batch_size, micro_shards=micro_shards, optimizer=optimizer)
    claim_json_path(json_path)
    out_dir, temporary = _claim_out(out)
    data.prepare(None, num_samples)  # generated once here, not inside the reference run's time
    clip = "off" if train["clip_grad_norm"] is None else f"{train['clip_grad_norm']:g}"
    print(f"# gradsync bench bitwise: gradsync train --deterministic, {epochs} epoch(s) of {num_samples} MNIST-1D "
          f"samples, global batch {global_batch_size}, {micro_shards} micro-shards, {optimizer}, clip-grad-norm "
          f"{clip}; world sizes {','.join(map(str, world_sizes))} x --shard {','.join(levels)}; reference: "
          f"world size 1, --shard none", flush=True)
    rows = []
    try:
        for model in names:
            for world_size, shard in settings_matrix(world_sizes, levels):
                row = run_one(model, world_size, shard, train, out_dir / f"{model}-ws{world_size}-{shard}")
                rows.append(row)
                print(f"# done: {model} world size {world_size} --shard {shard} ({row['wall_s']:.1f} s)", flush=True)
    finally:
        if temporary:
            shutil.rmtree(out_dir, ignore_errors=True)
    rows = compare(rows)
    print(format_table(rows), flush=True)
    if json_path:
        write_json(json_path, rows)
    return rows
