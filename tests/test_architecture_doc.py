"""docs/architecture.md's layer drawing and module list are what ``make architecture`` writes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import architecture  # noqa: E402


def test_architecture_page_is_up_to_date():
    """Every module is listed under its layer with its docstring, as the generator would write the page."""
    page = architecture.DOC.read_text(encoding="utf-8")
    if architecture.render(page) != page:
        pytest.fail(f"docs/architecture.md is out of date (a module added, moved or its docstring changed): "
                    f"run `{architecture.COMMAND}` and commit the page")


def test_generator_lists_a_new_module_under_its_layer(tmp_path):
    """A module added to a made-up package appears in the list, under its layer, with its docstring's first paragraph."""
    package = tmp_path / "gradsync"
    (package / "sim").mkdir(parents=True)
    (package / "__init__.py").write_text('"""The facade."""\n')
    (package / "sim" / "__init__.py").write_text('"""The simulator."""\n')
    (package / "sim" / "extra.py").write_text('"""A new module,\nwrapped.\n\nDetails."""\n')
    page = architecture.render(architecture.DOC.read_text(encoding="utf-8"), src=tmp_path)
    assert "**sim/**\n\n- `sim/__init__.py`: The simulator.\n- `sim/extra.py`: A new module, wrapped.\n" in page
    assert "  sim/ " in page and "  bench/ " not in page


def test_a_module_without_a_docstring_is_named(tmp_path):
    """The generator refuses a module with no docstring and says which file."""
    (tmp_path / "gradsync").mkdir()
    (tmp_path / "gradsync" / "__init__.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="__init__.py: no module docstring"):
        architecture.render(architecture.DOC.read_text(encoding="utf-8"), src=tmp_path)
