"""``make docs``: rewrite docs/training.md's option table from ``gradsync.jobs.option_rules.RULES``.

One row per ``gradsync train`` option, one column per combination that
gradsync runs (mode, membership, placement): ``yes`` where the option is
honoured, ``-`` where it is refused before any process starts; the last
column says what it needs (and what it cannot go with). The text between ``<!-- generated: options -->``
and ``<!-- end generated: options -->`` is replaced. ``--check`` writes
nothing and exits 1 when the page differs.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from gradsync.jobs import option_rules as options

DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"
START, END = "<!-- generated: options -->", "<!-- end generated: options -->"
AXES = ("mode", "elastic", "hosts")  # the columns themselves
_SHORT = {"sync": "sync", "async": "async", "local-sgd": "local-sgd", "static": "", "elastic": " elastic",
          "local": "", "torchrun": " torchrun", "test hosts": " hosts", "slurm": " slurm"}


def combinations() -> list[tuple[str, str, str]]:
    """Every (mode, membership, placement) gradsync runs, in the table's column order."""
    return [where for where in itertools.product(options.MODES, options.MEMBERSHIPS, options.PLACEMENTS)
            if not any(options._matches(pattern, where) for pattern in options.REFUSED_COMBINATIONS)]


def render() -> str:
    columns = combinations()
    header = ["option"] + ["".join(_SHORT[part] for part in where) for where in columns] + ["needs"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, rule in options.RULES.items():
        if name in AXES:
            continue
        cells = ["yes" if rule.honoured_in(*where) else "-" for where in columns]
        needs = " or ".join(options.option(field) + ("" if value in (None, True) else f" {value}")
                            for field, value in rule.needs)
        needs += "".join(f"not with {options.option(field)} {value}" for field, value in rule.excludes)
        lines.append("| " + " | ".join([f"`{options.option(name)}`", *cells, needs]) + " |")
    return "\n".join(lines)


def rewrite(text: str) -> str:
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    return f"{before}{START}\n{render()}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/training.md is not up to date")
    args = parser.parse_args(argv)
    text = DOC.read_text(encoding="utf-8")
    wanted = rewrite(text)
    if args.check:
        if wanted != text:
            print("docs/training.md's option table is out of date: run `make docs`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted, encoding="utf-8")
    print(f"rewrote {DOC.relative_to(DOC.parents[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
