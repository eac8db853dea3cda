"""A per-rank timeline of spans, written as a Chrome trace (chrome://tracing, Perfetto).

Each rank records spans (forward, backward, each bucket's AllReduce, the
optimizer step) with ``time.perf_counter`` and converts them to wall-clock
microseconds on export, so ranks on one machine line up. Spans export as a
fixed-layout float64 tensor (:meth:`Timeline.rows`), which a trainer can
all-gather to rank 0 without pickling; :func:`trace_events` turns every
rank's rows into one trace with one process track per rank ("rank 0", ...)
and one thread row per thread ("main", "comm"). Format: the Trace Event
Format's complete events (``"ph": "X"``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterable

import torch

KINDS = ("forward", "backward", "optimizer", "allreduce", "eval", "average")
THREADS = ("main", "comm")
ROW_NUMEL = 6  # kind, thread, start (wall-clock µs), duration (µs), bucket (-1: none), bytes


class Timeline:
    """Spans recorded by one rank. Appending is thread-safe (the comm thread records buckets)."""

    def __init__(self, rank: int):
        self.rank = rank
        self._spans: list[tuple[int, int, float, float, int, int]] = []
        self._wall_offset_s = time.time() - time.perf_counter()

    def add(self, kind: str, start_s: float, end_s: float, thread: str = "main",
            bucket: int = -1, nbytes: int = 0) -> None:
        """Record a span of ``kind`` (one of ``KINDS``); times are ``time.perf_counter()`` seconds."""
        self._spans.append((KINDS.index(kind), THREADS.index(thread), start_s, end_s, bucket, nbytes))

    def rows(self) -> torch.Tensor:
        """The spans as a ``(num_spans, ROW_NUMEL)`` float64 tensor with wall-clock microseconds."""
        table = torch.tensor([[kind, thread, (start + self._wall_offset_s) * 1e6,
                               max(end - start, 0.0) * 1e6, bucket, nbytes]
                              for kind, thread, start, end, bucket, nbytes in list(self._spans)],
                             dtype=torch.float64)
        return table.reshape(-1, ROW_NUMEL)


def trace_events(rows_per_rank: Iterable[torch.Tensor]) -> list[dict]:
    """Trace Event Format events for every rank's :meth:`Timeline.rows` (index = rank)."""
    events = []
    for rank, rows in enumerate(rows_per_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
                   for tid, name in enumerate(THREADS)]
        for kind, thread, start_us, duration_us, bucket, nbytes in rows.tolist():
            name = KINDS[int(kind)]
            args = {}
            if bucket >= 0:
                name = f"{name} bucket {int(bucket)}"
                args = {"bucket": int(bucket), "bytes": int(nbytes)}
            events.append({"name": name, "cat": KINDS[int(kind)], "ph": "X", "pid": rank,
                           "tid": int(thread), "ts": start_us, "dur": duration_us, "args": args})
    return events


def write_trace(path: Path, events: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, file)
