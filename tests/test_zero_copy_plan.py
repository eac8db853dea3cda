"""``collectives.zero_copy_plan``: which DataParallel buckets live in an algorithm's shared storage.

The rule it took over from the reducer: a bucket gets storage when the
algorithm that reduces it offers zero-copy storage for its dtype (shm:
float32/float64 on CPU), it holds at least one byte, and the group shares
memory; under ``auto`` only the buckets ``auto`` resolves to shm for their
size; never for ring. Thread ranks of one process share one host.
"""

from __future__ import annotations

import torch

from _dist import run_threads
from gradsync.collectives import ops
from gradsync.collectives.communicator import Communicator
from gradsync.transport.thread import ThreadWorld

WORLD_SIZE = 2
CPU = torch.device("cpu")
BUCKETS = [(16, torch.float32, CPU), (2**14, torch.float32, CPU), (2**18, torch.float64, CPU),
           (100, torch.float16, CPU), (0, torch.float32, CPU), (2**20 + 3, torch.float32, CPU)]


def _storage_bytes(storages):
    return [None if storage is None else (storage.dtype, storage.numel()) for storage in storages]


def _rank_plans(comm):
    plans = {name: ops.zero_copy_plan(comm, BUCKETS, name) for name in ("shm", "auto", "ring")}
    auto_picks = [ops.resolve_algorithm(comm, numel * dtype.itemsize, "auto") for numel, dtype, _ in BUCKETS]
    return ({name: _storage_bytes(storages) for name, storages in plans.items()}, auto_picks,
            [[(s.data_ptr(), s.data_ptr() + s.numel()) for s in storages if s is not None]
             for storages in plans.values()])


def test_zero_copy_plan_places_the_buckets_the_reducer_placed():
    """shm: every non-empty float32/float64 CPU bucket, 64-byte rounded; auto: those of them that auto
    resolves to shm; ring: none. Ranges never overlap, on every rank."""
    for rank, (plans, auto_picks, spans) in enumerate(run_threads(WORLD_SIZE, _rank_plans, timeout_s=60)):
        eligible = [numel > 0 and dtype in (torch.float32, torch.float64) for numel, dtype, _ in BUCKETS]
        rounded = [(torch.uint8, -(-numel * dtype.itemsize // 64) * 64) for numel, dtype, _ in BUCKETS]
        assert plans["shm"] == [size if ok else None for size, ok in zip(rounded, eligible)], f"rank {rank}"
        assert plans["auto"] == [size if ok and pick == "shm" else None
                                 for size, ok, pick in zip(rounded, eligible, auto_picks)], f"rank {rank}"
        assert plans["ring"] == [None] * len(BUCKETS), f"rank {rank}"
        every = sorted(span for plan_spans in spans for span in plan_spans)
        assert all(end <= start for (_, end), (start, _) in zip(every, every[1:])), f"rank {rank}: overlap"


def test_zero_copy_plan_of_one_rank_is_none_everywhere():
    """A world of one rank communicates nothing: no bucket needs shared storage."""
    comm = Communicator(ThreadWorld(1).transport(0))
    assert ops.zero_copy_plan(comm, BUCKETS, "shm") == [None] * len(BUCKETS)
