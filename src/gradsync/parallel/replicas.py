"""Construction-time checks that make replicas start identical.

``verify_parameters`` compares every parameter's and buffer's name, shape,
dtype and ``requires_grad`` across ranks; ``broadcast_tensors`` copies rank 0's values into every rank's
tensors, one flat message per dtype.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from gradsync.collectives import ops as collectives
from gradsync.collectives.communicator import Communicator
from gradsync.collectives.dtypes import dtype_code, dtype_name
from gradsync.errors import CollectiveMismatchError

_ROW_NUMEL = 11  # crc32(name), dtype code, requires_grad, ndim, up to 7 dims
_MAX_DIMS = _ROW_NUMEL - 4


def _describe(name: str, tensor: torch.Tensor) -> list[int]:
    dims = list(tensor.shape)[:_MAX_DIMS]
    row = [zlib.crc32(name.encode()), dtype_code(tensor.dtype), int(tensor.requires_grad), tensor.dim()]
    row += dims
    return row + [-1] * (_ROW_NUMEL - len(row))


def _render(row: list[int], name_row: list[int]) -> str:
    if row[0] == -1:
        return "nothing there"
    ndim = row[3]
    text = (f"shape {tuple(row[4:4 + min(ndim, _MAX_DIMS)])} dtype {dtype_name(row[1])} "
            f"requires_grad={bool(row[2])}")
    return text if row[0] == name_row[0] else f"a differently named tensor with {text}"


def verify_parameters(named_tensors: Sequence[tuple[str, torch.Tensor]], comm: Communicator,
                      owner: str = "DataParallel") -> None:
    """Raise CollectiveMismatchError on every rank unless all ranks hold the same named tensors.

    Names, shapes, dtypes and ``requires_grad`` are compared in order; the
    message names the first differing tensor (this rank's name) and what each
    rank has there. DataParallel passes every parameter, then every buffer.

    Collective: every rank must call this.
    """
    if comm.world_size == 1:
        return
    counts = collectives.all_gather(torch.tensor([len(named_tensors)]), comm)
    max_count = max(int(count) for count in counts)
    table = torch.full((max(max_count, 1), _ROW_NUMEL), -1, dtype=torch.int64)
    for index, (name, tensor) in enumerate(named_tensors):
        table[index] = torch.tensor(_describe(name, tensor))
    rows = [part.tolist() for part in collectives.all_gather(table, comm)]
    for index in range(max_count):
        per_rank = [rank_rows[index] for rank_rows in rows]
        if any(row != per_rank[0] for row in per_rank):
            name = named_tensors[index][0] if index < len(named_tensors) else f"#{index}"
            mine = per_rank[comm.rank]
            detail = "; ".join(f"rank {rank} has {_render(row, mine)}" for rank, row in enumerate(per_rank))
            raise CollectiveMismatchError(
                f"{owner}: replicas differ at parameter or buffer {index} ({name!r} on rank "
                f"{comm.rank}): {detail}")


_SETTING_NBYTES = 120  # each setting's "name=value" text, truncated


def verify_settings(settings: dict[str, object], comm: Communicator, owner: str = "DataParallel") -> None:
    """Raise CollectiveMismatchError on every rank unless all ranks pass equal ``settings``.

    Ranks that bucket or compress differently would exchange messages of
    different sizes, which Gloo answers by aborting the process; this names
    the first differing setting and each rank's value instead.

    Collective: every rank must call this with the same keys.
    """
    if comm.world_size == 1:
        return
    texts = [f"{name}={value}" for name, value in settings.items()]
    table = torch.zeros(len(texts), _SETTING_NBYTES, dtype=torch.uint8)
    for row, text in zip(table, texts):
        encoded = text.encode()[:_SETTING_NBYTES]
        row[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    gathered = collectives.all_gather(table, comm)
    for index, text in enumerate(texts):
        values = [bytes(part[index].tolist()).rstrip(b"\0").decode(errors="replace") for part in gathered]
        if any(value != values[0] for value in values):
            detail = "; ".join(f"rank {rank} has {value}" for rank, value in enumerate(values))
            raise CollectiveMismatchError(f"{owner}: ranks were constructed with different "
                                          f"{text.split('=')[0]}: {detail}")


def broadcast_tensors(tensors: Sequence[torch.Tensor], comm: Communicator, src: int = 0,
                      verify: bool = True) -> None:
    """Overwrite every rank's ``tensors`` with rank ``src``'s values, one message per dtype/device.

    ``verify=False`` skips the layout check, for a set of tensors already
    broadcast once with it (DataParallel's buffers at every forward).

    Collective: every rank must call this with tensors of equal shapes and dtypes.
    """
    if comm.world_size == 1:
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for members in groups.values():
            flat = torch.cat([tensor.reshape(-1) for tensor in members])
            collectives.broadcast(flat, comm, src=src, verify=verify)
            offset = 0
            for tensor in members:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
