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

import torch
from torch import nn

from gradsync.collectives import ops as collectives
from gradsync.collectives.chunking import chunk_bounds
from gradsync.parallel.exact_sum import precision_bits


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


class MicroShard:
    """What ``micro_shard()`` yields: its ``index`` and :meth:`backward`, which records the loss too."""

    def __init__(self, index: int):
        self.index = index
        self.loss: float | None = None
        self.backwards = 0

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, keeping the loss (a scalar, summed over the micro-shard's samples) for synchronize."""
        loss.backward()
        self.backwards += 1
        self.loss = float(loss.detach())


def check_arguments(module, num_micro_shards, algorithm, seed, owner: str) -> None:
    """This rank's argument checks (TypeError / ValueError naming the argument)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{owner} wraps a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(num_micro_shards, int) or isinstance(num_micro_shards, bool) or num_micro_shards < 1:
        raise ValueError(f"num_micro_shards must be an int >= 1, got {num_micro_shards!r}")
    precision_bits(num_micro_shards)
    collectives.validate_algorithm(algorithm)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    for name, param in module.named_parameters():
        if param.requires_grad and not param.is_floating_point():
            raise TypeError(f"{owner}: parameter {name!r} is {param.dtype}; gradients must be floating point")
    for name, child in module.named_modules():
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and child.track_running_stats:
            raise ValueError(f"{owner}: {name or 'the module'!r} ({type(child).__name__}) updates running statistics "
                             "in every forward, so they would follow the micro-shards each rank ran; use "
                             "track_running_stats=False, GroupNorm or LayerNorm")
