"""Reduce-scatter and all-gather: the public calls, and the in-place pair for agreed layouts (ZeRO shards).

Public (exported as ``gradsync.reduce_scatter`` / ``gradsync.all_gather``,
re-exported by :mod:`~gradsync.collectives.ops`): :func:`reduce_scatter`
returns this rank's summed chunk of the flattened tensor, a new tensor;
:func:`all_gather` the list of every rank's tensor. In place, on a flat
buffer: :func:`reduce_scatter_flat` and :func:`all_gather_flat`, which
DataParallel's sharded levels call on buckets whose layouts they compared
once (so these compare none, as :func:`~gradsync.collectives.ops.average`).

Chunks are ``torch.tensor_split``'s: rank r owns chunk r, the first
``numel % world_size`` chunks one element longer, some empty when numel <
world_size. Every call takes every name of ``ALGORITHMS``
(:mod:`~gradsync.collectives.registry`): each algorithm's own reduce-scatter
and all-gather (``REDUCE_SCATTER``, ``ALL_GATHER``; for ring, halving_doubling,
hierarchical and shm the first or second phase of its AllReduce, for native
the backend's own); ``auto`` picks per message size from the cost model's
formulas for that collective (:mod:`~gradsync.collectives.auto`); ``tree``,
a reduction to one root, has neither and is refused in one line
(``NO_REDUCE_SCATTER``): a ValueError on the rank, a CollectiveMismatchError
naming it on the others. fp16/bf16 are summed in float32, as by
``all_reduce``. The public calls check their arguments and compare layouts
across ranks as ``all_reduce`` does (:mod:`~gradsync.collectives.validate`).
"""

from __future__ import annotations

import functools

import torch

from gradsync.collectives.chunking import chunk_bounds
from gradsync.collectives.communicator import Communicator
from gradsync.collectives.recording import public_collective
from gradsync.collectives.registry import ALGORITHMS, ALL_GATHER, AUTO, DEFAULT_ALGORITHM, REDUCE_SCATTER, refusal
from gradsync.collectives.validate import start_call, usable_after_all, working_dtype

set_grad_enabled = torch._C._set_grad_enabled  # what torch.no_grad() calls on entry and exit


def without_grad(collective):
    """``collective`` run with autograd off, as ``torch.no_grad()`` but without building a context object
    per call (a few microseconds of a small AllReduce's budget)."""
    @functools.wraps(collective)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return collective(*args, **kwargs)
        set_grad_enabled(False)
        try:
            return collective(*args, **kwargs)
        finally:
            set_grad_enabled(True)
    return run


def _runs(comm: Communicator, started, requested, what: str, nbytes: int) -> str:
    """The algorithm the call runs: the resolved one, or ``auto``'s next pick when it chose the one-host
    fast path and the group turns out to span hosts."""
    return usable_after_all(comm, started.call, requested, started.algorithm, nbytes, what)


@public_collective
@without_grad
def reduce_scatter(tensor: torch.Tensor, comm: Communicator, *, op: str = "sum",
                   timeout: float | None = None, verify: bool = True,
                   algorithm: str | None = DEFAULT_ALGORITHM) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return this rank's chunk.

    Args:
        tensor: any shape, contiguous or not, a dtype in ``SUPPORTED_DTYPES``; not modified.
        comm: the group.
        op: "sum" or "avg" (the sum divided by world_size; floats only).
        algorithm: a name in ``ALGORITHMS`` but "tree" and "double_binary_tree" (None: ``DEFAULT_ALGORITHM``).
        timeout: seconds for the whole call (None: the communicator's default).
        verify: compare layouts across ranks first.

    Returns:
        Chunk ``rank`` of ``torch.tensor_split(sum.flatten(), world_size)``: a new ``(chunk_numel,)``
        tensor of ``tensor.dtype``.

    Raises:
        ValueError: unknown op or algorithm, a tree (``"tree"``, ``"double_binary_tree"``), a bad timeout; TypeError as
        :func:`~gradsync.collectives.ops.all_reduce`; CollectiveMismatchError (ranks disagree, or another
        rank rejected the call); CollectiveTimeoutError.

    Collective: every rank must call this in the same order with equal shape and dtype.
    """
    def prepare(name: str) -> torch.Tensor:
        return comm.workspace.get(tensor.numel(), working_dtype(tensor.dtype, name), tensor.device, purpose="stage")

    started = start_call(comm, tensor, "reduce_scatter", op=op, algorithm=algorithm, timeout=timeout,
                         verify=verify, prepare=prepare)
    flat, world_size, numel = started.staged, comm.world_size, tensor.numel()
    if world_size > 1 and numel:
        name = _runs(comm, started, algorithm, "reduce_scatter", numel * tensor.element_size())
        flat = flat if name == started.algorithm else prepare(name)
        flat.copy_(tensor.reshape(-1))
        start, stop = REDUCE_SCATTER[name](flat, started.call)
    else:
        flat.copy_(tensor.reshape(-1))
        start, stop = chunk_bounds(numel, world_size)[comm.rank]
    chunk = flat[start:stop]
    if op == "avg":
        chunk.div_(world_size)
    return chunk.to(tensor.dtype, copy=True)


@public_collective
@without_grad
def all_gather(tensor: torch.Tensor, comm: Communicator, *, timeout: float | None = None,
               verify: bool = True, algorithm: str | None = DEFAULT_ALGORITHM) -> list[torch.Tensor]:
    """Return every rank's ``tensor``: a list of ``world_size`` new tensors, index = rank.

    ``algorithm``: a name in ``ALGORITHMS`` but "tree" and "double_binary_tree" (None: ``DEFAULT_ALGORITHM``);
    ``auto`` prices the gathered ``world_size * numel`` elements. Raises as :func:`reduce_scatter`.

    Collective: every rank must call this in the same order with equal shape and dtype.
    """
    def prepare(name: str) -> torch.Tensor:
        return torch.empty(tensor.numel() * comm.world_size, dtype=tensor.dtype, device=tensor.device)

    started = start_call(comm, tensor, "all_gather", algorithm=algorithm, timeout=timeout, verify=verify,
                         prepare=prepare, scale=comm.world_size)
    numel, world_size, gathered = tensor.numel(), comm.world_size, started.staged
    gathered[comm.rank * numel:(comm.rank + 1) * numel] = tensor.reshape(-1)
    if world_size > 1 and numel:
        name = _runs(comm, started, algorithm, "all_gather", gathered.numel() * gathered.element_size())
        ALL_GATHER[name](gathered, started.call)
    return [part.view(tensor.shape) for part in gathered.split(numel)] if numel else \
        [tensor.new_empty(tensor.shape) for _ in range(world_size)]


def _check_algorithm(what: str, algorithm) -> None:
    """The in-place pair's own check of ``algorithm``, before any early return (one rank's error)."""
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if algorithm not in REDUCE_SCATTER and algorithm != AUTO:
        raise refusal(what, algorithm)


@without_grad
def reduce_scatter_flat(flat: torch.Tensor, comm: Communicator, *, algorithm: str = DEFAULT_ALGORITHM,
                        timeout: float | None = None) -> tuple[int, int]:
    """Sum ``flat`` over the ranks so that this rank's chunk holds the sum; return the chunk's ``(start, stop)``.

    Args:
        flat: ``(numel,)`` contiguous float32/float64/int64/float16/bfloat16 tensor, modified in place;
            only this rank's chunk (``torch.tensor_split`` bounds) is meaningful afterwards (fp16/bf16
            are summed in float32 and rounded once).
        algorithm: a name in ``gradsync.ALGORITHMS`` but "tree" and "double_binary_tree" (``auto`` resolved
            for ``flat``'s bytes).
        timeout: seconds for the whole call (None: the communicator's default).

    Raises:
        ValueError: an unknown algorithm, a tree (it has no reduce_scatter), a bad timeout (on this rank:
        no layout check); CollectiveTimeoutError.

    Collective: every rank calls it in the same order with equal numel and dtype (not compared here).
    """
    _check_algorithm("reduce_scatter", algorithm)
    chunks = chunk_bounds(flat.numel(), comm.world_size)
    if comm.world_size == 1 or flat.numel() == 0:
        return chunks[comm.rank]
    started = start_call(comm, flat, "reduce_scatter", algorithm=algorithm, timeout=timeout, verify=False)
    name = _runs(comm, started, algorithm, "reduce_scatter", flat.numel() * flat.element_size())
    work_dtype = working_dtype(flat.dtype, name)
    if work_dtype == flat.dtype:
        return REDUCE_SCATTER[name](flat, started.call)
    staged = comm.workspace.get(flat.numel(), work_dtype, flat.device, purpose="stage")
    staged.copy_(flat)
    start, stop = REDUCE_SCATTER[name](staged, started.call)
    flat[start:stop] = staged[start:stop]
    return start, stop


@without_grad
def all_gather_flat(flat: torch.Tensor, comm: Communicator, *, algorithm: str = DEFAULT_ALGORITHM,
                    timeout: float | None = None) -> None:
    """Fill every chunk of ``flat`` from the rank that owns it (rank r owns chunk r, ``torch.tensor_split`` bounds).

    Args:
        flat: ``(numel,)`` contiguous tensor of any supported dtype whose chunk ``rank`` is valid; the others
            are overwritten in place.
        algorithm: a name in ``gradsync.ALGORITHMS`` but "tree" and "double_binary_tree" (``auto`` resolved
            for ``flat``'s bytes).

    Raises:
        as :func:`reduce_scatter_flat`.

    Collective: every rank calls it in the same order with equal numel and dtype (not compared here).
    """
    _check_algorithm("all_gather", algorithm)
    if comm.world_size == 1 or flat.numel() == 0:
        return
    started = start_call(comm, flat, "all_gather", algorithm=algorithm, timeout=timeout, verify=False)
    ALL_GATHER[_runs(comm, started, algorithm, "all_gather", flat.numel() * flat.element_size())](flat, started.call)


__all__ = ["all_gather", "all_gather_flat", "reduce_scatter", "reduce_scatter_flat", "without_grad"]
