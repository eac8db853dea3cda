"""The one list of AllReduce algorithms: name -> function, and what each offers beyond it.

Adding an algorithm: write ``collectives/<name>.py`` with
``all_reduce(flat, call)`` (settings, if any, as an options class in the
same module, read with ``call.options(MyOptions)``), then add one line to
``ALL_REDUCE`` below. ``ALGORITHMS``, the public validation, the layout
check's codes and the CLI choices all come from this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gradsync.collectives import halving_doubling, hierarchical, native, ring, shm, tree
from gradsync.collectives.call import CollectiveCall

AllReduce = Callable[[torch.Tensor, CollectiveCall], None]

ALL_REDUCE: dict[str, AllReduce] = {
    "ring": ring.all_reduce,
    "tree": tree.all_reduce,
    "halving_doubling": halving_doubling.all_reduce,
    "hierarchical": hierarchical.all_reduce,
    "shm": shm.all_reduce,
    "native": native.all_reduce,
}
AUTO = "auto"  # resolved per call by collectives.auto.choose
ALGORITHMS = tuple(ALL_REDUCE) + (AUTO,)


@dataclass(frozen=True)
class SharedStorage:
    """An algorithm that reduces a tensor in place when it lies in storage the algorithm allocated.

    ``allocate(call, nbytes)``: this rank's ``(nbytes,)`` uint8 buffer, or
    None where the group cannot share memory; ``dtypes``: the dtypes reduced
    there without a copy.
    """

    allocate: Callable[[CollectiveCall, int], "torch.Tensor | None"]
    dtypes: tuple[torch.dtype, ...]


ZERO_COPY: dict[str, SharedStorage] = {"shm": SharedStorage(shm.allocate_shared, shm.IN_PLACE_DTYPES)}
