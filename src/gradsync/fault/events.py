"""``events.jsonl`` in the run folder: faults, their detection, checkpoints and resumes, with wall-clock times.

Every rank may append (one ``write`` of one line on a file opened with
``O_APPEND``, so lines from several processes never interleave). Records:
``{"event": "fault", "fault": "kill"|"hang", "rank", "step", "attempt", "time"}``,
``{"event": "detected", "rank", "peer", "error", "attempt", "time"}``,
``{"event": "checkpoint", "step", "seconds", "attempt", "time"}``,
``{"event": "resumed", "from_step", "checkpoint", "attempt", "time"}``.
``time`` is ``time.time()`` (seconds since the epoch), comparable across
processes of one machine.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Append-only event records; a folder that does not exist (another node's) is silently skipped."""

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / EVENTS_FILE

    def write(self, record: dict) -> None:
        if not self.path.parent.is_dir():
            return
        line = (json.dumps({**record, "time": time.time()}) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError:
            pass  # the record is diagnostic; training must not fail for it


def read_events(folder: str | Path) -> list[dict]:
    path = Path(folder) / EVENTS_FILE
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]
