"""A worker's side of an elastic run: join, take part in one membership after another, leave.

Around a training step (what ``gradsync train --elastic`` does)::

    member = ElasticMember(store, slot, incarnation, timeout_s=30)
    member.join(step=-1)
    while True:
        membership = member.enter()          # a fresh communicator among this membership's members
        try:
            state = sync_from_rank0(state)   # rank 0 is the member with the most committed steps
            while not finished:
                if member.change_requested():
                    raise MembershipChanged(...)
                train_one_step()             # collectives raise when a peer dies or hangs
        except member.RECOVERABLE as exc:
            member.leave(committed_steps, exc)   # then loop: the next membership

A death anywhere shows at once: a Gloo peer's socket closes, a shared-memory
peer's process is gone or has closed its mapping, a launcher reports its
process's exit to the quorum. A rank that leaves a membership shuts its
communicator down, which closes its sockets and mappings, so every peer still
waiting on it fails at once too, instead of at its timeout.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from gradsync import process_group
from gradsync.elastic.run_store import get_json, post, wait_json, wait_key
from gradsync.errors import GradsyncError

# Errors after which a member leaves its membership and joins the next: a collective that failed
# (a peer died, hung, or left), or torch.distributed's own error when a group could not form.
RECOVERABLE = (GradsyncError, RuntimeError, TimeoutError, ConnectionError)
POLL_S = 0.005
log = logging.getLogger(__name__)


# The errors a failure of a peer causes; others (a mismatch, a divergence, a bug) are bounded: the same step
# failing with one of them FATAL_AFTER times in a row ends the run (:meth:`ElasticMember.fail`).
FATAL_AFTER = 3


def transient(error: BaseException) -> bool:
    from gradsync.errors import CollectiveTimeoutError, GroupClosedError

    return isinstance(error, (CollectiveTimeoutError, MembershipChanged, GroupClosedError, TimeoutError,
                              ConnectionError))


class MembershipChanged(GradsyncError):
    """The quorum closed this membership (a worker joins or left): stop at this step boundary."""


class Evicted(GradsyncError):
    """This worker is not in the run any more (the run ended or failed without it)."""


@dataclass
class Membership:
    epoch: int
    rank: int
    world_size: int
    members: list[dict]   # {"slot", "incarnation", "step", "host"} by rank; rank 0 is the source
    reason: str
    record: dict

    def slot_of(self, rank: int) -> int:
        return self.members[rank]["slot"]

    def rank_of(self, slot: int) -> int | None:
        return next((rank for rank, m in enumerate(self.members) if m["slot"] == slot), None)


class ElasticMember:
    """This worker's membership in an elastic run whose quorum service serves ``store``."""

    def __init__(self, store, slot: int, incarnation: int, timeout_s: float, backend: str = "auto",
                 wait_s: float = 600.0):
        self.store, self.slot, self.incarnation = store, slot, incarnation
        self.timeout_s, self.backend, self.wait_s = timeout_s, backend, wait_s
        self.membership: Membership | None = None
        self.next_epoch = 1
        self.heartbeat_stop = threading.Event()

    def join(self, step: int = -1) -> None:
        """Ask to be admitted; ``step`` is what this worker could offer (-1: nothing, a fresh process).

        Also starts this process's heartbeat (a counter in the store, every :data:`HEARTBEAT_S`), which
        the quorum reads while it closes a membership: a member whose process is gone and whose launcher
        is gone with it (a lost host) stops beating and is evicted without waiting for its timeout.
        """
        start_heartbeat(self.store, self.slot, self.incarnation, self.timeout_s, self.heartbeat_stop)
        current = self.store.get("q/epoch").decode() if self.store.check(["q/epoch"]) else "0"
        self.next_epoch = int(current) + 1
        post(self.store, "join", slot=self.slot, incarnation=self.incarnation, step=step, pid=os.getpid(),
             host=socket.gethostname())

    def stop_heartbeat(self) -> None:
        """End this process's heartbeat (the run is over for it)."""
        self.heartbeat_stop.set()

    def enter(self) -> Membership:
        """Wait for the next membership that includes this worker and form its communicator.

        Raises:
            Evicted: the run ended or failed, or this worker was evicted.
            TimeoutError: no membership within ``wait_s``.
        """
        deadline = time.monotonic() + self.wait_s
        while True:
            record = self._wait_epoch(self.next_epoch, deadline)
            self.next_epoch = record["epoch"] + 1
            keys = [(m["slot"], m["incarnation"]) for m in record["members"]]
            if (self.slot, self.incarnation) in keys:
                break
        rank = keys.index((self.slot, self.incarnation))
        self.membership = Membership(record["epoch"], rank, len(keys), record["members"], record["reason"], record)
        group_store = dist.PrefixStore(f"pg/{record['epoch']}", self.store)
        process_group.init_from_store(group_store, rank, len(keys), self.backend, self.timeout_s)
        return self.membership

    def _wait_epoch(self, epoch: int, deadline: float) -> dict:
        key = f"q/members/{epoch}"
        while not self.store.check([key]):
            for outcome in ("done", "failed"):
                if self.store.check([f"q/{outcome}"]):
                    self.stop_heartbeat()
                    raise Evicted(f"slot {self.slot}: the run is {outcome} "
                                  f"({get_json(self.store, f'q/{outcome}')})")
            if self.store.check([f"q/evict/{self.slot}/{self.incarnation}"]):
                self.stop_heartbeat()
                raise Evicted(f"slot {self.slot} was evicted: {self.store.get(f'q/evict/{self.slot}/{self.incarnation}').decode()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"slot {self.slot}: no membership {epoch} within {self.wait_s:g} s")
            wait_key(self.store, key, 0.2)
        return wait_json(self.store, key, 1.0)

    def change_requested(self) -> bool:
        """Whether the quorum closed this membership (check at step boundaries: one store round trip)."""
        return bool(self.store.check([f"q/next/{self.membership.epoch}"]))

    def done(self) -> bool:
        return bool(self.store.check(["q/done"]))

    def leave(self, step: int, error: BaseException | None = None) -> None:
        """Tell the quorum this member left (``step`` steps committed), then shut its communicator down.

        A :class:`~gradsync.CollectiveTimeoutError` names the peer: one that timed out is reported as
        the ``suspect`` (hung), one whose connection closed as ``closed`` (gone: a member that leaves
        reports first and closes after, so a closed connection of a member that did not report means
        its process is dead, e.g. its whole host was lost and no launcher is left to say so).
        """
        membership = self.membership
        suspect = closed = None
        peer = getattr(error, "peer", None)
        if error is not None and peer is not None and 0 <= peer < membership.world_size:
            if getattr(error, "timed_out", False):
                suspect = membership.slot_of(peer)
            else:
                closed = membership.slot_of(peer)
        reason = None if error is None else f"{type(error).__name__}: {error}"[:300]
        post(self.store, "ready", slot=self.slot, incarnation=self.incarnation, epoch=membership.epoch, step=step,
             suspect=suspect, closed=closed, reason=reason)
        process_group.shutdown()
        self.membership = None

    def fail(self, error: BaseException) -> None:
        """End the run: an error that recovery cannot cure (the same step failed :data:`FATAL_AFTER` times,
        or an error no peer caused). Every launcher stops; ``gradsync train`` reports ``error``."""
        self.stop_heartbeat()
        post(self.store, "fatal", slot=self.slot, incarnation=self.incarnation,
             error=f"{type(error).__name__}: {error}"[:1000])

    def finish(self) -> None:
        """Tell the quorum this member trained to the end (rank 0's ends the run)."""
        post(self.store, "finished", slot=self.slot, incarnation=self.incarnation, epoch=self.membership.epoch)

    def wait_end(self) -> bool:
        """After :meth:`finish`: wait until the run is done (True) or this membership closes (False)."""
        epoch = self.membership.epoch
        while True:
            if self.store.check(["q/done"]):
                self.stop_heartbeat()  # the store goes soon after: a beat that fails then is no news
                return True
            if self.store.check([f"q/next/{epoch}"]):
                return False
            time.sleep(POLL_S)


HEARTBEAT_S = 0.25


def heartbeat_key(slot: int, incarnation: int) -> str:
    return f"hb/{slot}/{incarnation}"


def start_heartbeat(store, slot: int, incarnation: int, timeout_s: float, stop: threading.Event,
                    interval_s: float = HEARTBEAT_S) -> threading.Thread:
    """A daemon thread bumping ``hb/<slot>/<incarnation>`` every ``interval_s`` on a store connection
    of its own (a beat never waits behind the trainer's store calls).

    A failed beat is logged and retried at the next one, on a fresh connection (the failed call may
    have left the old one mid-message): a store that hiccups must not get a healthy member evicted.
    The thread ends when ``stop`` is set, or when the store has failed every beat for longer than
    ``timeout_s`` (the member's own timeout; it logs an error saying so): by then the run is over.
    """
    key = heartbeat_key(slot, incarnation)

    def beat() -> None:
        connection, failing_since = None, None
        while not stop.is_set():
            try:
                connection = connection or _own_connection(store)
                connection.add(key, 1)
            except Exception as exc:  # noqa: BLE001 - any store error: judged by how long it lasts
                first = failing_since is None
                connection, failing_since = None, failing_since or time.monotonic()
                if _store_gone(slot, exc, time.monotonic() - failing_since, timeout_s, first):
                    return
            else:
                if failing_since is not None:
                    log.warning("heartbeat of slot %d: the store answers again", slot)
                failing_since = None
            stop.wait(interval_s)

    thread = threading.Thread(target=beat, daemon=True, name="gradsync-heartbeat")
    thread.start()
    return thread


def _own_connection(store):
    try:
        return store.clone()
    except (AttributeError, NotImplementedError):  # a store that cannot clone (HashStore, a test's): share it
        return store


def _store_gone(slot: int, error: Exception, failing_s: float, timeout_s: float, first: bool) -> bool:
    """True (and an error logged) once the store has failed for longer than ``timeout_s``; the first
    failure of a run of them is logged as a warning, the others only at debug level."""
    if failing_s > timeout_s:
        log.error("heartbeat of slot %d stops: the run's store has failed every beat for %.1f s, longer than "
                  "the timeout %g s (last error %s: %s)", slot, failing_s, timeout_s, type(error).__name__, error)
        return True
    log.log(logging.WARNING if first else logging.DEBUG, "heartbeat of slot %d: a beat failed (%s: %s); "
            "retrying every beat for up to %g s", slot, type(error).__name__, error, timeout_s)
    return False
