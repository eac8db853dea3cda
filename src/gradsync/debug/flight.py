"""The flight recorder: every rank's last collective calls, always kept, written out when one fails.

Each :class:`~gradsync.collectives.Communicator` owns a :class:`FlightRecorder`,
a ring of its last ``capacity`` calls (``GRADSYNC_FLIGHT_ENTRIES``, default
2000): sequence number (the call's ordinal on the communicator, equal on every
rank of a correct program), op, algorithm (as resolved: ``auto (ring)``),
dtype, shape, bytes, a context label (DataParallel: ``bucket 3``), state
(started, waiting on peer r, done, failed with the error's short text) and
start/end times on both clocks (wall clock, to line up the ranks of several
machines; monotonic, for durations). NCCL's and PyTorch's flight recorder are
the model.

Cost: the entries are the calls themselves (``CollectiveCall`` is a
:class:`FlightEntry`), so recording a call costs one list store when it starts,
one attribute store per wait on a peer and one clock read when it ends; no
dict, no lock (a communicator runs one call at a time, on its lane). Times
are measured by ``python -m gradsync.bench.flight_cost``.

On a :class:`~gradsync.errors.CollectiveTimeoutError` or
:class:`~gradsync.errors.CollectiveMismatchError` raised from a collective,
the rank writes its ring to ``<folder>/rank-<rank>.json`` (atomically: a
temporary file, then a rename) and sets ``error.flight_dump`` to that path. The
folder is :attr:`FlightRecorder.folder` (``gradsync train``: ``<run
folder>/flight``), else ``$GRADSYNC_FLIGHT_DIR`` read at that moment, else none:
nothing is written (a library user who did not ask for files gets none),
and :meth:`FlightRecorder.records` (``gradsync.flight_records()``) still
reads the ring. ``gradsync debug DIR`` (:mod:`~gradsync.debug.analyze`)
reads every rank's file.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path

from gradsync.errors import CollectiveMismatchError, CollectiveTimeoutError

DEFAULT_ENTRIES = 2000
ENTRIES_ENV = "GRADSYNC_FLIGHT_ENTRIES"
FOLDER_ENV = "GRADSYNC_FLIGHT_DIR"
FLIGHT_FOLDER = "flight"  # the dumps' folder inside a gradsync train run folder
FORMAT = "gradsync-flight/1"
DUMPED_ERRORS = (CollectiveTimeoutError, CollectiveMismatchError)
SHORT_ERROR_CHARS = 240  # of an error's text kept in its record (the dump keeps the whole text once)
STATES = ("started", "waiting", "done", "failed")


def dump_name(rank: int) -> str:
    """The file name of ``rank``'s dump: ``rank-3.json``."""
    return f"rank-{rank}.json"


class FlightEntry:
    """What the recorder reads from a call; the defaults are class attributes, so a call that never
    waits, fails or gets a label pays nothing for those fields.

    Set when the call starts: ``ordinal`` (sequence number), ``op_name``, ``algorithm``,
    ``started_wall`` (``time.time()``, seconds), ``started_mono`` (``time.monotonic()``, seconds);
    by the argument checks (``validate.start_call``): ``dtype``, ``shape`` (the tensor's,
    ``torch.Size``); by the recorder: ``label``,
    ``ended_mono``, ``error`` (short text), ``blamed`` (the rank a timeout names), ``timed_out`` (a timeout's
    kind: True, the peer was silent; False, its connection closed); by every wait:
    ``waiting_on`` (the group rank waited for, -1: none yet).
    """

    ordinal = 0
    op_name = ""
    algorithm = ""
    started_wall = 0.0
    started_mono = 0.0
    dtype = None
    shape = None
    label: str | None = None
    waiting_on = -1
    ended_mono: float | None = None
    error: str | None = None
    blamed: int | None = None
    timed_out: bool | None = None


def short_error(error: BaseException) -> str:
    """``"CollectiveTimeoutError: <first line, at most SHORT_ERROR_CHARS characters>"``."""
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0] if text else ''}"
    return line if len(line) <= SHORT_ERROR_CHARS else line[:SHORT_ERROR_CHARS - 1] + "…"


def entries_from_env() -> int:
    """``GRADSYNC_FLIGHT_ENTRIES`` (default ``DEFAULT_ENTRIES``).

    Raises:
        ValueError: it is not an integer >= 1 (the recorder is always on).
    """
    value = os.environ.get(ENTRIES_ENV, "").strip()
    if not value:
        return DEFAULT_ENTRIES
    try:
        entries = int(value)
    except ValueError:
        entries = 0
    if entries < 1:
        raise ValueError(f"{ENTRIES_ENV}={value!r} must be an integer >= 1 (the number of collective calls "
                         f"each rank's flight recorder keeps; default {DEFAULT_ENTRIES})")
    return entries


class FlightRecorder:
    """The last ``capacity`` calls of one communicator on this rank.

    Args:
        rank, world_size: this rank and the group size (written into the dump).
        capacity: calls kept (None: ``GRADSYNC_FLIGHT_ENTRIES``, default 2000); older ones are dropped.
        folder: where :meth:`dump` writes (None: ``$GRADSYNC_FLIGHT_DIR`` at dump time, else nowhere).

    Attributes:
        label: a context label given to the calls started while it is set (``"bucket 3"``), or None;
            the owner of the calls sets it and resets it after (DataParallel's reducer).

    Raises:
        ValueError: ``capacity`` (or the environment variable) is not an integer >= 1.
    """

    def __init__(self, rank: int, world_size: int, capacity: int | None = None, folder: str | Path | None = None):
        capacity = entries_from_env() if capacity is None else capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        self.rank = rank
        self.world_size = world_size
        self.capacity = capacity
        self.folder = folder
        self.label: str | None = None
        self._entries: list[FlightEntry | None] = [None] * capacity  # slot = ordinal % capacity

    def enter(self, entry: FlightEntry) -> None:
        """Keep ``entry`` (a call that just started; ordinals increase by one per call)."""
        self._entries[entry.ordinal % self.capacity] = entry
        if self.label is not None:
            entry.label = self.label

    def _span(self, first: int, last: int):
        """The kept entries with ordinals ``first..last`` that have not ended."""
        entries, capacity = self._entries, self.capacity
        for ordinal in range(max(first, last - capacity + 1), last + 1):
            entry = entries[ordinal % capacity]
            if entry is not None and entry.ordinal == ordinal and entry.ended_mono is None:
                yield entry

    def finish_last(self, ordinal: int) -> None:
        """Mark the call ``ordinal`` done, now: the last one entered (the usual case, one call per collective)."""
        self._entries[ordinal % self.capacity].ended_mono = time.monotonic()

    def finish(self, first: int, last: int) -> None:
        """Mark the calls ``first..last`` (ordinals, inclusive) done, now (those not ended yet)."""
        now = time.monotonic()
        for entry in self._span(first, last):
            entry.ended_mono = now

    def fail(self, first: int, last: int, error: BaseException) -> Path | None:
        """Mark the calls ``first..last`` failed with ``error``; for a timeout or mismatch, :meth:`dump`.

        Returns the dump's path (None: not dumped). ``error.flight_dump`` is set to it, and an
        error that already has a dump (nested collectives) is not dumped again.
        """
        now, text = time.monotonic(), short_error(error)
        timeout = isinstance(error, CollectiveTimeoutError)
        for entry in self._span(first, last):
            entry.ended_mono, entry.error = now, text
            if timeout:
                entry.blamed, entry.timed_out = error.peer, error.timed_out
            else:
                entry.waiting_on = -1  # it failed on what the ranks said, not waiting on a peer
        if not isinstance(error, DUMPED_ERRORS) or getattr(error, "flight_dump", None) is not None:
            return None
        path = self.dump(error)
        if path is not None:
            error.flight_dump = path
        return path

    def records(self) -> list[dict]:
        """The kept calls, oldest first, as dicts (the dump's ``records``; see :func:`record_of`)."""
        anchor = (time.time(), time.monotonic())
        kept = sorted((entry for entry in self._entries if entry is not None), key=lambda entry: entry.ordinal)
        return [record_of(entry, anchor) for entry in kept]

    def target(self) -> Path | None:
        """Where :meth:`dump` would write now (None: no folder is set)."""
        folder = self.folder or os.environ.get(FOLDER_ENV, "").strip() or None
        return Path(folder) / dump_name(self.rank) if folder else None

    def dump(self, error: BaseException | None = None) -> Path | None:
        """Write the ring to :meth:`target` atomically; return its path (None: no folder, or writing
        failed: then one line on stderr says why, and the caller's error is not masked)."""
        path = self.target()
        if path is None:
            return None
        header = {"format": FORMAT, "rank": self.rank, "world_size": self.world_size,
                  "hostname": socket.gethostname(), "pid": os.getpid(),
                  "error": None if error is None else {"type": type(error).__name__, "message": str(error)},
                  "capacity": self.capacity,
                  "calls_started": max((entry.ordinal for entry in self._entries if entry is not None), default=0),
                  "written_wall": time.time(), "written_monotonic": time.monotonic()}
        records = self.records()
        try:
            _write_atomically(path, header, records)
        except (OSError, TypeError, ValueError) as exc:  # never mask the collective's own error
            print(f"gradsync: rank {self.rank} could not write its flight record to {path}: {exc}", file=sys.stderr)
            return None
        print(f"gradsync: rank {self.rank} wrote its flight record (last {len(records)} collective calls) to "
              f"{path}; read every rank's with: gradsync debug {path.parent}", file=sys.stderr)
        return path


def state_of(entry: FlightEntry) -> tuple[str, int | None]:
    """(one of ``STATES``, the peer rank it waited on or None)."""
    peer = entry.waiting_on if entry.waiting_on >= 0 else None
    if entry.error is not None:
        return "failed", peer
    if entry.ended_mono is not None:
        return "done", None
    return ("waiting", peer) if peer is not None else ("started", None)


def record_of(entry: FlightEntry, anchor: tuple[float, float]) -> dict:
    """One entry as a JSON-ready dict; ``anchor``: (``time.time()``, ``time.monotonic()``) read together,
    which turns the end's monotonic time into wall-clock time."""
    state, peer = state_of(entry)
    shape = list(entry.shape) if entry.shape is not None else None
    itemsize = getattr(entry.dtype, "itemsize", None)
    ended = entry.ended_mono
    return {"seq": entry.ordinal, "op": entry.op_name, "algorithm": entry.algorithm, "label": entry.label,
            "dtype": str(entry.dtype).replace("torch.", "") if entry.dtype is not None else None,
            "shape": shape, "nbytes": math.prod(shape) * itemsize if shape is not None and itemsize else None,
            "state": state, "peer": peer, "blamed": entry.blamed, "timed_out": entry.timed_out, "error": entry.error,
            "start_wall": entry.started_wall, "start_monotonic": entry.started_mono,
            "end_wall": None if ended is None else anchor[0] - (anchor[1] - ended), "end_monotonic": ended}


def _write_atomically(path: Path, header: dict, records: list[dict]) -> None:
    """Write the dump: the header and ``"records": [`` on the first line, then one record per line, so
    that a reader can still use the lines of a file cut short (:mod:`~gradsync.debug.analyze`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    lines = [json.dumps(header)[:-1] + ', "records": [']
    lines += [json.dumps(record) + ("," if index < len(records) - 1 else "") for index, record in enumerate(records)]
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write("\n".join(lines) + "\n]}\n")
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


__all__ = ["DEFAULT_ENTRIES", "DUMPED_ERRORS", "ENTRIES_ENV", "FLIGHT_FOLDER", "FOLDER_ENV", "FORMAT", "FlightEntry",
           "FlightRecorder", "STATES", "dump_name", "entries_from_env", "record_of", "short_error", "state_of"]
