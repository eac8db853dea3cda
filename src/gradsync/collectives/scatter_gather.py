"""In-place reduce-scatter and all-gather of a flat buffer, for callers whose layouts are agreed (ZeRO shards).

DataParallel's sharded levels reduce-scatter each gradient bucket and
all-gather each parameter bucket in place, as its AllReduce buckets are
reduced: layouts were compared once at construction, so no call here
compares them again (as :func:`~gradsync.collectives.ops.average`).
"""

from __future__ import annotations

import torch

from gradsync.collectives.chunking import chunk_bounds
from gradsync.collectives.communicator import Communicator
from gradsync.collectives.ops import without_grad
from gradsync.collectives.registry import ALL_GATHER, REDUCE_SCATTER
from gradsync.collectives.validate import start_call

_FALLBACK = "ring"


def _algorithm_for(table: dict, algorithm: str) -> str:
    return algorithm if algorithm in table else _FALLBACK


@without_grad
def reduce_scatter_flat(flat: torch.Tensor, comm: Communicator, *, algorithm: str = _FALLBACK,
                        timeout: float | None = None) -> tuple[int, int]:
    """Sum ``flat`` over the ranks so that this rank's chunk holds the sum; return the chunk's ``(start, stop)``.

    Args:
        flat: ``(numel,)`` contiguous float32/float64/int64 tensor, modified in place; only this rank's chunk
            (``torch.tensor_split`` bounds) is meaningful afterwards.
        algorithm: a name in ``gradsync.ALGORITHMS``.

    Collective: every rank calls it in the same order with equal numel and dtype (not compared here).
    """
    chunks = chunk_bounds(flat.numel(), comm.world_size)
    if comm.world_size == 1 or flat.numel() == 0:
        return chunks[comm.rank]
    started = start_call(comm, flat, "reduce_scatter", algorithm=_algorithm_for(REDUCE_SCATTER, algorithm),
                         timeout=timeout, verify=False)
    return REDUCE_SCATTER[started.algorithm](flat, started.call)


@without_grad
def all_gather_flat(flat: torch.Tensor, comm: Communicator, *, algorithm: str = _FALLBACK,
                    timeout: float | None = None) -> None:
    """Fill every chunk of ``flat`` from the rank that owns it (rank r owns chunk r, ``torch.tensor_split`` bounds).

    Args:
        flat: ``(numel,)`` contiguous tensor of any supported dtype whose chunk ``rank`` is valid; the others
            are overwritten in place.
        algorithm: a name in ``gradsync.ALGORITHMS``.

    Collective: every rank calls it in the same order with equal numel and dtype (not compared here).
    """
    if comm.world_size == 1 or flat.numel() == 0:
        return
    started = start_call(comm, flat, "all_gather", algorithm=_algorithm_for(ALL_GATHER, algorithm),
                         timeout=timeout, verify=False)
    ALL_GATHER[started.algorithm](flat, started.call)
