"""Faults at the worst moments of an elastic run, for tests: ``--elastic-fault SLOT:WHERE:STEP``.

``WHERE`` is ``allreduce`` (slot SLOT dies inside the backward of optimizer
step STEP, once the first buckets' AllReduces are in flight: its peers are
left inside a bucket's AllReduce) or ``broadcast`` (slot SLOT, as rank 0 of
a membership that has a joiner, dies after sending the state's length and
before its payload, at the first such hand-over at or after step STEP).
Like ``--fail-at`` it fires once per run (the run folder's ``events.jsonl``
records it) and ends the process at once with
:data:`~gradsync.fault.injection.INJECTED_EXIT_CODE`.

``,WORLD:hold:STEP`` may follow (or stand alone): every member of a
membership that starts at optimizer step STEP or later with fewer than WORLD
members holds before its hand-over until the quorum closes that membership
(a joiner or a relaunched worker has asked in), so that a test's joiners are
admitted before the run can end, however slowly the machine starts them.
It waits for that as long as it takes: for tests, not for runs.
"""

from __future__ import annotations

import os
import time

from gradsync.fault.events import EventLog, read_events
from gradsync.fault.injection import INJECTED_EXIT_CODE

WHERE = ("allreduce", "broadcast")
HOLD = "hold"
HOLD_POLL_S = 0.02  # how often a held member reads the run's events


def parse(text: str) -> tuple[int, str, int] | None:
    """``(slot, where, step)`` of ``--elastic-fault``, or None when it only holds (:func:`parse_hold`).

    Raises:
        ValueError: malformed (the message names the option).
    """
    kills = [item for item in _items(text) if item[1] != HOLD]
    return kills[0] if kills else None


def parse_hold(text: str | None) -> tuple[int, int] | None:
    """``(world, step)`` of the ``WORLD:hold:STEP`` item of ``--elastic-fault``, or None."""
    holds = [(world, step) for world, where, step in _items(text) if where == HOLD] if text else []
    return holds[0] if holds else None


def _items(text: str) -> list[tuple[int, str, int]]:
    items = [_item(text, part) for part in text.split(",")]
    if sum(where != HOLD for _, where, _ in items) > 1 or sum(where == HOLD for _, where, _ in items) > 1:
        raise ValueError(f"--elastic-fault {text!r}: at most one fault and one hold")
    return items


def _item(text: str, item: str) -> tuple[int, str, int]:
    parts = item.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in WHERE + (HOLD,) or not parts[2].isdigit() \
            or int(parts[2]) < 1:
        raise ValueError(f"--elastic-fault {text!r} must be SLOT:WHERE:STEP (STEP >= 1) with WHERE one of "
                         f"{', '.join(WHERE)}, optionally followed by ,WORLD:{HOLD}:STEP")
    return int(parts[0]), parts[1], int(parts[2])


class ElasticFault:
    """The fault this slot injects (none unless the variable names it); ``next_step()`` is the step about to run."""

    def __init__(self, slot: int, where: str | None, step: int | None, events: EventLog, next_step,
                 hold: tuple[int, int] | None = None):
        self.slot, self.where, self.step, self.events, self.next_step = slot, where, step, events, next_step
        self.hold = hold

    @classmethod
    def from_config(cls, text: str | None, slot: int, events: EventLog, next_step) -> "ElasticFault":
        """The fault ``--elastic-fault`` (``text``) plans for ``slot``, unless it already fired in this run
        (a hold is every slot's, every time)."""
        hold = parse_hold(text)
        fault = parse(text) if text else None
        if fault is None:
            return cls(slot, None, None, events, next_step, hold)
        target, where, step = fault
        fired = any(e.get("event") == "fault" and e.get("slot") == slot for e in read_events(events.path.parent))
        if target != slot or fired:
            return cls(slot, None, None, events, next_step, hold)
        return cls(slot, where, step, events, next_step, hold)

    def _fire(self) -> None:
        self.events.write({"event": "fault", "fault": f"kill in {self.where}", "slot": self.slot,
                           "rank": self.slot, "step": self.next_step()})
        os._exit(INJECTED_EXIT_CODE)

    def arm_allreduce(self, module) -> None:
        """Die in the backward of step ``step`` once the first parameter's gradient is ready (the one
        DataParallel reduces last: the earlier buckets are on the wire by then)."""
        if self.where != "allreduce" or self.next_step() > self.step:
            return
        first = next(p for p in module.parameters() if p.requires_grad)
        first.register_post_accumulate_grad_hook(lambda param: self._fire() if self.next_step() == self.step
                                                 else None)

    def broadcast_hook(self, membership):
        """The fault to run inside this membership's state hand-over (rank 0, a joiner present), or None.

        Called by every member before the hand-over: a ``WORLD:hold:STEP`` holds here first."""
        self._hold(membership)
        if self.where != "broadcast" or membership.rank != 0 or self.next_step() < self.step:
            return None
        if not any(m["step"] < 0 for m in membership.members):
            return None
        return self._fire

    def _hold(self, membership) -> None:
        """Wait until the quorum closes ``membership`` (or the run ends) if the hold applies to it.

        Every member decides alike (the membership's size and its source's step), before any collective.
        """
        if self.hold is None:
            return
        world, step = self.hold
        if membership.world_size >= world or membership.record["step"] + 1 < step:
            return
        self.events.write({"event": "hold", "slot": self.slot, "epoch": membership.epoch,
                           "world_size": membership.world_size, "until_world": world})
        while not self._closed(membership.epoch):
            time.sleep(HOLD_POLL_S)

    def _closed(self, epoch: int) -> bool:
        try:
            events = read_events(self.events.path.parent)
        except ValueError:  # a line being written right now: read again
            return False
        return any((e.get("event") == "change" and e.get("epoch") == epoch) or e.get("event") in ("done", "failed")
                   for e in events)
