"""The virtual clock: ranks as greenlets, run in the order of their simulated time.

Every simulated rank runs the real algorithm code in a greenlet of its own
(greenlet, the coroutines of gevent: a switch costs well under a
microsecond, so thousands of ranks fit in one thread). A rank runs until it
waits for a transfer that has not finished by its clock; the scheduler then
resumes the rank whose clock is earliest. Transfers are priced when both
ends have posted (:meth:`VirtualCluster.transfer`): they start once both
are posted and every port they cross is free, and keep those ports busy for
their bytes over the bandwidth. Reductions and copies advance the running
rank's clock (:meth:`VirtualCluster.compute`).

Ports: each rank has an egress and an ingress port on the intra-host link
(one port for both directions when the link is ``cpu_bound``: loopback TCP
copies every byte on the sender's and the receiver's core, so a rank that
sends and receives at once takes twice as long as one that only sends,
as ``gradsync calibrate``'s exchange against its ping-pong shows); each host
has ``nics_per_host`` NICs with an egress and an ingress port each (see
:mod:`gradsync.collectives.cost.profile`).
"""

from __future__ import annotations

import gc
import heapq
import itertools
from dataclasses import dataclass, field

import greenlet

from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.cost.topology import Topology


def _reason(blocked_on) -> str:
    """``blocked_on`` as text: a string, or ``("transfer", peer)`` (kept unformatted until needed)."""
    if isinstance(blocked_on, tuple):
        return f"waits for a transfer with rank {blocked_on[1]}"
    return blocked_on


class SimulationDeadlock(RuntimeError):
    """Every unfinished rank waits for a transfer no rank will post (an algorithm or model error)."""


@dataclass
class RankState:
    rank: int
    host: int
    local_rank: int
    now: float = 0.0
    glet: greenlet.greenlet | None = None
    blocked_on: object = ""
    finished: bool = False


@dataclass
class TraceEvent:
    """One transfer or reduction: ``kind`` is "send" (src -> dst) or "reduce"/"copy"/"scale" (on ``src``)."""

    kind: str
    src: int
    dst: int
    root: int
    offset: int
    numel: int
    nbytes: int
    start_s: float
    end_s: float
    terms: dict = field(default_factory=dict)


class VirtualCluster:
    """The clocks, ports and scheduler of one simulated run.

    Args:
        profile: the hardware numbers.
        topology: ranks on hosts.
        trace: keep every transfer and reduction as a :class:`TraceEvent` (for ``gradsync explain``).
    """

    def __init__(self, profile: Profile, topology: Topology, trace: bool = False):
        self.profile = profile
        self.topology = topology
        hosts = topology.host_of()
        first: dict[int, int] = {}
        for rank, host in enumerate(hosts):
            first.setdefault(host, rank)
        local = [rank - first[host] for rank, host in enumerate(hosts)]
        self.ranks = [RankState(rank, host, local[rank]) for rank, host in enumerate(hosts)]
        self.oversub = [profile.oversubscription(topology.host_sizes[host]) for host in range(topology.hosts)]
        self.ports: dict[tuple, float] = {}  # port -> the time it is free again
        self.current: RankState | None = None
        self._ready: list[tuple[float, int, RankState]] = []
        self._order = itertools.count()
        self.trace: list[TraceEvent] | None = [] if trace else None
        self.barriers: dict[tuple, list] = {}

    # -- scheduling ------------------------------------------------------------------------------
    def run(self, body) -> float:
        """Run ``body(rank_state)`` on every rank to the end; return the latest rank's finish time (s).

        Raises:
            SimulationDeadlock: ranks wait for each other forever; whatever ``body`` raised.
        """
        collecting = gc.isenabled()
        gc.disable()  # thousands of greenlets make every collection slow (a third of the run)
        try:
            return self._run(body)
        finally:
            if collecting:
                gc.enable()

    def _run(self, body) -> float:
        scheduler = greenlet.getcurrent()
        for state in self.ranks:
            state.glet = greenlet.greenlet(self._runner(body, state), parent=scheduler)
            self._push(state, 0.0)
        while self._ready:
            when, _, state = heapq.heappop(self._ready)
            state.now = max(state.now, when)
            self.current = state
            state.glet.switch()
        self.current = None
        stuck = [state for state in self.ranks if not state.finished]
        if stuck:
            waits = "; ".join(f"rank {s.rank} {_reason(s.blocked_on)}" for s in stuck[:8])
            raise SimulationDeadlock(f"{len(stuck)} simulated ranks wait forever: {waits}")
        return max(state.now for state in self.ranks)

    def _runner(self, body, state: RankState):
        def run():
            body(state)
            state.finished = True
        return run

    def _push(self, state: RankState, when: float) -> None:
        heapq.heappush(self._ready, (when, next(self._order), state))

    def keep_order(self) -> None:
        """Let ranks whose clocks are behind the running rank's go first (called before a post)."""
        state = self.current
        if self._ready and self._ready[0][0] < state.now:
            self._push(state, state.now)
            self._switch()

    def block(self, reason) -> None:
        """Park the running rank until :meth:`wake` schedules it."""
        self.current.blocked_on = reason
        self._switch()

    def wake(self, state: RankState, when: float) -> None:
        state.blocked_on = ""
        self._push(state, when)

    def _switch(self) -> None:
        """Hand over to the earliest ready rank directly (not through the scheduler: half the switches);
        back to the scheduler only when no rank is ready."""
        state = self.current
        ready = self._ready
        if ready and ready[0][2].glet:  # started: a greenlet first switched to from here would nest its stack
            when, _, following = heapq.heappop(ready)
            if following.now < when:
                following.now = when
            self.current = following
            if following is not state:
                following.glet.switch()
        else:
            state.glet.parent.switch()
        self.current = state

    def advance_to(self, when: float) -> None:
        """The running rank waits until ``when`` (simulated seconds)."""
        state = self.current
        if when > state.now:
            state.now = when
        self.keep_order()

    # -- costs -----------------------------------------------------------------------------------
    def compute(self, kind: str, tensor) -> None:
        """Charge a reduction, copy or scaling of ``tensor``'s bytes to the running rank."""
        state = self.current
        if state is None:
            return
        per_byte = self.profile.copy_s_per_byte if kind == "copy" else self.profile.gamma_s_per_byte
        seconds = tensor.nbytes * per_byte * self.oversub[state.host]
        start = state.now
        state.now += seconds
        if self.trace is not None:
            self.trace.append(TraceEvent(kind, state.rank, state.rank, tensor.root, tensor.offset,
                                         tensor.numel(), tensor.nbytes, start, state.now,
                                         {"gamma" if kind != "copy" else "copy": seconds}))

    def transfer(self, src: int, dst: int, nbytes: int, posted_s: float, tensor=None, exchange: bool = True) -> float:
        """Price a message of ``nbytes`` from ``src`` to ``dst`` whose later end posted at ``posted_s``;
        return the time it completes at both ends. ``exchange``: the receiver sends at the same time (a
        ring step: ``Link.hop_at``), else a one-way message (``Link.one_way_at``)."""
        a, b = self.ranks[src], self.ranks[dst]
        if a.host == b.host:
            link = self.profile.intra
            # a CPU-bound link (loopback TCP): the kernel copies a message on the sender's and the
            # receiver's core, so a rank's sends and receives share one port (its core's time)
            ports = (("cpu", src), ("cpu", dst)) if link.cpu_bound else (("out", src), ("in", dst))
        else:
            link, nics = self.profile.link(False), self.profile.nics_per_host
            ports = (("nic-out", a.host, a.local_rank % nics), ("nic-in", b.host, b.local_rank % nics))
        crowd = self.oversub[a.host]
        slow = crowd if link.cpu_bound else 1.0
        out, into = ports
        free = self.ports
        busy = nbytes * link.beta_s_per_byte * slow
        # each end's port serves its messages in turn, each end on its own: a message waiting for one
        # end does not hold the other idle (socket buffers, a fabric sharing its links among flows)
        sending, receiving = max(posted_s, free.get(out, 0.0)), max(posted_s, free.get(into, 0.0))
        free[out], free[into] = sending + busy, receiving + busy
        start = max(sending, receiving)
        latency = link.hop_at(crowd) if exchange else link.one_way_at(crowd)  # in a schedule, crowded or not
        done = start + busy + latency
        if self.trace is not None:
            self.trace.append(TraceEvent("send", src, dst, getattr(tensor, "root", 0), getattr(tensor, "offset", 0),
                                         tensor.numel() if tensor is not None else 0, nbytes, start, done,
                                         {"alpha": latency, "beta": busy,
                                          "queued": start - posted_s}))
        return done

    def barrier(self, key: tuple, members: list[int], cost_s: float) -> None:
        """Block the running rank until every rank of ``members`` reached barrier ``key``; all leave at
        the latest arrival plus ``cost_s``."""
        state = self.current
        waiting = self.barriers.setdefault(key, [])
        waiting.append(state)
        if len(waiting) < len(members):
            self.block(f"in a shared-memory barrier of ranks {members[:8]}")
            return
        del self.barriers[key]
        leave = max(s.now for s in waiting) + cost_s
        for other in waiting:
            if other is not state:
                self.wake(other, leave)
        self.advance_to(leave)
