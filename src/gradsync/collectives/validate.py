"""What every collective checks before data moves: its arguments, its algorithm, the ranks' agreement.

:func:`start_call` is the one entry of every public collective in
:mod:`~gradsync.collectives.ops`. In order, on every rank, whatever its
arguments:

1. learn the group's locality if the communicator does not know it yet (a
   hand-built one, at its first call; see ``Communicator.learn_locality``);
2. look for a rank-local problem: a wrong type or value of op, algorithm,
   src or timeout, a non-tensor, a sparse, meta or (for in-place calls)
   inference tensor, an unsupported dtype, a tensor the call writes into
   whose elements overlap in memory (``expand()``), an algorithm this group cannot
   run (a one-host fast path across hosts or on a GPU, ``registry.GROUP_PROBLEM``), and
   finally the staging buffers the call will need (so that an allocation
   failure, too, is known before the exchange);
3. resolve the algorithm (``auto`` becomes what it runs) and fingerprint the
   options it runs with (``registry.OPTIONS_COMPARED``);
4. compare all of that across ranks (:func:`~gradsync.collectives.check.verify_layout`):
   a problem travels as a rejection, so the rejecting rank raises its own
   error and every other rank a CollectiveMismatchError naming it.

With ``verify=False`` (layouts every rank verified before, as DataParallel's
buckets) step 4 is skipped: a problem is then raised on this rank only.

What an algorithm needs beyond the generic checks is data in
:mod:`~gradsync.collectives.registry`; this module names no algorithm.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import torch

from gradsync.collectives import auto, plans
from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.check import describe, rejection_code, verify_layout
from gradsync.collectives.chunking import SegmentOptions
from gradsync.collectives.communicator import Communicator, check_timeout
from gradsync.collectives.dtypes import FLOAT32_ACCUMULATED, SUPPORTED_DTYPES
from gradsync.collectives.fast_path import ONE_HOST, Plan
from gradsync.collectives.hierarchical import HierarchicalOptions
from gradsync.collectives.options import check_count
from gradsync.collectives.recording import public_collective
from gradsync.collectives import registry
from gradsync.collectives.registry import AUTO

OPS = ("sum", "avg")
class _NoOp:
    """The op of collectives that take none (a user's op=None or op="none" is still rejected)."""

    def __repr__(self) -> str:
        return "none"


NO_OP = _NoOp()
FIXED_ALGORITHM = {"broadcast": next(iter(registry.BROADCAST))}  # algorithm=None runs these
_CHOICES = {"broadcast": tuple(registry.BROADCAST)}
SCATTER_GATHER = {"reduce_scatter": registry.REDUCE_SCATTER, "all_gather": registry.ALL_GATHER}  # None: the default
_IN_PLACE = ("all_reduce", "broadcast")

Rejection = tuple[int, Exception]


def _reject(cause: str, error: Exception) -> Rejection:
    return rejection_code(cause), error


def working_dtype(dtype: torch.dtype, algorithm: str) -> torch.dtype:
    """The dtype ``algorithm`` reduces a ``dtype`` tensor in (fp16/bf16: float32)."""
    if dtype in FLOAT32_ACCUMULATED:
        return torch.float32
    return registry.UPCAST.get(algorithm, {}).get(dtype, dtype)


def _choice_problem(what: str, op, algorithm) -> Rejection | None:
    if op is not NO_OP:
        if not isinstance(op, str):
            return _reject("a bad op", TypeError(f"op must be one of {', '.join(map(repr, OPS))}, got "
                                                 f"{type(op).__name__} {op!r}"))
        if op not in OPS:
            return _reject("a bad op", ValueError(f"unknown op {op!r}; choose one of {', '.join(OPS)}"))
    choices = _CHOICES.get(what, registry.ALGORITHMS)  # read per call: the one list (registry)
    optional = what in _CHOICES or what in SCATTER_GATHER  # algorithm=None: the default
    if algorithm is None and not optional or algorithm is not None and not isinstance(algorithm, str):
        return _reject("a bad algorithm", TypeError(f"algorithm must be one of {', '.join(choices)}, got "
                                                    f"{type(algorithm).__name__} {algorithm!r}"))
    if algorithm is not None and algorithm not in choices:
        where = f" for {what}" if what in _CHOICES else ""
        return _reject("a bad algorithm", ValueError(f"unknown algorithm {algorithm!r}{where}; choose one of "
                                                     f"{', '.join(choices)}"))
    if what in SCATTER_GATHER and algorithm not in SCATTER_GATHER[what] and algorithm not in (AUTO, None):
        return _reject("a bad algorithm", registry.refusal(what, algorithm))
    return None


def _timeout_problem(timeout) -> Rejection | None:
    try:
        if timeout is not None:
            check_timeout(timeout)
    except (TypeError, ValueError) as exc:
        return _reject("a bad timeout", exc)
    return None


def _tensor_problem(tensor, what: str) -> Rejection | None:
    if not isinstance(tensor, torch.Tensor):
        return _reject("a non-tensor argument", TypeError(f"{what} expects a torch.Tensor, got "
                                                          f"{type(tensor).__name__}"))
    if tensor.layout != torch.strided:
        return _reject("a sparse tensor", TypeError(f"{what} needs a dense (strided) tensor, got a sparse one "
                                                    f"({tensor.layout}); call .to_dense() first"))
    if tensor.device.type == "meta":
        return _reject("an unsupported device", ValueError(f"{what} needs a tensor with data, got one on the "
                                                           f"meta device"))
    if what in _IN_PLACE and tensor.is_inference() and not torch.is_inference_mode_enabled():
        return _reject("an inference tensor", ValueError(
            f"{what} works in place, and a tensor made under torch.inference_mode() cannot be modified outside "
            f"it: pass a clone, or call {what} inside torch.inference_mode()"))
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(dtype).replace("torch.", "") for dtype in SUPPORTED_DTYPES)
        return _reject("an unsupported dtype", TypeError(f"{what} does not support dtype {tensor.dtype}; "
                                                         f"supported: {names}"))
    return None


def overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether some elements of ``tensor`` may share memory (``expand()``, a zero stride, ``as_strided``).

    torch's own check answers yes, no or "too hard to tell" (any non-contiguous view); then the
    strides decide: sorted by stride, each dim's stride must pass the extent of the dims below it
    (true of every slice, transpose or permutation of a tensor without overlap).
    """
    check = getattr(torch, "_debug_has_internal_overlap", None)
    verdict = check(tensor) if check is not None else 2
    if verdict != 2:
        return verdict == 1
    extent = 0  # the largest offset the dims seen so far reach
    for stride, size in sorted((abs(stride), size) for stride, size in zip(tensor.stride(), tensor.shape)
                               if size > 1):
        if stride <= extent:
            return True
        extent += stride * (size - 1)
    return False


def _overlap_problem(tensor: torch.Tensor, what: str) -> Rejection | None:
    if tensor.numel() > 1 and overlaps_itself(tensor):
        return _reject("overlapping memory", ValueError(
            f"{what} writes into its tensor, and this tensor has overlapping memory (e.g. from expand()); "
            f"pass a .clone() or .contiguous() copy"))
    return None


def argument_problem(tensor, what: str, op, algorithm, src, timeout, world_size: int) -> Rejection | None:
    """(rejection code, the error a bad argument deserves, not raised yet), or None."""
    if src is not None and (isinstance(src, bool) or not isinstance(src, int)):
        return _reject("a bad src", TypeError(f"src must be an int rank, got {type(src).__name__} {src!r}"))
    problem = _choice_problem(what, op, algorithm) or _timeout_problem(timeout) or _tensor_problem(tensor, what)
    if problem:
        return problem
    if what in _IN_PLACE and (problem := _overlap_problem(tensor, what)):
        return problem
    if op == "avg" and not tensor.is_floating_point():
        return _reject("a bad op", TypeError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}; "
                                             f"use op='sum'"))
    if src is not None and not 0 <= src < world_size:
        return _reject("a bad src", ValueError(f"src must be a rank in [0, {world_size}), got {src}"))
    return None


def resolve_algorithm(comm: Communicator, nbytes: int, algorithm: str, device: str = "cpu",
                      collective: str = "all_reduce") -> str:
    """The algorithm that ``algorithm`` means for a ``collective`` ("all_reduce", "reduce_scatter" or
    "all_gather") of ``nbytes`` bytes (the whole flat buffer) on ``comm`` now: itself, or for ``auto``
    :func:`~gradsync.collectives.auto.choose`'s pick from the group's locality (explicit
    ``HierarchicalOptions.ranks_per_node`` wins over the hosts; else the hosts' rank counts).

    ``auto``'s pick is kept per (bytes, device, ``GRADSYNC_PROFILE``, collective) in ``comm.decisions`` once
    what it depends on is settled (the locality known, whether the one-host fast path works found out).

    Raises:
        ValueError: ``GRADSYNC_PROFILE`` names no profile.
    """
    if algorithm != AUTO:
        return algorithm
    key = (nbytes, device, os.environ.get(auto.PROFILE_ENV), collective)
    known = comm.locality
    kept = comm.decisions.get(key)
    if kept is not None and kept[0] is known:  # the locality a pick was made for (tests replace it)
        return kept[1]
    chosen = _choose(comm, nbytes, device, collective)
    if known is not None and _one_host_available(comm, device) is not None:
        plans.keep(comm.decisions, key, (known, chosen))
    return chosen


def _choose(comm: Communicator, nbytes: int, device: str, collective: str = "all_reduce") -> str:
    """:func:`resolve_algorithm`'s ``auto`` pick, from the group's locality and options now."""
    explicit = comm.options(HierarchicalOptions).ranks_per_node
    known = comm.locality
    host_sizes = None
    if explicit is not None:
        ranks_per_node = explicit
    elif known is not None:
        ranks_per_node = known.ranks_per_node or 1
        host_sizes = known.host_sizes
    else:
        ranks_per_node = comm.world_size
    return auto.choose(nbytes, comm.world_size, ranks_per_node, shm_available=_one_host_available(comm, device),
                       host_sizes=host_sizes, collective=collective)


def _one_host_available(comm: Communicator, device: str) -> bool | None:
    """Whether ``auto`` may pick the one-host fast path: None (not known yet), True or False."""
    known = comm.locality
    if device != "cpu" or (known is not None and not known.one_host):
        return False
    answers = {comm.options(path.options).available for path in ONE_HOST.values()}
    return True if True in answers else None if None in answers else False


def usable_after_all(comm: Communicator, call: CollectiveCall, requested, resolved: str, nbytes: int,
                     collective: str = "all_reduce") -> str:
    """``resolved``, or what ``auto`` picks instead when it chose a one-host fast path and the group
    turns out to span hosts (found out here: collective the first time, every rank the same answer)."""
    fast_path = ONE_HOST.get(resolved) if requested == AUTO else None
    if fast_path is None or fast_path.usable(call):
        return resolved
    return resolve_algorithm(comm, nbytes, AUTO, collective=collective)


def _runnable_problem(comm: Communicator, algorithm: str, device: str) -> Rejection | None:
    """Why this group cannot run ``algorithm`` (resolved) on a ``device`` tensor, or None."""
    cause = "an algorithm this group cannot run"
    known = comm.locality
    if algorithm in ONE_HOST:
        if device != "cpu":
            return _reject("an unsupported device", ValueError(f"algorithm {algorithm!r} needs CPU tensors, "
                                                               f"got {device}"))
        if known is not None and not known.one_host:
            return _reject(cause, ValueError(f"algorithm {algorithm!r} needs every rank of the group on one "
                                             f"host; this group has {known.describe()}"))
    group_problem = registry.GROUP_PROBLEM.get(algorithm)
    problem = group_problem(comm) if group_problem is not None else None
    return None if problem is None else _reject(cause, problem)


def options_fingerprint(comm: Communicator, algorithm: str) -> int:
    """crc32 of the options ``algorithm`` runs with (ranks must agree on them)."""
    compared = registry.OPTIONS_COMPARED.get(algorithm)
    parts = compared(comm) if compared is not None else (comm.options(SegmentOptions).segment_bytes,)
    return zlib.crc32(repr((algorithm, parts)).encode())


def _fingerprint(comm: Communicator, resolved: str, requested) -> int:
    """The options fingerprint, with the cost model's profile digest when ``auto`` chose (so ranks that
    decided from different numbers raise instead of running different algorithms)."""
    fingerprint = options_fingerprint(comm, resolved)
    if requested != AUTO:
        return fingerprint
    several = comm.locality is not None and not comm.locality.one_host
    return zlib.crc32(f"{fingerprint}/{auto.profile_digest(several)}".encode())


def _stage(prepare, algorithm: str):
    try:
        return None, prepare(algorithm) if prepare is not None else None
    except (RuntimeError, MemoryError) as exc:  # an allocation failure: tell the others, then raise it
        return _reject("a staging allocation failure", exc), None


def _layout_key(tensor: torch.Tensor, algorithm: str, src) -> str:
    key = f"{algorithm}, {tensor.numel()} x {str(tensor.dtype).replace('torch.', '')}"
    return key if src is None else f"{key}, src {src}"


@dataclass
class Started:
    """A collective call that passed its checks.

    ``algorithm``: the one it runs (``auto`` resolved); ``staged``: what
    ``prepare(algorithm)`` returned (None without ``prepare``, or with ``plan``);
    ``plan``: a fast path's plan for this layout (``ONE_HOST``), or
    None: when set, the layout check was left to the plan's own round, so the
    caller must run it (``plan.run(tensor, call)``) and may keep it (:mod:`~gradsync.collectives.plans`).
    """

    call: CollectiveCall
    algorithm: str
    staged: object = None
    plan: Plan | None = None


def start_call(comm: Communicator, tensor, what: str, *, op=NO_OP, algorithm: str | None = None,
               src: int | None = None, timeout: float | None, verify: bool,
               prepare=None, lean: bool = False, scale: int = 1) -> Started:
    """Check the arguments and the ranks' agreement; return the started call.

    ``op``: ``NO_OP`` for collectives without one. A problem on this rank is
    raised here, after every rank learnt of it (see the module docstring).
    ``lean`` (AllReduce): when the resolved algorithm is a one-host fast path that has a plan for a
    call this small, the layout check is left to that plan's one round (``Started.plan``).
    ``scale``: the message ``auto`` prices is ``scale`` times ``tensor``'s bytes (all_gather: world_size).
    """
    problem = argument_problem(tensor, what, op, algorithm, src, timeout, comm.world_size)
    call = comm.new_call(what, str(algorithm), None if problem else timeout)
    comm.learn_locality(call)
    resolved = label = str(algorithm)
    device = "cpu"
    if isinstance(tensor, torch.Tensor):
        device, call.dtype, call.shape = tensor.device.type, tensor.dtype, tensor.shape  # the last two: flight record
    if problem is None:
        if what in FIXED_ALGORITHM:
            resolved = label = algorithm or FIXED_ALGORITHM[what]
        else:
            algorithm = registry.DEFAULT_ALGORITHM if algorithm is None else algorithm  # reduce_scatter, all_gather
            try:
                resolved = resolve_algorithm(comm, scale * tensor.numel() * tensor.element_size(), algorithm, device,
                                             what if what in SCATTER_GATHER else "all_reduce")
            except ValueError as exc:  # a bad GRADSYNC_PROFILE: tell the others, then raise it
                problem = _reject("a bad argument", exc)
            label = f"auto ({resolved})" if algorithm == AUTO else resolved
        call.algorithm = label
        problem = problem or _runnable_problem(comm, resolved, device)
        call.refine_tag(_layout_key(tensor, resolved, src))
    staged = None
    fast_path = ONE_HOST.get(resolved) if lean and problem is None else None
    if fast_path is not None and isinstance(tensor, torch.Tensor):
        def describe_row() -> torch.Tensor:
            return describe(tensor, "all_reduce", op, resolved, -1, options=_fingerprint(comm, resolved, algorithm))

        plan = fast_path.plan(comm, tensor, working_dtype(tensor.dtype, resolved), op == "avg", describe_row, call)
        if plan is not None:
            return Started(call, resolved, plan=plan)
    if problem is None:
        problem, staged = _stage(prepare, resolved)
    if verify:
        verify_layout(call, tensor if problem is None else None, collective=what,
                      op=op if problem is None and op is not NO_OP else "none",
                      src=src if problem is None and src is not None else -1,
                      algorithm=resolved if problem is None else "none", rejection=problem,
                      options=_fingerprint(comm, resolved, algorithm) if problem is None else 0)
    if problem is not None:
        raise problem[1]
    return Started(call, resolved, staged)


def sequence_problem(sends, receives, world_size: int, timeout) -> Rejection | None:
    """all_to_all's rank-local problems (types, counts, contiguity, timeout), or None."""
    for name, tensors in (("sends", sends), ("receives", receives)):
        if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in tensors):
            return _reject("a non-tensor argument", TypeError(f"all_to_all {name} must be a list of tensors"))
        if len(tensors) != world_size:
            return _reject("a bad argument", ValueError(f"all_to_all needs {world_size} send and receive tensors, "
                                                        f"got {len(sends)} and {len(receives)}"))
        for tensor in tensors:
            problem = _tensor_problem(tensor, "all_to_all")
            if problem:
                return problem
    problem = next(filter(None, (_overlap_problem(tensor, "all_to_all") for tensor in receives)), None)
    if problem:
        return problem
    if not all(tensor.is_contiguous() for tensor in receives):
        return _reject("a bad argument", ValueError("all_to_all receive buffers must be contiguous"))
    return _timeout_problem(timeout)


@public_collective
def reject_call(comm: Communicator, what: str, error: Exception, cause: str = "a bad argument") -> None:
    """Take part in ``what``'s layout check on ``comm`` as a rank that rejects the call with ``error``;
    return once every rank knows (the caller then raises ``error``; the others raise
    CollectiveMismatchError naming this rank). For an argument found bad before the call's own
    checks can run, such as a ``group`` this rank cannot resolve (``cause``: one of ``REJECTIONS``).

    Collective: the peers are in ``what`` on ``comm`` (the same protocol as :func:`start_call`).
    """
    call = comm.new_call(what, "rejected")
    comm.learn_locality(call)
    verify_layout(call, None, collective=what, rejection=_reject(cause, error))


def nbytes_problem(nbytes, algorithm) -> Rejection | None:
    """shared_buffer's rank-local problems, or None."""
    try:
        check_count("nbytes", nbytes, minimum=0)
    except (TypeError, ValueError) as exc:
        return _reject("a bad argument", exc)
    return _choice_problem("shared_buffer", NO_OP, algorithm)  # no op: only the algorithm is checked


__all__ = ["FIXED_ALGORITHM", "NO_OP", "OPS", "SCATTER_GATHER", "Started", "argument_problem", "nbytes_problem",
           "options_fingerprint", "reject_call", "resolve_algorithm", "sequence_problem", "start_call",
           "usable_after_all", "working_dtype"]
