"""Count the samples an elastic run used, per sample id: none lost, none used twice within an epoch.

Each member appends to its own ``elastic/samples-<slot>.<incarnation>.jsonl``
``{"m", "step", "epoch", "ids"}`` before it computes a step in membership
``m`` and ``{"m", "commit"}`` once it committed it
(:mod:`~gradsync.elastic.membership`). The expected samples
of a step are its global batch of the epoch's permutation
(the caller's ``epoch_batches``), whatever the world
size was.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from typing import Callable, Iterable

SAMPLES_FOLDER = "elastic"


def read_used(out_dir: str | Path) -> tuple[Counter, set[int]]:
    """``(Counter of (epoch, sample id) used by committed steps, committed step numbers)``.

    A member's record of the ids it computed step ``s`` on in membership ``m`` counts when some member
    committed ``s`` in ``m``: then every member's gradient was in the sum (an AllReduce cannot finish
    without each member's part), the dead one's included. A torn last line (a kill mid-write) is skipped.
    """
    computed, commits = [], set()
    for path in sorted((Path(out_dir) / SAMPLES_FOLDER).glob("samples-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "commit" in record:
                commits.add((record["m"], record["commit"]))
            else:
                computed.append(record)
    used = Counter()
    for record in computed:
        if (record["m"], record["step"]) in commits:
            used.update((record["epoch"], sample) for sample in record["ids"])
    return used, {step for _, step in commits}


def count_samples(out_dir: str | Path, epoch_batches: Callable[[int], Iterable], steps_done: int | None = None) -> dict:
    """``{"samples_used", "samples_lost", "samples_duplicated", "steps"}`` of the run in ``out_dir``.

    ``epoch_batches(epoch)``: that epoch's global batches in step order (sample ids, e.g.
    :func:`~gradsync.train.global_batch.global_batches`); ``samples_lost``: ids of the global batch of a
    step the run committed (steps ``0 .. steps_done-1``; default: the steps some member recorded) that
    no member recorded; ``samples_duplicated``: extra uses of an id within one epoch.
    """
    used, steps = read_used(out_dir)
    if steps_done is not None:
        steps = set(range(steps_done))
    expected, step = Counter(), 0
    for epoch in range(max(steps) + 1 if steps else 0):
        for batch in epoch_batches(epoch):
            if step in steps:
                expected.update((epoch, int(sample)) for sample in batch)
            step += 1
        if step > max(steps):
            break
    lost = sum((expected - used).values())
    duplicated = sum(count - 1 for count in used.values() if count > 1)
    return {"samples_used": sum(used.values()), "samples_lost": lost, "samples_duplicated": duplicated,
            "steps": len(steps)}
