"""What a benchmark prints and writes: its text tables, and ``--json FILE`` (claimed first, written at the end)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence, Union

Cell = Union[str, Callable[[object], str]]


def comma_names(text: str, option: str, allowed: Sequence[str]) -> list[str]:
    """The comma-separated names of ``text`` (an option's value), each once, in order.

    Raises:
        ValueError: none given, or one not in ``allowed`` (naming ``option``).
    """
    names = list(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))
    if not names:
        raise ValueError(f"{option} needs at least one value")
    for name in names:
        if name not in allowed:
            raise ValueError(f"unknown {name!r} in {option}; choose from {', '.join(allowed)}")
    return names


def claim_json_path(path: str | None, option: str = "--json") -> None:
    """Create ``path`` (and its folders) now, so a bad path fails before the benchmark runs; an
    existing file is kept as it is until the run writes it (``option``: what the error names).

    Raises:
        ValueError: the file cannot be written.
    """
    if not path:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {path} is not writable: {exc.strerror or exc}") from None


def write_json(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(rows, file, indent=2)
        file.write("\n")


def fmt_optional(value, spec: str) -> str:
    """``format(value, spec)``, or "-" for a value that was not measured (None)."""
    return "-" if value is None else format(value, spec)


def optional(key: str, spec: str) -> Callable[[dict], str]:
    """A table cell: the row's ``key`` formatted with ``spec``, or "-" when it is missing or None."""
    return lambda row: fmt_optional(row.get(key), spec)


def host_layout(row: dict) -> str:
    """A table cell: hosts x ranks per host (``2x4``) of a row measured across hosts."""
    return f"{row.get('hosts', 1)}x{row.get('nproc_per_host', row['world_size'])}"


def format_rows(rows, columns: Sequence[tuple[str, int, Cell]]) -> str:
    """An aligned text table: a header line, a rule as long as it, one line per row.

    Each column is ``(header, width, cell)``, right-aligned to ``width``, one space between
    columns; ``cell`` is a template filled from the row (``"{time_us:.1f}"``) or a function of
    the row returning its text.

    >>> print(format_rows([{"n": 4, "t": 1.25}], [("n", 3, "{n}"), ("t [s]", 6, lambda row: f"{row['t']:.1f}")]))
      n  t [s]
    ----------
      4    1.2
    """
    header = " ".join(f"{title:>{width}}" for title, width, _ in columns)
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(" ".join(f"{cell.format_map(row) if isinstance(cell, str) else cell(row):>{width}}"
                              for _, width, cell in columns))
    return "\n".join(lines)
