"""What a training checkpoint holds, and putting it back, so a restarted job continues as if nothing happened.

Shared (rank 0's file, the same on every rank in sync mode): the model, the
optimizer and scheduler, the data position (epoch, optimizer steps done in
that epoch), DataParallel's bucket layout (it fixes
the order in which gradients are summed, so results stay bitwise equal),
where ``metrics.jsonl`` ends at that step (its length and SHA-256, not its text: the
file is cut back to it on resume), the epoch records, wall times. Per rank: the epoch's running loss, RNG
states (torch, numpy, python), compressor state (error feedback), this
rank's time and byte counters, and in local-SGD mode its own model and
optimizer (replicas differ between averages).

Everything is tensors, numbers, strings, lists and dicts, so files load
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import random
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch

import gradsync
from gradsync.fault import checkpoint
from gradsync.fault.injection import attempt
from gradsync.parallel.staleness import StalenessStats
from gradsync.train.config import TrainConfig
from gradsync.train.meter import StepTimes
from gradsync.train.metrics import resumed_text
from gradsync.train.state import TrainState

# Options that define the training trajectory: a checkpoint only resumes a job that agrees on all of them.
# The AllReduce algorithm and bucketing fix the order in which gradients are summed: another
# order gives other bits, so they count too.
RESUME_FIELDS = ("mode", "model", "epochs", "batch_size", "accumulate", "lr", "lr_schedule", "optimizer",
                 "weight_decay", "seed", "num_samples", "sync_every", "compression", "topk_ratio",
                 "powersgd_rank", "compression_warmup_steps", "algorithm", "bucket_cap_mb",
                 "gradient_as_bucket_view", "global_batch_size", "deterministic", "micro_shards")
# Added after checkpoints existed: a checkpoint without them was written with their defaults.
_LATER_FIELDS = ("global_batch_size", "deterministic", "micro_shards")
STATE_FORMAT = 2  # 2: "metrics" (length + SHA-256 of metrics.jsonl) instead of 1's "metrics_text" (still read)


def config_fields(config: TrainConfig) -> dict:
    return {name: getattr(config, name) for name in RESUME_FIELDS}


def check_compatible(saved: dict, config: TrainConfig, world_size: int, saved_world_size: int,
                     folder) -> None:
    """Raise ValueError naming every option that differs from the checkpoint's job, or a changed world size."""
    defaults = config_fields(TrainConfig())
    saved = {**{name: defaults[name] for name in _LATER_FIELDS}, **saved}
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


@dataclass
class Replica:
    """The objects a checkpoint holds the ``state_dict`` of: the wrapped model, its optimizer and schedule.

    ``model`` is a DataParallel (sync) or LocalSGD (``local_sgd``: every rank
    saves its own model and optimizer, as replicas differ between averages).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    local_sgd: bool = False


def shared_state(state: TrainState, replica: Replica, config: TrainConfig, metrics: dict,
                 elapsed_s: float) -> dict:
    """Rank 0's part of a checkpoint taken after ``state.step`` optimizer steps, ``elapsed_s`` wall seconds in.

    ``metrics``: :meth:`MetricsLog.position` (a few bytes whatever the run's length)."""
    shared = {"format": STATE_FORMAT, "config": config_fields(config), "step": state.step,
              "epoch": state.epoch, "steps_in_epoch": state.steps_in_epoch,
              "scheduler": replica.scheduler.state_dict(), "staleness": list(state.staleness.histogram),
              "metrics": metrics, "epoch_records": list(state.epoch_records), "elapsed_s": elapsed_s,
              "eval_s": state.eval_s}
    if not replica.local_sgd:
        shared["model"] = replica.model.module.state_dict()
        shared["optimizer"] = replica.optimizer.state_dict()
        shared["bucket_layout"] = getattr(replica.model, "bucket_layout", None)  # none: deterministic sums
    return shared


def rank_state(state: TrainState, replica: Replica) -> dict:
    """This rank's part of a checkpoint: RNGs, running epoch loss, counters, compressor state."""
    stats = replica.model.comm.stats
    own = {"rng": rng_state(), "epoch_loss": state.epoch_loss(), "times": asdict(state.times),
           "step_bytes_sent": state.step_bytes_sent,
           "bytes_sent": state.bytes_sent_offset + stats.bytes_sent,
           "bytes_received": state.bytes_received_offset + stats.bytes_received}
    compression = getattr(replica.model, "compression", None)
    if compression is not None:
        own["compression"] = compression.state_dict()
    if replica.local_sgd:
        own["model"] = replica.model.module.state_dict()
        own["optimizer"] = replica.optimizer.state_dict()
        own["local_steps"] = replica.model.local_steps
    return own


def state_from(shared: dict, own: dict, bytes_counted: tuple[int, int] = (0, 0)) -> TrainState:
    """The :class:`TrainState` a checkpoint holds; ``bytes_counted``: (sent, received) this attempt's
    transport has counted so far (the totals continue from the checkpoint's)."""
    epoch_loss = own["epoch_loss"]
    staleness = StalenessStats()
    staleness.histogram = [int(n) for n in shared["staleness"]]
    return TrainState(step=int(shared["step"]), epoch=int(shared["epoch"]),
                      steps_in_epoch=int(shared["steps_in_epoch"]), epoch_loss_sum=float(epoch_loss[0]),
                      epoch_loss_steps=int(epoch_loss[1]),
                      times=StepTimes(**{name: float(value) for name, value in own["times"].items()}),
                      staleness=staleness, step_bytes_sent=int(own["step_bytes_sent"]),
                      bytes_sent_offset=int(own["bytes_sent"]) - bytes_counted[0],
                      bytes_received_offset=int(own["bytes_received"]) - bytes_counted[1],
                      epoch_records=list(shared["epoch_records"]), eval_s=float(shared["eval_s"]),
                      elapsed_before_s=float(shared["elapsed_s"]), resumed_from_step=int(shared["step"]))


def restore_replica(replica: Replica, shared: dict, own: dict) -> None:
    """Put a checkpoint's model, optimizer, schedule, bucket layout and compressor state back (every rank)."""
    source = own if replica.local_sgd else shared
    replica.model.module.load_state_dict(source["model"])
    replica.optimizer.load_state_dict(source["optimizer"])
    replica.scheduler.load_state_dict(shared["scheduler"])
    if replica.local_sgd:
        replica.model.local_steps = int(own["local_steps"])
    elif shared.get("bucket_layout"):
        replica.model.bucket_layout = shared["bucket_layout"]
    compression = getattr(replica.model, "compression", None)
    if compression is not None and "compression" in own:
        compression.load_state_dict(own["compression"])


def load_latest(root, config: TrainConfig, replica: Replica, metrics_file=None) -> tuple[TrainState, str | None,
                                                                                         object]:
    """Restore the newest complete checkpoint under ``root`` into ``replica``, if checkpointing (collective).

    Rank 0 chooses (corrupt or partial newer ones are skipped with a
    warning) and broadcasts the step, so every rank loads the same one.

    Returns:
        The :class:`TrainState` to continue from (a fresh one when there is
        no checkpoint), the ``metrics.jsonl`` text to start the log with
        (None: not checkpointing, append to the file as it is; read from
        ``metrics_file``, else the file the checkpoint's run wrote, on the
        rank that passes ``metrics_file``), and the checkpoint found (None if none).

    Raises:
        ValueError: the checkpoint belongs to another job or world size.
    """
    if root is None:
        return TrainState(), None, None
    rank, world_size = gradsync.rank(), gradsync.world_size()
    found = _latest_reporting_skips(root) if rank == 0 else None
    chosen = torch.tensor([found.step if found else -1], dtype=torch.int64)
    gradsync.broadcast(chosen, src=0)
    if int(chosen) < 0:
        return TrainState(), "", None
    found = found or checkpoint.verify(checkpoint.step_dir(root, int(chosen)))
    shared = found.load_shared()
    check_compatible(shared["config"], config, world_size, found.world_size, found.folder)
    own = found.load_rank(rank)
    restore_replica(replica, shared, own)
    stats = replica.model.comm.stats
    state = state_from(shared, own, (stats.bytes_sent, stats.bytes_received))
    set_rng_state(own["rng"])
    return state, _metrics_text(shared, metrics_file) if metrics_file is not None else None, found


def _metrics_text(shared: dict, metrics_file) -> str:
    """``metrics.jsonl`` as it was at the checkpoint: the saved text (format 1) or the file's prefix (2).

    A log that no longer holds that prefix (deleted, another run's) restarts
    empty, said on one line: the checkpoint's model and data position still resume.
    """
    if "metrics_text" in shared:
        return shared["metrics_text"]
    position = shared["metrics"]
    text = resumed_text(position, [metrics_file])
    if text is None:
        say(f"metrics.jsonl up to step {shared['step']} ({position['path']}, {position['nbytes']} bytes) is gone or "
            f"changed; {metrics_file} starts empty at step {shared['step']}")
        return ""
    return text


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


def announce(state: TrainState, total_steps: int, folder, events) -> None:
    """Rank 0 says where this attempt starts (stderr and ``events``); silent on a fresh first attempt.

    ``folder``: the checkpoint resumed from, or None.
    """
    if folder is not None:
        say(f"attempt {attempt() + 1}: resuming from {folder} (step {state.step} of {total_steps})")
    elif attempt() > 0:
        say(f"attempt {attempt() + 1}: no checkpoint yet; starting again from step 0 of {total_steps}")
    else:
        return
    events.write({"event": "resumed", "from_step": state.step, "attempt": attempt(),
                  "checkpoint": str(folder) if folder is not None else None})
