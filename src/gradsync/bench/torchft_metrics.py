"""From the torchft replicas' step logs to the chaos row: detect, recover, steps and samples lost, throughput.

Inputs are the records :mod:`gradsync.bench.torchft_worker` appends (one per
attempted step, wall-clock ``time.time()`` seconds) and the driver's kills
``[{"victim": replica, "pid": int, "time": s}]``. Per failure (kill at ``t``):

- ``detect_s``: ``t`` -> the first survivor attempt that shows the loss: its
  AllReduce failed (not committed), or its quorum changed (another quorum id,
  or fewer participants, than its last step before ``t``: the Lighthouse
  dropped the dead replica); timed at its ``t_backward`` (the AllReduce
  returned, which for a quorum change is after the quorum);
- ``recover_s``: ``t`` -> the first step a survivor commits after that;
- ``steps_lost``: attempts a survivor did not commit in ``[t, recover]`` (the
  most over survivors; torchft retries the same step, so no step index is
  skipped); ``steps_lost_at_rejoin``: the same from recovery to the next kill
  (a joiner's quorum change can fail a step too);
- ``steps_replicas_unequal``: committed steps after which the replicas'
  parameter digests differ (every replica that committed the step, a healed
  joiner included), i.e. the replicas are checked after every recovery;
- ``joiner_startup_s``: ``t`` -> the relaunched victim's first committed step
  (healing from a peer, or taking part); ``rejoin_stall_s``: the survivors' longest step in the
  joiner's first second in the quorum (reconfigure + checkpoint send).

Samples are counted per sample id: step ``s`` of the run has global batch
``batches(s)``; each replica that took part in the commit of ``s`` trained its
piece (:func:`trained_pieces`). ``samples_lost``: ids of a committed global batch nobody trained (a
missing or healing replica's piece under the ``fixed`` split);
``samples_duplicated``: ids trained twice in one committed step. Retried
(uncommitted) steps are neither: their batch is trained again at the same step.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

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


def failure(kill: dict, next_time: float, by_replica: dict[int, list[dict]], counts: dict) -> dict:
    """One kill's figures (None where the logs never show the event)."""
    t, victim = kill["time"], kill["victim"]
    survivors = {rep: recs for rep, recs in by_replica.items() if rep != victim}
    detect = None
    for recs in survivors.values():
        before = [r for r in recs if r["t_end"] <= t]
        if not before:
            continue
        last = before[-1]
        for r in recs:
            if t < r["t_end"] < next_time and (not r["committed"] or r["participants"] < last["participants"]
                                               or r["quorum_id"] != last["quorum_id"]):
                detect = r["t_backward"] if detect is None else min(detect, r["t_backward"])
                break
    recover = None
    if detect is not None:
        ends = [r["t_end"] for recs in survivors.values() for r in recs if r["committed"] and r["t_end"] >= detect]
        recover = min(ends) if ends else None
    lost = lost_rejoin = 0
    stop = recover if recover is not None else next_time
    for recs in survivors.values():
        lost = max(lost, sum(1 for r in recs if t <= r["t_end"] <= stop and not r["committed"]))
        lost_rejoin = max(lost_rejoin, sum(1 for r in recs if stop < r["t_end"] < next_time and not r["committed"]))
    joined = [r["t_end"] for r in by_replica.get(victim, []) if r["t_end"] > t and r["committed"]]
    joined_at = min(joined) if joined else None
    stall = None
    if joined_at is not None:
        spans = [r["t_end"] - r["t_start"] for recs in survivors.values() for r in recs
                 if joined_at - 1.0 <= r["t_end"] <= joined_at + 1.0]
        stall = max(spans) if spans else None
    _, _, samples_lost, samples_dup = totals(counts, t, next_time)
    return {"victim": victim, "kill_time": t,
            "detect_s": None if detect is None else detect - t,
            "recover_s": None if recover is None else recover - t,
            "steps_lost": lost, "steps_lost_at_rejoin": lost_rejoin,
            "joiner_startup_s": None if joined_at is None else joined_at - t,
            "rejoin_stall_s": stall, "samples_lost": samples_lost, "samples_duplicated": samples_dup}


def unequal_steps(steps: list[dict]) -> tuple[int, int]:
    """(committed steps whose replicas' parameter digests after the step differ, steps compared)."""
    hashes = defaultdict(set)
    for record in steps:
        if record["committed"] and "params_hash" in record:
            hashes[record["step"]].add(record["params_hash"])
    return sum(1 for digests in hashes.values() if len(digests) > 1), len(hashes)


def kept_within_run(counts: dict, kills: list[dict], start: float, end: float, settle_s: float = 3.0) -> float | None:
    """Committed samples of ``[start, end)`` / what the run's own steady rate would have committed.

    The steady rate is the median of the samples committed per whole second
    over the seconds that hold no kill and start ``settle_s`` or more after
    one. Unlike ``throughput_kept`` (against another run) it does not move
    with the load of the shared machine between the two runs.
    """
    seconds = int(end - start)
    if seconds < 1:
        return None
    per_second = [0] * seconds
    for time, trained, _, _ in counts.values():
        if start <= time < start + seconds:
            per_second[int(time - start)] += trained
    kill_times = [k["time"] - start for k in kills]
    steady = [n for i, n in enumerate(per_second)
              if not any(t - 1 < i < t + settle_s for t in kill_times)]
    rate = statistics.median(steady) if steady else 0
    return sum(per_second) / (rate * seconds) if rate else None


def median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(kills: list[dict], steps: list[dict], batches, start: float, end: float) -> dict:
    """The row's measured keys from the kills and every replica's step records in ``[start, end]``."""
    by_replica = defaultdict(list)
    for record in steps:
        by_replica[record["replica"]].append(record)
    counts = count_samples(commits(steps), batches)
    committed, samples, lost, dup = totals(counts, start, end)
    times = [k["time"] for k in kills] + [end]
    failures = [failure(kill, times[i + 1], by_replica, counts) for i, kill in enumerate(kills)]
    unequal, compared = unequal_steps(steps)
    return {"failures": len(kills), "per_failure": failures,
            "steps_replicas_unequal": unequal, "steps_replicas_compared": compared,
            "detect_s": median([f["detect_s"] for f in failures]),
            "detect_s_list": [f["detect_s"] for f in failures],
            "recover_s": median([f["recover_s"] for f in failures]),
            "recover_s_list": [f["recover_s"] for f in failures],
            "steps_lost_per_fault": median([f["steps_lost"] for f in failures]),
            "steps_lost_list": [f["steps_lost"] for f in failures],
            "steps_lost_at_rejoin_list": [f["steps_lost_at_rejoin"] for f in failures],
            "joiner_startup_s": median([f["joiner_startup_s"] for f in failures]),
            "joiner_startup_s_list": [f["joiner_startup_s"] for f in failures],
            "rejoin_stall_s_list": [f["rejoin_stall_s"] for f in failures],
            "samples_lost": lost, "samples_duplicated": dup,
            "throughput_kept_within_run": kept_within_run(counts, kills, start, end),
            "samples_per_s": samples / max(end - start, 1e-9),
            "committed_steps": committed,
            "attempts_uncommitted": sum(1 for r in steps if start <= r["t_end"] <= end and not r["committed"])}
