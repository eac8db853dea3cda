"""Replica checks: are the ranks' parameters, buffers and optimizer state still bitwise equal?

Data parallelism is correct only while every replica holds the same bits;
when they drift (a missed AllReduce, a rank-dependent code path, a flipped
bit) training goes on silently and only a checkpoint that does not
reproduce gives it away. :func:`check_replicas` compares every rank's
:func:`~gradsync.parallel.checksum.fingerprint` of its tensors (with the
step, the tensor count and a code of their names, shapes and dtypes) in one
small AllReduce (:func:`_all_equal`); only when they differ do two
all_gathers of those rows and of per-tensor checksums find the first
differing tensor, so that
:class:`~gradsync.errors.ReplicaDivergenceError` names it, the ranks on
each side and the step, on every rank.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from gradsync.collectives import ops as collectives
from gradsync.collectives.communicator import Communicator, check_timeout
from gradsync.errors import CollectiveMismatchError, ReplicaDivergenceError
from gradsync.parallel.checksum import checksum, fingerprint
from gradsync.process_group import resolve_group

_SIGNED = 1 << 63
_MASK = (1 << 64) - 1
_NAME_WORDS = 16  # int64 words of a tensor's label in the divergence table (128 bytes of UTF-8)


@dataclass(frozen=True)
class ReplicaCheck:
    """What a check that found the replicas equal compared.

    Attributes:
        step: the step it was told (or -1).
        tensors: tensors compared (parameters, buffers, optimizer state).
        nbytes: bytes checksummed on this rank.
        seconds: wall time of the check on this rank (checksums and collectives).
    """

    step: int
    tensors: int
    nbytes: int
    seconds: float


def named_state(module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                buffers: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The tensors a replica check compares, in a fixed order, with the names errors quote:
    ``parameter 'fc.weight'``, ``buffer 'bn.running_mean'``, ``optimizer state 'fc.weight' exp_avg``."""
    named = [(f"parameter {name!r}", param) for name, param in module.named_parameters()]
    if buffers:
        named += [(f"buffer {name!r}", buffer) for name, buffer in module.named_buffers()]
    if optimizer is not None:
        names = {id(param): name for name, param in module.named_parameters()}
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                for key in sorted(state):
                    if isinstance(state[key], torch.Tensor):
                        label = names.get(id(param), f"#{len(names)}")
                        named.append((f"optimizer state {label!r} {key}", state[key]))
    return named


def _check_arguments(module, optimizer, step, buffers, timeout) -> int:
    """The step as an int (-1 for None); TypeError/ValueError for a bad argument."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"check_replicas needs a torch.nn.Module, got {type(module).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"check_replicas: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(buffers, bool):
        raise TypeError(f"check_replicas: buffers must be True or False, got {buffers!r}")
    if timeout is not None:
        check_timeout(timeout)
    if step is None:
        return -1
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise ValueError(f"check_replicas: step must be an int in [0, 2**63) or None, got {step!r}")
    return step


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= _SIGNED else value


def _layout_code(named: list[tuple[str, torch.Tensor]]) -> int:
    text = ";".join(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}" for name, tensor in named)
    return zlib.crc32(text.encode())


def check_replicas(module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   buffers: bool = True, step: int | None = None, group=None,
                   timeout: float | None = None, compare_step: bool = True,
                   _rejection: Exception | None = None) -> ReplicaCheck:
    """Raise ReplicaDivergenceError on every rank unless all ranks' tensors are bitwise equal.

    Compares every parameter, (``buffers=True``) every buffer and (with
    ``optimizer``) every tensor of the optimizer's state, by a 64-bit
    position-weighted checksum of their bits (a flipped bit or two swapped
    elements always change it; see :mod:`gradsync.parallel.checksum`).

    Args:
        module: a plain ``nn.Module`` (``DataParallel.check_replicas`` and
            ``LocalSGD.check_replicas`` call this with what must agree there).
        optimizer: include its state (momentum, Adam moments, step counts).
        buffers: include the module's buffers.
        step: the training step, quoted in the error and compared across ranks (None: -1).
        group: None (the default group), a Communicator or a torch ProcessGroup.
        timeout: seconds each of the (at most two) collectives may take.
        compare_step: whether ranks at different ``step`` values diverge (False:
            the step only labels the error, as for ``DataParallel``'s own count).
        _rejection: (wrappers) why this rank cannot take part: it still joins the
            exchange, so the others raise CollectiveMismatchError naming it, then raises this.

    Returns:
        a :class:`ReplicaCheck` (what was compared, how long it took).

    Raises:
        ReplicaDivergenceError: on every rank: the ranks' tensors differ in
            bits, in names/shapes/dtypes, or the ranks are at different steps;
            the message names the first differing tensor and the ranks on each side.
        TypeError: a sparse or quantized tensor.
        CollectiveTimeoutError: a rank did not take part in time.

    Collective: every rank must call this at the same point.
    """
    comm = resolve_group(group)
    started = time.perf_counter()
    problem, named, row = None, [], [-1, -1, 0, 0, 0]  # a rank that cannot take part says so
    try:
        if _rejection is not None:
            raise _rejection
        step = _check_arguments(module, optimizer, step, buffers, timeout)
        named = named_state(module, optimizer, buffers)
        c1, c2 = fingerprint([tensor for _, tensor in named])
        row = [step if compare_step else -1, len(named), _layout_code(named), _signed(c1), _signed(c2)]
    except (TypeError, ValueError) as error:
        problem = error
    if problem is not None:
        timeout = None  # a bad timeout must not keep this rank out of the exchange
    agreed = comm.world_size == 1 or _all_equal(row, comm, timeout)
    if not agreed:  # only now: every rank's row, to say what differs
        rows = [part.tolist() for part in collectives.all_gather(torch.tensor(row, dtype=torch.int64), comm,
                                                                 timeout=timeout)]
    if problem is not None:
        raise problem
    if not agreed:
        _raise_divergence(named, rows, comm, timeout, step)
    nbytes = sum(tensor.numel() * tensor.element_size() for _, tensor in named)
    return ReplicaCheck(step, len(named), nbytes, time.perf_counter() - started)


def _all_equal(row: list[int], comm: Communicator, timeout) -> bool:
    """Whether every rank passed the same ``row`` of int64, by one small AllReduce.

    Each value is cut into 16-bit chunks ``c``; the sum over ranks of ``c`` and
    of ``c**2`` equal ``world_size * c`` and ``world_size * c**2`` on every
    rank exactly when all ranks agree (if they differ somewhere, the chunks
    there have a variance > 0, so no rank's own value satisfies both), and
    neither sum can overflow. Every rank reaches the same answer. The layout
    is the same on every rank by construction, so it is not compared first
    (that check is a round trip of its own, ten times the AllReduce here);
    a rank in another collective makes this time out.
    """
    chunks = torch.tensor([(value >> shift) & 0xFFFF for value in row for shift in (0, 16, 32, 48)],
                          dtype=torch.int64)
    mine = torch.cat([chunks, chunks * chunks])
    total = collectives.all_reduce(mine.clone(), comm, algorithm=collectives.AUTO, timeout=timeout, verify=False)
    return torch.equal(total, mine * comm.world_size)


def _ranks_by(values: list) -> tuple[str, list[list[int]]]:
    """``values`` (one per rank) as ("ranks 0, 2 have A; rank 1 has B", [[0, 2], [1]]), the largest group first."""
    groups: dict[object, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
    parts = []
    for value, ranks in ordered:
        who = f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} have"
        parts.append(f"{who} {value}")
    return "; ".join(parts), [ranks for _, ranks in ordered]


def _raise_divergence(named, rows: list[list[int]], comm: Communicator, timeout, my_step: int) -> None:
    rejected = [rank for rank, row in enumerate(rows) if row[1] < 0]
    if rejected:
        raise CollectiveMismatchError(f"replica check on rank {comm.rank}: rank {rejected[0]} rejected the "
                                      f"check (its own error says why)")
    steps = [row[0] for row in rows]
    if any(value != steps[0] for value in steps):
        text, groups = _ranks_by([f"step {value}" for value in steps])
        raise ReplicaDivergenceError(f"replica check on rank {comm.rank}: the ranks are at different steps: "
                                     f"{text}", step=steps[comm.rank], groups=groups)
    step = my_step
    at = f"at step {step}" if step >= 0 else "(no step given)"
    counts = [row[1] for row in rows]
    width = max(counts)
    table = torch.zeros(max(width, 1), 3 + _NAME_WORDS, dtype=torch.int64)
    for index, (name, tensor) in enumerate(named):
        table[index, 0] = zlib.crc32(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        table[index, 1:3] = torch.tensor([_signed(value) for value in checksum(tensor)])
        encoded = name.encode()[:_NAME_WORDS * 8].ljust(_NAME_WORDS * 8, b"\0")
        table[index, 3:] = torch.frombuffer(bytearray(encoded), dtype=torch.int64)
    gathered = [part for part in collectives.all_gather(table, comm, timeout=timeout)]
    for index in range(width):
        entries = [part[index, :3].tolist() if index < count else None for part, count in zip(gathered, counts)]
        if any(entry != entries[0] for entry in entries):
            holder = next(rank for rank, entry in enumerate(entries) if entry is not None)
            name = bytes(gathered[holder][index, 3:].numpy().tobytes()).rstrip(b"\0").decode(errors="replace")
            raise _divergence(name, index, entries, comm.rank, step, at)
    text, groups = _ranks_by([f"fingerprint {row[3] & _MASK:016x}" for row in rows])
    raise ReplicaDivergenceError(f"replica check on rank {comm.rank} {at}: fingerprints differ across ranks "
                                 f"({text}) but no single tensor does (differences that cancel in the fold)",
                                 step=step, groups=groups)


def _divergence(name: str, index: int, entries: list, rank: int, step: int, at: str) -> ReplicaDivergenceError:
    if any(entry is None for entry in entries):
        text, groups = _ranks_by(["no tensor there" if entry is None else "a tensor" for entry in entries])
        message = (f"replica check on rank {rank} {at}: the ranks hold different numbers of tensors, "
                   f"first at {name} (tensor {index}): {text}")
    elif any(entry[0] != entries[0][0] for entry in entries):
        text, groups = _ranks_by([f"layout code {entry[0]:08x}" for entry in entries])
        message = (f"replica check on rank {rank} {at}: {name} (tensor {index} on rank {rank}) has another "
                   f"name, shape or dtype on some ranks: {text}")
    else:
        text, groups = _ranks_by([f"checksum {entry[1] & _MASK:016x}{entry[2] & _MASK:016x}" for entry in entries])
        message = f"replicas diverged {at}: {name} (tensor {index}) differs across ranks: {text}"
    return ReplicaDivergenceError(message, tensor=name, step=step, groups=groups)
