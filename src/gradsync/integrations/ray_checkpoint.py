"""gradsync's state in a Ray Train checkpoint: every worker reports its own part, Ray merges them into one.

Ray Train lets each worker of a run report files into the same checkpoint
(``ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d),
checkpoint_dir_name=NAME)`` on every worker: the files of all workers land in
one ``NAME`` folder of the run's storage). :func:`save_checkpoint` writes this
worker's part in gradsync's checkpoint layout (:mod:`gradsync.fault.checkpoint`)::

    rank-00003.pt    every rank: its RNG states, its compressor's error feedback, its ZeRO optimizer shard
    shared.pt        rank 0: the model, the optimizer (unsharded), the shard level, the bucket layout,
                     the scheduler and the caller's ``extra``
    MANIFEST.json    rank 0: the step, the world size, every rank's file with its size and SHA-256
                     (gathered from the ranks, so the merged folder checks whole or not at all)

:func:`load_checkpoint` verifies the merged folder (``ray.train.get_checkpoint()``
by default) and puts everything back: a run restarted by Ray after a worker
failure continues as if it had not stopped. At another world size the
optimizer's shards are consolidated and cut again
(:mod:`~gradsync.train.sharded_checkpoint`), the error-feedback residuals
become the old ranks' mean (:func:`~gradsync.train.reshard.reshard_compressor`),
and a rank the checkpoint has no file for keeps its own RNG.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
from pathlib import Path

import torch

from gradsync import collectives
from gradsync.errors import import_extra
from gradsync.fault import checkpoint as layout
from gradsync.train import sharded_checkpoint
from gradsync.train.reshard import reshard_compressor
from gradsync.train.resume import whole_parameters
from gradsync.train.rng import rng_state, set_rng_state

FEATURE = "gradsync.integrations.ray"
FORMAT = 1
DIR_PREFIX = "gradsync-step-"  # report_checkpoint's checkpoint_dir_name: gradsync-step-000000012
_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def _train():
    return import_extra("ray.train", "ray", FEATURE)


def save_checkpoint(model, optimizer, folder, *, step: int = 0, extra: dict | None = None, scheduler=None):
    """Write this worker's part of a gradsync checkpoint into ``folder`` (collective: every rank calls it).

    ``folder`` is this worker's own (a temporary folder is fine): pass the returned checkpoint to
    ``ray.train.report(..., checkpoint=..., checkpoint_dir_name=NAME)`` with the same ``NAME`` on every
    worker, and Ray merges the parts (:func:`report_checkpoint` does both).

    Args:
        model: the :class:`gradsync.DataParallel` from :func:`~gradsync.integrations.ray.prepare_model`.
        optimizer: its optimizer (a :class:`gradsync.ShardedOptimizer` when ``shard`` is not ``"none"``).
        folder: where to write (created if missing).
        step: optimizer steps done (>= 0), recorded in the manifest.
        extra: rank 0's own data to keep (epoch, step, data position ...): tensors, numbers, strings,
            None, and lists, tuples and dicts of them (what ``torch.load(weights_only=True)`` reads).
        scheduler: an LR scheduler whose ``state_dict`` to keep, or None.

    Returns:
        ``ray.train.Checkpoint.from_directory(folder)``.

    Raises:
        TypeError: ``model`` is not a gradsync DataParallel, or ``extra`` holds something else (named).
        ValueError: a bad ``step``. MissingExtraError: Ray is not installed.
    """
    train = _train()
    _check_save(model, step, extra)
    comm = model.comm
    with whole_parameters(model):  # ZeRO-3: every rank gathers them; the others wait for the step's all-gather
        own = rank_part(model, optimizer)
        shared = shared_part(model, optimizer, extra, scheduler) if comm.rank == 0 else None
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = layout.serialize(own)
    layout.write_atomic(folder / layout.rank_file(comm.rank), data)
    record = torch.tensor(list(hashlib.sha256(data).digest()) + list(len(data).to_bytes(8, "little")),
                          dtype=torch.uint8)
    records = collectives.all_gather(record, comm) if comm.world_size > 1 else [record]
    if comm.rank == 0:
        _write_shared(folder, shared, records, step)
    return train.Checkpoint.from_directory(str(folder))


def report_checkpoint(metrics: dict, model, optimizer, *, step: int, extra: dict | None = None, scheduler=None,
                      **report_options) -> None:
    """Save a checkpoint (:func:`save_checkpoint`, in a temporary folder) and ``ray.train.report`` it, with
    ``metrics``, into the run's ``gradsync-step-NNNNNNNNN`` folder (collective: every worker calls it).

    ``report_options`` go to ``ray.train.report`` (``checkpoint_upload_mode`` ...).
    """
    train = _train()
    with tempfile.TemporaryDirectory(prefix="gradsync-ray-") as folder:
        found = save_checkpoint(model, optimizer, folder, step=step, extra=extra, scheduler=scheduler)
        train.report(metrics, checkpoint=found, checkpoint_dir_name=f"{DIR_PREFIX}{step:09d}", **report_options)


def load_checkpoint(model, optimizer, checkpoint=None, *, scheduler=None) -> dict | None:
    """Put a gradsync checkpoint back into ``model`` and ``optimizer`` (every rank calls it).

    Args:
        model, optimizer, scheduler: as given to :func:`save_checkpoint` (the same model; any world size,
            any shard level).
        checkpoint: a ``ray.train.Checkpoint``, a folder, or None: ``ray.train.get_checkpoint()`` (the
            run's latest reported one, which Ray hands to restarted workers).

    Returns:
        The ``extra`` dict saved with it (``{}`` if none), or None when there is no checkpoint (a fresh start).

    Raises:
        ValueError: the folder is not a complete gradsync checkpoint (the message names the file at fault).
        RuntimeError: ``checkpoint`` is None outside a Ray Train worker.
    """
    if checkpoint is None:
        checkpoint = _train().get_checkpoint()
        if checkpoint is None:
            return None
    with _as_directory(checkpoint) as folder:
        found = layout.verify(Path(folder))
        shared = found.load_shared()
        if shared.get("written_by") != FEATURE:
            raise ValueError(f"{found.folder} is a gradsync checkpoint but not one of {FEATURE}'s (a gradsync "
                             f"train one resumes with gradsync train --checkpoint-dir)")
        states, own = _rank_files(found, model, optimizer, shared)
        _restore(model, optimizer, scheduler, shared, own, states)
    return dict(shared.get("extra") or {})


def rank_part(model, optimizer) -> dict:
    """This rank's own state: RNGs, its compressor's error feedback, a ZeRO optimizer's shard."""
    own = {"rng": rng_state()}
    compression = getattr(model, "compression", None)
    if compression is not None:
        own["compression"] = compression.state_dict()
    own.update(sharded_checkpoint.rank_entries(optimizer))
    return own


def shared_part(model, optimizer, extra: dict | None, scheduler) -> dict:
    """Rank 0's state: the model (whole), the optimizer unless sharded, bucket layout, scheduler, ``extra``."""
    sharded = sharded_checkpoint.is_sharded(optimizer)
    shared = {"format": FORMAT, "written_by": FEATURE, "model": model.module.state_dict(),
              "bucket_layout": None if sharded else getattr(model, "bucket_layout", None),
              "scheduler": scheduler.state_dict() if scheduler is not None else None,
              "extra": extra if extra is not None else {}}
    shared.update(sharded_checkpoint.shared_entries(model, optimizer))
    return shared


def _write_shared(folder: Path, shared: dict, records: list[torch.Tensor], step: int) -> None:
    files = {layout.rank_file(rank): {"sha256": bytes(r[:32].tolist()).hex(),
                                      "nbytes": int.from_bytes(bytes(r[32:].tolist()), "little")}
             for rank, r in enumerate(records)}
    data = layout.serialize(shared)
    layout.write_atomic(folder / layout.SHARED_FILE, data)
    files[layout.SHARED_FILE] = {"sha256": hashlib.sha256(data).hexdigest(), "nbytes": len(data)}
    manifest = {"format": layout.FORMAT_VERSION, "step": step, "world_size": len(records), "files": files,
                "written_by": FEATURE}
    layout.write_atomic(folder / layout.MANIFEST, json.dumps(manifest, indent=1).encode())


def _check_save(model, step, extra) -> None:
    if not hasattr(model, "comm") or not hasattr(model, "module"):
        raise TypeError(f"save_checkpoint takes the gradsync.DataParallel prepare_model returned, "
                        f"got {type(model).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    _check_plain(extra, "extra")


def _check_plain(value, where: str) -> None:
    """Raise TypeError naming the first part of ``value`` that ``torch.load(weights_only=True)`` cannot read."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; use str or int keys")
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(f"{where} is a {type(value).__name__}; a checkpoint keeps tensors, numbers, strings, "
                        f"None and lists/dicts of them")


@contextlib.contextmanager
def _as_directory(checkpoint):
    if isinstance(checkpoint, (str, Path)):
        yield Path(checkpoint)
        return
    if not hasattr(checkpoint, "as_directory"):
        raise TypeError(f"checkpoint must be a ray.train.Checkpoint, a folder or None, got "
                        f"{type(checkpoint).__name__}")
    with checkpoint.as_directory() as folder:
        yield folder


def _rank_files(found: layout.Checkpoint, model, optimizer, shared: dict) -> tuple[list[dict] | None, dict]:
    """(every rank's file where needed, else None; this rank's own state, possibly re-sharded)."""
    comm = model.comm
    every = sharded_checkpoint.needs_every_rank(shared, found.world_size, comm.world_size,
                                                sharded_checkpoint.is_sharded(optimizer),
                                                getattr(model, "shard", "none"))
    if found.world_size == comm.world_size:
        states = sharded_checkpoint.every_rank(found) if every else None
        return states, states[comm.rank] if states is not None else found.load_rank(comm.rank)
    states = sharded_checkpoint.every_rank(found)
    own = dict(states[comm.rank]) if comm.rank < found.world_size else {}
    compressions = [state["compression"] for state in states if "compression" in state]
    if compressions:
        own["compression"] = reshard_compressor(compressions)
    return (states if every else None), own


def _restore(model, optimizer, scheduler, shared: dict, own: dict, states: list[dict] | None) -> None:
    with whole_parameters(model):  # ZeRO-3: the loaded values are kept when the units are freed again
        model.module.load_state_dict(shared["model"])
    optimizer.load_state_dict(sharded_checkpoint.optimizer_state(shared, own, states))
    if scheduler is not None and shared.get("scheduler") is not None:
        scheduler.load_state_dict(shared["scheduler"])
    if shared.get("bucket_layout") and not sharded_checkpoint.is_sharded(optimizer):
        model.bucket_layout = shared["bucket_layout"]
    compression = getattr(model, "compression", None)
    if compression is not None and "compression" in own:
        compression.load_state_dict(own["compression"])
    if "rng" in own:
        set_rng_state(own["rng"])
