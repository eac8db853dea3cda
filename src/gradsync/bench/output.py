"""The benchmarks' ``--json FILE``: claimed before any process starts, written at the end."""

from __future__ import annotations

import json
from pathlib import Path


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
