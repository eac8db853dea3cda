"""Fault tolerance: checkpoints that are complete or ignored (atomic, checksummed, pruned)."""

from gradsync.fault.checkpoint import Checkpoint, CheckpointWarning, latest, prune, save, verify

__all__ = ["Checkpoint", "CheckpointWarning", "latest", "prune", "save", "verify"]
