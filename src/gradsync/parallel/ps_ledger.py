"""What the elastic parameter server must remember to apply every step exactly once across failures.

Two records, both checkpointed with the parameters:

* steps: the server hands out steps ``0 .. total_steps-1``; a step handed out
  and not applied is *assigned*. When a membership re-forms, every assigned
  step that no survivor replayed is handed out again (its worker died with
  it), and a step applied from a replay after a restart (handed out by the
  server's previous life, after its checkpoint) is never handed out again.
* sequence numbers: each worker slot numbers its pushes; the server keeps,
  per slot, the highest number it applied and drops a push numbered at or
  below it (a replay of a push it already applied). Pushes of one slot are
  applied in their order (a worker has one push outstanding at a time and
  replays in order), so one number per slot is the whole record.

>>> ledger = Ledger(total_steps=4)
>>> [ledger.take(slot=s) for s in (0, 1)], ledger.accept(slot=0, seq=1)
([0, 1], True)
>>> ledger.complete(0, slot=0, seq=1)
>>> ledger.accept(slot=0, seq=1)  # its replay: dropped
False
>>> ledger.requeue_assigned(), ledger.take(slot=2)  # slot 1 died holding step 1: it goes to slot 2
([1], 1)
"""

from __future__ import annotations


def incarnation_seq(incarnation: int, count: int) -> int:
    """Sequence number of a slot's ``count``-th push (from 1) in ``incarnation``: later incarnations
    number above every earlier one, so a replacement never needs the server to tell it where to start."""
    return (incarnation << 32) + count


class Ledger:
    """Steps handed out and applied, and per slot the highest applied sequence number.

    Args:
        total_steps: steps of the run (>= 0).

    Attributes:
        next_step: the lowest step never handed out (steps below it are applied, assigned or requeued).
        requeue: steps to hand out again, lowest first.
        ahead: steps >= ``next_step`` already applied (from replays after a restart): skipped.
        assigned: ``{step: slot}`` handed out, not applied.
        applied_seq: ``{slot: highest sequence number applied}``.
        duplicates: pushes dropped as already applied.
    """

    def __init__(self, total_steps: int):
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise ValueError(f"total_steps must be an int >= 0, got {total_steps!r}")
        self.total_steps = total_steps
        self.next_step = 0
        self.requeue: list[int] = []
        self.ahead: set[int] = set()
        self.assigned: dict[int, int] = {}
        self.applied_seq: dict[int, int] = {}
        self.duplicates = 0

    def take(self, slot: int) -> int | None:
        """The next step for ``slot`` (requeued ones first), now assigned to it; None when none is left."""
        if self.requeue:
            step = self.requeue.pop(0)
        else:
            while self.next_step in self.ahead:
                self.ahead.discard(self.next_step)
                self.next_step += 1
            if self.next_step >= self.total_steps:
                return None
            step, self.next_step = self.next_step, self.next_step + 1
        self.assigned[step] = slot
        return step

    def accept(self, slot: int, seq: int) -> bool:
        """Whether a push numbered ``seq`` from ``slot`` is new (False: a duplicate, counted and to be dropped)."""
        if seq <= self.applied_seq.get(slot, 0):
            self.duplicates += 1
            return False
        return True

    def pending(self, step: int) -> bool:
        """Whether ``step`` still needs its gradient (False: outside the run or applied already, which
        only a second failure before a checkpoint could cause; such a push is dropped and counted)."""
        if 0 <= step < self.total_steps and (step in self.assigned or step in self.requeue
                                             or (step >= self.next_step and step not in self.ahead)):
            return True
        self.duplicates += 1
        return False

    def complete(self, step: int, slot: int, seq: int) -> None:
        """Record the push ``seq`` of ``slot`` (gradient of ``step``) as applied.

        Raises:
            ValueError: ``step`` is outside the run, or was applied already (it was not assigned,
                not requeued, and is below ``next_step``).
        """
        if not 0 <= step < self.total_steps:
            raise ValueError(f"parameter server: slot {slot} pushed step {step}, outside 0..{self.total_steps - 1}")
        if step in self.assigned:
            del self.assigned[step]
        elif step in self.requeue:
            self.requeue.remove(step)
        elif step >= self.next_step and step not in self.ahead:
            self.ahead.add(step)
        else:
            raise ValueError(f"parameter server: slot {slot} pushed step {step}, which was applied already")
        self.applied_seq[slot] = max(seq, self.applied_seq.get(slot, 0))

    def requeue_assigned(self) -> list[int]:
        """Hand every assigned step out again (call once a new membership's survivors have replayed); returns them."""
        steps = sorted(self.assigned)
        self.requeue = sorted(set(self.requeue) | set(steps))
        self.assigned.clear()
        return steps

    def state_dict(self) -> dict:
        return {"total_steps": self.total_steps, "next_step": self.next_step, "requeue": list(self.requeue),
                "ahead": sorted(self.ahead), "assigned": {int(k): int(v) for k, v in self.assigned.items()},
                "applied_seq": {int(k): int(v) for k, v in self.applied_seq.items()}, "duplicates": self.duplicates}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: it was written for another number of steps.
        """
        if int(state["total_steps"]) != self.total_steps:
            raise ValueError(f"the checkpoint's run has {state['total_steps']} steps, this one {self.total_steps}")
        self.next_step, self.duplicates = int(state["next_step"]), int(state["duplicates"])
        self.requeue, self.ahead = [int(s) for s in state["requeue"]], {int(s) for s in state["ahead"]}
        self.assigned = {int(k): int(v) for k, v in state["assigned"].items()}
        self.applied_seq = {int(k): int(v) for k, v in state["applied_seq"].items()}
