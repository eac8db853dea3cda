"""Checkpoints that are complete or ignored: atomic files, checksums, a manifest written last.

Layout of one checkpoint, ``DIR/step-000001234/``::

    shared.pt        rank 0's state (model, optimizer, data position, metrics, ...)
    rank-00003.pt    one per rank: what differs by rank (RNG, compressor residuals)
    MANIFEST.json    written by rank 0 last: step, world size, every file's size and SHA-256

Every file is written to a temporary name in the same folder, flushed,
fsynced and renamed (POSIX rename is atomic), then the folder is fsynced. A
checkpoint counts only when its manifest exists and every file it lists has
the recorded size and checksum, so a crash at any point leaves either the
previous checkpoint or a complete new one. The folder must be one that every
rank sees (a shared file system): at every save rank 0 checks that it sees
each rank's file, and otherwise every rank raises
:class:`CheckpointFolderError` (per-node folders are not supported).
Folders are created 0700 and files 0600. Files are read with
``torch.load(weights_only=True)``: tensors, numbers, strings, lists, dicts.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from gradsync import collectives
from gradsync.collectives.communicator import Communicator
from gradsync.errors import CheckpointFolderError

MANIFEST = "MANIFEST.json"
SHARED_FILE = "shared.pt"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{9})$")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped because it is incomplete or corrupt (the message names the file)."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:09d}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename (then fsync the folder).

    Raises:
        OSError: naming ``path`` (disk full, no permission, ...); the temporary file is removed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, f"writing {path} failed: {exc.strerror or exc}") from None


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def serialize(state: dict) -> bytes:
    """``torch.save`` into bytes; a tensor that views part of a larger storage (a sharded model's parameters
    are views of one flat buffer per bucket) is saved as its own copy, so that the file holds what a plain
    ``state_dict`` would (no padding, no other tensors' bytes, the same bytes at every shard level)."""
    buffer = io.BytesIO()
    torch.save(_own_storages(state), buffer)
    return buffer.getvalue()


def _own_storages(value):
    if isinstance(value, torch.Tensor):
        whole = value.untyped_storage().nbytes() == value.numel() * value.element_size()
        return value if whole or value.is_sparse else value.clone()
    if isinstance(value, dict):
        return type(value)((key, _own_storages(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_own_storages(item) for item in value)
    return value


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def save(root: str | Path, step: int, shared_state: dict | None, rank_state: dict, comm: Communicator,
         keep: int = 2) -> Path:
    """Write checkpoint ``step`` (collective: every rank of ``comm`` calls this).

    Args:
        root: the checkpoint folder (created if missing).
        step: optimizer steps done (>= 0); names the checkpoint.
        shared_state: rank 0's state (ignored on other ranks).
        rank_state: this rank's own state.
        comm: the group; the files' checksums are gathered to rank 0, which
            writes the manifest once every rank's file is on disk.
        keep: complete checkpoints to keep (>= 1); rank 0 removes older ones.

    Returns:
        The checkpoint's folder.

    Raises:
        ValueError: bad ``step`` or ``keep``; OSError: the folder is not writable.
        CheckpointFolderError: on every rank, when rank 0 does not see another
        rank's file (the folder is not shared between the nodes).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    folder = step_dir(root, step)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    own = serialize(rank_state)
    write_atomic(folder / rank_file(comm.rank), own)
    record = torch.tensor(list(_digest(own)) + list(len(own).to_bytes(8, "little")), dtype=torch.uint8)
    records = collectives.all_gather(record, comm) if comm.world_size > 1 else [record]
    _check_shared(root, folder, records, comm)
    if comm.rank == 0:
        files = {rank_file(rank): {"sha256": bytes(r[:32].tolist()).hex(),
                                   "nbytes": int.from_bytes(bytes(r[32:].tolist()), "little")}
                 for rank, r in enumerate(records)}
        shared = serialize(shared_state if shared_state is not None else {})
        write_atomic(folder / SHARED_FILE, shared)
        files[SHARED_FILE] = {"sha256": _digest(shared).hex(), "nbytes": len(shared)}
        manifest = {"format": FORMAT_VERSION, "step": step, "world_size": comm.world_size, "files": files}
        write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
        prune(root, keep)
    return folder


def _check_shared(root, folder: Path, records: list[torch.Tensor], comm: Communicator) -> None:
    """Rank 0 looks for every rank's file (by size); every rank raises if any is missing.

    The files were written and fsynced before the gather, so on a shared
    folder rank 0 sees them; a node-local one shows only its own node's.
    """
    unseen = torch.zeros(comm.world_size, dtype=torch.uint8)
    if comm.rank == 0:
        for rank, record in enumerate(records):
            path = folder / rank_file(rank)
            nbytes = int.from_bytes(bytes(record[32:].tolist()), "little")
            unseen[rank] = not (path.is_file() and path.stat().st_size == nbytes)
    if comm.world_size > 1:
        collectives.broadcast(unseen, comm, src=0)
    missing = [str(rank) for rank in range(comm.world_size) if unseen[rank]]
    if missing:
        raise CheckpointFolderError(f"checkpoint folder {root} is not shared between ranks: rank 0 cannot see "
                                    f"the files of rank(s) {','.join(missing)}; use a folder all nodes mount")


@dataclass
class Checkpoint:
    """A complete checkpoint found on disk."""

    folder: Path
    step: int
    world_size: int

    def load_shared(self) -> dict:
        return _load(self.folder / SHARED_FILE)

    def load_rank(self, rank: int) -> dict:
        """This rank's file (``KeyError`` if the checkpoint was written by fewer ranks)."""
        if not 0 <= rank < self.world_size:
            raise KeyError(f"checkpoint {self.folder} was written by {self.world_size} ranks; it has no rank {rank}")
        return _load(self.folder / rank_file(rank))


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def verify(folder: Path) -> Checkpoint:
    """Return the checkpoint in ``folder`` if it is complete; ValueError naming the bad file otherwise."""
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files, step, world_size = manifest["files"], int(manifest["step"]), int(manifest["world_size"])
    except FileNotFoundError:
        raise ValueError(f"{manifest_path} is missing (the checkpoint was not finished)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{manifest_path} is unreadable: {exc}") from None
    for name, expected in files.items():
        path = folder / name
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"{path} is missing or unreadable: {exc.strerror or exc}") from None
        if len(data) != expected["nbytes"] or _digest(data).hex() != expected["sha256"]:
            raise ValueError(f"{path} is corrupt: {len(data)} bytes with checksum {_digest(data).hex()[:12]}..., "
                             f"the manifest says {expected['nbytes']} bytes, {expected['sha256'][:12]}...")
    return Checkpoint(folder, step, world_size)


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """Checkpoint folders under ``root``, newest step first."""
    if not Path(root).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(root).iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def latest(root: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint under ``root``, or None.

    Newer ones that are incomplete or corrupt are skipped with a
    :class:`CheckpointWarning` naming the file at fault.
    """
    for _, folder in _step_folders(Path(root)):
        try:
            return verify(folder)
        except ValueError as problem:
            warnings.warn(f"skipping checkpoint {folder.name}: {problem}", CheckpointWarning, stacklevel=2)
    return None


def prune(root: str | Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest complete checkpoints (and anything older); returns what was removed."""
    complete = 0
    removed = []
    for _, folder in _step_folders(Path(root)):
        if complete >= keep:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
            continue
        if (folder / MANIFEST).is_file():  # finished; checksums are checked on load, not on every save
            complete += 1
    return removed
