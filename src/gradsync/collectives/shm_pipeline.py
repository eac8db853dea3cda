"""Cache-sized pipelining of the shm AllReduce through the group segment's regions.

A message is cut into cells of ``ShmState.cell_bytes`` (each rank's share
of a cell small enough to stay in cache while it is copied in, reduced and
copied out); successive cells alternate between the segment's two region
sets, so a rank copies cell i+1 in while a slower rank still reads cell i.

Two ways to reduce a cell, chosen by world size (``REDUCE_ALL_MAX_RANKS``,
measured: ``gradsync bench allreduce``):

* **reduce-all** (small groups): every rank copies its cell in; one barrier;
  every rank sums every rank's copy straight into its output, in rank
  order (:func:`sum_rows`). One barrier and two
  passes over the payload per cell (copy in, reduce out); the p-fold reads
  come from cache. Each rank runs the same reduction on the same bytes, so
  the results are bitwise equal.
* **reduce-scatter + all-gather** (larger groups): copy in; barrier; rank r
  sums chunk r of every copy into its own region, ranks in a fixed order;
  barrier; every rank copies every chunk out of its owner's region. Two
  barriers, each chunk summed once (p-fold compute would cost more than a
  barrier there).

Bytes moved through memory per payload byte, per rank (the model behind the
benchmark's bound, ``gradsync bench allreduce``): reduce-all reads its input
and writes its output once from memory (2, plus the write's read for
ownership: 3), everything else stays in cache; the old whole-region design
moved 4 MiB slices through memory three times (~11 at world size 2).
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import chunk_bounds
from gradsync.collectives.shm_setup import barrier
from gradsync.transport.shm_segment import ShmSegment

REDUCE_ALL_MAX_RANKS = 4


def next_set(segment: ShmSegment) -> int:
    """The region set of the next slice or cell (alternating, across calls and collectives)."""
    segment.slice_counter += 1
    return segment.slice_counter % 2


def cells(numel: int, cell_numel: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each cell of ``numel`` elements (the last one may be shorter)."""
    return [(start, min(start + cell_numel, numel)) for start in range(0, numel, cell_numel)]


def all_reduce(flat: torch.Tensor, call: CollectiveCall, segment: ShmSegment, cell_bytes: int,
               after_first_barrier=None) -> None:
    """Sum ``flat`` (``(numel,)``, contiguous) over the ranks, in place, cell by cell.

    ``after_first_barrier``: called once every rank copied its first cell in (a check of what the
    ranks posted before it; it raises on every rank alike).

    Collective: every rank calls it in the same order with equal ``numel``, dtype and ``cell_bytes``.

    Raises:
        CollectiveTimeoutError: a rank did not reach a barrier (named; a dead one at once).
    """
    cell_numel = max(1, min(cell_bytes, segment.region_bytes) // flat.element_size())
    reduce_cell = _reduce_all if call.world_size <= REDUCE_ALL_MAX_RANKS else _reduce_scatter_gather
    for start, stop in cells(flat.numel(), cell_numel):
        reduce_cell(flat[start:stop], call, segment, next_set(segment), after_first_barrier)
        after_first_barrier = None


def _reduce_all(part: torch.Tensor, call: CollectiveCall, segment: ShmSegment, set_index: int,
                after_barrier=None) -> None:
    every_rank = segment.regions(set_index, part.dtype)[:, :part.numel()]
    every_rank[call.rank].copy_(part)
    barrier(segment, call, "shm all_reduce (cell copied in)")
    if after_barrier is not None:
        after_barrier()
    sum_rows(every_rank, part)


def sum_rows(every_rank, out: torch.Tensor) -> None:
    """``out`` = row 0 + row 1 + ... of ``every_rank`` (a ``(world_size, n)`` tensor or a list of
    ``world_size`` tensors shaped like ``out``), added in rank order.

    Pairwise ``torch.add`` rather than ``torch.sum(dim=0)``, which is 3-4x slower over rows this far
    apart (measured: 40 against 12 us for two rows of 64 Ki float32)."""
    torch.add(every_rank[0], every_rank[1], out=out)
    for row in range(2, len(every_rank)):
        out.add_(every_rank[row])


def _reduce_scatter_gather(part: torch.Tensor, call: CollectiveCall, segment: ShmSegment, set_index: int,
                           after_barrier=None) -> None:
    rank, world_size, numel = call.rank, call.world_size, part.numel()
    every_rank = segment.regions(set_index, part.dtype)[:, :numel]
    every_rank[rank].copy_(part)
    barrier(segment, call, "shm all_reduce (cell copied in)")
    if after_barrier is not None:
        after_barrier()
    chunks = chunk_bounds(numel, world_size)
    a, b = chunks[rank]
    mine = every_rank[rank, a:b]
    for offset in range(1, world_size):
        mine += every_rank[(rank + offset) % world_size, a:b]
    barrier(segment, call, "shm all_reduce (cell reduced)")
    for peer, (a, b) in enumerate(chunks):
        part[a:b] = every_rank[peer, a:b]
