"""Construction-time checks that make replicas start identical.

``verify_parameters`` compares every parameter's and buffer's name, shape,
dtype and ``requires_grad`` across ranks; ``broadcast_tensors`` copies rank 0's values into every rank's
tensors, one flat message per dtype.
"""

from __future__ import annotations

import zlib
from typing import Callable, Sequence

import torch

from gradsync.collectives import ops as collectives
from gradsync.collectives.communicator import Communicator
from gradsync.collectives.dtypes import SUPPORTED_DTYPES, dtype_code, dtype_name
from gradsync.errors import CollectiveMismatchError
from gradsync.process_group import default_communicator, is_initialized, resolve_group

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


def agree_on_arguments(owner: str, group, settings: dict[str, object], check: Callable[[], None]) -> Communicator:
    """Resolve ``group`` and run ``check()`` (this rank's argument validation), then compare ``settings``.

    A rank whose arguments are bad still takes part in the settings check, with
    an ``arguments=rejected: <why>`` entry, so its peers raise
    CollectiveMismatchError at once naming it and the argument, instead of
    waiting for it until their timeout; then it raises its own error. A bad
    ``group`` cannot be resolved: if a default group exists, the rejection is
    exchanged there (peers that passed the default group learn it; peers on
    another group cannot be reached).

    Returns:
        the resolved group.

    Raises:
        TypeError, ValueError: this rank's ``check()`` or ``group`` failed.
        CollectiveMismatchError: another rank rejected its arguments, or settings differ.

    Collective: every rank must call this with the same ``settings`` keys.
    """
    try:
        comm = resolve_group(group)
    except (TypeError, ValueError) as problem:
        if group is not None and is_initialized():
            _reject(owner, problem, settings, default_communicator())
        raise
    try:
        check()
    except (TypeError, ValueError) as problem:
        _reject(owner, problem, settings, comm)
        raise
    verify_settings({"arguments": "accepted", **settings}, comm, owner=owner)
    return comm


def _reject(owner: str, problem: Exception, settings: dict[str, object], comm: Communicator) -> None:
    try:
        verify_settings({"arguments": f"rejected: {problem}", **settings}, comm, owner=owner)
    except CollectiveMismatchError:
        pass  # the peers raise that; this rank raises its own error


def broadcast_tensors(tensors: Sequence[torch.Tensor], comm: Communicator, src: int = 0,
                      verify: bool = True, names: Sequence[str] | None = None) -> None:
    """Overwrite every rank's ``tensors`` with rank ``src``'s values, one message per dtype/device.

    ``verify=False`` skips the layout check, for a set of tensors already
    broadcast once with it (DataParallel's buffers at every forward). A dtype
    the collectives do not carry (bool masks, complex, ...) travels as its
    bytes.

    Raises:
        TypeError: a tensor that has no plain bytes (sparse, quantized), naming
        it (``names[i]``, else its index).

    Collective: every rank must call this with tensors of equal shapes and dtypes.
    """
    if comm.world_size == 1:
        return
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for index, tensor in enumerate(tensors):
        wire = _wire(tensor, names[index] if names is not None else f"tensor #{index}")
        groups.setdefault((wire.dtype, wire.device), []).append((tensor, wire))
    with torch.no_grad():
        for members in groups.values():
            flat = torch.cat([wire for _, wire in members])
            collectives.broadcast(flat, comm, src=src, verify=verify)
            offset = 0
            for tensor, wire in members:
                part = flat[offset:offset + wire.numel()]
                tensor.copy_(part.view(tensor.dtype).view_as(tensor) if part.dtype != tensor.dtype
                             else part.view_as(tensor))
                offset += wire.numel()


def _wire(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` flattened as the collectives can carry it: itself, or its bytes (uint8)."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"cannot broadcast {name!r}: a {tensor.layout} tensor of dtype {tensor.dtype} has no "
                        f"plain bytes (only dense tensors can be made equal on every rank)")
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype in SUPPORTED_DTYPES else flat.view(torch.uint8)


# -- what changed after wrapping (DataParallel checks it at every forward with grad enabled) ------------

class ParameterWatch:
    """Tells whether ``module``'s parameters are still the wrapped ones (objects and ``requires_grad``).

    :meth:`change` costs a walk over the modules listed at wrapping (a few
    microseconds for a small CNN); only when something differs are the
    parameters listed by name to say what changed.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.wrapped = param_signature(module)
        self._modules = list(module.modules())
        self._fast = self._fast_signature()

    def _fast_signature(self) -> list[tuple]:
        return [(tuple((id(p), p.requires_grad) for p in mod._parameters.values() if p is not None),
                 tuple(map(id, mod._modules.values()))) for mod in self._modules]

    def change(self) -> str | None:
        """None if nothing changed since wrapping, else what changed, naming the parameter."""
        if self._fast_signature() == self._fast:
            return None
        change = describe_change(self.wrapped, param_signature(self.module))
        if change is None:  # the same parameters under a new module tree: keep watching that one
            self._modules = list(self.module.modules())
            self._fast = self._fast_signature()
        return change


def name_code(names: list[str], change: str) -> int:
    """Index + 1 of the first of ``names`` that ``change`` (a :func:`describe_change` text) quotes; 0 if none."""
    for index, name in enumerate(names):
        if repr(name) in change:
            return index + 1
    return 0


def param_signature(module: torch.nn.Module) -> list[tuple[str, int, bool]]:
    """(name, id, requires_grad) of every parameter: equal lists mean the same parameter objects."""
    return [(name, id(param), param.requires_grad) for name, param in module.named_parameters()]


def describe_change(wrapped: list[tuple[str, int, bool]], now: list[tuple[str, int, bool]]) -> str | None:
    """None if ``now`` equals ``wrapped`` (both from :func:`param_signature`), else what changed, by name."""
    if now == wrapped:
        return None
    before, after = {name: rest for name, *rest in wrapped}, {name: rest for name, *rest in now}
    for name, (ident, requires_grad) in after.items():
        if name not in before:
            return f"parameter {name!r} was added after wrapping"
        if before[name][0] != ident:
            return f"parameter {name!r} was replaced by another tensor after wrapping"
        if before[name][1] != requires_grad:
            return f"parameter {name!r} was {'unfrozen' if requires_grad else 'frozen'} after wrapping"
    removed = [name for name in before if name not in after]
    return f"parameter {removed[0]!r} was removed after wrapping" if removed else "parameters were reordered"


def buffer_signature(module: torch.nn.Module, named=None) -> list[tuple[str, tuple, torch.dtype, torch.device]]:
    """(name, shape, dtype, device) of every buffer (``named``: ``module.named_buffers()`` already listed)."""
    named = module.named_buffers() if named is None else named
    return [(name, tuple(buffer.shape), buffer.dtype, buffer.device) for name, buffer in named]


def describe_buffer_change(layout: list[tuple], named) -> str:
    """What differs between the wrapped buffer ``layout`` (:func:`buffer_signature`) and the buffers ``named`` now."""
    now = {name: (tuple(buffer.shape), buffer.dtype, buffer.device) for name, buffer in named}
    for name, *was in layout:
        if name not in now:
            return f"buffer {name!r} was removed after wrapping"
        if now[name] != tuple(was):
            return (f"buffer {name!r} changed from shape {was[0]} {was[1]} on {was[2]} to shape {now[name][0]} "
                    f"{now[name][1]} on {now[name][2]} after wrapping")
    return "buffers were added after wrapping"


def placeholders(layout: list[tuple]) -> list[torch.Tensor]:
    """Zero tensors of the wrapped buffer layout: what a rank whose buffers changed sends and receives."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _, shape, dtype, device in layout]
