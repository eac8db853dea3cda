"""The memory-traffic bound of the shared-memory AllReduce, for ``gradsync bench allreduce``'s "of bound" column.

On one machine the shm designs are bound by the memory traffic of all ranks
together, so a row's bound is ``bytes_per_payload_byte(design, p) · p · n``
bytes over the machine's measured memory bandwidth (``measure_bandwidth``:
every rank copies a buffer too large for the caches at once; a copy moves
3 bytes per byte: the read, the write, and the read for ownership of the
written line). Per rank and payload byte (the models of the modules' docstrings):

* ``shm`` (:mod:`gradsync.collectives.shm_pipeline`; the lean path below
  64 KiB keeps everything in cache and is bound by latency instead): the
  caller's tensor is read once and written once, the cells stay in cache:
  3 bytes.
* ``shm_zero_copy`` (the data lies in the shared arena, reduced in place):
  the reduction reads every rank's copy of its chunk (1) and writes its
  chunk (2/p with the read for ownership), the copy-out reads the other
  chunks and writes them ((p-1)/p + 2(p-1)/p): 1 + 2/p + 3(p-1)/p bytes.

The fraction reported is bound time / measured time (1.0: at the bound).
"""

from __future__ import annotations

import time

import torch

from gradsync.collectives import ops
from gradsync.collectives.communicator import Communicator

BANDWIDTH_BUFFER_BYTES = 64 * 2**20  # per rank: twice the 32 MiB last-level cache of this machine, at least
COPY_TRAFFIC = 3  # bytes moved per byte copied (read, write, read for ownership)


def bytes_per_payload_byte(design: str, world_size: int) -> float | None:
    """Bytes of memory traffic per rank per payload byte of ``design`` (None: no model for it)."""
    p = world_size
    if design == "shm" or design.startswith("shm@"):
        return 3.0
    if design == "shm_zero_copy":
        return 1 + 2 / p + 3 * (p - 1) / p
    return None


def measure_bandwidth(comm: Communicator, repetitions: int = 3) -> float:
    """Bytes per second the machine's memory moves with every rank copying at once (collective).

    Every rank copies a ``BANDWIDTH_BUFFER_BYTES`` buffer between two barriers; traffic =
    ``COPY_TRAFFIC`` x bytes copied x ranks over the time from the first barrier to the second (so
    ranks that outnumber the cores, and copy in turns, count at the rate the machine gave them all),
    best of ``repetitions``.
    """
    source = torch.ones(BANDWIDTH_BUFFER_BYTES // 4)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch outside the timing
    best = float("inf")
    for _ in range(repetitions):
        ops.all_reduce(torch.zeros(1), comm, algorithm="native", verify=False)
        started = time.perf_counter()
        target.copy_(source)
        ops.all_reduce(torch.zeros(1), comm, algorithm="native", verify=False)
        seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        best = min(best, max(float(t) for t in ops.all_gather(seconds, comm)))
    return COPY_TRAFFIC * BANDWIDTH_BUFFER_BYTES * comm.world_size / best


def bound_fraction(design: str, world_size: int, nbytes: int, seconds: float, bandwidth: float) -> float | None:
    """Bound time / ``seconds`` for a call of ``nbytes`` of ``design`` (None: no model)."""
    per_byte = bytes_per_payload_byte(design, world_size)
    if per_byte is None or seconds <= 0 or bandwidth <= 0:
        return None
    return per_byte * world_size * nbytes / bandwidth / seconds
