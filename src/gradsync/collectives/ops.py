"""Public collectives over an explicit :class:`Communicator`.

Semantics (DESIGN.md §3): every call works in place on any shape and any
numel (0, 1, fewer than world_size, not divisible by it), contiguous or not,
for float32/float64/float16/bfloat16 and int8/uint8/int16/int32/int64.
fp16/bf16 are accumulated in float32 for every algorithm; results are
bitwise identical on every rank. Before any payload moves, the ranks' layouts
are compared (:mod:`~gradsync.collectives.check`) so a mismatch raises
:class:`~gradsync.errors.CollectiveMismatchError` on every rank.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from gradsync.collectives import broadcast as tree_broadcast
from gradsync.collectives import auto, ring, shm
from gradsync.collectives.all_to_all import all_to_all as _all_to_all
from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.check import verify_layout
from gradsync.collectives.chunking import chunk_bounds
from gradsync.collectives.communicator import Communicator, check_timeout
from gradsync.collectives.dtypes import FLOAT32_ACCUMULATED, SUPPORTED_DTYPES
from gradsync.collectives.hierarchical import HierarchicalOptions
from gradsync.collectives.lane import in_issue_order
from gradsync.collectives.registry import ALGORITHMS, ALL_REDUCE, AUTO, ZERO_COPY
from gradsync.errors import CollectiveMismatchError

OPS = ("sum", "avg")
_FIXED_ALGORITHM = {"broadcast": "tree", "all_gather": "ring", "reduce_scatter": "ring"}
_OTHER_CHOICES = {what: (default, "shm") for what, default in _FIXED_ALGORITHM.items()}
# Gloo's own all_reduce lacks some narrow integer types; integer sums wrap the
# same way in int64 followed by a narrowing cast, so native upcasts them.
_NATIVE_UPCAST = {torch.int8: torch.int64, torch.uint8: torch.int64, torch.int16: torch.int64}


def validate_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(OPS)}")


def validate_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def _argument_problem(tensor, what: str, op: str | None, algorithm: str | None, src,
                      timeout: float | None, world_size: int) -> Exception | None:
    """Return the error a bad argument deserves (not raised yet), or None."""
    if not isinstance(tensor, torch.Tensor):
        return TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if src is not None and (isinstance(src, bool) or not isinstance(src, int)):
        return TypeError(f"src must be an int rank, got {type(src).__name__}")
    try:
        if op is not None:
            validate_op(op)
        if algorithm is not None and what in _OTHER_CHOICES:
            if algorithm not in _OTHER_CHOICES[what]:
                raise ValueError(f"unknown algorithm {algorithm!r} for {what}; choose one of "
                                 f"{', '.join(_OTHER_CHOICES[what])}")
        elif algorithm is not None:
            validate_algorithm(algorithm)
        if timeout is not None:
            check_timeout(timeout)
    except (ValueError, TypeError) as exc:  # raised after the layout check, so no rank is left waiting
        return exc
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(dtype).replace("torch.", "") for dtype in SUPPORTED_DTYPES)
        return TypeError(f"{what} does not support dtype {tensor.dtype}; supported: {names}")
    if op == "avg" and not tensor.is_floating_point():
        return TypeError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}; use op='sum'")
    if src is not None and not 0 <= src < world_size:
        return ValueError(f"src must be a rank in [0, {world_size}), got {src}")
    return None


def _start_call(comm: Communicator, tensor, what: str, *, op: str | None = None,
                algorithm: str | None = None, src: int | None = None,
                timeout: float | None, verify: bool) -> CollectiveCall:
    """Check the arguments and the ranks' agreement; return the call to run.

    A bad argument on one rank must not leave the others waiting or out of
    step: the layout check still runs (describing what this rank was given),
    so the other ranks raise CollectiveMismatchError while this one raises
    its own TypeError or ValueError.
    """
    problem = _argument_problem(tensor, what, op, algorithm, src, timeout, comm.world_size)
    algorithm = algorithm or _FIXED_ALGORITHM[what]
    label = algorithm
    if algorithm == AUTO and problem is None:  # name the choice in errors, even the check's
        label = f"auto ({_auto_choice(tensor, comm)})"
    call = comm.new_call(what, label, None if problem else timeout)
    if verify:
        described = tensor if isinstance(tensor, torch.Tensor) else None
        try:
            verify_layout(call, described, collective=what, op=op or "none",
                          src=src if isinstance(src, int) else -1, algorithm=algorithm)
        except CollectiveMismatchError:
            if problem is None:
                raise
    if problem is not None:
        raise problem
    return call


def _auto_choice(tensor: torch.Tensor, comm: Communicator) -> str:
    return resolve_algorithm(comm, tensor.numel() * tensor.element_size(), AUTO)


def resolve_algorithm(comm: Communicator, nbytes: int, algorithm: str) -> str:
    """The algorithm an ``all_reduce`` of ``nbytes`` bytes with ``algorithm`` runs on ``comm`` now:
    ``algorithm`` itself, or for "auto" :func:`~gradsync.collectives.auto.choose`'s pick (knowing
    what the group learnt so far about shared memory)."""
    if algorithm != AUTO:
        return algorithm
    ranks_per_node = comm.options(HierarchicalOptions).node_size(comm.world_size)
    return auto.choose(nbytes, comm.world_size, ranks_per_node,
                       shm_available=comm.options(shm.ShmState).available)


def _working_dtype(dtype: torch.dtype, algorithm: str) -> torch.dtype:
    if dtype in FLOAT32_ACCUMULATED:
        return torch.float32
    if algorithm == "native":
        return _NATIVE_UPCAST.get(dtype, dtype)
    return dtype


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


@in_issue_order
@torch.no_grad()
def all_reduce(tensor: torch.Tensor, comm: Communicator, *, op: str = "sum",
               algorithm: str = "ring", timeout: float | None = None,
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
        ValueError: unknown op or algorithm; TypeError: unsupported dtype or
        ``avg`` on integers; CollectiveMismatchError; CollectiveTimeoutError.

    Collective: every rank must call this in the same order with equal shape and dtype.
    """
    call = _start_call(comm, tensor, "all_reduce", op=op, algorithm=algorithm, timeout=timeout,
                       verify=verify)
    if comm.world_size == 1 or tensor.numel() == 0:
        return tensor
    if algorithm == AUTO:
        algorithm = _auto_choice(tensor, comm)
        if algorithm == "shm" and not shm.usable(call):  # ranks on several hosts after all
            algorithm = _auto_choice(tensor, comm)
    work_dtype = _working_dtype(tensor.dtype, algorithm)
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


def average(flat: torch.Tensor, comm: Communicator, divisor: int, algorithm: str = "ring") -> torch.Tensor:
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


@in_issue_order
@torch.no_grad()
def broadcast(tensor: torch.Tensor, comm: Communicator, *, src: int = 0,
              timeout: float | None = None, verify: bool = True,
              algorithm: str | None = None) -> torch.Tensor:
    """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``, in place.

    ``algorithm``: None or "tree" (binomial tree), or "shm" (shared memory, one machine).

    Raises:
        ValueError: ``src`` outside ``[0, world_size)``; CollectiveMismatchError:
        ranks disagree on ``src``, shape or dtype; CollectiveTimeoutError.

    Collective: every rank must call this in the same order with equal shape, dtype and src.
    """
    call = _start_call(comm, tensor, "broadcast", src=src, algorithm=algorithm, timeout=timeout,
                       verify=verify)
    if comm.world_size == 1 or tensor.numel() == 0:
        return tensor
    with _flat_view(tensor, comm, tensor.dtype) as flat:
        if algorithm == "shm":
            shm.broadcast(flat, src, call)
        else:
            tree_broadcast.broadcast(flat, src, call)
    return tensor


@in_issue_order
@torch.no_grad()
def all_gather(tensor: torch.Tensor, comm: Communicator, *, timeout: float | None = None,
               verify: bool = True, algorithm: str | None = None) -> list[torch.Tensor]:
    """Return every rank's ``tensor``: a list of ``world_size`` new tensors, index = rank.

    ``algorithm``: None or "ring", or "shm" (shared memory, one machine).

    Collective: every rank must call this in the same order with equal shape and dtype.
    """
    call = _start_call(comm, tensor, "all_gather", algorithm=algorithm, timeout=timeout, verify=verify)
    numel, world_size = tensor.numel(), comm.world_size
    gathered = torch.empty(numel * world_size, dtype=tensor.dtype, device=tensor.device)
    gathered[comm.rank * numel:(comm.rank + 1) * numel] = tensor.reshape(-1)
    if algorithm == "shm" and world_size > 1:
        shm.all_gather(gathered, call)
    else:
        ring.all_gather(gathered, call)
    return [part.view(tensor.shape) for part in gathered.split(numel)] if numel else \
        [tensor.new_empty(tensor.shape) for _ in range(world_size)]


@in_issue_order
@torch.no_grad()
def reduce_scatter(tensor: torch.Tensor, comm: Communicator, *, op: str = "sum",
                   timeout: float | None = None, verify: bool = True,
                   algorithm: str | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return this rank's chunk.

    ``algorithm``: None or "ring", or "shm" (shared memory, one machine).

    The flattened tensor is split into world_size chunks as
    ``torch.tensor_split`` does; rank r gets chunk r, a new ``(chunk_numel,)``
    tensor of ``tensor.dtype``. ``tensor`` itself is not modified.

    Collective: every rank must call this in the same order with equal shape and dtype.
    """
    call = _start_call(comm, tensor, "reduce_scatter", op=op, algorithm=algorithm, timeout=timeout,
                       verify=verify)
    work_dtype = _working_dtype(tensor.dtype, "ring")
    flat = comm.workspace.get(tensor.numel(), work_dtype, tensor.device, purpose="stage")
    flat.copy_(tensor.reshape(-1))
    scatter = shm.reduce_scatter if algorithm == "shm" else ring.reduce_scatter
    start, stop = scatter(flat, call) if comm.world_size > 1 else (0, flat.numel())
    chunk = flat[start:stop]
    if op == "avg":
        chunk.div_(comm.world_size)
    return chunk.to(tensor.dtype, copy=True)


@in_issue_order
@torch.no_grad()
def all_to_all(sends: list[torch.Tensor], receives: list[torch.Tensor], comm: Communicator, *,
               timeout: float | None = None) -> list[torch.Tensor]:
    """Send ``sends[p]`` to rank p and receive rank p's message into ``receives[p]`` (MPI_Alltoall).

    Args:
        sends: ``world_size`` tensors (any shapes); ``sends[p]`` goes to rank p.
        receives: ``world_size`` contiguous tensors, ``receives[p]`` with the
            numel and dtype of rank p's ``sends[rank]``; written in place.
        timeout: seconds for the whole call (None: the communicator's default).

    Returns:
        ``receives``.

    Raises:
        ValueError: a list does not hold ``world_size`` tensors, or a receive
        buffer is not contiguous; CollectiveTimeoutError.

    The sizes are not compared across ranks (callers derive them from a
    layout every rank already agreed on, as compressors do from buckets).

    Collective: every rank must call this in the same order.
    """
    world_size = comm.world_size
    if len(sends) != world_size or len(receives) != world_size:
        raise ValueError(f"all_to_all needs {world_size} send and receive tensors, got "
                         f"{len(sends)} and {len(receives)}")
    if not all(tensor.is_contiguous() for tensor in receives):
        raise ValueError("all_to_all receive buffers must be contiguous")
    call = comm.new_call("all_to_all", "pairwise", timeout)
    _all_to_all([tensor.contiguous() for tensor in sends], receives, call)
    return receives


def zero_copy_dtypes(algorithm: str) -> tuple[torch.dtype, ...]:
    """The dtypes ``algorithm`` reduces in place in storage from :func:`shared_buffer` (empty: none)."""
    capability = ZERO_COPY.get(algorithm)
    return capability.dtypes if capability else ()


def shared_buffer(comm: Communicator, nbytes: int, algorithm: str) -> torch.Tensor | None:
    """A ``(nbytes,)`` uint8 buffer that ``all_reduce(..., algorithm=algorithm)`` reduces without
    copying in (DataParallel's zero-copy buckets), or None when ``algorithm`` offers no such storage
    or cannot here (for "shm": the ranks are not all on one machine).

    Collective (when ``algorithm`` offers it): every rank calls it with the same ``nbytes``.
    """
    capability = ZERO_COPY.get(algorithm)
    if capability is None or comm.world_size == 1:
        return None
    return capability.allocate(comm.new_call("shared_buffer", algorithm), nbytes)


__all__ = ["ALGORITHMS", "OPS", "SUPPORTED_DTYPES", "all_gather", "all_reduce", "all_to_all", "average",
           "broadcast", "chunk_bounds", "reduce_scatter", "resolve_algorithm", "shared_buffer",
           "validate_algorithm", "validate_op", "zero_copy_dtypes"]
