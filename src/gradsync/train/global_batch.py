"""The data order of ``--global-batch-size``: one permutation per epoch, cut into global batches, then split.

With ``--global-batch-size B`` the samples of an optimizer step do not depend
on the world size: epoch ``e`` shuffles the whole training split with a
generator seeded ``seed + e`` (the permutation ``DistributedSampler`` draws),
step ``i`` of the epoch takes ``permutation[i*B:(i+1)*B]`` (the last partial
batch is dropped), and the global batch is then split in contiguous pieces as
``torch.tensor_split`` splits it: into world_size shares and each share into
``accumulate`` micro-batches, or (``--deterministic``) into the micro-shards.

>>> batches = list(global_batches(10, 4, seed=0, epoch=0))
>>> [len(batch) for batch in batches], len(set(torch.cat(batches).tolist()))  # 2 steps, no sample twice
([4, 4], 8)
>>> [part.tolist() for part in split_contiguous(torch.arange(6), 3)]
[[0, 1], [2, 3], [4, 5]]
"""

from __future__ import annotations

from typing import Iterator

import torch


def epoch_permutation(num_train: int, seed: int, epoch: int) -> torch.Tensor:
    """``(num_train,)`` int64: the epoch's order of the training samples, the same on every rank."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_train, generator=generator)


def global_batches(num_train: int, global_batch_size: int, seed: int, epoch: int) -> Iterator[torch.Tensor]:
    """The epoch's global batches, ``(global_batch_size,)`` int64 sample indices each, in step order."""
    permutation = epoch_permutation(num_train, seed, epoch)
    for step in range(num_train // global_batch_size):
        yield permutation[step * global_batch_size:(step + 1) * global_batch_size]


def split_contiguous(indices: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``indices`` in ``parts`` contiguous pieces (``torch.tensor_split``: sizes differ by at most one)."""
    return list(torch.tensor_split(indices, parts))


def worker_micro_batches(batch: torch.Tensor, world_size: int, rank: int, accumulate: int) -> list[torch.Tensor]:
    """This rank's ``accumulate`` micro-batches of a global ``batch``: its contiguous share, split again."""
    return split_contiguous(split_contiguous(batch, world_size)[rank], accumulate)
