"""From the torchft replicas' step logs to the chaos row: failures, samples lost, throughput.

Inputs are the records :mod:`gradsync.bench.torchft_worker` appends (one per
attempted step, wall-clock ``time.time()`` seconds) and the driver's kills
``[{"victim": replica, "pid": int, "time": s}]``. Per failure, the figures of
:mod:`gradsync.bench.elastic_metrics` (``detect_s``, ``recover_s``,
``steps_redone``, ``joiner_s``: one definition for both libraries, the
records mapped by :func:`run_events`), and torchft's own ``rejoin_stall_s``:
the survivors' longest step within a second of the joiner's first commit
(reconfigure + checkpoint send). ``steps_replicas_unequal``: committed steps
after which the replicas' parameter digests differ (every replica that
committed the step, a healed joiner included).

Samples are counted per sample id: step ``s`` of the run has global batch
``batches(s)``; each replica that took part in the commit of ``s`` trained its
piece (:func:`trained_pieces`). ``samples_lost``: ids of a committed global batch nobody trained (a
missing or healing replica's piece under the ``fixed`` split);
``samples_duplicated``: ids trained twice in one committed step. Retried
(uncommitted) steps are neither: their batch is trained again at the same step.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from gradsync.bench.elastic_metrics import RunEvents, all_failures
from gradsync.train.global_batch import global_batches, split_contiguous


class Batches:
    """Global batch ``step`` of the run (epochs follow each other), ``(global_batch_size,)`` int64."""

    def __init__(self, num_train: int, global_batch_size: int, seed: int):
        self.num_train, self.size, self.seed = num_train, global_batch_size, seed
        self.per_epoch = num_train // global_batch_size
        self._epoch, self._batches = None, None

    def __call__(self, step: int) -> torch.Tensor:
        epoch = step // self.per_epoch
        if epoch != self._epoch:
            self._epoch, self._batches = epoch, list(global_batches(self.num_train, self.size, self.seed, epoch))
        return self._batches[step % self.per_epoch]


def read_log(path: Path) -> list[dict]:
    """A replica's records (a line cut by SIGKILL at the end is skipped)."""
    records = []
    if not Path(path).exists():
        return records
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def steps_of(records: list[dict]) -> list[dict]:
    return sorted((r for r in records if "step" in r), key=lambda r: r["t_end"])


def window_start(steps: list[dict], nproc: int) -> float | None:
    """The first commit with every replica in the quorum: where the measured window starts."""
    times = [r["t_end"] for r in steps if r["committed"] and r["participants"] == nproc]
    return min(times) if times else None


def commits(steps: list[dict]) -> dict[int, list[dict]]:
    """Committed step -> the committed records of that step, one per replica (healing ones included)."""
    table = defaultdict(dict)
    for record in steps:
        if record["committed"]:
            table[record["step"]][record["replica"]] = record
    return {step: list(by_replica.values()) for step, by_replica in table.items()}


def trained_pieces(records: list[dict]) -> tuple[list[tuple[int, int]], int]:
    """((pieces, piece) trained in one committed step, pieces inferred).

    A replica killed after its AllReduce succeeded contributed to the commit
    but never logged it: the commit's ``participants`` says how many did, and
    the pieces nobody logged (a healing replica logs its own) are theirs when
    their number is exactly the shortfall (else they count as lost).
    """
    part = [r for r in records if r["participating"]]
    trained = [(r["pieces"], r["piece"]) for r in part]
    missing = max(r["participants"] for r in records) - len(part)
    if missing > 0 and part:
        pieces = part[0]["pieces"]
        unlogged = sorted(set(range(pieces)) - {r["piece"] for r in records})
        if len(unlogged) == missing:
            return trained + [(pieces, piece) for piece in unlogged], missing
    return trained, 0


def sample_counts(step: int, records: list[dict], batches: Callable[[int], torch.Tensor]) -> tuple[int, int, int]:
    """(samples trained, lost, duplicated) of committed ``step`` by sample id."""
    batch = batches(step)
    trained = [split_contiguous(batch, pieces)[piece] for pieces, piece in trained_pieces(records)[0]]
    ids = torch.cat(trained) if trained else torch.empty(0, dtype=torch.int64)
    unique = torch.unique(ids).numel()
    return ids.numel(), batch.numel() - unique, ids.numel() - unique


def count_samples(table: dict[int, list[dict]], batches) -> dict[int, tuple[float, int, int, int]]:
    """Committed step -> (commit time, samples trained, lost, duplicated), in step order (one epoch at a time)."""
    return {step: (min(r["t_end"] for r in table[step]), *sample_counts(step, table[step], batches))
            for step in sorted(table)}


def totals(counts: dict, start: float, end: float) -> tuple[int, int, int, int]:
    """(committed steps, samples trained, lost, duplicated) of the steps committed in ``[start, end)``."""
    rows = [c for c in counts.values() if start <= c[0] < end]
    return len(rows), sum(c[1] for c in rows), sum(c[2] for c in rows), sum(c[3] for c in rows)


def run_events(steps: list[dict]) -> RunEvents:
    """The replicas' step records in the common form of :mod:`gradsync.bench.elastic_metrics`.

    Commits: each committed step index at the earliest ``t_end`` a replica logged it (every replica of
    the commit logs it, a healing joiner included). A record not committed is a failed attempt, timed at
    its ``t_backward`` (its AllReduce returned or failed); a committed one with another quorum id, or
    fewer participants, than the same replica's previous record saw a changed quorum (timed the same
    way: the quorum is known by then). Every committed record is a committed step of its replica.
    """
    first_commit, previous, run = {}, {}, RunEvents()
    for record in steps:
        replica, last = record["replica"], previous.get(record["replica"])
        if record["committed"]:
            first_commit[record["step"]] = min(first_commit.get(record["step"], record["t_end"]), record["t_end"])
            run.joined.append((record["t_end"], replica))
            if last is not None and (record["quorum_id"] != last["quorum_id"]
                                     or record["participants"] < last["participants"]):
                run.changed.append((record["t_backward"], replica))
        else:
            run.failed.append((record["t_backward"], replica, record["step"]))
        previous[replica] = record
    run.commits = [(time, step) for step, time in first_commit.items()]
    return run


def rejoin_stall(failure: dict, by_replica: dict[int, list[dict]]) -> float | None:
    """The survivors' longest step within a second of the joiner's first commit (reconfigure + state sent)."""
    if failure["joiner_s"] is None:
        return None
    joined_at = failure["kill_time"] + failure["joiner_s"]
    spans = [r["t_end"] - r["t_start"] for replica, recs in by_replica.items() if replica != failure["victim"]
             for r in recs if joined_at - 1.0 <= r["t_end"] <= joined_at + 1.0]
    return max(spans) if spans else None


def unequal_steps(steps: list[dict]) -> tuple[int, int]:
    """(committed steps whose replicas' parameter digests after the step differ, steps compared)."""
    hashes = defaultdict(set)
    for record in steps:
        if record["committed"] and "params_hash" in record:
            hashes[record["step"]].add(record["params_hash"])
    return sum(1 for digests in hashes.values() if len(digests) > 1), len(hashes)


def summarize(kills: list[dict], steps: list[dict], batches, start: float, end: float) -> dict:
    """The run's measured keys from the kills and every replica's step records in ``[start, end]``."""
    by_replica = defaultdict(list)
    for record in steps:
        by_replica[record["replica"]].append(record)
    counts = count_samples(commits(steps), batches)
    committed, samples, lost, dup = totals(counts, start, end)
    failures = all_failures(run_events(steps), kills, end)
    times = [k["time"] for k in kills] + [end]
    for index, failure in enumerate(failures):
        failure["rejoin_stall_s"] = rejoin_stall(failure, by_replica)
        failure["samples_lost"] = totals(counts, times[index], times[index + 1])[2]
    unequal, compared = unequal_steps(steps)
    return {"failures": len(kills), "per_failure": failures,
            "steps_replicas_unequal": unequal, "steps_replicas_compared": compared,
            "samples_lost": lost, "samples_duplicated": dup,
            "samples_per_s": samples / max(end - start, 1e-9), "committed_steps": committed,
            "attempts_uncommitted": sum(1 for r in steps if start <= r["t_end"] <= end and not r["committed"])}
