"""Construction-time checks that make replicas start identical.

``verify_parameters`` compares every parameter's name, shape and dtype
across ranks; ``broadcast_tensors`` copies rank 0's values into every rank's
tensors, one flat message per dtype.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from gradsync.collectives import api as collectives
from gradsync.collectives.communicator import Communicator
from gradsync.errors import CollectiveMismatchError

_ROW_NUMEL = 10  # crc32(name), dtype code, ndim, up to 7 dims
_MAX_DIMS = _ROW_NUMEL - 3
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
           torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def _describe(name: str, param: torch.Tensor) -> list[int]:
    dims = list(param.shape)[:_MAX_DIMS]
    dtype_code = _DTYPES.index(param.dtype) if param.dtype in _DTYPES else len(_DTYPES)
    row = [zlib.crc32(name.encode()), dtype_code, param.dim()] + dims
    return row + [-1] * (_ROW_NUMEL - len(row))


def _render(row: list[int]) -> str:
    if row[0] == -1:
        return "no such parameter"
    ndim = row[2]
    dtype = _DTYPES[row[1]] if row[1] < len(_DTYPES) else "other dtype"
    return f"shape {tuple(row[3:3 + min(ndim, _MAX_DIMS)])} dtype {str(dtype).replace('torch.', '')}"


def verify_parameters(named_params: Sequence[tuple[str, torch.Tensor]], comm: Communicator) -> None:
    """Raise CollectiveMismatchError on every rank unless all ranks hold the same parameters.

    The message names the first differing parameter and what each rank has.

    Collective: every rank must call this.
    """
    if comm.world_size == 1:
        return
    counts = collectives.all_gather(torch.tensor([len(named_params)]), comm)
    max_count = max(int(count) for count in counts)
    table = torch.full((max(max_count, 1), _ROW_NUMEL), -1, dtype=torch.int64)
    for index, (name, param) in enumerate(named_params):
        table[index] = torch.tensor(_describe(name, param))
    rows = [part.tolist() for part in collectives.all_gather(table, comm)]
    for index in range(max_count):
        per_rank = [rank_rows[index] for rank_rows in rows]
        if any(row != per_rank[0] for row in per_rank):
            name = named_params[index][0] if index < len(named_params) else f"#{index}"
            detail = "; ".join(f"rank {rank} has {_render(row)}" for rank, row in enumerate(per_rank))
            raise CollectiveMismatchError(
                f"DataParallel: replicas differ at parameter {index} ({name!r} on rank {comm.rank}): "
                f"{detail}")


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
