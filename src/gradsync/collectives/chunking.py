"""Chunk arithmetic shared by every algorithm.

Nomenclature (Gloo's): a *chunk* is one rank's share of the flattened tensor;
a *segment* is the pipelining unit inside a chunk. Bounds are half-open
``(start, stop)`` element offsets. Chunks follow ``torch.tensor_split``: the
first ``numel % world_size`` chunks hold one element more, so chunk sizes
differ by at most one and a chunk may be empty when ``numel < world_size``.

>>> chunk_bounds(10, 4)
[(0, 3), (3, 6), (6, 8), (8, 10)]
>>> chunk_bounds(2, 3)
[(0, 1), (1, 2), (2, 2)]
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.collectives.options import AlgorithmOptions, check_count

DEFAULT_SEGMENT_BYTES = 4 * 2**20  # measured: 256 KiB halves ring busbw here, 4 MiB reaches native


@dataclass(frozen=True)
class SegmentOptions(AlgorithmOptions):
    """The pipelining unit of ring and tree (and of hierarchical's ring steps).

    Args:
        segment_bytes: bytes per segment (> 0; equal on every rank).

    Raises:
        TypeError: ``segment_bytes`` is not an int; ValueError: it is not positive.
    """

    segment_bytes: int = DEFAULT_SEGMENT_BYTES

    def __post_init__(self):
        check_count("segment_bytes", self.segment_bytes, minimum=1)

    def segment_numel(self, element_size: int) -> int:
        """Elements per pipelining segment (at least one)."""
        return max(1, self.segment_bytes // element_size)


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Split ``[0, numel)`` into ``world_size`` contiguous chunks as ``torch.tensor_split`` does.

    Raises:
        ValueError: ``numel`` is negative or ``world_size`` < 1.
    """
    if numel < 0 or world_size < 1:
        raise ValueError(f"need numel >= 0 and world_size >= 1, got {numel}, {world_size}")
    base, extra = divmod(numel, world_size)
    bounds = []
    start = 0
    for index in range(world_size):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def segment_bounds(start: int, stop: int, segment_numel: int) -> list[tuple[int, int]]:
    """Cut the chunk ``[start, stop)`` into segments of ``segment_numel`` (the last may be shorter).

    An empty chunk has no segments.

    >>> segment_bounds(10, 35, 10)
    [(10, 20), (20, 30), (30, 35)]
    >>> segment_bounds(4, 4, 8)
    []
    """
    if segment_numel < 1:
        raise ValueError(f"segment_numel must be >= 1, got {segment_numel}")
    return [(offset, min(offset + segment_numel, stop)) for offset in range(start, stop, segment_numel)]
