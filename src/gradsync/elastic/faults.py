"""Faults at the worst moments of an elastic run, for tests: ``--elastic-fault SLOT:WHERE:STEP``.

``WHERE`` is ``allreduce`` (slot SLOT dies inside the backward of optimizer
step STEP, once the first buckets' AllReduces are in flight: its peers are
left inside a bucket's AllReduce) or ``broadcast`` (slot SLOT, as rank 0 of
a membership that has a joiner, dies after sending the state's length and
before its payload, at the first such hand-over at or after step STEP).
Like ``--fail-at`` it fires once per run (the run folder's ``events.jsonl``
records it) and ends the process at once with
:data:`~gradsync.fault.injection.INJECTED_EXIT_CODE`.
"""

from __future__ import annotations

import os

from gradsync.fault.events import EventLog, read_events
from gradsync.fault.injection import INJECTED_EXIT_CODE

WHERE = ("allreduce", "broadcast")


def parse(text: str) -> tuple[int, str, int]:
    """``(slot, where, step)`` of ``--elastic-fault``.

    Raises:
        ValueError: malformed (the message names the option).
    """
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in WHERE or not parts[2].isdigit() \
            or int(parts[2]) < 1:
        raise ValueError(f"--elastic-fault {text!r} must be SLOT:WHERE:STEP (STEP >= 1) with WHERE one of "
                         f"{', '.join(WHERE)}")
    return int(parts[0]), parts[1], int(parts[2])


class ElasticFault:
    """The fault this slot injects (none unless the variable names it); ``next_step()`` is the step about to run."""

    def __init__(self, slot: int, where: str | None, step: int | None, events: EventLog, next_step):
        self.slot, self.where, self.step, self.events, self.next_step = slot, where, step, events, next_step

    @classmethod
    def from_config(cls, text: str | None, slot: int, events: EventLog, next_step) -> "ElasticFault":
        """The fault ``--elastic-fault`` (``text``) plans for ``slot``, unless it already fired in this run."""
        if not text:
            return cls(slot, None, None, events, next_step)
        target, where, step = parse(text)
        fired = any(e.get("event") == "fault" and e.get("slot") == slot for e in read_events(events.path.parent))
        if target != slot or fired:
            return cls(slot, None, None, events, next_step)
        return cls(slot, where, step, events, next_step)

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
        """The fault to run inside this membership's state hand-over (rank 0, a joiner present), or None."""
        if self.where != "broadcast" or membership.rank != 0 or self.next_step() < self.step:
            return None
        if not any(m["step"] < 0 for m in membership.members):
            return None
        return self._fire
