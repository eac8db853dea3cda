"""Public collectives over an explicit :class:`Communicator`.

Semantics (docs/contract.md): every call works in place on any shape and any
numel (0, 1, fewer than world_size, not divisible by it), contiguous or not,
for float32/float64/float16/bfloat16 and int8/uint8/int16/int32/int64.
fp16/bf16 are accumulated in float32 for every algorithm; results are
bitwise identical on every rank. Before any payload moves, every rank
checks its own arguments and the ranks compare their calls
(:mod:`~gradsync.collectives.validate`, :mod:`~gradsync.collectives.check`):
layout, op, src, the algorithm each resolved (``auto`` included) and its
options. A difference raises :class:`~gradsync.errors.CollectiveMismatchError`
on every rank; a bad argument on one rank (timeout, op, algorithm, a sparse,
meta or inference tensor, a dtype, a failed staging allocation) raises its
own TypeError/ValueError there and a CollectiveMismatchError naming that
rank and the cause on every other, so the group stays in step.

Which algorithms a collective offers, and what each needs or offers beyond
its function (a one-host fast path, zero-copy storage), is data in
:mod:`~gradsync.collectives.registry`; this module names no algorithm.
``reduce_scatter`` and ``all_gather`` live in
:mod:`~gradsync.collectives.scatter_gather` and are re-exported here.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Sequence

import torch

from gradsync.collectives import plans
from gradsync.collectives.all_to_all import all_to_all as _all_to_all
from gradsync.collectives.auto import PROFILE_ENV
from gradsync.collectives.auto import profiles_fingerprint as auto_profiles_fingerprint
from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.check import verify_layout, verify_pairs
from gradsync.collectives.chunking import chunk_bounds
from gradsync.collectives.communicator import Communicator
from gradsync.collectives.dtypes import SUPPORTED_DTYPES
from gradsync.collectives.recording import public_collective, recorded
from gradsync.collectives.registry import ALGORITHMS, ALL_REDUCE, AUTO, BROADCAST, DEFAULT_ALGORITHM, ZERO_COPY
from gradsync.collectives.scatter_gather import all_gather, reduce_scatter, without_grad
from gradsync.collectives.validate import (OPS, nbytes_problem, resolve_algorithm, sequence_problem, start_call,
                                           usable_after_all, working_dtype)


def validate_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(OPS)}")


def validate_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def _stage_through_workspace(comm: Communicator, tensor: torch.Tensor, dtype_for):
    """A ``prepare`` for start_call: grow the staging buffer ``_flat_view`` will use, before the layout check."""
    def prepare(algorithm: str) -> None:
        dtype = dtype_for(algorithm)
        if comm.world_size > 1 and tensor.numel() and not (tensor.is_contiguous() and tensor.dtype == dtype):
            comm.workspace.get(tensor.numel(), dtype, tensor.device, purpose="stage")
    return prepare


@contextmanager
def _flat_view(tensor: torch.Tensor, comm: Communicator, dtype: torch.dtype):
    """Yield a contiguous ``(numel,)`` buffer of ``dtype`` holding ``tensor``; write it back after.

    A contiguous tensor of the right dtype is used in place (no copy);
    otherwise a reused workspace buffer stages the data and the result is
    copied back through the original (possibly non-contiguous) view.
    """
    if tensor.is_contiguous() and tensor.dtype == dtype:
        yield tensor.view(-1)
        return
    staged = comm.workspace.get(tensor.numel(), dtype, tensor.device, purpose="stage")
    staged.copy_(tensor.reshape(-1))
    yield staged
    tensor.copy_(staged.view(tensor.shape))


@public_collective
@without_grad
def all_reduce(tensor: torch.Tensor, comm: Communicator, *, op: str = "sum",
               algorithm: str = DEFAULT_ALGORITHM, timeout: float | None = None,
               verify: bool = True) -> torch.Tensor:
    """Sum (or average) ``tensor`` over all ranks of ``comm``, in place.

    Args:
        tensor: any shape, contiguous or not, a dtype in ``SUPPORTED_DTYPES``.
        comm: the group.
        op: "sum" or "avg" (sum divided by world_size once; floats only).
        algorithm: a name in ``ALGORITHMS``.
        timeout: seconds for the whole call (None: the communicator's default).
        verify: compare layouts across ranks first (skip only for layouts
            already verified on every rank, such as DataParallel buckets).

    Returns:
        ``tensor``, now holding the result (bitwise equal on every rank).

    Raises:
        ValueError: unknown op or algorithm, a bad timeout, an inference or
        meta tensor, an algorithm this group cannot run; TypeError: a wrong
        type (op, algorithm, timeout, a sparse tensor), an unsupported dtype or
        ``avg`` on integers; CollectiveMismatchError (ranks disagree, or
        another rank rejected the call for one of these reasons);
        CollectiveTimeoutError.

    Collective: every rank must call this in the same order with equal shape and dtype.
    """
    key = plans.plan_key(tensor, op, algorithm, timeout)
    if key is not None:
        if algorithm == AUTO:
            key += (os.environ.get(PROFILE_ENV),)
        plan = comm.plans.get(key)
        if plan is not None:  # a layout already checked: straight to its plan's round
            plan.run(tensor, comm.new_call("all_reduce", plan.label, timeout))
            return tensor
    prepare = _stage_through_workspace(comm, tensor, lambda name: working_dtype(tensor.dtype, name))
    requested = algorithm
    started = start_call(comm, tensor, "all_reduce", op=op, algorithm=requested, timeout=timeout,
                         verify=verify, prepare=prepare, lean=True)
    call, algorithm = started.call, started.algorithm
    if started.plan is not None:
        plans.keep(comm.plans, key, started.plan)
        started.plan.run(tensor, call)
        return tensor
    if comm.world_size == 1 or tensor.numel() == 0:
        return tensor
    algorithm = usable_after_all(comm, call, requested, algorithm, tensor.numel() * tensor.element_size())
    work_dtype = working_dtype(tensor.dtype, algorithm)
    if tensor.is_contiguous() and tensor.dtype == work_dtype:  # the common case, without staging
        _reduce_flat(tensor.view(-1), call, algorithm, op)
        return tensor
    with _flat_view(tensor, comm, work_dtype) as flat:
        _reduce_flat(flat, call, algorithm, op)
    return tensor


def _reduce_flat(flat: torch.Tensor, call: CollectiveCall, algorithm: str, op: str) -> None:
    ALL_REDUCE[algorithm](flat, call)
    if op == "avg":
        flat.div_(call.world_size)


def average(flat: torch.Tensor, comm: Communicator, divisor: int,
            algorithm: str = DEFAULT_ALGORITHM) -> torch.Tensor:
    """Replace ``flat`` (floating point, contiguous) by the sum over ranks divided by ``divisor``, in place.

    ``divisor``: the ranks whose values count (``world_size``, fewer when
    some ranks contribute zeros, as under ``DataParallel.join``). With every
    rank contributing this is ``op="avg"``; otherwise ``flat`` is divided
    first, so that a float16 sum cannot overflow on the way. Layouts are not
    compared across ranks (callers pass layouts verified once, as buckets).

    Collective: every rank must call this in the same order with equal shape, dtype and ``divisor``.
    """
    if divisor == comm.world_size:
        return all_reduce(flat, comm, op="avg", algorithm=algorithm, verify=False)
    flat.div_(divisor)
    return all_reduce(flat, comm, op="sum", algorithm=algorithm, verify=False)


@public_collective
@torch.no_grad()
def broadcast(tensor: torch.Tensor, comm: Communicator, *, src: int = 0,
              timeout: float | None = None, verify: bool = True,
              algorithm: str | None = None) -> torch.Tensor:
    """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``, in place.

    ``algorithm``: None (a binomial tree) or a name in ``registry.BROADCAST``.

    Raises:
        ValueError: ``src`` outside ``[0, world_size)``; CollectiveMismatchError:
        ranks disagree on ``src``, shape or dtype; CollectiveTimeoutError.

    Collective: every rank must call this in the same order with equal shape, dtype and src.
    """
    prepare = _stage_through_workspace(comm, tensor, lambda name: tensor.dtype)
    started = start_call(comm, tensor, "broadcast", src=src, algorithm=algorithm, timeout=timeout,
                         verify=verify, prepare=prepare)
    if comm.world_size == 1 or tensor.numel() == 0:
        return tensor
    with _flat_view(tensor, comm, tensor.dtype) as flat:
        BROADCAST[started.algorithm](flat, src, started.call)
    return tensor


@public_collective
@torch.no_grad()
def all_to_all(sends: list[torch.Tensor], receives: list[torch.Tensor], comm: Communicator, *,
               timeout: float | None = None, verify: bool = True) -> list[torch.Tensor]:
    """Send ``sends[p]`` to rank p and receive rank p's message into ``receives[p]`` (MPI_Alltoall).

    Args:
        sends: ``world_size`` tensors (any shapes); ``sends[p]`` goes to rank p.
        receives: ``world_size`` contiguous tensors, ``receives[p]`` with the
            numel and dtype of rank p's ``sends[rank]``; written in place.
        timeout: seconds for the whole call (None: the communicator's default).
        verify: agree first that no rank rejects the call and that every rank q's ``sends[p]``
            has the numel and dtype of rank p's ``receives[q]`` (two small exchanges; callers whose
            arguments every rank derived from one agreed layout, as compressors, pass False).

    Returns:
        ``receives``.

    Raises:
        ValueError: a list does not hold ``world_size`` tensors, or a receive
        buffer is not contiguous; TypeError: not lists of dense tensors, a bad
        timeout; CollectiveMismatchError: another rank rejected the call so, or
        (``verify``) a send and its receive differ in numel or dtype, naming the pair;
        CollectiveTimeoutError.

    Collective: every rank must call this in the same order.
    """
    problem = sequence_problem(sends, receives, comm.world_size, timeout)
    call = comm.new_call("all_to_all", "pairwise", None if problem else timeout)
    comm.learn_locality(call)
    if verify:
        verify_layout(call, None, collective="all_to_all", rejection=problem)
    if problem is not None:
        raise problem[1]
    if verify:
        verify_pairs(call, sends, receives)
    _all_to_all([tensor.contiguous() for tensor in sends], receives, call)
    return receives


@recorded
def shared_buffer(comm: Communicator, nbytes: int, algorithm: str) -> torch.Tensor | None:
    """A ``(nbytes,)`` uint8 buffer that ``all_reduce(..., algorithm=algorithm)`` reduces without
    copying in (DataParallel's zero-copy buckets), or None when ``algorithm`` offers no such storage
    or cannot here (for shared memory: the ranks are not all on one machine).

    Every call gets storage of its own (for shared memory: a range of the group's
    arena that no other call shares, kept until the group is closed, and
    mapped as long as any tensor views it, after :func:`gradsync.shutdown` too).
    Each rank must all-reduce a tensor at the same place of its buffer.

    Collective: every rank calls it in the same order with the same ``nbytes`` and ``algorithm``
    (compared first, with any rank's rejection of a bad argument, so that every rank raises).
    """
    problem = nbytes_problem(nbytes, algorithm)
    if comm.world_size == 1:
        if problem is not None:
            raise problem[1]
        return None
    call = comm.new_call("shared_buffer", str(algorithm))
    comm.learn_locality(call)
    described = None if problem else torch.empty(nbytes, dtype=torch.uint8, device="meta")
    verify_layout(call, described, collective="shared_buffer", algorithm=str(algorithm), rejection=problem)
    if problem is not None:
        raise problem[1]
    capability = ZERO_COPY.get(algorithm)
    return capability.allocate(call, nbytes) if capability is not None else None


def zero_copy_plan(comm: Communicator, buckets: Sequence[tuple[int, torch.dtype, torch.device]],
                   algorithm: str) -> list[torch.Tensor | None]:
    """Where each bucket must live for ``algorithm`` to all-reduce it without copying it in (DataParallel's
    zero-copy buckets): per bucket, uint8 storage of at least ``numel * dtype.itemsize`` bytes from
    :func:`shared_buffer`, or None (its own memory will do).

    Args:
        buckets: ``(numel, dtype, device)`` of each bucket's AllReduce, in order.
        algorithm: a name in ``ALGORITHMS``; ``auto`` is resolved per bucket as :func:`all_reduce`
            resolves it for that many bytes.

    A bucket gets storage when the algorithm that reduces it offers zero-copy
    storage (``registry.ZERO_COPY``) for its dtype, it is on the CPU and holds
    at least one byte, and the group can share that storage (else None for
    every bucket). Each call takes fresh storage (see :func:`shared_buffer`).

    Collective: every rank calls it in the same order with the same ``buckets`` and ``algorithm``
    (a world of one rank communicates nothing and gets None for every bucket).
    """
    storages: list[torch.Tensor | None] = [None] * len(buckets)
    if comm.world_size == 1:
        return storages
    wanted: dict[str, list[tuple[int, int]]] = {}  # algorithm -> (bucket, storage bytes)
    offered = {dtype for capability in ZERO_COPY.values() for dtype in capability.dtypes}
    for index, (numel, dtype, device) in enumerate(buckets):
        nbytes = numel * dtype.itemsize
        if not nbytes or torch.device(device).type != "cpu" or dtype not in offered:
            continue
        name = resolve_algorithm(comm, nbytes, algorithm) if algorithm == AUTO else algorithm
        capability = ZERO_COPY.get(name)
        if capability is not None and dtype in capability.dtypes:
            align = capability.align_bytes
            wanted.setdefault(name, []).append((index, -(-nbytes // align) * align))
    for name, parts in wanted.items():
        storage = shared_buffer(comm, sum(nbytes for _, nbytes in parts), name)
        offset = 0
        for index, nbytes in parts if storage is not None else ():
            storages[index] = storage[offset:offset + nbytes]
            offset += nbytes
    return storages


__all__ = ["ALGORITHMS", "AUTO", "DEFAULT_ALGORITHM", "OPS", "SUPPORTED_DTYPES", "all_gather", "all_reduce",
           "all_to_all", "auto_profiles_fingerprint", "average", "broadcast", "chunk_bounds", "reduce_scatter",
           "resolve_algorithm", "shared_buffer", "validate_algorithm", "validate_op", "without_grad", "zero_copy_plan"]
