"""What one optimizer step computes: its micro-batches, their forward and backward, the loss it reports.

The data order is :mod:`~gradsync.train.position`'s (DistributedSampler's)
without a global batch, :mod:`~gradsync.train.global_batch`'s with one; the
loop (:mod:`~gradsync.train.loop`) decides when a step runs and what follows it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterator

import torch

from gradsync import api
from gradsync.train.data import Splits
from gradsync.train.global_batch import epoch_permutation, global_batches, split_contiguous, worker_micro_batches
from gradsync.train.meter import StepMeter
from gradsync.train.position import EpochOrder, rank_steps
from gradsync.train.task import sample_loss


def epoch_micro_batches(config, num_train: int, global_batch: int | None, epoch: int, order_start: int,
                        rank: int, world_size: int, local_shards=None) -> Iterator[list[torch.Tensor]]:
    """The epoch's optimizer steps, each a list of ``accumulate`` micro-batches of sample indices (int64).

    ``local_shards``: with ``config.deterministic``, this rank's micro-shard indices; each step is then
    this rank's micro-shards of the global batch. ``order_start``: where the epoch's order at this world
    size starts (after a resume at another world size; without a global batch only).
    """
    if global_batch is not None:
        for batch in global_batches(num_train, global_batch, config.seed, epoch):
            if config.deterministic:
                shards = split_contiguous(batch, config.micro_shards)
                yield [shards[index] for index in local_shards]
            else:
                yield worker_micro_batches(batch, world_size, rank, config.accumulate)
        return
    permutation = epoch_permutation(num_train, config.seed, epoch)
    yield from rank_steps(permutation, EpochOrder(order_start), world_size, rank, config.batch_size,
                          config.accumulate)


def backward(model, data: Splits, micro_batches: list, meter: StepMeter, global_batch: int | None,
             world_size: int, global_loss: bool = False) -> float:
    """Forward and backward of each micro-batch, synchronising on the last; returns this rank's loss
    (``global_loss``: the global batch's mean loss, all-reduced).

    Without a global batch each micro-batch's mean loss is divided by their number (DDP's recipe for
    accumulation). With a global batch of B samples each rank's loss is its samples' sum scaled by
    ``world_size / B``, so that DataParallel's average over ranks is the global batch's mean, weighted
    by samples, not by rank (an elastic run's shares are uneven when B does not divide).
    """
    step_loss = torch.zeros(1, dtype=torch.float64)
    for index, indices in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        x, y = data.x_train[indices], data.y_train[indices]
        with nullcontext() if last else model.no_sync():
            with meter.phase("forward"):
                if global_batch is None:
                    loss = sample_loss(model(x), y) / len(micro_batches)
                else:
                    loss = sample_loss(model(x), y, reduction="sum") * (world_size / global_batch)
            with meter.phase("backward"):
                loss.backward()  # the last micro-batch's AllReduces run inside it
        step_loss += loss.detach().double()
    if global_loss:
        api.all_reduce(step_loss, op="sum")
        step_loss /= world_size
    return float(step_loss[0])


def micro_shard_backward(model, data: Splits, shards: list, meter: StepMeter, step: int, global_batch: int) -> float:
    """``--deterministic``: one backward per micro-shard of this rank, then the exact sum (collective);
    returns the global batch's mean loss."""
    for index, indices in zip(model.local_shards(), shards):
        x, y = data.x_train[indices], data.y_train[indices]
        with model.micro_shard(index, step) as shard:
            with meter.phase("forward"):
                loss = sample_loss(model(x), y, reduction="sum")  # divided by B once, after the sum
            with meter.phase("backward"):
                shard.backward(loss)
    with meter.phase("backward"):  # the exchange, as DataParallel's end-of-backward wait
        return model.synchronize(divisor=global_batch)
