"""One membership of the elastic parameter server: a receiver thread per worker, the barrier, the way out.

Gloo cannot wait for "a request from any worker, or the quorum's change":
a timed-out receive closes the pair, and a peer's death does not end a
receive from any source. So each worker's requests are received on a thread
of its own (a receive from that one peer, which fails at once when the peer
dies) and queued; the server's thread takes them from the queue and looks at
the quorum every ``POLL_S`` in between. A receiver receives its next message
only once the server has handled the last one, and ends after the worker was
told ``STOP`` or ``CHANGE``, so no receive is left pending on the group when
the membership ends (except one from a worker that went silent: it ends when
that worker's connection closes, i.e. when its launcher kills it).

The protocol is described in :mod:`gradsync.elastic.ps_server`; the
server object passed in holds the state (``version``, ``ledger``, ``gate``,
``shared``, ``durable_seq``, ``apply``, ``checkpoint`` ...).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import torch

from gradsync.errors import PeerFailure
from gradsync.parallel.ps_protocol import (CHANGE, PARAMS, PULL, PUSH, REJECT, REPLAY, STOP, TAG_GRADIENT,
                                           TAG_PARAMETERS, TAG_REPLY, TAG_REQUEST, MembershipChange, new_header,
                                           peer_error)

POLL_S = 0.01                 # how often the server looks at the quorum while no request arrives
RECEIVE_S = 7 * 24 * 3600.0   # a receiver thread's wait; worker timeouts are the server's own clock


class _Receiver(threading.Thread):
    """Receives one worker's requests (header, then a push's payload) and queues them for the server."""

    def __init__(self, transport, rank: int, push_numel: int, dtype: torch.dtype, inbox: queue.Queue):
        super().__init__(daemon=True, name=f"gradsync-ps-receiver-{rank}")
        self.transport, self.rank, self.inbox = transport, rank, inbox
        self.payload = torch.empty(push_numel, dtype=dtype)
        self._go, self._more = threading.Semaphore(0), True

    def run(self) -> None:
        while self._more:
            header = new_header()
            try:
                self.transport.irecv_tagged(header, self.rank, TAG_REQUEST).wait(RECEIVE_S)
                if header[0] in (PUSH, REPLAY):
                    self.transport.irecv_tagged(self.payload, self.rank, TAG_GRADIENT).wait(RECEIVE_S)
            except PeerFailure as failure:
                self.inbox.put((self.rank, None, failure))
                return
            self.inbox.put((self.rank, header, self.payload))
            self._go.acquire()

    def proceed(self, more: bool = True) -> None:
        """The queued message was handled: receive the next one (or stop)."""
        self._more = more
        self._go.release()


class Session:
    """One membership of the server: its ranks, receivers, barrier and the way out."""

    def __init__(self, server, comm, slots: list[int], should_close, on_update):
        self.server, self.comm, self.slots = server, comm, list(slots)
        self.should_close, self.on_update = should_close, on_update
        self.rank = comm.rank
        self.workers = [r for r in range(comm.world_size) if r != self.rank]
        self.inbox: queue.Queue = queue.Queue()
        dtype = server.flat.dtype
        self.receivers = {r: _Receiver(comm.transport, r, server.shared.push_numel, dtype, self.inbox)
                          for r in self.workers}
        self.live = set(self.workers)
        self.pulled: set[int] = set()       # ranks that asked for parameters (the barrier)
        self.replays: list[tuple] = []      # (version_read, slot, seq, header, payload) until the barrier
        self.barrier_done = False
        self.waiting: deque[int] = deque()  # ranks whose request awaits its reply
        self.answered: set[int] = set()     # ranks told STOP or CHANGE: nothing more from them here
        self.replied_at = {r: time.monotonic() for r in self.workers}
        self.closing: str | None = None
        self.error: Exception | None = None
        server.gate.in_flight.clear()       # the previous membership's in-flight steps are requeued
        self._reply_header = new_header()

    def run(self) -> None:
        for receiver in self.receivers.values():
            receiver.start()
        polled = 0.0
        while True:
            try:
                self._handle(*self.inbox.get(timeout=POLL_S))
            except queue.Empty:
                pass
            now = time.monotonic()
            if self.closing is None and now - polled >= POLL_S:
                polled = now
                if self.should_close():
                    self.closing = "the quorum closed this membership"
            if self.inbox.empty():  # a worker whose request waits in the queue is not silent
                self._check_silent(now)
            self._answer_waiting()
            if self.live <= self.answered:
                if self.closing is not None:
                    if self.error is not None:
                        raise self.error
                    raise MembershipChange(f"parameter server leaves the membership: {self.closing}")
                if self.server.finished:
                    return
                # no worker left in this membership: wait for the quorum to bring one

    def _handle(self, rank: int, header: torch.Tensor | None, payload) -> None:
        receiver = self.receivers[rank]
        if rank not in self.live:  # given up on as silent (its step is requeued): ignore it from now on
            receiver.proceed(more=False)
            return
        if header is None:  # its connection closed: it died or left
            self._lose(rank, f"slot {self.slots[rank]}'s connection closed ({payload.reason})")
            return
        kind, slot = int(header[0]), self.slots[rank]
        if kind == PULL:
            self._admit(rank, header[1:].tolist())
            self.pulled.add(rank)
            self.waiting.append(rank)
        elif kind == REPLAY:  # applied at the barrier, all workers' replays in their original order
            self.replays.append((int(header[1]), slot, int(header[3]), header, payload.clone()))
            receiver.proceed()
        elif kind == PUSH:
            if self.server.gate.in_flight.pop(slot, None) is None:
                raise ValueError(f"parameter server: slot {slot} pushed a gradient it was not asked for")
            self.server.apply(slot, header, payload, self.on_update)
            self.waiting.append(rank)
        else:
            raise ValueError(f"parameter server: slot {slot} sent unknown request {header.tolist()}")

    def _admit(self, rank: int, signature: list[int]) -> None:
        try:
            self.server.shared.check_peer([signature[2], signature[0], signature[1]], rank)
        except ValueError:
            try:
                self._send_header(rank, REJECT, 0)
            except PeerFailure:
                pass  # it is gone anyway; the ValueError says why it was refused
            raise

    def _lose(self, rank: int, why: str) -> None:
        """``rank`` is gone: its assigned step goes back at the next barrier; close this membership."""
        self.live.discard(rank)
        self.server.gate.in_flight.pop(self.slots[rank], None)
        self.closing = self.closing or why

    def _check_silent(self, now: float) -> None:
        for rank in list(self.live - self.answered - set(self.waiting)):
            if now - self.replied_at[rank] > self.server.timeout_s:
                failure = PeerFailure(rank, "sent no request in time: it died, hangs or is slower than the "
                                            "timeout", True)
                self.error = self.error or peer_error(failure, "serve", self.rank, self.comm.world_size,
                                                      self.server.timeout_s)
                self._lose(rank, f"slot {self.slots[rank]} is silent")

    def _answer_waiting(self) -> None:
        """Reply to waiting workers, oldest first, as far as the barrier and the staleness gate allow."""
        server = self.server
        if not self.barrier_done:
            if self.closing is None and not self.live <= self.pulled:
                return
            self.barrier_done = True
            self._apply_replays()
            server.ledger.requeue_assigned()  # every survivor has replayed: what is left lost its worker
            if self.closing is None and server.checkpointed_version != server.version:
                server.checkpoint()           # the departed workers' applied pushes are durable now
        while self.waiting:
            rank = self.waiting.popleft()
            if rank not in self.live:
                continue
            if self.closing is not None:
                self._final(rank, CHANGE)
            elif server.finished:
                if server.checkpointed_version != server.version:
                    server.checkpoint()
                self._final(rank, STOP)
            else:
                step = server.ledger.take(self.slots[rank]) if server.gate.may_start(server.version) else None
                if step is None:  # the gate holds it back, or every step left is being computed
                    self.waiting.appendleft(rank)
                    return
                server.gate.start(self.slots[rank], server.version)
                if self._reply(rank, PARAMS, step):
                    self.receivers[rank].proceed()

    def _apply_replays(self) -> None:
        """Apply the replayed pushes by the version they were computed on (then slot, seq): under
        ``max_staleness=0`` exactly the order the lost server had applied them in, so a restart does not
        change the trajectory at all; duplicates are dropped."""
        for _, slot, _, header, payload in sorted(self.replays, key=lambda r: r[:3]):
            self.server.apply(slot, header, payload, self.on_update)
        self.replays.clear()

    def _final(self, rank: int, kind: int) -> None:
        self._reply(rank, kind, 0)
        self.answered.add(rank)
        self.receivers[rank].proceed(more=False)

    def _reply(self, rank: int, kind: int, step: int) -> bool:
        """Send ``kind`` (with the parameters unless CHANGE); False (and the rank is lost) if it failed."""
        durable = self.server.durable_seq.get(self.slots[rank], 0)
        try:
            self._send_header(rank, kind, step, durable, with_parameters=kind != CHANGE)
        except PeerFailure as failure:
            self._lose(rank, f"slot {self.slots[rank]}: reply failed ({failure.reason})")
            return False
        self.replied_at[rank] = time.monotonic()
        return True

    def _send_header(self, rank: int, kind: int, step: int, durable: int = 0, with_parameters: bool = False):
        header = self._reply_header
        header[0], header[1], header[2], header[3] = kind, self.server.version, step, durable
        transport = self.comm.transport
        handles = [transport.isend_tagged(header, rank, TAG_REPLY)]
        if with_parameters:
            handles.append(transport.isend_tagged(self.server.flat, rank, TAG_PARAMETERS))
        for handle in handles:  # the worker is waiting for it: this is quick, or it failed
            handle.wait(self.server.timeout_s)

    def end(self) -> None:
        """Let every receiver end (one blocked in a receive ends when its connection closes)."""
        for receiver in self.receivers.values():
            receiver.proceed(more=False)
