"""The optimizer's part of a training checkpoint under ZeRO: one shard per rank file, consolidated when needed.

A sync run's checkpoint (:mod:`~gradsync.fault.checkpoint`: ``shared.pt``, one
``rank-NNNNN.pt`` per rank, a checksummed manifest) holds the optimizer state
in one of two ways:

* unsharded (``--shard none``): the whole ``optimizer.state_dict()`` in rank 0's ``shared.pt``;
* sharded (``--shard optimizer|gradients``): each rank's
  :meth:`~gradsync.ShardedOptimizer.state_dict` (its pieces' state and the
  layout that names them) in its own rank file, under :data:`SHARD_KEY`;
  ``shared.pt`` says the level and holds the model, whole on every rank after
  the step's all-gather, as always.

A resume at the same world size by a sharded run loads each rank's own shard
(the same bits). Any other resume (another world size, or another shard level:
``none``, ``optimizer`` and ``gradients`` in any direction) reads every rank
file (the folder is shared by all ranks) and consolidates the shards into the
whole state dict (:func:`gradsync.parallel.sharded_state.consolidate`), which
an unsharded optimizer loads as it is and a :class:`~gradsync.ShardedOptimizer`
slices to its own pieces. :func:`export_checkpoint` writes the same whole
state, with the model, into one file that plain torch loads (what DeepSpeed's
``zero_to_fp32.py`` and FSDP's ``FULL_STATE_DICT`` give their users).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import gradsync
from gradsync.fault import checkpoint
from gradsync.parallel.sharded_state import consolidate

SHARD_KEY = "optimizer_shard"  # a sharded checkpoint's rank file: that rank's ShardedOptimizer.state_dict()
EXPORT_FORMAT = 1


def is_sharded(optimizer) -> bool:
    """Whether ``optimizer`` steps one rank's shard (a :class:`~gradsync.ShardedOptimizer`)."""
    return isinstance(optimizer, gradsync.ShardedOptimizer)


def shared_entries(model, optimizer) -> dict:
    """Rank 0's optimizer entries: the shard level, and the whole state dict unless it is sharded."""
    entries = {"shard": getattr(model, "shard", "none")}
    if not is_sharded(optimizer):
        entries["optimizer"] = optimizer.state_dict()
    return entries


def rank_entries(optimizer) -> dict:
    """This rank's optimizer entries: its shard (waits for the parameters' all-gather in flight), or none."""
    return {SHARD_KEY: optimizer.state_dict()} if is_sharded(optimizer) else {}


def needs_every_rank(shared: dict, saved_world_size: int, world_size: int, sharded_here: bool,
                     shard_here: str | None = None) -> bool:
    """Whether resuming ``shared``'s checkpoint needs every rank's file for the optimizer: it was sharded, and
    this run is not at its world size, not sharded, or lays its shards out otherwise (``--shard parameters``
    cuts by unit, the other levels by bucket): its shards are consolidated."""
    saved_sharded = "model" in shared and "optimizer" not in shared  # local SGD: in the rank files, whole
    other_layout = shard_here is not None and "parameters" in (shard_here, shared.get("shard")) \
        and shard_here != shared.get("shard")
    return saved_sharded and (saved_world_size != world_size or not sharded_here or other_layout)


def every_rank(found: checkpoint.Checkpoint) -> list[dict]:
    """Every rank file of ``found``, in rank order."""
    return [found.load_rank(rank) for rank in range(found.world_size)]


def optimizer_state(shared: dict, own: dict, states: list[dict] | None) -> dict:
    """The optimizer state dict a resumed replica loads: the whole one (saved whole, or consolidated from
    ``states``, every rank's file), else this rank's own shard (``own``'s)."""
    if "optimizer" in shared:
        return shared["optimizer"]
    if states is not None:
        return consolidate([state[SHARD_KEY] for state in states])
    return own[SHARD_KEY]


def export_checkpoint(source: str | Path, out: str | Path) -> dict:
    """Write the whole state of a ``gradsync train`` checkpoint into ``out``, sharded or not.

    Args:
        source: a checkpoint folder (``.../step-000001234``) or the folder holding them
            (``--checkpoint-dir``: its newest complete checkpoint).
        out: the file to write (atomically, 0600); ``torch.load(out, weights_only=True)`` reads it.

    Returns:
        What was written: ``{"format", "step", "world_size", "shard", "config", "model"`` (the module's
        ``state_dict``), ``"optimizer"`` (the whole ``optimizer.state_dict()``, loadable into
        ``torch.optim.X(model.parameters())`` of the same model), ``"scheduler"}``.

    Raises:
        ValueError: no complete checkpoint at ``source``, a local-SGD one (one model per rank, by design
            different between averages), or a file of it corrupt (the message names it).
    """
    found = _find(Path(source))
    shared = found.load_shared()
    if "model" not in shared:
        raise ValueError(f"checkpoint {found.folder} is a local-SGD one: each rank holds its own model and "
                         f"optimizer (they differ between averages); there is no one whole state to export")
    states = every_rank(found) if needs_every_rank(shared, found.world_size, found.world_size, False) else None
    whole = {"format": EXPORT_FORMAT, "step": found.step, "world_size": found.world_size,
             "shard": shared.get("shard", "none"), "config": dict(shared.get("config", {})),
             "model": {name: tensor.clone() for name, tensor in shared["model"].items()},
             "optimizer": optimizer_state(shared, {}, states), "scheduler": shared.get("scheduler")}
    checkpoint.write_atomic(Path(out), checkpoint.serialize(whole))
    return whole


def _find(source: Path) -> checkpoint.Checkpoint:
    """The checkpoint in ``source`` (a step folder), else the newest complete one under it."""
    if (source / checkpoint.MANIFEST).is_file():
        return checkpoint.verify(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.CheckpointWarning)
        found = checkpoint.latest(source)
    if found is None:
        raise ValueError(f"no complete gradsync train checkpoint in {source} (a step-NNNNNNNNN folder with its "
                         f"MANIFEST.json, or a --checkpoint-dir holding some)")
    return found
