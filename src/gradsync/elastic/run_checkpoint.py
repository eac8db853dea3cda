"""Checkpoints of an elastic run: rank 0's replicated state, resumable at any world size.

An elastic run's state does not depend on its world size: the model,
optimizer and schedule are the same on every member, and the data position
is a step of the epoch's global batches. Rank 0 writes it every
``--checkpoint-every`` steps to ``<checkpoint dir>/elastic/step-<N>.pt``
(atomically, the newest ``--keep-checkpoints`` kept). When the whole job
fails, a new ``gradsync train --elastic`` with the same options and any
``--nproc`` offers the newest one when its workers join: the quorum makes the
worker holding it rank 0 of the first membership, and every member takes it
from there. What is per rank (RNG streams, error-feedback residuals) starts
fresh, since no rank's own is in it.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import torch

from gradsync.fault.checkpoint import CheckpointWarning, write_atomic

FOLDER = "elastic"


def folder(checkpoint_dir: str | Path | None) -> Path | None:
    """``<checkpoint dir>/elastic``, or None without a checkpoint folder."""
    return Path(checkpoint_dir) / FOLDER if checkpoint_dir else None


def save(root: Path, state: dict, world_size: int, keep: int, config: dict) -> Path:
    """Write ``state`` (model, optimizer, scheduler, progress, global_batch) after
    ``state["progress"]["step"]`` steps into ``root``, with the job's ``config`` fields (what a resume
    compares); the newest ``keep`` are kept."""
    root.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({**state, "config": config, "world_size": world_size}, buffer)
    path = root / f"step-{state['progress']['step']:08d}.pt"
    write_atomic(path, buffer.getvalue())
    for old in sorted(root.glob("step-*.pt"))[:-max(keep, 1)]:
        old.unlink(missing_ok=True)
    return path


# what the Trainer's snapshot (gradsync.train.loop_records) and check_resumable read: a loadable file without
# them is no elastic checkpoint
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "progress", "global_batch", "config", "world_size")


def latest(root: Path | None) -> tuple[Path, dict] | None:
    """The newest readable checkpoint and its state, or None.

    Each newer one that cannot be used is skipped with a
    :class:`~gradsync.fault.checkpoint.CheckpointWarning` naming the file and
    what is wrong with it (the same fallback as torch's and DeepSpeed's: the
    last *valid* checkpoint, said out loud).
    """
    found, skipped = scan(root)
    for line in skipped:
        warnings.warn(line, CheckpointWarning, stacklevel=2)
    return found


def scan(root: Path | None) -> tuple[tuple[Path, dict] | None, list[str]]:
    """``(newest usable (path, state) or None, one line per newer checkpoint skipped)`` under ``root``
    (:func:`folder`); warns nothing, so that a run can record the lines (its events) as well as show them."""
    if root is None or not root.is_dir():
        return None, []
    skipped = []
    for path in sorted(root.glob("step-*.pt"), reverse=True):
        state, problem = _read(path)
        if problem is None:
            return (path, state), skipped
        skipped.append(f"skipping elastic checkpoint {path}: {problem}; trying the one before")
    return None, skipped


def _read(path: Path) -> tuple[dict | None, str | None]:
    """``(state, None)``, or ``(None, what is wrong)`` for a torn, corrupt or foreign file."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types for a damaged file
        return None, f"it cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    missing = [key for key in REQUIRED_KEYS if key not in state] if isinstance(state, dict) else list(REQUIRED_KEYS)
    if missing:
        return None, f"it lacks {', '.join(missing)} (not an elastic checkpoint)"
    return state, None


def offer(found: tuple[Path, dict], global_batch: int, world_size: int) -> tuple[dict, str]:
    """What rank 0 of a whole job's first membership hands over from the newest checkpoint ``found``, and
    the line that says so."""
    path, state = found
    progress = state["progress"]
    line = (f"elastic run resuming from step {progress['step']} of {path}, written by {state['world_size']} "
            f"workers, now {world_size}: the same global batch of {global_batch} samples and data position "
            f"(epoch {progress['epoch']}, step {progress['steps_in_epoch']} of it); per-rank RNG streams and "
            f"error-feedback residuals start fresh")
    return {name: state[name] for name in ("model", "optimizer", "scheduler", "progress")}, line
