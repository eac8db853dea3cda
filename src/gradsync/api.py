"""The top-level collectives: ``gradsync.all_reduce`` and friends on the default group.

Each is :mod:`gradsync.collectives.ops` with ``group`` resolved (None and
``torch.distributed.group.WORLD`` mean the group made by :func:`gradsync.init`);
see there for the full contract. A ``group`` one rank cannot resolve is
rejected in the call's layout check on the default group, so every rank
raises (:func:`~gradsync.process_group.resolve_group_or_reject`).
"""

from __future__ import annotations

import torch

from gradsync.collectives import ops as _collectives
from gradsync.process_group import resolve_group, resolve_group_or_reject


def all_reduce(tensor: torch.Tensor, op: str = "sum", algorithm: str = "ring",
               group=None, timeout: float | None = None) -> torch.Tensor:
    """Sum or average ``tensor`` over the group, in place; returns ``tensor``.

    Collective: every rank must call this in the same order with equal shape and dtype.
    """
    comm = resolve_group_or_reject(group, "all_reduce")
    return _collectives.all_reduce(tensor, comm, op=op, algorithm=algorithm, timeout=timeout)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None,
              timeout: float | None = None, algorithm: str | None = None) -> torch.Tensor:
    """Copy rank ``src``'s ``tensor`` to every rank, in place; returns ``tensor``.

    ``algorithm``: None or "tree" (binomial tree), "shm" (shared memory, ranks on one machine).
    """
    comm = resolve_group_or_reject(group, "broadcast")
    return _collectives.broadcast(tensor, comm, src=src, timeout=timeout, algorithm=algorithm)


def all_gather(tensor: torch.Tensor, group=None, timeout: float | None = None,
               algorithm: str | None = "ring") -> list[torch.Tensor]:
    """Return a list of every rank's ``tensor`` (index = rank).

    ``algorithm``: a name in ``ALGORITHMS`` but "tree" and "double_binary_tree" (refused in one line: a tree
    reduces to one root); "auto" picks by the gathered size; None: the default, "ring".
    """
    comm = resolve_group_or_reject(group, "all_gather")
    return _collectives.all_gather(tensor, comm, timeout=timeout, algorithm=algorithm)


def reduce_scatter(tensor: torch.Tensor, op: str = "sum", group=None,
                   timeout: float | None = None, algorithm: str | None = "ring") -> torch.Tensor:
    """Reduce ``tensor`` over the group and return this rank's chunk (``torch.tensor_split`` order), a new tensor.

    ``algorithm``: as :func:`all_gather`'s.
    """
    comm = resolve_group_or_reject(group, "reduce_scatter")
    return _collectives.reduce_scatter(tensor, comm, op=op, timeout=timeout, algorithm=algorithm)


def all_to_all(sends: list[torch.Tensor], receives: list[torch.Tensor], group=None,
               timeout: float | None = None) -> list[torch.Tensor]:
    """Send ``sends[p]`` to rank p and receive rank p's message into ``receives[p]`` (MPI_Alltoall).

    ``receives[p]``: contiguous, the numel and dtype of rank p's ``sends[rank]``; written in place
    and returned. Raises ValueError for lists not of ``world_size`` tensors; CollectiveTimeoutError.
    """
    comm = resolve_group_or_reject(group, "all_to_all")
    return _collectives.all_to_all(sends, receives, comm, timeout=timeout)


def flight_records(group=None) -> list[dict]:
    """This rank's flight record of the group: its last collective calls, oldest first.

    One dict per call (:func:`gradsync.debug.flight.record_of`): ``seq`` (the call's ordinal on the
    group, equal on every rank of a correct program), ``op``, ``algorithm`` (resolved: ``"auto (ring)"``),
    ``label`` (``"bucket 3"`` for DataParallel's buckets, else None), ``dtype``, ``shape``, ``nbytes``,
    ``state`` ("started", "waiting", "done" or "failed"), ``peer`` (the rank it waited on), ``error``
    (short text), ``blamed`` and ``timed_out`` (a timeout's named rank and kind), ``start_wall`` /
    ``end_wall`` (``time.time()`` seconds) and ``start_monotonic`` / ``end_monotonic``. How many are
    kept: ``GRADSYNC_FLIGHT_ENTRIES`` (default 2000). On a timeout or mismatch they are also written
    to ``$GRADSYNC_FLIGHT_DIR/rank-<rank>.json`` (:mod:`gradsync.debug.flight`).
    """
    return resolve_group(group).flight.records()


def comm_stats(group=None) -> dict[str, int]:
    """Bytes and messages this rank sent and received in the group so far."""
    return resolve_group(group).stats.as_dict()
