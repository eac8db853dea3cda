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

A resume at another world size changes ``T`` (:meth:`LrSchedule.stretch` at the resume step ``a``): cosine
continues from its value at ``a`` to 0 at the new ``T'``; step keeps the drops of the milestones passed
at ``a`` and puts each remaining one at ``max(round(f T'), a)``, so the run drops three times in all.

The lr options' checks live here too (:func:`validate_lr_options`, :func:`lr_problem`, and
:func:`validate_scaled_lr` once the world size is known): ``--lr`` and ``--lr`` x scale must be float32s the
optimizers can step with (finite, at most ~3.4e38, not 0 after rounding).

>>> schedule = LrSchedule(scale=4.0, warmup_steps=4, total_steps=12, kind="cosine")
>>> [round(schedule(t), 3) for t in (0, 3, 4, 8, 11)]
[1.0, 4.0, 4.0, 2.0, 0.152]
"""

from __future__ import annotations

import math

import torch

from gradsync.train.config import LR_SCALINGS, STEP_FRACTIONS, TrainConfig

STEP_FACTOR = 0.1  # --lr-schedule step: the lr's factor at each milestone
FLOAT32_MAX = torch.finfo(torch.float32).max  # the largest lr the optimizers' float32 tensors hold


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
        self.anchor_drops = 0  # step: milestones passed at anchor_step (under the total steps before it)
        self.global_batch: int | None = None  # G that scale was computed from (None: not recorded)

    def __call__(self, step: int) -> float:
        warm = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        return self.scale * warm * self.decay(step)

    def decay(self, step: int) -> float:
        """``decay(t)`` (re-anchored after :meth:`stretch`)."""
        if self.kind == "step":
            return STEP_FACTOR ** self.drops(step)
        if self.anchor_step is None or step < self.anchor_step:
            return self._decay(step)
        at_anchor = self._decay(self.anchor_step)
        return 0.0 if at_anchor == 0.0 else self.anchor_decay * self._decay(step) / at_anchor

    def _decay(self, step: int) -> float:
        if self.kind == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    def drops(self, step: int) -> int:
        """``--lr-schedule step``: milestones passed at ``step`` (0 to ``len(STEP_FRACTIONS)``). After a
        stretch at ``a``: those passed at ``a`` under the old ``T``, plus the later fractions whose
        ``round(f T')`` under the new ``T'`` is at most ``step``."""
        done = self.anchor_drops if self.anchor_step is not None and step >= self.anchor_step else 0
        return done + sum(step >= round(f * self.total_steps) for f in STEP_FRACTIONS[done:])

    def stretch(self, total_steps: int, step: int) -> None:
        """The run now ends at ``total_steps`` (a resume at another world size): from ``step`` on, the decay
        goes from its present value to the new end's without a jump (the warm-up keeps its steps); step
        keeps the milestones passed at ``step`` and places the remaining ones at the new end's fractions."""
        self.anchor_decay, self.anchor_drops = self.decay(step), self.drops(step)
        self.anchor_step = step
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
    if workers is not None or config.mode == "async" or config.elastic:
        schedule.global_batch = config.lr_global_batch(workers or 1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def lr_fields(scheduler, config: TrainConfig, workers: int) -> dict:
    """``summary.json``'s ``"lr"``: the base (``--lr``) and scaled lr, the global batch it was scaled for
    (``global_batch_size``: the start's, which a resume at another ``--nproc`` keeps with the scale) and the
    run's now (``current_global_batch_size``, ``workers`` workers), the scaling, the warm-up steps and the
    schedule."""
    schedule = scheduler.lr_lambdas[0] if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) else None
    if not isinstance(schedule, LrSchedule):
        return {"base": config.lr, "scaled": config.lr, "schedule": config.lr_schedule}
    current = config.lr_global_batch(workers)
    scaled_for = schedule.global_batch if schedule.global_batch is not None else current
    return {"base": config.lr, "scaled": config.lr * schedule.scale, "scaling": config.lr_scaling,
            "base_batch_size": config.base_batch_size, "global_batch_size": scaled_for,
            "current_global_batch_size": current, **schedule.describe()}


def stretch(scheduler, total_steps: int) -> None:
    """:meth:`LrSchedule.stretch` at the scheduler's present step (a scheduler of another kind: left alone)."""
    for schedule in getattr(scheduler, "lr_lambdas", ()):
        if isinstance(schedule, LrSchedule):
            schedule.stretch(total_steps, scheduler.last_epoch)
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                group["lr"] = base * schedule(scheduler.last_epoch)
            return


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _float32_lr(lr: float) -> bool:
    """The optimizers hold the lr in float32 tensors: finite, at most :data:`FLOAT32_MAX` and > 0 rounded."""
    return isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr <= FLOAT32_MAX \
        and float(torch.tensor(lr, dtype=torch.float32)) > 0


def lr_problem(lr) -> str | None:
    """``--lr``'s refusal (one line), or None: it must be a float32 the optimizers can step with."""
    if _float32_lr(lr):
        return None
    underflow = " (0 in float32)" if isinstance(lr, (int, float)) and 0 < lr <= FLOAT32_MAX else ""
    shown = f"{lr:g}" if isinstance(lr, (int, float)) else repr(lr)
    return f"--lr must be a finite float32 > 0 (at most {FLOAT32_MAX:.2g}), got {shown}{underflow}"


def validate_scaled_lr(config: TrainConfig, workers: int, num_train: int) -> None:
    """``--base-batch-size`` within the training set, and ``--lr`` x the scale of ``workers`` workers a float32
    the optimizers can step with (:func:`_float32_lr`).

    Raises:
        ValueError: one line naming the option.
    """
    if config.base_batch_size is not None and config.base_batch_size > num_train:
        raise ValueError(f"--base-batch-size {config.base_batch_size} is larger than the {num_train} training "
                         f"samples: no global batch reaches it")
    scale = config.lr_scale(workers)
    if not _float32_lr(config.lr * scale):
        raise ValueError(f"--lr {config.lr:g} x --lr-scaling {config.lr_scaling}'s scale {scale:g} = "
                         f"{config.lr * scale:g} is not a finite float32 > 0 (at most {FLOAT32_MAX:.2g})")


def validate_lr_options(config: TrainConfig) -> None:
    """``--lr-scaling`` / ``--base-batch-size`` and ``--warmup-steps`` / ``--warmup-epochs``: their values, and
    that each pair is given as it must be (a warm-up longer than the run:
    :func:`~gradsync.train.validation.validate_against_data`).

    Raises:
        ValueError: one line naming the option.
    """
    base, steps, epochs = config.base_batch_size, config.warmup_steps, config.warmup_epochs
    if config.lr_scaling not in LR_SCALINGS:
        raise ValueError(f"unknown --lr-scaling {config.lr_scaling!r}; choose one of {', '.join(LR_SCALINGS)}")
    if base is not None and (not _is_int(base) or base < 1):
        raise ValueError(f"--base-batch-size must be an int >= 1 (samples), got {base!r}")
    if config.lr_scaling != "none" and base is None:
        raise ValueError(f"--lr-scaling {config.lr_scaling} needs --base-batch-size B: the global batch --lr was "
                         f"tuned for, which the lr is scaled from")
    if config.lr_scaling == "none" and base is not None:
        raise ValueError("--base-batch-size applies to --lr-scaling linear or sqrt (the lr is not scaled without it)")
    if steps is not None and epochs is not None:
        raise ValueError(f"--warmup-steps {steps} and --warmup-epochs {epochs} exclude each other: give one")
    if steps is not None and (not _is_int(steps) or steps < 0):
        raise ValueError(f"--warmup-steps must be an int >= 0 (optimizer steps), got {steps!r}")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, (int, float))
                               or not 0 <= epochs < math.inf):
        raise ValueError(f"--warmup-epochs must be a finite number >= 0, got {epochs!r}")
    if epochs is not None and epochs > config.epochs:
        raise ValueError(f"--warmup-epochs {epochs} is longer than the run's --epochs {config.epochs}")
