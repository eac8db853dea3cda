"""One definition of every per-failure figure of the elastic bench, for gradsync's and torchft's logs alike.

Each library maps its own records to a :class:`RunEvents` (gradsync:
:func:`gradsync.bench.faults_elastic.run_events`, from ``events.jsonl`` and
``metrics.jsonl``; torchft: :func:`gradsync.bench.torchft_metrics.run_events`,
from its replicas' step records). Times are wall-clock ``time.time()``
seconds. A step's *index* is the number of steps committed before it (the
first step is 0). Per failure (a worker killed or hung at wall time ``t``,
the next failure at ``until``), :func:`failure_figures` gives:

- ``detect_s``: ``t`` -> the first *survivor attempt* that shows the loss: a
  step attempt of a member other than the victim that failed (its collective
  failed or timed out), or that saw a changed membership (gradsync: the
  quorum closed the membership at a step boundary; torchft: a new quorum id or
  fewer participants than its previous step). gradsync's launcher sees a kill
  earlier still, but torchft has no such event, so it does not count.
- ``recover_s``: ``t`` -> the first step committed at or after the detection
  (gradsync: rank 0's step record; torchft: the first replica's). A step that
  was past its AllReduce when the kill came may commit between ``t`` and the
  detection: it is not the recovery.
- ``steps_redone``: the steps run again because of the failure: the committed
  steps the survivors lost (the highest index committed before the detection,
  + 1, minus the recovery's index) plus the step in flight, once per time it
  failed (the most failed attempts of one survivor, from ``t`` to the
  recovery, at indices the recovery had not committed). A kill between two
  steps, or one seen as a changed membership before any step failed, costs 0.
- ``joiner_s``: ``t`` -> the relaunched victim's first committed step (for
  torchft its healing step counts: it commits without training a piece).

:func:`pooled` summarises the failures of every repetition (median, min and
max of each figure over all of them) and :func:`paired_kept` forms the
throughput kept within each repetition (chaos samples/s over the same
repetition's fault-free samples/s). Samples/s, for both: the samples of the
steps committed from the run's first committed step (gradsync) or first
full quorum (torchft) on, per second of that window: start-up is left out.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from gradsync.bench.spread import paired_ratios, with_spread

FIGURES = ("detect_s", "recover_s", "steps_redone", "joiner_s")


@dataclass
class RunEvents:
    """One run's records in the common form (wall-clock seconds, step indices from 0).

    ``commits``: ``(time, index)`` of every committed step (the same index twice when a
    committed step was lost and run again); ``failed``: ``(time, member, index)`` of every step
    attempt that did not commit; ``changed``: ``(time, member)`` of every attempt that saw a changed
    membership without failing a step; ``joined``: ``(time, member)`` of a member's committed steps
    (at least its first after each (re)start).
    """

    commits: list[tuple[float, int]] = field(default_factory=list)
    failed: list[tuple[float, int, int]] = field(default_factory=list)
    changed: list[tuple[float, int]] = field(default_factory=list)
    joined: list[tuple[float, int]] = field(default_factory=list)


def failure_figures(events: RunEvents, kill_time: float, victim: int, until: float = float("inf")) -> dict:
    """The figures of one failure (the module docstring's definitions); None where the logs lack the event.

    Args: ``kill_time`` wall-clock s of the kill or hang; ``victim`` the member (slot, replica) that
    failed; ``until`` the next failure's time (events from then on belong to it).
    """
    signals = [time for time, member, _ in events.failed if member != victim and kill_time <= time < until]
    signals += [time for time, member in events.changed if member != victim and kill_time <= time < until]
    detect = min(signals, default=None)
    joins = [time for time, member in events.joined if member == victim and kill_time < time < until]
    figures = {"victim": victim, "kill_time": kill_time, "detect_s": None, "recover_s": None,
               "steps_redone": None, "joiner_s": min(joins) - kill_time if joins else None}
    if detect is None:
        return figures
    figures["detect_s"] = detect - kill_time
    after = sorted((time, index) for time, index in events.commits if detect <= time < until)
    if not after:
        return figures
    recover, resumed = after[0]
    figures["recover_s"] = recover - kill_time
    reached = max((index for time, index in events.commits if time < detect), default=-1)
    retried = Counter(member for time, member, index in events.failed
                      if member != victim and kill_time <= time <= recover and index >= resumed and index > reached)
    figures["steps_redone"] = max(reached + 1 - resumed, 0) + max(retried.values(), default=0)
    return figures


def all_failures(events: RunEvents, faults: list[dict], end: float = float("inf")) -> list[dict]:
    """:func:`failure_figures` of each fault ``{"time", "victim"}`` (in time order), each until the next."""
    faults = sorted(faults, key=lambda fault: fault["time"])
    times = [fault["time"] for fault in faults[1:]] + [end]
    return [failure_figures(events, fault["time"], fault["victim"], until) for fault, until in zip(faults, times)]


def pooled(failures: list[dict]) -> dict:
    """Each figure over every failure given (all repetitions pooled): ``name`` (the median), ``name_median``,
    ``name_min``, ``name_max``, all None when no failure measured it; ``name_missing``: failures without it."""
    row = {"failures": len(failures)}
    for name in FIGURES:
        values = [failure[name] for failure in failures if failure.get(name) is not None]
        row.update(with_spread(name, values) if values else dict.fromkeys(
            (name, f"{name}_median", f"{name}_min", f"{name}_max")))
        row[f"{name}_missing"] = len(failures) - len(values)
    return row


def paired_kept(chaos_samples_per_s: list[float], fault_free_samples_per_s: list[float]) -> dict:
    """``throughput_kept`` (median, min, max over repetitions) of chaos samples/s over the fault-free
    samples/s of the same repetition, and both throughputs' own spreads.

    Raises:
        ValueError: the two lists differ in length or are empty, or a fault-free throughput is not positive.
    """
    ratios = paired_ratios(chaos_samples_per_s, fault_free_samples_per_s)
    return {**with_spread("throughput_kept", ratios), **with_spread("samples_per_s", chaos_samples_per_s),
            **with_spread("fault_free_samples_per_s", fault_free_samples_per_s),
            "throughput_kept_list": ratios}


def reference_fields() -> dict:
    """What a fault-free reference row holds for every comparative figure: None (it is not compared)."""
    names = [f"{name}{suffix}" for name in FIGURES + ("throughput_kept",)
             for suffix in ("", "_median", "_min", "_max")]
    return {**dict.fromkeys(names), "bitwise_equal_to_fault_free": None, "failures": 0}
