"""gradsync's part of a Lightning checkpoint: every rank's state gathered into rank 0's file, each rank's restored.

A Lightning checkpoint is one file that rank 0 writes from the dict every rank builds. gradsync adds what
differs between ranks:

* ``checkpoint["gradsync"]`` (:data:`KEY`): ``{"format", "world_size", "bucket_layout", "ranks"}``, where
  ``ranks[r]`` is rank r's ``{"compression": model.compression.state_dict()}`` (its error-feedback
  residuals, keyed by parameter name) gathered at save time;
* ``checkpoint["optimizer_states"]``: under ``shard="optimizer"|"gradients"`` every rank's shard
  consolidated into the whole ``optimizer.state_dict()`` (as Lightning does for torch's
  ``ZeroRedundancyOptimizer``), which a sharded optimizer slices back to its own pieces on load and an
  unsharded run (or ``DDPStrategy``) loads as it is.

A resume at another world size starts the compressors' state fresh (as gradsync's elastic resume does).
"""

from __future__ import annotations

import warnings

import torch.distributed as dist

import gradsync
from gradsync.parallel.sharded_state import consolidate

KEY = "gradsync"
FORMAT = 1


def gather_to_rank0(obj, rank: int, world_size: int) -> list | None:
    """Every rank's ``obj`` on rank 0 (rank order), None elsewhere. Collective over the default group."""
    if world_size == 1 or not dist.is_initialized():
        return [obj]
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def rank_state(model) -> dict:
    """This rank's gradsync state: its compressor's (empty without compression)."""
    compression = getattr(model, "compression", None)
    return {"compression": compression.state_dict()} if compression is not None else {}


def gradsync_entry(model, rank: int, world_size: int) -> dict | None:
    """:data:`KEY`'s value on rank 0 (None elsewhere). Collective: every rank calls it when saving."""
    ranks = gather_to_rank0(rank_state(model), rank, world_size)
    if ranks is None:
        return None
    layout = None if getattr(model, "shard", "none") != "none" else model.bucket_layout
    return {"format": FORMAT, "world_size": world_size, "bucket_layout": layout, "ranks": ranks}


def sharded_optimizer_state(optimizer, rank: int, world_size: int) -> dict:
    """The whole state of a :class:`gradsync.ShardedOptimizer` on rank 0 (``{}`` elsewhere): every rank's
    shard gathered and consolidated. Collective: every rank calls it."""
    shards = gather_to_rank0(optimizer.state_dict(), rank, world_size)
    return consolidate(shards) if shards is not None else {}


def is_sharded(optimizer) -> bool:
    """Whether ``optimizer`` steps one rank's pieces (a :class:`gradsync.ShardedOptimizer`)."""
    return isinstance(optimizer, gradsync.ShardedOptimizer)


def restore(model, entry: dict | None, rank: int, world_size: int) -> None:
    """Put :func:`gradsync_entry`'s state back into ``model`` (a wrapped DataParallel) on this rank.

    Without an entry (a checkpoint written by another strategy) nothing is restored. At another world
    size the compressor starts fresh, with a warning.

    Raises:
        ValueError: an entry of an unknown format, or a compressor state of other keys (another compression).
    """
    if entry is None:
        return
    if entry.get("format") != FORMAT:
        raise ValueError(f"this checkpoint's {KEY!r} entry has format {entry.get('format')!r}; this gradsync "
                         f"reads format {FORMAT}")
    if entry.get("bucket_layout") and getattr(model, "shard", "none") == "none":
        model.bucket_layout = entry["bucket_layout"]
    compression = getattr(model, "compression", None)
    if compression is None:
        return
    if entry["world_size"] != world_size:
        warnings.warn(f"gradsync: the checkpoint was written by {entry['world_size']} ranks, this run has "
                      f"{world_size}: each rank's compressor state (error feedback) starts fresh", stacklevel=2)
        return
    own = entry["ranks"][rank].get("compression")
    if own is not None:
        compression.load_state_dict(own)

