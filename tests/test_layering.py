"""The import graph of ``src/gradsync`` has no cycle, and every import goes down the layers.

Every module is parsed with ``ast`` (nothing is imported), and every import
statement anywhere in it counts: module level, inside a function (a
"lazy" import only defers a cycle, it does not remove it), under ``if`` or
``try``. Edges go to the most specific gradsync module named:
``import gradsync.a.b`` -> ``gradsync.a.b``; ``from gradsync.a import b`` ->
``gradsync.a.b`` when that is a module, else ``gradsync.a``;
``from . import b`` and ``from ..a import b`` are resolved against the
importing module's package; ``import gradsync`` -> the package's
``__init__``. A cycle is reported as ``a -> b -> a`` with the file and line of
each import. The layers are data in ``tools/layers.py`` (the same rows
docs/architecture.md draws); an upward import is reported as importer,
imported and file:line.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "gradsync"
sys.path.insert(0, str(ROOT / "tools"))

from layers import ROWS, may_import, unit_of  # noqa: E402


def module_name(path: Path, src: Path = SRC) -> str:
    """``src/gradsync/train/loop.py`` -> ``gradsync.train.loop``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def discover(src: Path = SRC) -> dict[str, Path]:
    """Every module of the package under ``src``: name -> file."""
    return {module_name(path, src): path for path in sorted((src / PACKAGE).rglob("*.py"))}


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name ``from <level dots><module> import ...`` refers to inside ``importer``."""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    if level > 1:
        package = package[:len(package) - (level - 1)]
    return ".".join(package + ([module] if module else []))


def _most_specific(name: str, modules) -> str | None:
    """``name`` or its longest prefix that is a known module (``gradsync.a.b.func`` -> ``gradsync.a.b``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(importer: str, path: Path, modules) -> list[tuple[str, int]]:
    """(imported gradsync module, line) for every import statement anywhere in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(importer, is_package, node.level, node.module) if node.level
                    else node.module or "")
            # ``from a import b``: b may be a submodule (then that is the edge) or a name in a.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                resolved = _most_specific(target, modules)
                if resolved is not None and resolved != importer:
                    edges.append((resolved, node.lineno))
    return edges


def import_graph(src: Path = SRC) -> dict[str, dict[str, int]]:
    """importer -> {imported module: line of the first such import}."""
    modules = discover(src)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for target, line in imports_of(name, path, modules):
            edges.setdefault(target, line)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, {}):
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_within(graph, set(component), component[0]) for component in components]


def _cycle_within(graph, component: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start using only nodes of ``component`` (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target not in component:
                    continue
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
                if target not in parents:
                    parents[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def describe(graph, cycle: list[str], src: Path = SRC) -> str:
    """``a -> b -> a`` followed by where each import is (file:line)."""
    files = discover(src)
    hops = [f"  {importer} imports {imported} at "
            f"{files[importer].relative_to(src.parent)}:{graph[importer][imported]}"
            for importer, imported in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n" + "\n".join(hops)


def upward_imports(graph: dict[str, dict[str, int]]) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import of a module in a layer above the importer's."""
    return [(importer, imported, line) for importer in sorted(graph)
            for imported, line in sorted(graph[importer].items()) if not may_import(importer, imported)]


# ---------------------------------------------------------------- the checker on made-up packages


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / PACKAGE / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_a_cycle_through_a_function_local_import(tmp_path):
    """loop imports async_loop inside a function, async_loop imports loop at top level: one cycle, both lines."""
    src = _write_package(tmp_path, {
        "__init__.py": "",
        "train/__init__.py": "",
        "train/loop.py": "import os\n\ndef run():\n    from gradsync.train.async_loop import role\n",
        "train/async_loop.py": "from gradsync.train.loop import make_optimizer\n",
    })
    graph = import_graph(src)
    assert graph["gradsync.train.loop"] == {"gradsync.train.async_loop": 4}
    assert graph["gradsync.train.async_loop"] == {"gradsync.train.loop": 1}
    assert find_cycles(graph) == [["gradsync.train.async_loop", "gradsync.train.loop",
                                   "gradsync.train.async_loop"]]


def test_checker_resolves_relative_and_submodule_imports(tmp_path):
    """``from . import b``, ``from ..x import y`` and ``from gradsync.a import b`` (b a module) are edges."""
    src = _write_package(tmp_path, {
        "__init__.py": "from gradsync import a\n",
        "a/__init__.py": "from . import b\n",
        "a/b.py": "from ..x import helper\nimport numpy\n",
        "x.py": "def helper():\n    import gradsync.a.b\n",
    })
    graph = import_graph(src)
    assert graph["gradsync"] == {"gradsync.a": 1}
    assert graph["gradsync.a"] == {"gradsync.a.b": 1}
    assert graph["gradsync.a.b"] == {"gradsync.x": 1}
    assert graph["gradsync.x"] == {"gradsync.a.b": 2}
    assert find_cycles(graph) == [["gradsync.a.b", "gradsync.x", "gradsync.a.b"]]


def test_checker_accepts_a_layered_package(tmp_path):
    """Imports that only go downward (and ``from gradsync.a import name``, a name not a module) form no cycle."""
    src = _write_package(tmp_path, {
        "__init__.py": "from gradsync.top import run\n",
        "top.py": "from gradsync.low import helper\nfrom gradsync import low\n",
        "low.py": "import math\nhelper = math.sqrt\n",
    })
    assert find_cycles(import_graph(src)) == []


def test_direction_checker_finds_one_upward_import(tmp_path):
    """collectives importing sim (a layer above it) inside a function is the one upward edge, with its line."""
    src = _write_package(tmp_path, {
        "__init__.py": "from gradsync.collectives import auto\n",
        "collectives/__init__.py": "",
        "collectives/auto.py": "import math\n\ndef choose():\n    from gradsync.sim import formulas\n",
        "sim/__init__.py": "",
        "sim/formulas.py": "from gradsync.collectives.auto import choose\n",
    })
    assert upward_imports(import_graph(src)) == [("gradsync.collectives.auto", "gradsync.sim.formulas", 4)]


def test_direction_checker_accepts_a_layered_package(tmp_path):
    """Down the rows, right along a row, within a unit, and the application (cli) to the root package's
    public names: no upward edge."""
    src = _write_package(tmp_path, {
        "__init__.py": "from gradsync import api\n",
        "cli.py": "import gradsync\nfrom gradsync.bench import report\n",
        "bench/__init__.py": "",
        "bench/report.py": "from gradsync.bench import output\nfrom gradsync.sim import engine\n",
        "bench/output.py": "from gradsync.errors import GradsyncError\n",
        "sim/__init__.py": "",
        "sim/engine.py": "from gradsync.collectives.cost import formulas\n",
        "collectives/__init__.py": "",
        "collectives/cost/__init__.py": "",
        "collectives/cost/formulas.py": "from gradsync.collectives import SegmentOptions\n",
        "api.py": "from gradsync.process_group import init\n",
        "process_group.py": "from gradsync.rendezvous import store\n",
        "rendezvous.py": "",
        "errors.py": "",
    })
    assert upward_imports(import_graph(src)) == []


def test_a_row_may_import_rightward_only():
    """Within the api/launch row, launch may import process_group but process_group not launch."""
    assert may_import("gradsync.launch", "gradsync.process_group")
    assert not may_import("gradsync.process_group", "gradsync.launch")
    assert not may_import("gradsync.sim.engine", "gradsync.bench.output")


def test_the_root_package_sits_above_the_library_not_at_the_top():
    """``import gradsync`` (the public names) is for the application above parallel/, not for the library."""
    assert may_import("gradsync.train.loop", "gradsync")
    assert may_import("gradsync.bench.train", "gradsync")
    assert not may_import("gradsync.parallel.data_parallel", "gradsync")
    assert not may_import("gradsync.collectives.ops", "gradsync")
    assert may_import("gradsync", "gradsync.parallel")


# ---------------------------------------------------------------- the real package


def test_import_graph_covers_every_module():
    """The graph has every module under src/gradsync, and the package's own layering edges appear in it."""
    graph = import_graph()
    assert set(graph) == set(discover())
    assert "gradsync.collectives" in graph["gradsync"], graph["gradsync"]
    assert len(graph) > 30


def test_gradsync_has_no_import_cycle():
    """No chain of gradsync imports (module level or function-local) leads back to where it started."""
    graph = import_graph()
    cycles = find_cycles(graph)
    if cycles:
        pytest.fail(f"{len(cycles)} import cycle(s) in src/gradsync:\n"
                    + "\n".join(describe(graph, cycle) for cycle in cycles))


def test_every_module_is_in_a_layer():
    """Each module's unit (subpackage or top-level module) is named in a row of tools/layers.py."""
    named = {unit for _, units, _ in ROWS for unit in units}
    missing = sorted({unit_of(module) for module in discover()} - named)
    assert not missing, f"add these to a row of tools/layers.py: {missing}"


def test_gradsync_imports_only_downward():
    """No module imports a module of a layer above its own (tools/layers.py, top to bottom)."""
    graph = import_graph()
    upward = upward_imports(graph)
    if upward:
        files = discover()
        pytest.fail(f"{len(upward)} upward import(s) in src/gradsync (layers: tools/layers.py):\n" + "\n".join(
            f"  {importer} imports {imported} at {files[importer].relative_to(SRC.parent)}:{line}"
            for importer, imported, line in upward))
