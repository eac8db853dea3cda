"""No algorithm names outside their registry (docs/architecture.md): the generic collective entry
(``collectives/ops.py``, ``collectives/validate.py``) and every ``parallel/`` module name no algorithm
in a string literal; what an algorithm needs or offers is data in ``collectives/registry.py`` and
``collectives/fast_path.py``, and the algorithm modules may name themselves.

Literals are found with ``ast`` (nothing is imported); docstrings are exempt (they explain behaviour
in words), every other string constant counts, f-string parts and default arguments included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gradsync.collectives.registry import ALGORITHMS

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gradsync"
GENERIC = [PACKAGE / "collectives" / "ops.py", PACKAGE / "collectives" / "validate.py",
           *sorted((PACKAGE / "parallel").glob("*.py"))]


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def algorithm_literals(source: str, names=ALGORITHMS) -> list[tuple[int, str]]:
    """(line, literal) of every string constant in ``source`` that is an algorithm name, docstrings aside."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                  and id(node) not in docstrings)


def test_checker_finds_a_name_in_logic_and_ignores_docstrings():
    """The checker reports a comparison, a default argument and a dict key, not a docstring mentioning one."""
    source = ('"""Runs "shm" when it can."""\n'
              'def f(algorithm="ring"):\n'
              '    """Say "auto" here."""\n'
              '    table = {"native": 1}\n'
              '    return algorithm == "shm"\n')
    assert algorithm_literals(source) == [(2, "ring"), (4, "native"), (5, "shm")]


@pytest.mark.parametrize("path", GENERIC, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_generic_module_names_no_algorithm(path: Path):
    """Neither the generic collective entry nor a parallel/ module names an algorithm in a string literal."""
    found = algorithm_literals(path.read_text(encoding="utf-8"))
    assert not found, (f"{path.relative_to(PACKAGE.parent)} names algorithms {found}: ask the registry "
                       f"(collectives/registry.py, fast_path.py) for the capability instead")
