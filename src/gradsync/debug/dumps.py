"""Reading flight-record dumps as they are found on disk: whole, cut short, or garbage.

A dump (:mod:`~gradsync.debug.flight`) is one JSON object: a header (rank,
world size, host, pid, the error) and ``records``, written with the header on
the first line and one record per line. :func:`load_folder` reads every
``rank-*.json`` of a folder; a file that is not valid JSON is read line by
line (the header line, then the records before the damage), and a file with
nothing usable is named in :attr:`Folder.bad` with the reason, never raised.
Every field a reader uses is type-checked; a record that fails is skipped and
counted, so that an analysis of real dumps never stops on one bad value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from gradsync.debug.flight import FLIGHT_FOLDER, STATES

_NAME = re.compile(r"^rank-(\d+)\.json$")
_MAX_BYTES = 512 * 2**20  # a dump of the default 2000 records is ~1 MB; bigger is not ours
MAX_WORLD_SIZE = 2**20  # a rank or world size beyond this is damage, not a job
_MAX_NAME_CHARS = 80  # of an op, algorithm or label shown (a damaged one must not flood the screen)


@dataclass
class RankDump:
    """One rank's dump, checked. ``records``: seq -> record (the fields of
    :func:`~gradsync.debug.flight.record_of`, each of the right type or None). ``notes``: what was wrong
    with the file but could be read around (cut short, records skipped)."""

    path: Path
    rank: int
    world_size: int | None = None
    hostname: str | None = None
    pid: int | None = None
    error: str | None = None  # "CollectiveTimeoutError: <message>"
    written_wall: float | None = None
    records: dict[int, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def last(self) -> dict | None:
        """The record with the highest seq (where this rank stopped), or None."""
        return self.records[max(self.records)] if self.records else None


@dataclass
class Folder:
    """What :func:`load_folder` found: ``dumps`` by rank, ``bad`` (file name, reason) for files it could not use."""

    path: Path
    dumps: dict[int, RankDump] = field(default_factory=dict)
    bad: list[tuple[str, str]] = field(default_factory=list)


def dump_folder(folder: Path) -> Path:
    """The folder holding the dumps: ``folder/flight`` when that has any (a run folder), else ``folder``."""
    inner = folder / FLIGHT_FOLDER
    if inner.is_dir() and any(_NAME.match(path.name) for path in inner.iterdir()):
        return inner
    return folder


def _int(value, minimum: int = 0) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= minimum else None


def _float(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


def _name(value) -> str | None:
    text = _text(value)
    return text if text is None or len(text) <= _MAX_NAME_CHARS else text[:_MAX_NAME_CHARS - 1] + "…"


def check_record(raw) -> dict | None:
    """``raw`` with every field of the right type (else None), or None when ``seq`` or ``op`` is unusable."""
    if not isinstance(raw, dict) or _int(raw.get("seq"), 1) is None or not _text(raw.get("op")):
        return None
    shape = raw.get("shape")
    if not (isinstance(shape, list) and all(_int(dim) is not None for dim in shape)):
        shape = None
    state = raw.get("state")
    return {"seq": raw["seq"], "op": _name(raw["op"]), "algorithm": _name(raw.get("algorithm")) or "",
            "label": _name(raw.get("label")), "dtype": _name(raw.get("dtype")),
            "shape": tuple(shape) if shape is not None else None, "nbytes": _int(raw.get("nbytes")),
            "state": state if state in STATES else "unknown", "peer": _int(raw.get("peer")),
            "blamed": _int(raw.get("blamed")), "error": _text(raw.get("error")),
            "timed_out": raw.get("timed_out") if isinstance(raw.get("timed_out"), bool) else None,
            "start_wall": _float(raw.get("start_wall")), "end_wall": _float(raw.get("end_wall"))}


def _salvage(text: str) -> tuple[dict | None, list, str]:
    """(header or None, the records before the damage, what was wrong) of a dump that is not valid JSON."""
    lines = text.splitlines()
    header = None
    if lines:
        try:
            header = json.loads(lines[0] + "]}")
        except (ValueError, RecursionError):
            header = None
    records = []
    for number, line in enumerate(lines[1:], start=2):
        line = line.strip().rstrip(",")
        if line in ("]}", "]", ""):
            continue
        try:
            records.append(json.loads(line))
        except (ValueError, RecursionError):
            return header, records, f"cut short or damaged at line {number}"
    return header, records, "not valid JSON"


def load_dump(path: Path) -> RankDump:
    """Read and check one dump.

    Raises:
        ValueError: nothing usable in it (the message says why); OSError: it cannot be read.
    """
    if path.stat().st_size > _MAX_BYTES:
        raise ValueError(f"{path.stat().st_size} bytes: too big for a flight record")
    text = path.read_bytes().decode("utf-8", errors="replace")
    notes = []
    try:
        document = json.loads(text)
        raw_records = document.get("records") if isinstance(document, dict) else None
        if not isinstance(raw_records, list):
            raise ValueError("not a flight record (no list of records)")
    except (json.JSONDecodeError, RecursionError) as exc:
        document, raw_records, problem = _salvage(text)
        if document is None and not raw_records:
            where = f"{exc.msg} at line {exc.lineno} column {exc.colno}" if isinstance(exc, ValueError) else \
                "nested too deeply"
            raise ValueError(f"not valid JSON ({where}); empty, cut short or not a flight record") from None
        notes.append(f"{problem}: read its first {len(raw_records)} records")
    document = document if isinstance(document, dict) else {}
    return _checked(path, document, raw_records, notes)


def _checked(path: Path, document: dict, raw_records: list, notes: list[str]) -> RankDump:
    named = _NAME.match(path.name)
    rank = _int(document.get("rank"))
    if rank is None:
        if named is None:
            raise ValueError("no rank in it or in its name")
        rank = int(named.group(1))
        notes.append(f"no readable rank inside: rank {rank} from the file name")
    elif named is not None and int(named.group(1)) != rank:
        notes.append(f"holds rank {rank}'s record")
    world_size = _int(document.get("world_size"), 1)
    if rank >= MAX_WORLD_SIZE or (world_size or 0) > MAX_WORLD_SIZE:
        raise ValueError(f"rank {rank} of world size {world_size}: not a job's (damaged?)")
    if world_size is not None and rank >= world_size:
        raise ValueError(f"rank {rank} outside its own world size {world_size} (damaged?)")
    error = document.get("error")
    if isinstance(error, dict) and _text(error.get("message")) is not None:
        error = f"{_text(error.get('type')) or 'error'}: {error['message']}"
    records = {}
    for raw in raw_records:
        record = check_record(raw)
        if record is not None:
            records[record["seq"]] = record
    if len(records) < len(raw_records):
        notes.append(f"{len(raw_records) - len(records)} unreadable records skipped")
    return RankDump(path=path, rank=rank, world_size=world_size,
                    hostname=_text(document.get("hostname")), pid=_int(document.get("pid")),
                    error=_text(error), written_wall=_float(document.get("written_wall")),
                    records=records, notes=notes)


def load_folder(folder: str | Path) -> Folder:
    """Every rank's dump in ``folder`` (a run folder or its ``flight`` folder); bad files are listed, not raised.

    Of two files holding one rank, the one written last is used and the other listed as bad.

    Raises:
        ValueError: ``folder`` is not a folder.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    found = Folder(path=dump_folder(folder))
    for path in sorted(found.path.iterdir(), key=lambda path: _sort_key(path.name)):
        if not _NAME.match(path.name) or not path.is_file():
            continue
        try:
            dump = load_dump(path)
        except (OSError, ValueError) as exc:
            found.bad.append((path.name, str(exc)))
            continue
        kept = found.dumps.get(dump.rank)
        if kept is not None:
            older, dump = sorted((kept, dump), key=lambda d: d.written_wall or 0.0)
            found.bad.append((older.path.name, f"another file ({dump.path.name}) holds a newer record of "
                                               f"rank {dump.rank}"))
        found.dumps[dump.rank] = dump
    return found


def _sort_key(name: str) -> tuple[int, str]:
    named = _NAME.match(name)
    return (int(named.group(1)) if named else -1, name)


__all__ = ["FLIGHT_FOLDER", "MAX_WORLD_SIZE", "Folder", "RankDump", "check_record", "dump_folder", "load_dump",
           "load_folder"]
