"""ZeRO-3's units: the module subtrees whose parameters are all-gathered together, named or chosen by size.

Under ``shard="parameters"`` a parameter lives as one rank's chunk of its
*unit*'s flat buffer and is whole only while its unit runs
(:mod:`~gradsync.parallel.unit_params`). A unit is a submodule (with every
parameter below it not claimed by a smaller unit) or the root module (every
parameter left); FSDP2 calls them the modules ``fully_shard`` is applied to,
DeepSpeed's ZeRO-3 gathers per submodule.

Units named by the user (``units=``): submodule names (``"blocks.0"``),
submodule instances, or module classes (every submodule of that class, as
FSDP's ``transformer_auto_wrap_policy``).

Chosen by size (``units=None``): the root starts as one unit and, while a
unit holds more than ``max_unit_numel`` trainable elements and has children,
it is split: each child subtree with at least ``max_unit_numel // 16``
elements becomes a unit of its own (and is split again if still too large);
smaller children stay in their parent's unit, whose one gather then carries
them (many tiny gathers cost latency and save nothing). For a transformer
this gives one unit per block and the embeddings, final norm and head in the
root unit. A module whose forward reads its children's parameters without
calling them (``nn.MultiheadAttention`` reads ``out_proj.weight``) is never
split: its children would be freed when it reads them. Name units yourself
for such modules of your own.

A parameter shared by several modules (tied weights) belongs to the
deepest unit that contains every module using it, so it is whole wherever it
is read; the root unit is whole from the forward to the end of backward.

>>> import torch.nn as nn
>>> net = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
>>> [(u.name, u.numel) for u in choose_units(net, max_unit_numel=100)]
[('1', 90), ('0', 40), ('', 0)]
>>> [(u.name, u.numel) for u in choose_units(net, units=["1.0"])]
[('1.0', 72), ('', 58)]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

SMALL_CHILD = 16  # a child under max_unit_numel // SMALL_CHILD elements stays in its parent's unit
NEVER_SPLIT = (nn.MultiheadAttention,)  # forwards that read their children's parameters without calling them


@dataclass
class Unit:
    """One unit: ``name`` (module path, ``""`` the root), ``module``, ``params`` (indices into the
    trainable ``(name, parameter)`` list, registration order) and their ``numel``."""

    name: str
    module: nn.Module
    params: list[int] = field(default_factory=list)
    numel: int = 0


def choose_units(module: nn.Module, units=None, max_unit_numel: int = 6_553_600,
                 named: list | None = None) -> list[Unit]:
    """The units of ``module``, those with trainable parameters only, the root last.

    Args:
        module: the root module.
        units: None (by size), or an iterable of submodule names (str), submodules, or module classes.
        max_unit_numel: the by-size policy's most elements per unit (> 0); DataParallel passes its
            ``bucket_cap_mb`` in elements of the first parameter's dtype.
        named: the trainable ``(name, parameter)`` pairs (default: ``module.named_parameters()`` with
            ``requires_grad``); parameter indices refer to this list.

    Returns:
        Units in reverse order of their first parameter (the order backward usually finishes them), the
        root unit last (present even when it holds nothing); every trainable parameter in exactly one.

    Raises:
        TypeError: ``units`` holds something that is not a name, a module or a module class.
        ValueError: an unknown submodule name, a module that is not a submodule, the root itself, or a
            class no submodule has; ``max_unit_numel`` <= 0.
    """
    if named is None:
        named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
    if units is None:
        if not isinstance(max_unit_numel, int) or max_unit_numel <= 0:
            raise ValueError(f"max_unit_numel must be a positive int, got {max_unit_numel!r}")
        paths = _by_size(module, max_unit_numel)
    else:
        paths = _named_paths(module, units)
    return _assign(module, named, paths)


def _subtree_numel(module: nn.Module) -> int:
    return sum(param.numel() for param in module.parameters() if param.requires_grad)


def _by_size(root: nn.Module, max_numel: int) -> list[str]:
    """Module paths of the units the size policy chooses (the root excluded)."""
    chosen: list[str] = []

    def split(path: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            numel = _subtree_numel(child)
            if numel < max(1, max_numel // SMALL_CHILD):
                continue
            child_path = f"{path}.{name}" if path else name
            chosen.append(child_path)
            if numel > max_numel and not isinstance(child, NEVER_SPLIT):
                split(child_path, child)

    if _subtree_numel(root) > max_numel:
        split("", root)
    return chosen


def _named_paths(root: nn.Module, units) -> list[str]:
    """Module paths of user-named units (names, instances or classes)."""
    if isinstance(units, (str, nn.Module, type)):
        units = [units]
    if not hasattr(units, "__iter__"):
        raise TypeError(f"units takes a list of submodule names, submodules or module classes (or one of them), "
                        f"got {type(units).__name__}")
    paths_of = {}
    for path, sub in root.named_modules(remove_duplicate=False):
        paths_of.setdefault(id(sub), []).append(path)
    paths: list[str] = []
    for unit in units:
        if isinstance(unit, str):
            try:
                sub = root.get_submodule(unit)
            except AttributeError:
                raise ValueError(f"units: {unit!r} names no submodule of the wrapped module") from None
            found = paths_of[id(sub)]
        elif isinstance(unit, nn.Module):
            found = paths_of.get(id(unit))
            if found is None:
                raise ValueError(f"units: a {type(unit).__name__} that is not a submodule of the wrapped module")
        elif isinstance(unit, type) and issubclass(unit, nn.Module):
            found = [path for path, sub in root.named_modules(remove_duplicate=False)
                     if isinstance(sub, unit) and path]  # the root is a unit anyway
            if not found:
                raise ValueError(f"units: no submodule of the wrapped module is a {unit.__name__}")
        else:
            raise TypeError(f"units takes submodule names, submodules or module classes, got "
                            f"{type(unit).__name__}")
        if "" in found:
            raise ValueError("units: the root module is always a unit; name its submodules")
        paths.extend(path for path in found if path not in paths)
    return paths


def _assign(root: nn.Module, named: list, paths: list[str]) -> list[Unit]:
    """Each trainable parameter into the deepest unit containing every module that uses it."""
    index_of = {id(param): index for index, (_, param) in enumerate(named)}
    owners: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        if id(param) in index_of:
            owners.setdefault(index_of[id(param)], []).append(name.rpartition(".")[0])
    by_path = {path: Unit(path, root.get_submodule(path)) for path in paths}
    root_unit = Unit("", root)
    for index in range(len(named)):
        homes = [_deepest(paths, owner) for owner in owners[index]]
        home = homes[0]
        while not all(_within(other, home) for other in homes):
            home = _deepest(paths, home.rpartition(".")[0]) if home else ""
        unit = by_path[home] if home else root_unit
        unit.params.append(index)
        unit.numel += named[index][1].numel()
    found = [unit for unit in by_path.values() if unit.params]
    found.sort(key=lambda unit: unit.params[0], reverse=True)
    return found + [root_unit]


def _within(path: str, unit_path: str) -> bool:
    return unit_path == "" or path == unit_path or path.startswith(unit_path + ".")


def _deepest(paths: list[str], module_path: str) -> str:
    """The deepest unit path containing ``module_path`` (``""``: the root unit)."""
    best = ""
    for path in paths:
        if _within(module_path, path) and len(path) > len(best):
            best = path
    return best
