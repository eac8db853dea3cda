"""The collectives at an epoch's and a run's end: the test split scored by every rank, the timelines gathered."""

from __future__ import annotations

from pathlib import Path

import torch

from gradsync import api
from gradsync.hosts import resident
from gradsync.parallel.timeline import Timeline, trace_events, write_trace
from gradsync.train.data import Splits
from gradsync.train.task import position_counts


@torch.no_grad()
def evaluate(model, data: Splits, rank: int, world_size: int,
             shards: tuple[int, list[int]] | None = None) -> tuple[float, float]:
    """``(mean test loss, test accuracy)`` per position (a classifier's sample, the gpt's character): each
    rank scores its piece of the test split; the sums are all-reduced (collective). ``model`` is a wrapper
    with ``.module`` (DataParallel and its kin).

    ``shards``: ``(micro_shards, this rank's shard indices)`` for ``--deterministic``: the split is cut
    into that many pieces, each scored on its own and gathered by piece, so the result does not depend
    on the world size either.

    Under ``--shard parameters`` each forward gathers the units one at a time (collective), so every rank
    runs as many forwards: one piece each, or ``micro_shards / world_size`` (``--deterministic --shard
    parameters`` needs a multiple); the parameters are never all whole at once, so evaluation adds no
    whole copy of the model to a rank's peak memory.
    """
    model.eval()
    # the training steps' freed blocks go back to the kernel first: glibc's heap would otherwise keep them
    # while the one large forward below takes its own (the memory preflight measures it the same way)
    resident.trim_heap()
    pieces, mine = world_size, [rank]
    if shards is not None:
        pieces, mine = shards[0], list(shards[1])
    table = torch.zeros(pieces, 3, dtype=torch.float64)  # (piece, [loss sum, correct, positions])
    for index, piece in enumerate(torch.tensor_split(torch.arange(len(data.y_test)), pieces)):
        if index in mine:
            x, y = data.x_test[piece], data.y_test[piece]
            table[index] = torch.tensor(position_counts(model.module(x), y), dtype=torch.float64)
    if shards is not None:
        api.all_reduce(table, op="sum")  # one rank's value and zeros per entry: exact in any order
        totals = table.sum(0)
    else:
        totals = table.sum(0)
        api.all_reduce(totals, op="sum")
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count


def gather_trace(timeline: Timeline | None, trace: str | None, is_main: bool) -> None:
    """Gather every rank's timeline to rank 0, which writes the Chrome trace ``trace`` (collective;
    nothing when ``timeline`` is None)."""
    if timeline is None:
        return
    rows = timeline.rows()
    counts = api.all_gather(torch.tensor([rows.shape[0]]))
    padded = torch.zeros(int(max(counts)), rows.shape[1], dtype=torch.float64)
    padded[:rows.shape[0]] = rows
    gathered = api.all_gather(padded)
    if is_main:
        write_trace(Path(trace), trace_events(part[:int(count)] for part, count in zip(gathered, counts)))
