"""The learning-rate schedule of ``gradsync train``: scaling rule, linear warm-up, then cosine, constant or step.

One ``torch.optim.lr_scheduler.LambdaLR`` whose factor is an :class:`LrSchedule` (a callable object, so
``scheduler.state_dict()`` saves its fields and a resume restores them). At optimizer step ``t`` (from 0)
of a run of ``T`` steps with ``W`` warm-up steps the lr is ``--lr x scale x warm(t) x decay(t)``:

* ``scale``: ``--lr-scaling`` (Goyal et al. 2017, "Accurate, large minibatch SGD: training ImageNet in 1
  hour": linear, ``G / B``; sqrt, ``sqrt(G / B)``), ``G`` the global batch of one optimizer step and
  ``B`` = ``--base-batch-size``.
* ``warm(t) = min(1, (t + 1) / W)``: linear from ``lr / W`` at step 0 to the scaled lr at step ``W - 1``
  (Goyal et al. ramp from the small-batch lr; with ``G / B`` in the hundreds that start is ~0 as well,
  and from ~0 serves every scaling, none included).
* ``decay(t)``: cosine ``(1 + cos(pi (t - W) / (T - W))) / 2`` after the warm-up (from 1 at step ``W``
  towards 0 at ``T``), constant 1, or step: x0.1 at each of
  :data:`~gradsync.train.config.STEP_FRACTIONS` of the run (Goyal et al.'s epochs 30, 60 and 80 of 90:
  steps ``round(f T)``, counted from step 0, warm-up included).

>>> schedule = LrSchedule(scale=4.0, warmup_steps=4, total_steps=12, kind="cosine")
>>> [round(schedule(t), 3) for t in (0, 3, 4, 8, 11)]
[1.0, 4.0, 4.0, 2.0, 0.152]
"""

from __future__ import annotations

import math

import torch

from gradsync.train.config import STEP_FRACTIONS, TrainConfig

STEP_FACTOR = 0.1  # --lr-schedule step: the lr's factor at each milestone


class LrSchedule:
    """The factor of ``--lr`` at an optimizer step (``LambdaLR``'s ``lr_lambda``).

    Args:
        scale: ``--lr-scaling``'s factor (> 0). warmup_steps: ``W`` >= 0. total_steps: ``T`` >= 1.
        kind: ``"cosine"``, ``"constant"`` or ``"step"``.
    """

    def __init__(self, scale: float, warmup_steps: int, total_steps: int, kind: str):
        self.scale, self.warmup_steps, self.total_steps, self.kind = float(scale), int(warmup_steps), \
            max(int(total_steps), 1), kind
        self.anchor_step: int | None = None  # after a stretch: the decay continues from its value here
        self.anchor_decay = 1.0

    def __call__(self, step: int) -> float:
        warm = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        return self.scale * warm * self.decay(step)

    def decay(self, step: int) -> float:
        """``decay(t)`` (re-anchored after :meth:`stretch`)."""
        if self.anchor_step is None or step < self.anchor_step:
            return self._decay(step)
        at_anchor = self._decay(self.anchor_step)
        return 0.0 if at_anchor == 0.0 else self.anchor_decay * self._decay(step) / at_anchor

    def _decay(self, step: int) -> float:
        if self.kind == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.kind == "step":
            return STEP_FACTOR ** sum(step >= round(fraction * self.total_steps) for fraction in STEP_FRACTIONS)
        return 1.0

    def stretch(self, total_steps: int, step: int) -> None:
        """The run now ends at ``total_steps`` (a resume at another world size): from ``step`` on, the decay
        goes from its present value to the new end's without a jump (the warm-up keeps its steps)."""
        self.anchor_decay, self.anchor_step = self.decay(step), step
        self.total_steps = max(int(total_steps), 1)

    def describe(self) -> dict:
        return {"scale": self.scale, "warmup_steps": self.warmup_steps, "total_steps": self.total_steps,
                "schedule": self.kind}


def make_lr_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int,
                      workers: int | None) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR(optimizer, LrSchedule(...))`` for ``config`` (``workers``: the workers whose samples make
    the global batch; None only without ``--lr-scaling``).

    Raises:
        ValueError: ``--lr-scaling`` without ``workers``.
    """
    if config.lr_scaling != "none" and workers is None and config.mode != "async" and not config.elastic:
        raise ValueError("--lr-scaling: the scheduler needs the number of workers (the global batch)")
    scale = config.lr_scale(workers or 1)
    schedule = LrSchedule(scale, config.warmup_steps_of(total_steps), total_steps, config.lr_schedule)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def lr_fields(scheduler, config: TrainConfig, workers: int) -> dict:
    """``summary.json``'s ``"lr"``: the base (``--lr``) and scaled lr, the global batch it was scaled for,
    the scaling, the warm-up steps and the schedule."""
    schedule = scheduler.lr_lambdas[0] if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) else None
    if not isinstance(schedule, LrSchedule):
        return {"base": config.lr, "scaled": config.lr, "schedule": config.lr_schedule}
    return {"base": config.lr, "scaled": config.lr * schedule.scale, "scaling": config.lr_scaling,
            "base_batch_size": config.base_batch_size, "global_batch_size": config.lr_global_batch(workers),
            **schedule.describe()}


def stretch(scheduler, total_steps: int) -> None:
    """:meth:`LrSchedule.stretch` at the scheduler's present step (a scheduler of another kind: left alone)."""
    for schedule in getattr(scheduler, "lr_lambdas", ()):
        if isinstance(schedule, LrSchedule):
            schedule.stretch(total_steps, scheduler.last_epoch)
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                group["lr"] = base * schedule(scheduler.last_epoch)
            return
