"""ZeRO-3's check of the first forward: an operator that takes a parameter whose unit is not gathered raises.

A freed parameter is an empty tensor (:mod:`~gradsync.parallel.unit_params`); without this check the
forward of a module that reads another unit's parameter without calling that unit fails in the operator
with a shape error naming nothing, or computes silently with no elements.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn
from torch.overrides import TorchFunctionMode

from gradsync.errors import GradsyncError

# what may touch a freed parameter harmlessly: attribute reads and writes (``.dtype``, ``.device``, gradsync's own
# ``.data`` swaps), hashing (sets and dicts of parameters), and questions its empty tensor answers correctly
_HARMLESS = frozenset({"__get__", "__set__", "__hash__", "__repr__", "is_floating_point", "is_complex",
                       "element_size", "get_device", "requires_grad_"})


@contextmanager
def checked_once(owner, mode: TorchFunctionMode):
    """Run the block under ``mode``, then mark ``owner`` (a UnitParameters) as checked."""
    with mode:
        yield
    owner._read_checked = True


class FreedReadCheck(TorchFunctionMode):
    """Raises a clear GradsyncError when an operator takes a ZeRO-3 parameter whose unit is not gathered.

    Such a parameter is an empty tensor: without the check, the forward of a module that reads another
    unit's parameter without calling that unit (``x @ self.proj.weight``) fails in the operator with a
    shape error naming nothing, or silently computes with no elements. DataParallel runs its first
    forward under this mode (once: the forward order is fixed by then), as FSDP's debug mode checks.

    Args:
        whole_numel: ``id(parameter) -> (its numel when whole, its name, its unit's name)``.
    """

    def __init__(self, whole_numel: dict[int, tuple[int, str, str]]):
        super().__init__()
        self.whole_numel = whole_numel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _HARMLESS:
            for value in (*args, *kwargs.values()):
                for tensor in (value if isinstance(value, (list, tuple)) else (value,)):
                    self._check(tensor, func)
        return func(*args, **kwargs)

    def _check(self, tensor, func) -> None:
        entry = self.whole_numel.get(id(tensor)) if isinstance(tensor, nn.Parameter) else None
        if entry is None or tensor.numel() == entry[0]:
            return
        numel, name, unit = entry
        where = "the root unit" if not unit else f"unit {unit!r}"
        raise GradsyncError(
            f"DataParallel(shard='parameters'): {getattr(func, '__name__', func)} read parameter {name!r} "
            f"({numel} elements) while {where}, which holds it, was not gathered: a module's forward read it "
            f"without calling the module that owns it, so it was an empty tensor here; put the reading module "
            f"and that parameter's module in one unit (name their common parent in units=, or leave the "
            f"parameter's module out of units=)")
