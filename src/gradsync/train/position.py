"""The data position of a sync / local-SGD epoch as a sample offset, and each rank's batches from it, at any world size.

Without ``--global-batch-size`` the epoch's order is ``DistributedSampler``'s:
one permutation (:func:`~gradsync.train.global_batch.epoch_permutation`),
padded to a multiple of the world size W by repeating its start, rank ``r``
taking ``padded[r::W]`` in batches of ``b``. Micro-batch ``i`` of all ranks
together is then ``padded[i*b*W:(i+1)*b*W]``, so after ``k`` optimizer steps
(``accumulate`` a) the ranks have consumed exactly the prefix
``padded[:k*b*a*W]``: the sample offset, which means the same at every world size.

An :class:`EpochOrder` says how the epoch in progress is dealt out: from
sample ``start`` over the current world. ``start == 0`` is
``DistributedSampler``'s order; after a resume at another world size the
rest of the permutation, ``permutation[start:]``, is dealt out the same way
but not padded (no sample twice), and the epoch's last partial global batch
is dropped, as every epoch drops it.

>>> perm = torch.arange(10)  # 3 ranks from sample 0: padded to 12 (0..9, 0, 1); rank 0 takes [0, 3, 6, 9]
>>> [[batch.tolist() for batch in step] for step in rank_steps(perm, EpochOrder(), 3, 0, 2, 1)]
[[[0, 3]], [[6, 9]]]
>>> [[batch.tolist() for batch in step] for step in rank_steps(perm, EpochOrder(4), 2, 1, 2, 1)]  # 4..9 by 2
[[[5, 7]]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EpochOrder:
    """The epoch's order: ``start``, the sample offset it begins at (0: ``DistributedSampler``'s, padded)."""

    start: int = 0


def dealt_samples(permutation: torch.Tensor, order: EpochOrder, world_size: int) -> torch.Tensor:
    """The ``(n,)`` sample indices that ``world_size`` ranks are dealt, in order (rank ``r`` takes ``[r::W]``).

    ``order.start == 0``: padded to a multiple of ``world_size`` as ``DistributedSampler`` pads;
    otherwise ``permutation[start:]`` cut to a multiple of ``world_size``.
    """
    if order.start == 0:
        total = -(-len(permutation) // world_size) * world_size
        repeats = -(-total // max(len(permutation), 1))
        return permutation.repeat(repeats)[:total]
    rest = permutation[order.start:]
    return rest[:len(rest) // world_size * world_size]


def order_steps(num_train: int, order: EpochOrder, world_size: int, batch_size: int, accumulate: int) -> int:
    """Optimizer steps the order holds (each ``batch_size * accumulate`` samples per rank; partial ones dropped)."""
    per_rank = _dealt_count(num_train, order, world_size) // world_size
    return per_rank // batch_size // accumulate


def _dealt_count(num_train: int, order: EpochOrder, world_size: int) -> int:
    if order.start == 0:
        return -(-num_train // world_size) * world_size
    return max(num_train - order.start, 0) // world_size * world_size


def rank_steps(permutation: torch.Tensor, order: EpochOrder, world_size: int, rank: int, batch_size: int,
               accumulate: int) -> list[list[torch.Tensor]]:
    """This rank's optimizer steps of the order: each a list of ``accumulate`` micro-batches (int64 indices).

    With ``order.start == 0`` these are ``BatchSampler(DistributedSampler(...), batch_size, drop_last=True)``'s
    batches, grouped by ``accumulate``.
    """
    share = dealt_samples(permutation, order, world_size)[rank::world_size]
    steps = len(share) // batch_size // accumulate
    batches = share[:steps * batch_size * accumulate].view(steps, accumulate, batch_size)
    return [list(step) for step in batches]


def steps_taken(samples: int, order: EpochOrder, samples_per_step: int) -> int:
    """Steps of the order already taken when ``samples`` of the epoch are consumed.

    Raises:
        ValueError: ``samples`` is not ``order.start`` plus whole steps.
    """
    done = samples - order.start
    if done < 0 or done % samples_per_step:
        raise ValueError(f"sample position {samples} is not a whole number of {samples_per_step}-sample steps "
                         f"after the order's start {order.start}")
    return done // samples_per_step


def reorder(order: EpochOrder, samples: int, old_world_size: int, new_world_size: int) -> EpochOrder:
    """The order to continue an epoch with at ``new_world_size``, ``samples`` of it consumed at ``old_world_size``.

    The same world size keeps its order (so a resume is bitwise the run without a stop); another
    one starts a new order at the sample position: no sample of the epoch is lost or used twice.
    """
    if new_world_size == old_world_size:
        return order
    return EpochOrder(samples)


@dataclass(frozen=True)
class StepPlan:
    """How many optimizer steps a run's epochs hold at one world size.

    ``global_batch``: samples per step over all workers when fixed (``--global-batch-size``, an elastic
    run), else None: each worker's ``batch_size * accumulate`` of DistributedSampler's order.
    """

    num_train: int
    world_size: int
    epochs: int
    batch_size: int
    accumulate: int
    global_batch: int | None

    @property
    def samples_per_step(self) -> int:
        return self.global_batch or self.batch_size * self.accumulate * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        """A whole epoch's steps at this world size (the last partial batch dropped)."""
        if self.global_batch is not None:
            return self.num_train // self.global_batch
        return order_steps(self.num_train, EpochOrder(), self.world_size, self.batch_size, self.accumulate)

    def epoch_steps(self, state) -> int:
        """Optimizer steps of ``state``'s epoch in progress (a :class:`~gradsync.train.state.TrainState`):
        ``steps_per_epoch``, unless it continues at another world size (the steps done before, and the rest
        of the samples at this one)."""
        if self.global_batch is not None or state.order_start == 0:
            return self.steps_per_epoch
        order = EpochOrder(state.order_start)
        before = state.steps_in_epoch - steps_taken(state.samples_in_epoch, order, self.samples_per_step)
        return before + order_steps(self.num_train, order, self.world_size, self.batch_size, self.accumulate)

    def total_steps(self, state) -> int:
        """Optimizer steps of the whole run (more or fewer than planned after a resume at another world size)."""
        if state.epoch >= self.epochs:
            return state.step
        return (state.step - state.steps_in_epoch + self.epoch_steps(state)
                + (self.epochs - state.epoch - 1) * self.steps_per_epoch)
