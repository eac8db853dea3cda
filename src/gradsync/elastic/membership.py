"""The membership an elastic ``Trainer`` asks at every step boundary: changed? then rank 0 hands over.

:class:`~gradsync.train.loop.Trainer` runs one loop for every run; what a
membership decides is asked of an object with this interface (a static run's
:class:`~gradsync.train.loop.StaticMembership` never changes):

- ``join(step)`` once, then ``enter()`` per membership: a :class:`View` (this
  rank, the world size, the membership's number), or None when this worker
  was evicted or the run ended;
- ``at_step_boundary()`` before each step: raises
  :class:`~gradsync.elastic.member.MembershipChanged` once the quorum closed
  the membership;
- ``recoverable``: the errors after which ``leave(step, error)`` hands the
  worker back to the quorum instead of ending the run;
- ``finish()`` / ``wait_end()`` at the end; ``before_step`` / ``committed``
  record each step's sample ids (:mod:`~gradsync.elastic.samples`);
  ``handover_fault`` / ``arm`` are the fault-injection points of
  :mod:`~gradsync.elastic.fault_points`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from gradsync import process_group
from gradsync.elastic.fault_points import ElasticFault
from gradsync.elastic.member import FATAL_AFTER, RECOVERABLE, ElasticMember, Evicted, MembershipChanged, transient
from gradsync.elastic.samples import SAMPLES_FOLDER


@dataclass(frozen=True)
class View:
    """One membership as a member sees it: its ``rank`` among ``world_size`` members, the membership's
    number ``epoch`` (0 for a static run), and the quorum's :class:`~gradsync.elastic.member.Membership`
    (None for a static run)."""

    rank: int
    world_size: int
    epoch: int = 0
    quorum: object = None


class ElasticMembership:
    """Slot ``member.slot`` of an elastic run (:class:`~gradsync.elastic.member.ElasticMember`) as the
    trainer asks it; ``elastic_fault``: ``--elastic-fault``'s text (None: no fault)."""

    elastic = True
    recoverable = RECOVERABLE

    def __init__(self, member: ElasticMember, out_dir: Path, elastic_fault: str | None = None):
        self.member, self.slot = member, member.slot
        self.out_dir, self.elastic_fault = Path(out_dir), elastic_fault
        self.fault: ElasticFault | None = None
        self.events = None
        self.futile = (-1, 0)  # (step, times in a row it failed with an error no peer caused)
        path = self.out_dir / SAMPLES_FOLDER / f"samples-{member.slot}.{member.incarnation}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        # one handle for the run, a line each write (buffering=1): a kill loses at most a torn last line
        self.samples = open(path, "a", encoding="utf-8", buffering=1)

    def seed(self, base: int) -> int:
        """This process's own RNG stream: (seed, slot, incarnation), so a replacement draws anew."""
        return base * 1_000_003 + self.member.slot * 1009 + self.member.incarnation

    def attach(self, events, next_step) -> None:
        """The run's event log and a callable giving the step about to run (for fault injection)."""
        self.events = events
        self.fault = ElasticFault.from_config(self.elastic_fault, self.slot, events, next_step)

    def join(self, step: int) -> None:
        self.member.join(step=step)

    def enter(self) -> View | None:
        try:
            membership = self.member.enter()
        except Evicted:
            return None
        return View(membership.rank, membership.world_size, membership.epoch, membership)

    def at_step_boundary(self) -> None:
        if self.member.change_requested():
            raise MembershipChanged("the quorum closed this membership")

    def handover_fault(self, view: View):
        return self.fault.broadcast_hook(view.quorum)

    def arm(self, module) -> None:
        self.fault.arm_allreduce(module)

    def before_step(self, step: int, epoch: int, micro_batches: list) -> None:
        """Record the sample ids this member computes ``step`` on (before the step's collectives)."""
        ids = torch.cat(micro_batches).tolist() if micro_batches else []
        self._record({"m": self.member.membership.epoch, "step": step, "epoch": epoch, "ids": ids})

    def committed(self, step: int) -> None:
        """Record ``step`` as committed: a member killed before this line still counts, as long as some member
        committed that step in that membership (its gradient was in every member's sum)."""
        self._record({"m": self.member.membership.epoch, "commit": step})

    def _record(self, record: dict) -> None:
        self.samples.write(json.dumps(record) + "\n")

    def leave(self, step: int, error: BaseException) -> None:
        """Hand this worker back to the quorum after ``error``; an error no peer caused that repeats at the
        same step :data:`FATAL_AFTER` times ends the run instead (raised again)."""
        if not transient(error):
            self.futile = (step, self.futile[1] + 1 if self.futile[0] == step else 1)
            if self.futile[1] >= FATAL_AFTER:
                self.member.fail(error)
                raise error
        self.events.write({"event": "left", "slot": self.slot, "incarnation": self.member.incarnation,
                           "epoch": self.member.membership.epoch, "step": step,
                           "error": f"{type(error).__name__}: {error}"[:300]})
        self.member.leave(step, error)

    def fail(self, error: BaseException) -> None:
        self.member.fail(error)

    def finish(self) -> None:
        self.member.finish()

    def wait_end(self) -> bool:
        """True once the run is done (the group is shut down); False when the membership closed first."""
        if not self.member.wait_end():
            raise MembershipChanged("the membership closed before the run ended")
        process_group.shutdown()
        return True

    def summary_fields(self) -> dict:
        return {"elastic": True, "memberships": self.member.membership.epoch}


class StaticMembership:
    """The group torch's agent started (``gradsync.init()`` done): one membership that never changes."""

    elastic = False
    recoverable = ()  # nothing is handed back: a failure ends the run (torch's agent may restart it)

    def __init__(self):
        self.slot = process_group.rank()

    def seed(self, base: int) -> int:
        return base

    def attach(self, events, next_step) -> None:
        pass

    def join(self, step: int) -> None:
        pass

    def enter(self) -> View:
        return View(process_group.rank(), process_group.world_size())

    def at_step_boundary(self) -> None:
        pass

    def before_step(self, step: int, epoch: int, micro_batches: list) -> None:
        pass

    def committed(self, step: int) -> None:
        pass

    def fail(self, error: BaseException) -> None:
        pass

    def finish(self) -> None:
        pass

    def wait_end(self) -> bool:
        return True

    def summary_fields(self) -> dict:
        return {}
