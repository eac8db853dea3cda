"""DiLoCo: local SGD whose averages are outer Nesterov steps on the averaged pseudo-gradient.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models" (inner AdamW, outer Nesterov lr 0.7 momentum 0.9, H = 500:
500x less communication at equal perplexity); Streaming DiLoCo, Douillard
et al. 2025 (fragments synced at staggered steps, overlapped with the next
inner steps); OpenDiLoCo / INTELLECT-1 (int8 outer deltas). torchft's
counterpart is ``torchft.local_sgd.DiLoCo`` (a Manager, model fragments, an
inner and an outer torch optimizer); here the group is gradsync's and the
outer optimizer is named. The outer loop itself is
:class:`~gradsync.parallel.outer_sync.OuterSync`'s (its docstring gives the
round's steps and the overlap semantics).

>>> import torch, gradsync
>>> from gradsync.transport.thread import ThreadWorld
>>> comm = gradsync.Communicator(ThreadWorld(1).transport(0))
>>> model = DiLoCo(torch.nn.Linear(2, 1), sync_every=4, group=comm, outer_compression="int8")
>>> [model.step() for _ in range(4)]
[False, False, False, True]
"""

from __future__ import annotations

from torch import nn

from gradsync import collectives
from gradsync.parallel.local_sgd import LocalSGD
from gradsync.parallel.outer_optimizer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM


class DiLoCo(LocalSGD):
    """:class:`~gradsync.LocalSGD` with ``outer_optimizer="nesterov"`` and the paper's defaults.

    Build the inner optimizer on ``model.parameters()`` and call :meth:`step` after every
    ``optimizer.step()``, as for LocalSGD. Every ``sync_every`` (H) inner steps each fragment's
    pseudo-gradient (parameters at its last sync - local parameters) is averaged over the group
    (sent as ``outer_compression``: "fp32", "bf16", "fp16" or "int8", the latter three with error
    feedback) and stepped by Nesterov (``outer_lr``, ``outer_momentum``).

    Args:
        module, sync_every, group, algorithm, timeout: as LocalSGD's.
        outer_lr: Nesterov's learning rate (default 0.7). outer_momentum: its momentum (default 0.9).
        outer_compression: see above (default "fp32").
        outer_fragments: F >= 1 fragments, synced at staggered steps (F divides H; default 1).
        outer_delay: τ, inner steps each fragment's AllReduce overlaps (None: 1 with fragments, else 0).

    Raises:
        as LocalSGD's (ValueError naming a bad outer option, on every rank at once).
    """

    def __init__(self, module: nn.Module, sync_every: int, group=None, algorithm: str = collectives.DEFAULT_ALGORITHM,
                 timeout: float | None = None, *, outer_lr: float = DILOCO_OUTER_LR,
                 outer_momentum: float = DILOCO_OUTER_MOMENTUM, outer_compression: str = "fp32",
                 outer_fragments: int = 1, outer_delay: int | None = None):
        super().__init__(module, sync_every, group, algorithm, timeout, outer_optimizer="nesterov", outer_lr=outer_lr,
                         outer_momentum=outer_momentum, outer_compression=outer_compression,
                         outer_fragments=outer_fragments, outer_delay=outer_delay)
