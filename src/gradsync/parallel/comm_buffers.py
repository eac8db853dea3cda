"""The communication buffers one rank holds at each shard level, from the constants the collectives use.

Estimated without a group (the preflight runs before one exists or without
touching it), per rank and in bytes:

* **gradient buckets** (:mod:`~gradsync.parallel.bucketing`'s assignment at
  ``bucket_cap_mb``, the first bucket capped at 1 MiB, the last one carrying
  the used flags): whole under ``shard="none"`` and ``"optimizer"`` (padded
  to a multiple of the world size there), two slabs of the largest bucket
  under ``"gradients"``, two slabs of the largest unit under ``"parameters"``;
* **shared memory** when the buckets' AllReduce is ``shm`` (``auto`` on one
  host picks it for every bucket size here), counted as the pages the rank
  writes, which is what the kernel charges it (a page of a segment is
  allocated once, when it is first written, and the peers that read it add
  nothing): in the group's segment (:mod:`~gradsync.transport.shm_segment`)
  its counter line and two mailboxes (``MAILBOX_BYTES``: the small
  collectives' lean path) and, where messages go through the regions (the
  sharded levels' reduce-scatter and all-gather, an AllReduce not in the
  arena), one cell (``DEFAULT_CELL_BYTES``, or the largest bucket if
  smaller) in each of its two region sets; under ``"none"``, its slot of the
  arena that holds the zero-copy buckets
  (:func:`~gradsync.collectives.shm.allocate_shared`: each bucket 64-byte
  aligned), taken twice: the bucket rebuild after the first backward lays
  the buckets out again in fresh arena storage and the first layout stays
  reserved until the group closes;
* **workspace** of the other algorithms (:class:`~gradsync.collectives.call.Workspace`):
  ``ring`` receives four segments ahead (``ring.IN_FLIGHT``) (``DEFAULT_SEGMENT_BYTES`` or a
  chunk, the smaller), the others up to one message.

A world of one rank communicates nothing: its buckets are the only buffers.
"""

from __future__ import annotations

from gradsync.collectives import auto
from gradsync.collectives.chunking import DEFAULT_SEGMENT_BYTES
from gradsync.collectives.registry import AUTO, DEFAULT_ALGORITHM, SEGMENTED, ZERO_COPY
from gradsync.collectives.shm import ARENA_ALIGN
from gradsync.collectives.shm_setup import DEFAULT_CELL_BYTES, MAILBOX_BYTES
from gradsync.parallel.bucketing import padded_numel
from gradsync.parallel.zero import ZERO2_SLABS, ZERO3_SLABS
from gradsync.parallel.sync_round import flag_count
from gradsync.transport.shm_segment import DEFAULT_REGION_BYTES, LINE_BYTES, MAILBOX_SLOTS

PAGE_BYTES = 4096
RING_IN_FLIGHT = 4  # ring.py's IN_FLIGHT: segments received ahead


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def resolved_algorithm(algorithm: str, nbytes: int, world_size: int, one_host: bool) -> str:
    """What ``algorithm`` runs for a bucket of ``nbytes`` bytes: itself, or ``auto``'s pick
    (:func:`gradsync.collectives.auto.choose` for one host, or for ``world_size`` hosts of one rank)."""
    if algorithm != AUTO:
        return algorithm
    sizes = None if one_host else (1,) * world_size
    try:
        return auto.choose(nbytes, world_size, world_size if one_host else 1, shm_available=one_host or None,
                           host_sizes=sizes)
    except ValueError:  # the profile in use knows no link between hosts: the default algorithm's buffers then
        return DEFAULT_ALGORITHM


def bucket_bytes(numels: list[int], itemsize: int, world_size: int, padded: bool, num_params: int) -> list[int]:
    """Each bucket's buffer in bytes: its ``numels`` gradients, padded to a multiple of ``world_size`` when
    ``padded`` (sharded), the last one with the used flags of ``num_params`` parameters."""
    flags = flag_count(num_params, world_size)
    sizes = [padded_numel(numel, world_size) if padded else numel for numel in numels]
    if sizes:
        sizes[-1] += flags
    return [size * itemsize for size in sizes]


def group_segment_share(message_bytes: int) -> int:
    """The pages of the group's shm segment one rank writes: its counter line, its two mailboxes and, when
    ``message_bytes`` > 0 go through the regions, up to one cell of them in each of its two region sets."""
    cell = min(DEFAULT_CELL_BYTES, DEFAULT_REGION_BYTES, message_bytes)
    return LINE_BYTES + MAILBOX_SLOTS * MAILBOX_BYTES + 2 * _pages(cell)


def arena_share(buckets: list[int]) -> int:
    """The pages of the arena one rank writes when it holds ``buckets`` (bytes each) as zero-copy buckets."""
    return _pages(sum(-(-size // ARENA_ALIGN) * ARENA_ALIGN for size in buckets))


def buffer_bytes(shard: str, buckets: list[int], largest_unit: int, world_size: int, algorithm: str,
                 one_host: bool, dtype_ok: bool) -> int:
    """One rank's communication buffers at ``shard`` (see the module's docstring).

    Args:
        buckets: each bucket's bytes (:func:`bucket_bytes`, padded for the sharded levels).
        largest_unit: bytes of the largest ZeRO-3 unit (``shard="parameters"`` only).
        algorithm: the buckets' AllReduce (``auto`` resolved per bucket).
        one_host: whether every rank runs on this machine.
        dtype_ok: whether the gradients' dtype and device let shm reduce them in place (CPU float32/64).
    """
    slabs = {"none": sum(buckets), "optimizer": sum(buckets),
             "gradients": min(ZERO2_SLABS, len(buckets)) * max(buckets, default=0),
             "parameters": ZERO3_SLABS * largest_unit}[shard]
    if world_size == 1 or not buckets:
        return slabs
    names = {resolved_algorithm(algorithm, size, world_size, one_host) for size in buckets}
    total, largest = slabs, max(buckets)
    if names & set(ZERO_COPY) and one_host:
        in_arena = shard == "none" and dtype_ok  # zero-copy: the buckets live in the arena, laid out twice
        total += group_segment_share(0 if in_arena else largest)
        if in_arena:
            total += 2 * arena_share(buckets) - slabs
    if names & SEGMENTED:
        total += RING_IN_FLIGHT * min(DEFAULT_SEGMENT_BYTES, -(-largest // world_size))
    if names - set(ZERO_COPY) - SEGMENTED:
        total += largest
    return total


__all__ = ["arena_share", "bucket_bytes", "buffer_bytes", "group_segment_share",
           "resolved_algorithm"]
