"""Micro-shards: a global batch cut into a fixed number of pieces whatever the world size.

A *micro-shard* is the unit whose gradient is computed on its own (one
forward and backward over the same samples, on whichever rank holds it), so
its bits do not depend on the placement. A global batch of ``B`` samples is
cut into ``M`` micro-shards as ``torch.tensor_split`` cuts it (the first
``B % M`` hold one sample more); ranks hold contiguous blocks of
micro-shards, sizes differing by at most one (a rank may hold none when
``M < world_size``). Any other placement gives the same result, as long as
every micro-shard is computed exactly once per step.

>>> micro_shard_bounds(10, 4)
[(0, 3), (3, 6), (6, 8), (8, 10)]
>>> [list(contiguous_placement(4, 3, rank)) for rank in range(3)]
[[0, 1], [2], [3]]
"""

from __future__ import annotations

import hashlib

from gradsync.collectives.chunking import chunk_bounds


def micro_shard_bounds(num_samples: int, num_micro_shards: int) -> list[tuple[int, int]]:
    """``(start, stop)`` sample offsets of each micro-shard of a global batch of ``num_samples``.

    Raises:
        ValueError: ``num_samples`` < 0 or ``num_micro_shards`` < 1.
    """
    if num_micro_shards < 1:
        raise ValueError(f"num_micro_shards must be >= 1, got {num_micro_shards}")
    return chunk_bounds(num_samples, num_micro_shards)


def contiguous_placement(num_micro_shards: int, world_size: int, rank: int) -> range:
    """The micro-shard indices rank ``rank`` holds: its contiguous block (sizes differ by at most one).

    Raises:
        ValueError: ``rank`` not in ``[0, world_size)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    start, stop = chunk_bounds(num_micro_shards, world_size)[rank]
    return range(start, stop)


def shard_seed(seed: int, step: int, index: int) -> int:
    """The torch seed of micro-shard ``index`` at ``step``: a 63-bit hash of the three, the same on every rank.

    Dropout masks drawn under it depend on the micro-shard, not on the rank that computes it.

    >>> shard_seed(0, 5, 2) == shard_seed(0, 5, 2) != shard_seed(0, 5, 3)
    True
    """
    digest = hashlib.blake2b(f"gradsync-micro-shard:{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
