"""Layout check: ranks agree on the collective, shape, dtype, op and src, or all raise.

Every rank contributes a fixed-size int64 descriptor and sends it straight
to every other rank; since every descriptor has the same size this exchange
cannot itself mismatch. Talking to every peer directly (rather than round a
ring) means a rank that is dead or never calls is named by every other rank,
not only by its neighbours, and the p-1 messages travel concurrently. Every rank then compares all descriptors
and raises the same :class:`~gradsync.errors.CollectiveMismatchError` before
any payload moves, so no tensor is modified and the group stays usable.
Cost: (p-1) concurrent messages of ``DESCRIPTOR_NUMEL * 8`` bytes per rank. Callers that already verified a fixed layout (the
DataParallel buckets, checked once at construction) pass ``verify=False``.
"""

from __future__ import annotations

import zlib

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.dtypes import dtype_code, dtype_name
from gradsync.collectives.registry import ALGORITHMS
from gradsync.errors import CollectiveMismatchError

DESCRIPTOR_NUMEL = 16
MAX_DIMS = 8
_MAGIC = 0x67726164  # "grad"
_FIELDS = ("magic", "collective", "op", "algorithm", "dtype", "src", "numel", "ndim")
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
_OPS = ("none", "sum", "avg")


def _code(table, value) -> int:
    return table.index(value) if value in table else len(table) + zlib.crc32(str(value).encode())


_NOT_A_TENSOR = -2


def describe(tensor: torch.Tensor | None, collective: str, op: str, algorithm: str, src: int) -> torch.Tensor:
    """Encode a call's layout as a ``(DESCRIPTOR_NUMEL,)`` int64 tensor (None: not a tensor)."""
    if tensor is None:
        head = [_MAGIC, _code(_COLLECTIVES, collective), _code(_OPS, op), _code(ALGORITHMS, algorithm),
                _NOT_A_TENSOR, src, 0, 0]
        return torch.tensor(head + [0] * (DESCRIPTOR_NUMEL - len(head)), dtype=torch.int64)
    dims = list(tensor.shape)
    if len(dims) > MAX_DIMS:  # fold the tail into one value: still differs if any dim does
        dims = dims[: MAX_DIMS - 1] + [hash(tuple(dims[MAX_DIMS - 1:])) & 0x7FFFFFFF]
    head = [_MAGIC, _code(_COLLECTIVES, collective), _code(_OPS, op), _code(ALGORITHMS, algorithm),
            dtype_code(tensor.dtype), src, tensor.numel(), tensor.dim()]
    values = head + dims + [0] * (DESCRIPTOR_NUMEL - len(head) - len(dims))
    return torch.tensor(values, dtype=torch.int64)


def verify_layout(call: CollectiveCall, tensor: torch.Tensor | None, *, collective: str,
                  op: str = "none", src: int = 0, algorithm: str | None = None) -> None:
    """Raise CollectiveMismatchError on every rank unless all ranks describe the same call.

    Collective: every rank must call this, whatever its tensor.
    """
    world_size = call.world_size
    if world_size == 1:
        return
    stats = call.transport.stats
    before = (stats.bytes_sent, stats.bytes_received, stats.messages_sent, stats.messages_received)
    table = torch.zeros(world_size * DESCRIPTOR_NUMEL, dtype=torch.int64)
    own = slice(call.rank * DESCRIPTOR_NUMEL, (call.rank + 1) * DESCRIPTOR_NUMEL)
    table[own] = describe(tensor, collective, op, algorithm or call.algorithm, src)
    _exchange_with_every_peer(table.view(world_size, DESCRIPTOR_NUMEL), call)
    stats.reclassify_as_control(stats.bytes_sent - before[0], stats.bytes_received - before[1],
                                (stats.messages_sent - before[2], stats.messages_received - before[3]))
    rows = table.view(world_size, DESCRIPTOR_NUMEL).tolist()
    problem = _first_difference(rows, tensor_shapes=[_shape_of(row) for row in rows])
    if problem:
        raise CollectiveMismatchError(f"{collective} on rank {call.rank}: ranks disagree on {problem}")


def _exchange_with_every_peer(rows: torch.Tensor, call: CollectiveCall) -> None:
    """Send this rank's row to every peer and receive theirs, all in flight at once."""
    peers = [peer for peer in range(call.world_size) if peer != call.rank]
    own = rows[call.rank]
    sends = [call.isend(own, peer, f"layout check with peer rank {peer}") for peer in peers]
    receives = [call.irecv(rows[peer], peer, f"layout check with peer rank {peer}") for peer in peers]
    for peer, pending in zip(peers, receives):
        call.wait_on(pending, f"layout check with peer rank {peer}")
    call.wait_all(sends, "layout check")


def _shape_of(row: list[int]) -> tuple[int, ...]:
    ndim = row[7]
    return tuple(row[8: 8 + min(ndim, MAX_DIMS)])


def _decode(field: str, value: int) -> str:
    if field == "dtype":
        return "no tensor" if value == _NOT_A_TENSOR else dtype_name(value)
    tables = {"collective": _COLLECTIVES, "op": _OPS, "algorithm": ALGORITHMS}
    table = tables.get(field)
    if table is not None:
        return str(table[value]).replace("torch.", "") if 0 <= value < len(table) else "an unknown value"
    return str(value)


def _first_difference(rows: list[list[int]], tensor_shapes: list[tuple[int, ...]]) -> str:
    """Describe the first field on which ranks differ, grouping ranks by value ("" if none)."""
    if any(row[0] != _MAGIC for row in rows):
        bad = [rank for rank, row in enumerate(rows) if row[0] != _MAGIC]
        return f"the protocol: ranks {bad} sent no valid layout (they called another operation?)"
    for index, field in enumerate(_FIELDS[1:7], start=1):
        if field == "numel":
            continue
        values = [_decode(field, row[index]) for row in rows]
        if len(set(values)) > 1:
            return f"{field}: " + _group_by_value(values)
    shapes = [str(tuple(shape)) for shape in tensor_shapes]
    if len(set(shapes)) > 1:
        return "shape: " + _group_by_value(shapes)
    return ""


def _group_by_value(values: list[str]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    parts = []
    for value, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who} {'has' if len(ranks) == 1 else 'have'} {value}")
    return "; ".join(parts)
