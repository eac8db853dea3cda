"""What a training checkpoint holds, and putting it back, so a restarted job continues as if nothing happened.

Shared (rank 0's file, the same on every rank in sync mode): the model, the
optimizer (unless it is sharded: then each rank's file holds its shard,
:mod:`~gradsync.train.sharded_checkpoint`) and scheduler, the data position (epoch, optimizer steps done in
that epoch), DataParallel's bucket layout (it fixes
the order in which gradients are summed, so results stay bitwise equal),
where ``metrics.jsonl`` ends at that step (its length and SHA-256, not its text: the
file is cut back to it on resume), the epoch records, wall times. Per rank: the epoch's running loss, RNG
states (torch, numpy, python), compressor state (error feedback), this
rank's time and byte counters, and in local-SGD mode its own model and
optimizer (replicas differ between averages).

A checkpoint resumes at any world size: the same one continues bitwise as
if nothing happened; another one continues from the same sample of the
epoch, with the per-rank state re-sharded (:mod:`~gradsync.train.reshard`),
and the first line of the resumed run says so. It resumes at any ZeRO level
too (``--shard`` is no trajectory option): sharded optimizer state is
consolidated and cut again as the resuming run needs.

Everything is tensors, numbers, strings, lists and dicts, so files load
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib

import os
import warnings
from dataclasses import asdict, dataclass

import torch

import gradsync
from gradsync.fault import checkpoint
from gradsync.fault.injection import attempt
from gradsync.parallel.staleness import StalenessStats
from gradsync.train.config import OPTIMIZER_ALIASES, TrainConfig
from gradsync.train.meter import StepTimes
from gradsync.train.metrics import resumed_text
from gradsync.train.position import EpochOrder, reorder
from gradsync.train.reshard import reshard_rank_states
from gradsync.train.rng import rng_state, set_rng_state
from gradsync.train import schedule, sharded_checkpoint
from gradsync.train.state import TrainState

# Options that define the training trajectory: a checkpoint only resumes a job that agrees on all of them.
# The AllReduce algorithm and bucketing fix the order in which gradients are summed: another
# order gives other bits, so they count too.
RESUME_FIELDS = ("mode", "model", "epochs", "batch_size", "accumulate", "lr", "lr_schedule", "optimizer",
                 "weight_decay", "seed", "num_samples", "sync_every", "compression", "topk_ratio",
                 "powersgd_rank", "compression_warmup_steps", "algorithm", "bucket_cap_mb",
                 "gradient_as_bucket_view", "global_batch_size", "deterministic", "micro_shards",
                 "clip_grad_norm", "gpt_width", "gpt_depth", "gpt_heads", "gpt_context", "lr_scaling",
                 "base_batch_size", "warmup_steps", "warmup_epochs")
# Added after checkpoints existed: a checkpoint without them was written with their defaults.
_LATER_FIELDS = ("global_batch_size", "deterministic", "micro_shards", "clip_grad_norm", "gpt_width", "gpt_depth",
                 "gpt_heads", "gpt_context", "lr_scaling", "base_batch_size", "warmup_steps", "warmup_epochs")
# Not among them: --shard (ZeRO shards the same step; the optimizer state is consolidated and cut again), like
# the world size.
STATE_FORMAT = 2  # 2: "metrics" (length + SHA-256 of metrics.jsonl) instead of 1's "metrics_text" (still read)


def config_fields(config: TrainConfig) -> dict:
    return {name: getattr(config, name) for name in RESUME_FIELDS}


def check_compatible(saved: dict, config: TrainConfig, world_size: int, saved_world_size: int,
                     folder) -> None:
    """Raise ValueError naming every option that differs from the checkpoint's job.

    Another world size or ``--shard`` level is no difference: the run continues
    from the same sample with its per-rank state re-sharded and its optimizer
    state consolidated if need be (``world_size`` and ``saved_world_size`` are
    kept in the signature for callers).
    """
    defaults = config_fields(TrainConfig())
    saved = {**{name: defaults[name] for name in _LATER_FIELDS}, **saved}
    saved["optimizer"] = OPTIMIZER_ALIASES.get(saved.get("optimizer"), saved.get("optimizer"))  # "adam" before
    differences = [f"--{name.replace('_', '-')} {saved.get(name)!r} there, {value!r} here"
                   for name, value in config_fields(config).items() if saved.get(name) != value]
    if differences:
        raise ValueError(f"checkpoint {folder} belongs to another job: " + "; ".join(differences)
                         + ". Use the same options, or another --checkpoint-dir")


@dataclass
class Replica:
    """The objects a checkpoint holds the ``state_dict`` of: the wrapped model, its optimizer and schedule.

    ``model`` is a DataParallel (sync) or LocalSGD (``local_sgd``: every rank
    saves its own model and optimizer, as replicas differ between averages);
    ``optimizer`` a torch optimizer or, for a sharded model, a :class:`~gradsync.ShardedOptimizer`.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    local_sgd: bool = False

    @property
    def sharded(self) -> bool:
        """Whether its optimizer steps this rank's shard only (``--shard optimizer|gradients``)."""
        return sharded_checkpoint.is_sharded(self.optimizer)


def whole_parameters(model):
    """A context in which ``model``'s parameters are whole (collective under ``--shard parameters``: every
    rank enters it; a no-op for models that do not shard)."""
    full = getattr(model, "full_parameters", None)
    return contextlib.nullcontext() if full is None else full()


def shared_state(state: TrainState, replica: Replica, config: TrainConfig, metrics: dict,
                 elapsed_s: float) -> dict:
    """Rank 0's part of a checkpoint taken after ``state.step`` optimizer steps, ``elapsed_s`` wall seconds in.

    ``metrics``: :meth:`MetricsLog.position` (a few bytes whatever the run's length)."""
    shared = {"format": STATE_FORMAT, "config": config_fields(config), "step": state.step, "samples": state.samples,
              "epoch": state.epoch, "steps_in_epoch": state.steps_in_epoch,
              "samples_in_epoch": state.samples_in_epoch, "order_start": state.order_start,
              "scheduler": replica.scheduler.state_dict(), "staleness": list(state.staleness.histogram),
              "metrics": metrics, "epoch_records": list(state.epoch_records), "elapsed_s": elapsed_s,
              "eval_s": state.eval_s}
    if not replica.local_sgd:  # a sharded model's parameters are whole once its rank_state was taken
        shared["model"] = replica.model.module.state_dict()
        shared.update(sharded_checkpoint.shared_entries(replica.model, replica.optimizer))
        # none: deterministic sums, or sharded buckets (laid out once, whatever the checkpoint says)
        shared["bucket_layout"] = None if replica.sharded else getattr(replica.model, "bucket_layout", None)
    return shared


def rank_state(state: TrainState, replica: Replica) -> dict:
    """This rank's part of a checkpoint: RNGs, running epoch loss, counters, compressor state, and a sharded
    optimizer's shard (taking it waits for the parameters' all-gather: take this before :func:`shared_state`)."""
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
    own.update(sharded_checkpoint.rank_entries(replica.optimizer))
    return own


def state_from(shared: dict, own: dict, bytes_counted: tuple[int, int] = (0, 0)) -> TrainState:
    """The :class:`TrainState` a checkpoint holds; ``bytes_counted``: (sent, received) this attempt's
    transport has counted so far (the totals continue from the checkpoint's)."""
    epoch_loss = own["epoch_loss"]
    staleness = StalenessStats()
    staleness.histogram = [int(n) for n in shared["staleness"]]
    return TrainState(step=int(shared["step"]), samples=int(shared.get("samples", 0)), epoch=int(shared["epoch"]),
                      steps_in_epoch=int(shared["steps_in_epoch"]),
                      samples_in_epoch=int(shared.get("samples_in_epoch", 0)),
                      order_start=int(shared.get("order_start", 0)), epoch_loss_sum=float(epoch_loss[0]),
                      epoch_loss_steps=int(epoch_loss[1]),
                      times=StepTimes(**{name: float(value) for name, value in own["times"].items()}),
                      staleness=staleness, step_bytes_sent=int(own["step_bytes_sent"]),
                      bytes_sent_offset=int(own["bytes_sent"]) - bytes_counted[0],
                      bytes_received_offset=int(own["bytes_received"]) - bytes_counted[1],
                      epoch_records=list(shared["epoch_records"]), eval_s=float(shared["eval_s"]),
                      elapsed_before_s=float(shared["elapsed_s"]), resumed_from_step=int(shared["step"]))


def restore_replica(replica: Replica, shared: dict, own: dict, states: list[dict] | None = None) -> None:
    """Put a checkpoint's model, optimizer, schedule, bucket layout and compressor state back (every rank).

    ``states``: every rank file, where the optimizer's shards must be consolidated
    (:func:`~gradsync.train.sharded_checkpoint.needs_every_rank`)."""
    source = own if replica.local_sgd else shared
    replica.model.module.load_state_dict(source["model"])
    if replica.local_sgd:
        replica.optimizer.load_state_dict(own["optimizer"])
    else:
        replica.optimizer.load_state_dict(sharded_checkpoint.optimizer_state(shared, own, states))
    replica.scheduler.load_state_dict(shared["scheduler"])
    if replica.local_sgd:
        replica.model.local_steps = int(own["local_steps"])
    elif shared.get("bucket_layout") and not replica.sharded:
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
    every = sharded_checkpoint.needs_every_rank(shared, found.world_size, world_size, replica.sharded,
                                                getattr(replica.model, "shard", "none"))
    states = sharded_checkpoint.every_rank(found) if every else None
    if every and rank == 0:
        say(f"optimizer state: the {found.world_size} shards of --shard {shared.get('shard')} consolidated for "
            f"--shard {getattr(replica.model, 'shard', 'none')} at {world_size} worker(s)")
    own = rank_state_at(found, rank, world_size, config, states)
    restore_replica(replica, shared, own, states)
    stats = replica.model.comm.stats
    state = state_from(shared, own, (stats.bytes_sent, stats.bytes_received))
    state.samples_in_epoch, state.order_start = data_position(shared, config, found.world_size, world_size)
    if "samples" not in shared:  # written before the run's samples were counted: one global batch per step
        state.samples = state.step * config.samples_per_step(found.world_size)
    set_rng_state(own["rng"])
    return state, _metrics_text(shared, metrics_file) if metrics_file is not None else None, found


def rank_state_at(found: checkpoint.Checkpoint, rank: int, world_size: int, config: TrainConfig,
                  states: list[dict] | None = None) -> dict:
    """New rank ``rank``'s state: its own file at the checkpoint's world size, else every old rank's
    re-sharded (:func:`~gradsync.train.reshard.reshard_rank_states`); ``states``: every rank file, if read."""
    if found.world_size == world_size:
        return states[rank] if states is not None else found.load_rank(rank)
    states = states if states is not None else sharded_checkpoint.every_rank(found)
    return reshard_rank_states(states, world_size, config.seed, config.deterministic)[rank]


def data_position(shared: dict, config: TrainConfig, saved_world_size: int, world_size: int) -> tuple[int, int]:
    """``(samples_in_epoch, order_start)`` to continue from at ``world_size`` (see :mod:`~gradsync.train.position`).

    A checkpoint from before the sample position was saved has done ``steps_in_epoch`` steps of
    its world size's global batch. Another world size starts a new order at the sample position.
    """
    steps = int(shared["steps_in_epoch"])
    samples = int(shared.get("samples_in_epoch", steps * config.samples_per_step(saved_world_size)))
    start = int(shared.get("order_start", 0))
    return samples, reorder(EpochOrder(start), samples, saved_world_size, world_size).start


def stretch_schedule(scheduler, total_steps: int) -> None:
    """A schedule restored at another world size ends at the run's new ``total_steps`` instead.

    The decay continues from the current lr (no jump at the resume) to the new end
    (:meth:`~gradsync.train.schedule.LrSchedule.stretch`); a cosine ``CosineAnnealingLR`` gets the new
    ``T_max`` (its recursive form continues from the current lr); a constant schedule is left alone.
    """
    if hasattr(scheduler, "T_max"):
        scheduler.T_max = max(int(total_steps), 1)
    schedule.stretch(scheduler, total_steps)


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


def announce(state: TrainState, total_steps: int, folder, events, change: dict | None = None) -> None:
    """Rank 0 says where this attempt starts (stderr and ``events``); silent on a fresh first attempt.

    ``folder``: the checkpoint resumed from, or None. ``change``: :func:`~gradsync.train.reshard.world_change`
    when it was written at another world size (its ``line`` ends the announcement).
    """
    if folder is not None:
        line = f"attempt {attempt() + 1}: resuming from {folder} (step {state.step} of {total_steps})"
        say(line + (f" {change['line']}" if change else ""))
    elif attempt() > 0:
        say(f"attempt {attempt() + 1}: no checkpoint yet; starting again from step 0 of {total_steps}")
    else:
        return
    events.write({"event": "resumed", "from_step": state.step, "attempt": attempt(),
                  "checkpoint": str(folder) if folder is not None else None, **(change or {})})
