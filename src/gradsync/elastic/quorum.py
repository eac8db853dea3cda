"""The quorum: who trains in the next membership, decided by one process from the run's events.

A membership (an *epoch* of the quorum, numbered from 1) is an ordered list
of members; a member is a worker slot and its incarnation (a relaunched
worker is the same slot, one incarnation later). Rank ``i`` of the
membership is ``members[i]``, and rank 0 is always the *source*: the member
with the most committed steps, whose parameters, optimizer, schedule and
data position every other member takes (so a member that committed a step
its peers did not commit, when a failure cut the step's AllReduce short on
some ranks only, brings the others forward rather than the reverse).

Events (``gradsync.elastic.run_store.post``):
``join`` (slot, incarnation, step): a worker waits to be admitted;
``died`` (slot, incarnation, exitcode): its launcher saw the process end;
``ready`` (slot, incarnation, epoch, step, suspect, closed): a member left
epoch ``epoch`` (a collective failed, or it saw the change asked for) with
``step`` steps committed, suspects slot ``suspect`` of hanging, or saw slot
``closed``'s connection close (a member reports before it closes, so one
that closed without reporting is dead: a lost host has no launcher left to
say so);
``fatal`` (slot, error): an error recovery cannot cure, which ends the run;
``finished`` (slot, incarnation, epoch): it trained to the end (rank 0's, sent
once the run folder is written, ends the run; the others wait for ``q/done``
or ``q/next/<e>``, so that a failure in the last collectives is recovered too).

Keys the quorum writes: ``q/next/<e>`` (epoch ``e`` is over: its members
stop at their next step boundary or failed collective), ``q/members/<e>``
(the membership), ``q/epoch`` (the newest epoch), ``q/evict/<slot>/<inc>``
(its launcher kills that process: it hung, or stopped answering the
quorum), ``q/done`` / ``q/failed`` (the run's end). The same idea as
torchft's Lighthouse (a per-step quorum kept apart from the workers), with
death seen by the launchers at once instead of by heartbeats.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

HEARTBEAT_STALE_S = 2.0   # a member of a closing membership whose heartbeat has not moved this long is gone
HEARTBEAT_READ_S = 0.1    # how often the quorum reads a pending member's heartbeat


@dataclass
class Member:
    slot: int
    incarnation: int
    step: int = -1      # optimizer steps committed (-1: a fresh process with nothing to offer)
    host: str = ""

    @property
    def key(self) -> tuple[int, int]:
        return self.slot, self.incarnation

    def as_dict(self) -> dict:
        return {"slot": self.slot, "incarnation": self.incarnation, "step": self.step, "host": self.host}


@dataclass
class Change:
    """An epoch being closed: who has answered, who is gone."""

    reason: str
    started: float
    ready: dict = field(default_factory=dict)     # slot -> Member (with its committed step)
    gone: dict = field(default_factory=dict)      # slot -> why ("died", "evicted: ...")
    suspects: dict = field(default_factory=dict)  # slot -> the slot that suspected it


class Quorum:
    """Decides memberships from events; writes its decisions to ``store``.

    Args:
        nproc: members of the first membership (it waits up to ``startup_s`` for them, then starts with
            ``min_nproc`` or more).
        min_nproc / max_nproc: bounds of every membership; below ``min_nproc`` the run waits up to
            ``rejoin_s`` for joiners, then fails (``q/failed``).
        timeout_s: how long a member of a closing epoch may take to answer before it is evicted.
    """

    def __init__(self, store, nproc: int, min_nproc: int, max_nproc: int, timeout_s: float,
                 startup_s: float = 120.0, rejoin_s: float = 60.0, clock=time.monotonic, log=None):
        self.store, self.clock, self.log = store, clock, log or (lambda record: None)
        self.nproc, self.min_nproc, self.max_nproc = nproc, min_nproc, max_nproc
        self.timeout_s, self.startup_s, self.rejoin_s = timeout_s, startup_s, rejoin_s
        self.epoch = 0
        self.members: list[Member] = []
        self.joiners: dict[int, Member] = {}
        self.change: Change | None = None
        self.finished: set[int] = set()
        self.started = clock()
        self.outcome: str | None = None  # "done" / "failed: ..." once the run is over
        self.beats: dict[tuple[int, int], tuple[int, float, float]] = {}  # member -> (count, moved at, read at)

    # -- events --------------------------------------------------------------------------------

    def handle(self, event: dict) -> None:
        kind = event["kind"]
        if kind == "join":
            self._on_join(Member(event["slot"], event["incarnation"], event.get("step", -1), event.get("host", "")))
        elif kind == "died":
            self._on_gone(event["slot"], event["incarnation"], f"died (exit code {event.get('exitcode')})")
        elif kind == "ready":
            self._on_ready(event)
        elif kind == "finished":
            self._on_finished(event)
        elif kind == "fatal" and self.outcome is None:
            self._end("failed", {"reason": f"slot {event['slot']}: {event['error']}"})

    def _member(self, slot: int, incarnation: int) -> Member | None:
        return next((m for m in self.members if m.key == (slot, incarnation)), None)

    def _on_join(self, member: Member) -> None:
        if self.outcome is not None:
            return
        self.joiners[member.slot] = member
        if self.epoch and self.change is None and len(self.members) < self.max_nproc:
            self._begin_change(f"slot {member.slot} joins")

    def _on_gone(self, slot: int, incarnation: int, why: str) -> None:
        joiner = self.joiners.get(slot)
        if joiner is not None and joiner.incarnation == incarnation:
            del self.joiners[slot]
        if self._member(slot, incarnation) is None or self.outcome is not None:
            return
        if self.change is None:
            self._begin_change(f"slot {slot} {why}")
        self.change.gone.setdefault(slot, why)

    def _on_ready(self, event: dict) -> None:
        member = self._member(event["slot"], event["incarnation"])
        if member is None or event["epoch"] != self.epoch or self.outcome is not None:
            return
        if self.change is None:
            self._begin_change(event.get("reason") or f"slot {member.slot} left epoch {self.epoch}")
        member.step = event["step"]
        self.change.ready[member.slot] = member
        suspect = event.get("suspect")
        if suspect is not None and suspect != member.slot:
            self.change.suspects.setdefault(suspect, member.slot)
        closed = event.get("closed")
        if closed is not None and closed not in self.change.ready and closed != member.slot:
            gone = next((m for m in self.members if m.slot == closed), None)
            if gone is not None and closed not in self.change.gone:
                self._evict(gone, f"its connection closed before it reported (seen by slot {member.slot})")

    def _on_finished(self, event: dict) -> None:
        if self._member(event["slot"], event["incarnation"]) is None or event["epoch"] != self.epoch:
            return
        self.finished.add(event["slot"])
        if self.change is None and self.members[0].slot == event["slot"]:
            self._end("done", {"epoch": self.epoch, "members": [m.as_dict() for m in self.members]})

    # -- decisions -----------------------------------------------------------------------------

    def tick(self) -> None:
        """Act on time: form the first membership, evict members that do not answer, publish."""
        if self.outcome is not None:
            return
        now = self.clock()
        if self.epoch == 0:
            waited = now - self.started
            if len(self.joiners) >= self.nproc or (waited > self.startup_s and len(self.joiners) >= self.min_nproc):
                self._publish("start", [])
            elif waited > self.startup_s:
                self._end("failed", {"reason": f"only {len(self.joiners)} of --min-nproc {self.min_nproc} workers "
                                               f"joined within {self.startup_s:g} s"})
            return
        change = self.change
        if change is None:
            return
        pending = [m for m in self.members if m.slot not in change.ready and m.slot not in change.gone]
        for member in pending:
            if self._heartbeat_stopped(member, now):
                self._evict(member, f"evicted: its heartbeat stopped for {HEARTBEAT_STALE_S:g} s")
        pending = [m for m in pending if m.slot not in change.gone]
        if pending:
            innocent = [m for m in pending if m.slot not in change.suspects]
            late = now - change.started > self.timeout_s
            for member in pending:
                if late or (not innocent and member.slot in change.suspects):
                    why = (f"evicted: suspected of hanging by slot {change.suspects[member.slot]}"
                           if member.slot in change.suspects else f"evicted: no answer within {self.timeout_s:g} s")
                    self._evict(member, why)
            if any(m.slot not in change.ready and m.slot not in change.gone for m in self.members):
                return
        if len(change.ready) + len(self.joiners) < self.min_nproc:
            if not self.store.check(["q/waiting"]):
                self.store.set("q/waiting", json.dumps({"epoch": self.epoch, "workers": len(change.ready),
                                                        "joiners": len(self.joiners), "rejoin_s": self.rejoin_s}))
            if now - change.started > self.rejoin_s:
                self._end("failed", {"reason": f"{len(change.ready)} workers left, fewer than --min-nproc "
                                               f"{self.min_nproc}, and no replacement joined within "
                                               f"{self.rejoin_s:g} s"})
            return
        self._publish(change.reason, sorted(change.gone.items()))

    def _heartbeat_stopped(self, member: Member, now: float) -> bool:
        """Whether ``member``'s heartbeat counter has not moved for :data:`HEARTBEAT_STALE_S` (read at most
        every :data:`HEARTBEAT_READ_S`; a member that never beat is judged from the change's start)."""
        seen = self.beats.get(member.key)
        if seen is not None and now - seen[2] < HEARTBEAT_READ_S:
            return now - seen[1] > HEARTBEAT_STALE_S
        count = int(self.store.add(f"hb/{member.slot}/{member.incarnation}", 0))
        if seen is None or count != seen[0]:
            seen = (count, now if seen is not None or count else self.change.started, now)
        else:
            seen = (count, seen[1], now)
        self.beats[member.key] = seen
        return now - seen[1] > HEARTBEAT_STALE_S

    def _begin_change(self, reason: str) -> None:
        self.change = Change(reason, self.clock())
        self.store.set(f"q/next/{self.epoch}", reason)
        self.log({"event": "change", "epoch": self.epoch, "reason": reason, "time": time.time()})

    def _evict(self, member: Member, why: str) -> None:
        self.change.gone[member.slot] = why
        self.store.set(f"q/evict/{member.slot}/{member.incarnation}", why)
        self.log({"event": "evict", "slot": member.slot, "incarnation": member.incarnation, "why": why,
                  "time": time.time()})

    def _publish(self, reason: str, left: list) -> None:
        survivors = [m for m in self.change.ready.values() if m.slot not in self.change.gone] if self.change else []
        room = self.max_nproc - len(survivors)
        joiners = sorted(self.joiners.values(), key=lambda m: (-m.step, m.slot))[:max(room, 0)]
        for member in joiners:
            del self.joiners[member.slot]
        everyone = survivors + joiners
        source = min(everyone, key=lambda m: (-m.step, m.slot))
        ordered = [source] + sorted((m for m in everyone if m is not source), key=lambda m: m.slot)
        self.epoch += 1
        self.members, self.change, self.finished = ordered, None, set()
        self.store.delete_key("q/waiting")
        record = {"epoch": self.epoch, "members": [m.as_dict() for m in ordered], "source": source.slot,
                  "step": source.step, "reason": reason, "left": [{"slot": s, "why": w} for s, w in left],
                  "joined": [m.slot for m in joiners], "time": time.time()}
        self.store.set(f"q/members/{self.epoch}", json.dumps(record))
        self.store.set("q/epoch", str(self.epoch))
        self.log({"event": "membership", **record})
        if len(self.members) < self.max_nproc and self.joiners:
            self._begin_change("more joiners are waiting")

    def _end(self, outcome: str, record: dict) -> None:
        self.outcome = outcome
        self.store.set(f"q/{outcome}", json.dumps(record))
        self.log({"event": outcome, **record, "time": time.time()})
