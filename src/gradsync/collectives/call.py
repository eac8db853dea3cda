"""One collective call in flight: its deadline, its byte counts and its errors.

Algorithms move data through a :class:`CollectiveCall` rather than the raw
transport, so that every wait takes the time left until the call's deadline
and every failure becomes a :class:`~gradsync.errors.CollectiveTimeoutError`
naming the operation, algorithm, step, this rank and the peer. A call is also
its own entry in the communicator's flight recorder
(:class:`~gradsync.debug.flight.FlightEntry`): every wait notes the peer it
waits for there, a sub-call's in its parent's entry.
"""

from __future__ import annotations

import time
import zlib

import torch

from gradsync.collectives.options import OptionStore, T
from gradsync.debug.flight import FlightEntry
from gradsync.errors import CollectiveTimeoutError
from gradsync.transport.base import PeerFailure, Transport
from gradsync.transport.locality import Locality
from gradsync.transport.sub import SubTransport

_monotonic = time.monotonic


class Workspace:
    """Scratch buffers that grow once and are reused across calls.

    On these machines the first touch of fresh memory costs as much as the
    network, so receive buffers are never allocated per call.
    """

    def __init__(self):
        self._buffers: dict[tuple[torch.dtype, torch.device, str], torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device, purpose: str = "recv") -> torch.Tensor:
        """Return a ``(numel,)`` tensor of ``dtype`` on ``device`` (contents undefined)."""
        key = (dtype, torch.device(device), purpose)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel]

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer held now (what memory accounting counts as communication buffers)."""
        return list(self._buffers.values())


# Message tags on transports with ``call_tags`` (see Communicator._tags): base + ((layout hash *
# ordinals + call ordinal) * kinds + kind), below 2**31; kind 0 is the layout check's control tag.
TAG_BASE = 1024  # above the parameter server's tags
TAG_KINDS = 8
TAG_ORDINALS = 2**20
TAG_LAYOUTS = 64

class CollectiveCall(FlightEntry):
    """Deadline-bounded point-to-point helpers for one collective call.

    Args:
        transport: the group's transport.
        op_name: "all_reduce", "broadcast", ... (for error messages).
        algorithm: algorithm name (for error messages).
        timeout_s: seconds the whole call may take.
        workspace: scratch buffers to reuse.
        options: the group's per-algorithm settings (read with :meth:`options`).
        deadline: ``time.monotonic()`` value the call ends at (None: now + ``timeout_s``).
        reported_rank: (rank, world_size) that errors name (None: this transport's).
        hang_detector: names the rank that hung (:mod:`gradsync.fault.hang`); None: the waited-for peer.
        locality: which ranks share a host (:class:`~gradsync.transport.locality.Locality`), None: not
            learnt yet.
        entry: the flight-recorder entry its waits are noted in (None: this call; a sub-call: its parent's).
        group_ranks: ``group_ranks[r]`` is the rank of the entry's group that is rank r here (None: the same).
    """

    def __init__(self, transport: Transport, op_name: str, algorithm: str, timeout_s: float,
                 workspace: Workspace, *, options: OptionStore | None = None, deadline: float | None = None,
                 reported_rank: tuple[int, int] | None = None, hang_detector=None,
                 locality: Locality | None = None, tags: tuple[int, int] | None = None, ordinal: int = 0,
                 entry: FlightEntry | None = None, group_ranks: list[int] | None = None):
        self.started_mono = now = time.monotonic()
        self.started_wall = time.time()
        self.entry = entry  # None: this call (no reference to itself, which would need the cyclic GC)
        self._group_ranks = group_ranks
        self.transport = transport
        self.ordinal = ordinal  # the communicator's count of calls started, this one included
        self.layout = ""  # what refine_tag was told: the algorithm and layout, for error messages
        # (payload tag, control tag) of this call's messages, or None: the transport's FIFO only
        self.tags = tags
        self.rank = transport.rank
        self.world_size = transport.world_size
        # (rank, world_size) that errors name: a sub-call still reports the whole group's
        self.reported_rank = reported_rank or (self.rank, self.world_size)
        self.op_name = op_name
        self.algorithm = algorithm
        self.timeout_s = timeout_s
        self.deadline = now + timeout_s if deadline is None else deadline
        self.workspace = workspace
        self._options = options if options is not None else OptionStore()
        self.hang_detector = hang_detector
        self.locality = locality

    def refine_tag(self, layout: str) -> None:
        """Fold ``layout`` (the resolved algorithm, numel, dtype: equal on every rank of a correct
        call) into the payload tag, so that ranks that disagree on it without a layout check
        (``verify=False``) time out rather than exchange messages of other sizes (which aborts
        the process in Gloo). Sub-calls made afterwards inherit it."""
        self.layout = layout
        if self.tags is not None:
            payload, control = self.tags
            shift = (zlib.crc32(layout.encode()) % TAG_LAYOUTS) * TAG_ORDINALS * TAG_KINDS
            self.tags = (payload + shift, control)

    def options(self, kind: type[T]) -> T:
        """The group's ``kind`` options (e.g. ``SegmentOptions``), default-constructed if it has none."""
        return self._options.get(kind)

    def sub(self, members: list[int], algorithm: str, options=()) -> "CollectiveCall":
        """The same call restricted to ``members`` (parent ranks).

        The sub-call shares the deadline, workspace, hang detector, reported
        rank and every option of this call; ``options`` override some of them
        for the sub-call only (e.g. a node's own shared-memory state).
        """
        ranks = self._group_ranks
        return CollectiveCall(SubTransport(self.transport, members), self.op_name, algorithm,
                              self.timeout_s, self.workspace, options=OptionStore(options, self._options),
                              deadline=self.deadline, reported_rank=self.reported_rank,
                              hang_detector=self.hang_detector,
                              locality=self.locality.sub(members) if self.locality is not None else None,
                              tags=self.tags, ordinal=self.ordinal, entry=self.entry or self,
                              group_ranks=[ranks[member] for member in members] if ranks else list(members))

    def remaining_s(self) -> float:
        return max(self.deadline - _monotonic(), 0.0)

    def wait(self, handle, peer: int, step: str) -> None:
        """Wait for ``handle`` (a transfer with ``peer``, a rank of this call) until the call's deadline."""
        entry = self.entry
        if entry is None:
            self.waiting_on = peer
        else:
            entry.waiting_on = self._group_ranks[peer]
        try:
            handle.wait(max(self.deadline - _monotonic(), 0.0))
        except PeerFailure as failure:
            raise self.failure(failure, step) from failure

    # isend/irecv/wait_on run once per message of every point-to-point algorithm: kept flat (no
    # helper calls, one attribute lookup each), since a segment costs a few microseconds of Python.
    def isend(self, tensor: torch.Tensor, peer: int, step: str = "send", control: bool = False):
        """Start a send (None for an empty tensor); finish it with :meth:`wait_on`.

        ``control``: a layout-check message, tagged so that it meets the peers' layout check
        whatever collective they called (a payload message meets only the same collective's)."""
        if not tensor.numel():
            return None
        tags = self.tags
        try:
            if tags is None:
                return self.transport.isend(tensor, peer), peer
            return self.transport.isend(tensor, peer, tag=tags[1] if control else tags[0]), peer
        except PeerFailure as failure:
            raise self.failure(failure, step) from failure

    def irecv(self, tensor: torch.Tensor, peer: int, step: str = "receive", control: bool = False):
        """Start a receive (None for an empty tensor); finish it with :meth:`wait_on`."""
        if not tensor.numel():
            return None
        tags = self.tags
        try:
            if tags is None:
                return self.transport.irecv(tensor, peer), peer
            return self.transport.irecv(tensor, peer, tag=tags[1] if control else tags[0]), peer
        except PeerFailure as failure:
            raise self.failure(failure, step) from failure

    def wait_on(self, pending, step: str) -> None:
        """Finish one transfer started by :meth:`isend` / :meth:`irecv`."""
        if pending is not None:
            self.wait(pending[0], pending[1], step)

    def wait_all(self, pendings, step: str) -> None:
        for pending in pendings:
            self.wait_on(pending, step)

    def send(self, tensor: torch.Tensor, peer: int, step: str) -> None:
        self.wait_on(self.isend(tensor, peer, step), step)

    def recv(self, tensor: torch.Tensor, peer: int, step: str) -> None:
        self.wait_on(self.irecv(tensor, peer, step), step)

    def send_recv(self, send_tensor: torch.Tensor, dst: int,
                  recv_tensor: torch.Tensor, src: int, step: str) -> None:
        """Send to ``dst`` and receive from ``src`` concurrently; empty tensors are skipped.

        The receive is posted first: Gloo moves a payload only into a posted receive, so a send
        posted first costs a notify round trip, which on a loaded link waits behind the queue.
        """
        receiving = self.irecv(recv_tensor, src, step)
        sending = self.isend(send_tensor, dst, step)
        self.wait_on(receiving, step)
        self.wait_on(sending, step)

    def exchange_with_every_peer(self, rows: torch.Tensor, step: str, senders=None) -> None:
        """Send row ``rank`` of ``rows`` (``(world_size, n)``, contiguous) to every peer and receive
        each peer's row in its place, all in flight at once; counted as control traffic.

        Sends are posted first (unlike payload steps): a send to a peer whose process is gone fails at
        once, so a dead peer is named before a live one that has already given up and left.

        ``senders``: the ranks whose rows travel (None: every rank); the others only receive.
        """
        stats = self.transport.stats
        before = (stats.bytes_sent, stats.bytes_received, stats.messages_sent, stats.messages_received)
        peers = [peer for peer in range(self.world_size) if peer != self.rank]
        senders = set(range(self.world_size) if senders is None else senders)
        try:
            sends = [self.isend(rows[self.rank], peer, f"{step} with peer rank {peer}", control=True)
                     for peer in peers if self.rank in senders]
            receives = [(peer, self.irecv(rows[peer], peer, f"{step} with peer rank {peer}", control=True))
                        for peer in peers if peer in senders]
            for peer, pending in receives:
                self.wait_on(pending, f"{step} with peer rank {peer}")
            self.wait_all(sends, step)
        finally:
            stats.reclassify_as_control(stats.bytes_sent - before[0], stats.bytes_received - before[1],
                                        (stats.messages_sent - before[2], stats.messages_received - before[3]))

    def failure(self, failure: PeerFailure, step: str) -> CollectiveTimeoutError:
        """Build the error for a failed wait on ``failure.peer`` during ``step``.

        On a timeout with a hang detector, the error names the rank that did
        not reach the collective rather than the neighbour this rank waited for;
        a silent rank whose process is gone is named as dead, first.
        """
        peer = "an unknown peer" if failure.peer < 0 else f"peer rank {failure.peer}"
        if failure.peer >= 0:  # the group's rank already (transports keep the parent's numbers)
            (self.entry or self).waiting_on = failure.peer
        rank, world_size = self.reported_rank
        blamed, reason = failure.peer, f"{peer} {failure.reason} at {step}"
        where = f"{self.op_name} #{self.ordinal}" + (f" ({self.layout})" if self.layout else "")
        silent = self.hang_detector.silent_ranks(where) if failure.timed_out and self.hang_detector else None
        elsewhere = getattr(self.hang_detector, "elsewhere", {}) if silent is not None else {}
        if silent:
            blamed, reason = self._blame(silent, failure.peer, step)
        elif elsewhere:
            others = "; ".join(f"rank {peer} in {place}" for peer, place in sorted(elsewhere.items()))
            blamed = failure.peer if failure.peer in elsewhere else min(elsewhere)
            reason += (f"; the ranks are out of step: this rank is in {where}, {others} (every rank must "
                       f"issue the same collectives in the same order: a forward with grad enabled, a "
                       f"backward or a collective ran on some ranks only)")
        elif silent is None and failure.timed_out and getattr(self.hang_detector, "store_unanswered", False):
            reason += "; the rendezvous store did not answer either (a stopped rank 0 hosts it under MASTER_ADDR)"
        message = (f"{self.op_name} (algorithm={self.algorithm}) on rank {rank} of "
                   f"{world_size}: {reason} (timeout {self.timeout_s:g} s)")
        return CollectiveTimeoutError(message, op=self.op_name, algorithm=self.algorithm,
                                      rank=rank, peer=blamed, step=step,
                                      timed_out=failure.timed_out)

    def _blame(self, silent: list[int], waited_for: int, step: str) -> tuple[int, str]:
        """(blamed rank, reason) for a timeout whose diagnosis found ``silent`` ranks (non-empty)."""
        dead = [rank for rank in silent if rank in getattr(self.hang_detector, "dead", ())]
        candidates = dead or silent
        blamed = waited_for if waited_for in candidates else candidates[0]
        rest = [rank for rank in silent if rank != blamed]
        others = f" (also silent: ranks {', '.join(map(str, rest))})" if rest else ""
        waited = "" if blamed == waited_for or waited_for < 0 else f" waiting for rank {waited_for}"
        what = ("died (its process is gone)" if blamed in dead else
                "stopped responding: alive but silent, it never reached this call or froze inside it")
        return blamed, f"peer rank {blamed} {what}{others}; this rank timed out at {step}{waited}"
