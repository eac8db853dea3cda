"""The one list of AllReduce algorithms: name -> function, and what each offers beyond it.

Adding an algorithm: write ``collectives/<name>.py`` with
``all_reduce(flat, call)`` (settings, if any, as an options class in the
same module, read with ``call.options(MyOptions)``), then add one line to
``ALL_REDUCE`` below. ``ALGORITHMS``, the public validation, the layout
check's codes and the CLI choices all come from this table. What an
algorithm needs or offers beyond that (its options in the layout check, a
group it cannot run on, other collectives, zero-copy storage) is data in the
tables after it (the reduce-scatter and all-gather an algorithm carries, or
why it has none), and a one-host fast path is data in
:mod:`~gradsync.collectives.fast_path` (its small-call plans meet the layout
check, which sits below this table): the generic entry
(:mod:`~gradsync.collectives.ops`, :mod:`~gradsync.collectives.validate`)
reads them and never names an algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gradsync.collectives import (broadcast, double_binary_tree, halving_doubling, hierarchical, hierarchical_shards,
                                  native, ring, shm, shm_shards, tree)
from gradsync.collectives.call import CollectiveCall

AllReduce = Callable[[torch.Tensor, CollectiveCall], None]

ALL_REDUCE: dict[str, AllReduce] = {
    "ring": ring.all_reduce,
    "tree": tree.all_reduce,
    "double_binary_tree": double_binary_tree.all_reduce,
    "halving_doubling": halving_doubling.all_reduce,
    "hierarchical": hierarchical.all_reduce,
    "shm": shm.all_reduce,
    "native": native.all_reduce,
}
AUTO = "auto"  # resolved by collectives.auto.choose, once per message size (validate.resolve_algorithm)
ALGORITHMS = tuple(ALL_REDUCE) + (AUTO,)
DEFAULT_ALGORITHM = "ring"  # all_reduce's, DataParallel's and LocalSGD's default

BROADCAST = {"tree": broadcast.broadcast, "shm": shm.broadcast}
"""Broadcast's algorithms; the first is the one ``algorithm=None`` runs."""

ReduceScatter = Callable[[torch.Tensor, CollectiveCall], "tuple[int, int]"]
REDUCE_SCATTER: dict[str, ReduceScatter] = {
    "ring": ring.reduce_scatter,
    "halving_doubling": halving_doubling.reduce_scatter,
    "hierarchical": hierarchical_shards.reduce_scatter,
    "shm": shm_shards.reduce_scatter,
    "native": native.reduce_scatter,
}
"""``reduce_scatter(flat, call) -> (start, stop)``: sum ``flat`` (``(numel,)``, in place) so that this rank's
chunk (``torch.tensor_split`` order) holds the sum over the ranks."""
ALL_GATHER: dict[str, AllReduce] = {
    "ring": ring.all_gather,
    "halving_doubling": halving_doubling.all_gather,
    "hierarchical": hierarchical_shards.all_gather,
    "shm": shm_shards.all_gather,
    "native": native.all_gather,
}
"""``all_gather(flat, call)``: fill every ``torch.tensor_split`` chunk of ``flat`` from the rank that owns it."""
NO_REDUCE_SCATTER: dict[str, str] = {"tree": "a tree reduces to one root",
                                      "double_binary_tree": "each tree reduces to one root"}
"""Why an algorithm of ``ALL_REDUCE`` carries neither reduce-scatter nor all-gather (every other one has both)."""


def refusal(collective: str, algorithm: str) -> ValueError:
    """The one-line error of a ``collective`` (reduce_scatter or all_gather) asked of an algorithm that
    carries none (``NO_REDUCE_SCATTER`` says why)."""
    carriers = ", ".join(tuple(REDUCE_SCATTER) + (AUTO,))
    reason = NO_REDUCE_SCATTER.get(algorithm, "none is registered")
    return ValueError(f"algorithm {algorithm!r} has no {collective}: {reason}; "
                      f"choose one of {carriers}")

UPCAST: dict[str, dict[torch.dtype, torch.dtype]] = {"native": native.UPCAST}
"""Dtypes an algorithm reduces in a wider one (fp16/bf16 go to float32 for every algorithm)."""

OPTIONS_COMPARED: dict[str, Callable] = {
    "native": lambda comm: (),
    "shm": lambda comm: comm.options(shm.ShmState).compared(),
    "hierarchical": hierarchical.options_compared,
}
"""``(communicator) -> tuple``: the options the ranks must agree on (absent: ``SegmentOptions.segment_bytes``)."""

GROUP_PROBLEM: dict[str, Callable] = {"hierarchical": hierarchical.group_problem}
"""``(communicator) -> Exception | None``: why this group cannot run the algorithm (absent: it can)."""


@dataclass(frozen=True)
class SharedStorage:
    """An algorithm that reduces a tensor in place when it lies in storage the algorithm allocated (its
    AllReduce, and its reduce-scatter and all-gather too).

    ``allocate(call, nbytes)``: this rank's ``(nbytes,)`` uint8 buffer, or
    None where the group cannot share memory; ``dtypes``: the dtypes reduced
    there without a copy; ``align_bytes``: where each buffer of a zero-copy
    plan starts (a cache line).
    """

    allocate: Callable[[CollectiveCall, int], "torch.Tensor | None"]
    dtypes: tuple[torch.dtype, ...]
    align_bytes: int


ZERO_COPY: dict[str, SharedStorage] = {"shm": SharedStorage(shm.allocate_shared, shm.IN_PLACE_DTYPES,
                                                           shm.ARENA_ALIGN)}

SEGMENTED = frozenset({"ring"})
"""Algorithms that receive into their own segments (``chunking.DEFAULT_SEGMENT_BYTES`` each, a few in flight)
beside the bucket: what a rank's communication buffers add for them (the memory preflight)."""
