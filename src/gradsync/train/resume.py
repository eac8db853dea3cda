"""What a training checkpoint holds, and putting it back, so a restarted job continues as if nothing happened.

Shared (rank 0's file, the same on every rank in sync mode): the model, the
optimizer and scheduler, the data position (epoch, optimizer steps done in
that epoch), DataParallel's bucket layout (it fixes
the order in which gradients are summed, so results stay bitwise equal),
``metrics.jsonl`` so far, the epoch records, wall times. Per rank: the epoch's running loss, RNG
states (torch, numpy, python), compressor state (error feedback), this
rank's time and byte counters, and in local-SGD mode its own model and
optimizer (replicas differ between averages).

Everything is tensors, numbers, strings, lists and dicts, so files load
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import random
import time
import warnings
from dataclasses import asdict

import numpy as np
import torch

import gradsync
from gradsync.fault import checkpoint
from gradsync.fault.injection import attempt
from gradsync.train.config import TrainConfig

# Options that define the training trajectory: a checkpoint only resumes a job that agrees on all of them.
# The AllReduce algorithm and bucketing fix the order in which gradients are summed: another
# order gives other bits, so they count too.
RESUME_FIELDS = ("mode", "model", "epochs", "batch_size", "accumulate", "lr", "lr_schedule", "optimizer",
                 "weight_decay", "seed", "num_samples", "sync_every", "compression", "topk_ratio",
                 "powersgd_rank", "compression_warmup_steps", "algorithm", "bucket_cap_mb",
                 "gradient_as_bucket_view")
STATE_FORMAT = 1


def config_fields(config: TrainConfig) -> dict:
    return {name: getattr(config, name) for name in RESUME_FIELDS}


def check_compatible(saved: dict, config: TrainConfig, world_size: int, saved_world_size: int,
                     folder) -> None:
    """Raise ValueError naming every option that differs from the checkpoint's job, or a changed world size."""
    differences = [f"--{name.replace('_', '-')} {saved.get(name)!r} there, {value!r} here"
                   for name, value in config_fields(config).items() if saved.get(name) != value]
    if differences:
        raise ValueError(f"checkpoint {folder} belongs to another job: " + "; ".join(differences)
                         + ". Use the same options, or another --checkpoint-dir")
    if saved_world_size != world_size:
        raise ValueError(f"checkpoint {folder} was written by {saved_world_size} workers; this job has "
                         f"{world_size}. gradsync resumes only at the same world size (the global batch, "
                         f"the data shards and the per-rank compressor state depend on it): resume with "
                         f"--nproc {saved_world_size}, or start afresh with another --checkpoint-dir")


def rng_state() -> dict:
    """torch, numpy and python RNG states as tensors and numbers."""
    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    version, python_state, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(position),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gauss)},
            "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64),
                       "gauss_next": gauss_next}}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss_next"]))


def shared_state(trainer, epoch: int, steps_in_epoch: int) -> dict:
    """Rank 0's part of a checkpoint taken after ``trainer.step`` optimizer steps."""
    state = {"format": STATE_FORMAT, "config": config_fields(trainer.config), "step": trainer.step,
             "epoch": epoch, "steps_in_epoch": steps_in_epoch,
             "scheduler": trainer.scheduler.state_dict(), "staleness": list(trainer.staleness.histogram),
             "metrics_text": trainer.log.text() if trainer.log else "",
             "epoch_records": list(trainer.epoch_records), "elapsed_s": trainer.elapsed_s(),
             "eval_s": trainer.eval_s}
    if not trainer.local_sgd:
        state["model"] = trainer.model.module.state_dict()
        state["optimizer"] = trainer.optimizer.state_dict()
        state["bucket_layout"] = trainer.model.bucket_layout
    return state


def rank_state(trainer, epoch_loss: torch.Tensor) -> dict:
    """This rank's part of a checkpoint; ``epoch_loss`` is its (sum of step losses, steps) in this epoch."""
    stats = trainer.model.comm.stats
    state = {"rng": rng_state(), "epoch_loss": epoch_loss.clone(), "times": asdict(trainer.times), "step_bytes_sent": trainer.step_bytes_sent,
             "bytes_sent": trainer.bytes_offset[0] + stats.bytes_sent,
             "bytes_received": trainer.bytes_offset[1] + stats.bytes_received}
    compression = getattr(trainer.model, "compression", None)
    if compression is not None:
        state["compression"] = compression.state_dict()
    if trainer.local_sgd:
        state["model"] = trainer.model.module.state_dict()
        state["optimizer"] = trainer.optimizer.state_dict()
        state["local_steps"] = trainer.model.local_steps
    return state


def restore(trainer, shared: dict, own: dict) -> None:
    """Put a checkpoint back into ``trainer`` (every rank, after the model is built and wrapped)."""
    source = own if trainer.local_sgd else shared
    trainer.model.module.load_state_dict(source["model"])
    trainer.optimizer.load_state_dict(source["optimizer"])
    trainer.scheduler.load_state_dict(shared["scheduler"])
    if trainer.local_sgd:
        trainer.model.local_steps = int(own["local_steps"])
    elif shared.get("bucket_layout"):
        trainer.model.bucket_layout = shared["bucket_layout"]
    compression = getattr(trainer.model, "compression", None)
    if compression is not None and "compression" in own:
        compression.load_state_dict(own["compression"])
    trainer.step = int(shared["step"])
    trainer.staleness.histogram = [int(n) for n in shared["staleness"]]
    trainer.epoch_records = list(shared["epoch_records"])
    for name, value in own["times"].items():
        setattr(trainer.times, name, float(value))
    trainer.step_bytes_sent = int(own["step_bytes_sent"])
    stats = trainer.model.comm.stats
    trainer.bytes_offset = (int(own["bytes_sent"]) - stats.bytes_sent,
                            int(own["bytes_received"]) - stats.bytes_received)
    trainer.eval_s = float(shared["eval_s"])
    set_rng_state(own["rng"])


def load_latest(trainer) -> tuple[tuple[int, int, torch.Tensor], str | None]:
    """Restore the newest complete checkpoint into ``trainer``, if checkpointing (collective).

    Rank 0 chooses (corrupt or partial newer ones are skipped with a
    warning) and broadcasts the step, so every rank loads the same one.

    Returns:
        ``(epoch, optimizer steps done in it, this rank's running epoch loss)``
        to continue from, and the ``metrics.jsonl`` text to start the log
        with (None: not checkpointing, append to the file as it is).

    Raises:
        ValueError: the checkpoint belongs to another job or world size.
    """
    start = (0, 0, torch.zeros(2, dtype=torch.float64))
    if trainer.checkpoint_root is None:
        return start, None
    found = _latest_reporting_skips(trainer.checkpoint_root) if trainer.is_main else None
    chosen = torch.tensor([found.step if found else -1], dtype=torch.int64)
    gradsync.broadcast(chosen, src=0)
    if int(chosen) < 0:
        return start, ""
    found = found or checkpoint.verify(checkpoint.step_dir(trainer.checkpoint_root, int(chosen)))
    shared = found.load_shared()
    check_compatible(shared["config"], trainer.config, trainer.world_size, found.world_size, found.folder)
    own = found.load_rank(trainer.rank)
    restore(trainer, shared, own)
    trainer.resumed_from = found
    trainer.started = time.perf_counter() - float(shared["elapsed_s"])
    return (int(shared["epoch"]), int(shared["steps_in_epoch"]), own["epoch_loss"]), shared["metrics_text"]


def _latest_reporting_skips(root):
    """:func:`checkpoint.latest`, each skipped checkpoint reported on one stderr line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", checkpoint.CheckpointWarning)
        found = checkpoint.latest(root)
    for warning in caught:
        say(f"{warning.category.__name__}: {warning.message}")
    return found


def say(line: str) -> None:
    """One line on stderr in one write, so lines from several workers never interleave."""
    os.write(2, f"gradsync: {line}\n".encode())


def announce(trainer) -> None:
    """Rank 0 says where this attempt starts (stderr and ``events.jsonl``); silent on a fresh first attempt."""
    total = trainer.steps_per_epoch * trainer.config.epochs
    if trainer.resumed_from is not None:
        say(f"attempt {attempt() + 1}: resuming from {trainer.resumed_from.folder} (step {trainer.step} of {total})")
    elif attempt() > 0:
        say(f"attempt {attempt() + 1}: no checkpoint yet; starting again from step 0 of {total}")
    else:
        return
    trainer.events.write({"event": "resumed", "from_step": trainer.step, "attempt": attempt(),
                          "checkpoint": str(trainer.resumed_from.folder) if trainer.resumed_from else None})
