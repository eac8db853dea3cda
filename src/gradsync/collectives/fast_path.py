"""The one-host fast path as a capability: algorithms that run only on CPU tensors of a group whose
ranks all share one machine (through memory they share).

Data, as :mod:`~gradsync.collectives.registry`'s tables, kept beside the
registry rather than in it because a fast path's small-call plans
(:mod:`~gradsync.collectives.shm_lean`) run their own layout check
(:mod:`~gradsync.collectives.check`), and the check reads the registry.
:mod:`~gradsync.collectives.validate` reads this table: ``auto`` considers a
fast path unless the group is known to span hosts, a call that resolved to one
falls back when the group turns out to, and a small AllReduce runs its plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from gradsync.collectives import shm, shm_lean


class Plan(Protocol):
    """One layout's AllReduce, its arguments checked: ``run`` sums ``tensor`` over the ranks of ``call``
    (a CollectiveCall), in place; ``label``: the algorithm its calls are recorded under."""

    label: str

    def run(self, tensor: torch.Tensor, call) -> None: ...


@dataclass(frozen=True)
class OneHost:
    """A fast path.

    ``options``: its options class, whose ``available`` is None until a call
    found out whether the ranks share a machine, then True or False;
    ``usable(call)``: find out (collective the first time, every rank learns
    the same answer); ``plan(comm, tensor, work_dtype, avg, describe_row, call)``:
    a :class:`Plan` that reduces a small
    AllReduce of this layout in one round with its layout check, or None where
    the call is not small enough (``describe_row()``: the call's layout
    descriptor, built only for a plan).
    """

    options: type
    usable: Callable
    plan: Callable


ONE_HOST: dict[str, OneHost] = {"shm": OneHost(shm.ShmState, shm.usable, shm_lean.plan)}
