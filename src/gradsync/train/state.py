"""``TrainState``: everything a sync or local-SGD run has done so far, besides its model and optimizer.

The trainer holds one and updates it after every step and epoch;
``resume.py`` turns it into the checkpoint's entries and back. Models,
optimizers and schedulers are not part of it (they carry their own
``state_dict``); RNG states are read from and written to the global
generators when a checkpoint is taken or restored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gradsync.parallel.staleness import StalenessStats
from gradsync.train.meter import StepTimes


def _histogram_equal(a: StalenessStats, b: StalenessStats) -> bool:
    return list(a.histogram) == list(b.histogram)


SHARED_FIELDS = ("step", "samples", "epoch", "steps_in_epoch", "samples_in_epoch", "order_start", "epoch_loss_sum",
                 "epoch_loss_steps", "epoch_records", "eval_s", "elapsed_before_s", "resumed_from_step")


@dataclass(eq=False)
class TrainState:
    """Progress, counters and records of one worker's run (times in seconds, bytes in bytes).

    Data position: ``epoch`` is the epoch in progress, ``steps_in_epoch``
    the optimizer steps done in it and ``samples_in_epoch`` the samples all
    ranks consumed in them (an offset into the epoch's permutation, the same
    at every world size); ``order_start`` is the sample the epoch's order at
    this world size starts from (0, or where a resume at another world size
    continued, :mod:`~gradsync.train.position`). ``epoch_loss_sum`` /
    ``epoch_loss_steps`` are this rank's running loss over those steps
    (all-reduced at the epoch's end).
    """

    step: int = 0                   # optimizer steps done in the whole run
    samples: int = 0                # samples those steps took, all ranks (the global batch may change on resume)
    epoch: int = 0
    steps_in_epoch: int = 0
    samples_in_epoch: int = 0
    order_start: int = 0
    epoch_loss_sum: float = 0.0
    epoch_loss_steps: int = 0
    times: StepTimes = field(default_factory=StepTimes)
    staleness: StalenessStats = field(default_factory=StalenessStats)  # sync: 0; local SGD: local steps
    step_bytes_sent: int = 0        # bytes sent inside optimizer steps (gradient sync), whole run
    # added to the transport's counts to get the run's totals: after a resume, the checkpoint's
    # totals less what this attempt's transport had counted when it restored them
    bytes_sent_offset: int = 0
    bytes_received_offset: int = 0
    epoch_records: list[dict] = field(default_factory=list)  # the finished epochs' metrics records
    eval_s: float = 0.0
    checkpoint_s: float = 0.0       # this attempt's seconds writing checkpoints
    elapsed_before_s: float = 0.0   # wall seconds of the run up to the checkpoint this attempt resumed from
    resumed_from_step: int | None = None

    def shared(self) -> dict:
        """The fields every rank holds alike (what an elastic membership hands over from its rank 0)."""
        return {name: getattr(self, name) for name in SHARED_FIELDS}

    def adopt(self, shared: dict) -> None:
        """Take rank 0's :meth:`shared` fields; this rank's own (times, bytes, staleness) stay."""
        fresh = TrainState()
        for name in SHARED_FIELDS:  # a checkpoint of an older format lacks some: they start afresh
            setattr(self, name, shared.get(name, getattr(fresh, name)))

    def add_step_loss(self, loss: float) -> None:
        self.epoch_loss_sum += loss
        self.epoch_loss_steps += 1

    def epoch_loss(self) -> torch.Tensor:
        """``(sum of step losses, steps)`` of this rank in the epoch, float64 ``(2,)``."""
        return torch.tensor([self.epoch_loss_sum, float(self.epoch_loss_steps)], dtype=torch.float64)

    def next_epoch(self) -> None:
        self.epoch += 1
        self.steps_in_epoch = self.samples_in_epoch = self.order_start = 0
        self.epoch_loss_sum, self.epoch_loss_steps = 0.0, 0

    def __eq__(self, other) -> bool:
        if not isinstance(other, TrainState):
            return NotImplemented
        mine, theirs = dict(vars(self)), dict(vars(other))
        return (_histogram_equal(mine.pop("staleness"), theirs.pop("staleness")) and mine == theirs)
