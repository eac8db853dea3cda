"""``make architecture``: rewrite docs/architecture.md's layer drawing and module list from tools/layers.py.

The text between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``
(NAME ``layers`` or ``modules``) is replaced; everything else in the page is
kept. A module's line is the first paragraph of its docstring. ``--check``
writes nothing and exits 1 when the page differs from what would be written.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from pathlib import Path

from layers import ROWS, unit_of

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOC = ROOT / "docs" / "architecture.md"
COMMAND = "make architecture"
_WIDTH = 104
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of ``gradsync`` under ``src``: dotted name -> file."""
    found = {}
    for path in sorted((src / "gradsync").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def summary(path: Path) -> str:
    """The first paragraph of the module's docstring on one line, roles and double backquotes as markdown code."""
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if not docstring:
        raise ValueError(f"{path}: no module docstring (the architecture page lists its first paragraph)")
    text = " ".join(docstring.strip().split("\n\n")[0].split())
    return _ROLE.sub(lambda match: f"``{match.group(1)}``", text).replace("``", "`")


def _rows_in_use(names) -> list[tuple[str, tuple[str, ...], str, list[str]]]:
    """The rows that have modules, each with its modules in file order."""
    rows = []
    for title, units, description in ROWS:
        members = [name for name in names if unit_of(name) in units]
        if members:
            rows.append((title, units, description, members))
    return rows


def render_layers(names) -> str:
    """The drawing: one row per layer in use, top to bottom, joined by ``|``."""
    lines = ["```"]
    rows = _rows_in_use(names)
    for index, (title, _, description, _) in enumerate(rows):
        text = description.replace("``", "")
        wrapped = textwrap.wrap(text, _WIDTH - 22) or [""]
        last = index == len(rows) - 1
        lines.append(f"  {title:<19} {wrapped[0]}".rstrip())
        lines.extend(f"  {'' if last else '  |':<19} {more}" for more in wrapped[1:])
        if not last:
            lines.append("    |")
    lines.append("```")
    return "\n".join(lines)


def render_modules(found: dict[str, Path], src: Path = SRC) -> str:
    """Every module, grouped by layer: ``- `file`: first paragraph of its docstring``."""
    blocks = []
    for title, _, _, members in _rows_in_use(found):
        lines = [f"**{title}**", ""]
        lines.extend(f"- `{found[name].relative_to(src / 'gradsync')}`: {summary(found[name])}" for name in members)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def render(page: str, src: Path = SRC) -> str:
    """``page`` with its generated blocks rewritten."""
    found = modules(src)
    blocks = {"layers": render_layers(found), "modules": render_modules(found, src)}
    for name, body in blocks.items():
        begin = f"<!-- generated: {name} (`{COMMAND}`; do not edit by hand) -->"
        end = f"<!-- end generated: {name} -->"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
        if not pattern.search(page):
            raise ValueError(f"{DOC.name}: no block {begin} ... {end}")
        page = pattern.sub(lambda _: f"{begin}\n{body}\n{end}", page)
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date; write nothing")
    args = parser.parse_args(argv)
    current = DOC.read_text(encoding="utf-8")
    wanted = render(current)
    if args.check:
        if current != wanted:
            print(f"{DOC.relative_to(ROOT)} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        DOC.write_text(wanted, encoding="utf-8")
        print(f"rewrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
