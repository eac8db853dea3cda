"""A per-rank timeline of spans, written as a Chrome trace (chrome://tracing, Perfetto).

Each rank records spans (forward, backward, each bucket's AllReduce,
optimizer step) with ``time.perf_counter`` and converts them to wall-clock
microseconds when written, so the per-rank files of ranks on one machine line
up; :func:`merge_traces` joins them into one file with one process track per
rank ("rank 0", "rank 1", ...) and one thread row per thread ("main",
"comm"). Format: the Trace Event Format's complete events (``"ph": "X"``).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

THREAD_IDS = {"main": 0, "comm": 1}


class Timeline:
    """Spans recorded by one rank. Appending is thread-safe (the comm thread records buckets)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.spans: list[tuple[str, str, float, float, str, dict]] = []
        self._wall_offset_s = time.time() - time.perf_counter()

    def add(self, name: str, category: str, start_s: float, end_s: float, thread: str = "main",
            **args) -> None:
        """Record a span; ``start_s``/``end_s`` are ``time.perf_counter()`` seconds."""
        self.spans.append((name, category, start_s, end_s, thread, args))

    @contextmanager
    def span(self, name: str, category: str, thread: str = "main", **args):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, category, started, time.perf_counter(), thread, **args)

    def events(self) -> list[dict]:
        """Trace Event Format events: process/thread names, then one complete event per span."""
        events = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                   "args": {"name": f"rank {self.rank}"}},
                  {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
                   "args": {"sort_index": self.rank}}]
        events += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                    "args": {"name": thread}} for thread, tid in THREAD_IDS.items()]
        for name, category, start_s, end_s, thread, args in list(self.spans):
            events.append({"name": name, "cat": category, "ph": "X", "pid": self.rank,
                           "tid": THREAD_IDS.get(thread, len(THREAD_IDS)),
                           "ts": (start_s + self._wall_offset_s) * 1e6,
                           "dur": max(end_s - start_s, 0.0) * 1e6, "args": args})
        return events

    def write(self, path: Path) -> None:
        write_trace(path, self.events())


def write_trace(path: Path, events: Iterable[dict]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump({"traceEvents": list(events), "displayTimeUnit": "ms"}, file)


def merge_traces(paths: Iterable[Path], out_path: Path) -> int:
    """Write the events of every trace in ``paths`` into ``out_path``; return how many files were merged."""
    events, merged = [], 0
    for path in paths:
        with open(path, encoding="utf-8") as file:
            events += json.load(file)["traceEvents"]
        merged += 1
    write_trace(out_path, events)
    return merged
