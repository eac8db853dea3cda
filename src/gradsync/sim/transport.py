"""The simulator's :class:`~gradsync.transport.base.Transport`: messages priced on the virtual clock.

``isend`` / ``irecv`` match in posting order per ordered pair of ranks (the
FIFO the real transports give); a matched pair is priced by
:meth:`VirtualCluster.transfer <gradsync.sim.cluster.VirtualCluster.transfer>`
and ``handle.wait`` parks the rank's greenlet until the transfer's end. No
byte moves; :attr:`stats` counts what the real transports count for the
same calls (payload bytes and messages at posting).

The shared-memory collective has no messages to price: the simulator gives
it a formula instead (:class:`VirtualSharedMemory`, reached by
:mod:`gradsync.collectives.shm` through ``transport.shared_memory_model``),
with barriers among the node's simulated ranks.
"""

from __future__ import annotations

from collections import deque

from gradsync.collectives.cost.shm_formulas import COPY_MEMORY_BYTES, shm_cells, shm_lean, shm_rates, shm_slices
from gradsync.collectives.shm_setup import ShmState
from gradsync.sim.cluster import VirtualCluster
from gradsync.transport.base import TransportStats
from gradsync.transport.locality import Locality, derive


class SimHandle:
    """A simulated transfer: ``done_s`` is known once both ends have posted."""

    __slots__ = ("cluster", "peer", "nbytes", "posted_s", "tensor", "done_s", "waiter", "crossing")

    def __init__(self, cluster: VirtualCluster, peer: int, nbytes: int, posted_s: float, tensor):
        self.cluster = cluster
        self.peer = peer
        self.nbytes = nbytes
        self.posted_s = posted_s
        self.tensor = tensor
        self.done_s: float | None = None
        self.waiter = None
        self.crossing = True  # its end had a transfer the other way pending when posted (set by SimWorld.post)

    def wait(self, timeout_s: float) -> None:
        cluster = self.cluster
        if self.done_s is None:
            self.waiter = cluster.current
            cluster.block(("transfer", self.peer))
        state = cluster.current
        if self.done_s > state.now:
            state.now = self.done_s
        if cluster._ready and cluster._ready[0][0] < state.now:  # let the ranks behind this one go first
            cluster.keep_order()

    def finish(self, done_s: float) -> None:
        self.done_s = done_s
        if self.waiter is not None:
            self.cluster.wake(self.waiter, done_s)
            self.waiter = None


class SimWorld:
    """The mailboxes and shared-memory model of one simulated run."""

    def __init__(self, cluster: VirtualCluster):
        self.cluster = cluster
        hosts = cluster.topology.host_of()
        self.locality: Locality = derive([(host,) for host in hosts])
        self.sends: dict[tuple[int, int], deque] = {}
        self.receives: dict[tuple[int, int], deque] = {}
        self.pending: dict[tuple[int, bool], list[SimHandle]] = {}  # (rank, sending) -> its transfers not known over
        self.shared_memory = VirtualSharedMemory(cluster)

    def busy(self, rank: int, sending: bool, when: float) -> bool:
        """Whether ``rank`` has a send (``sending``) or a receive of its own posted by ``when`` and not over
        by then."""
        pending = self.pending.get((rank, sending))
        if not pending:
            return False
        pending[:] = [h for h in pending if h.done_s is None or h.done_s > when]
        return any(h.posted_s <= when for h in pending)

    def transport(self, rank: int) -> "SimTransport":
        return SimTransport(self, rank)

    def post(self, src: int, dst: int, handle: SimHandle, sending: bool) -> None:
        """Post one end of a message; price it once both ends are posted. A message is one side of an
        exchange (a ring step, a halving/doubling pair: its hop costs ``Link.hop_alpha_s``) when its
        sender had a receive of its own pending as it posted the send, or its receiver a send as it
        posted the receive (each end judged as it posts, so the order in which simulated ranks run at
        one instant does not matter); else it is one-way (a tree's edge, a fold:
        ``Link.one_way_hop_alpha_s``)."""
        rank = src if sending else dst
        handle.crossing = self.busy(rank, not sending, handle.posted_s)
        self.pending.setdefault((rank, sending), []).append(handle)
        mine, theirs = (self.sends, self.receives) if sending else (self.receives, self.sends)
        waiting = theirs.get((src, dst))
        if not waiting:
            mine.setdefault((src, dst), deque()).append(handle)
            return
        other = waiting.popleft()
        if other.nbytes != handle.nbytes:
            raise ValueError(f"simulated message from rank {src} to rank {dst}: {handle.nbytes if sending else other.nbytes}"
                             f" bytes sent into a receive of {other.nbytes if sending else handle.nbytes}")
        tensor = handle.tensor if sending else other.tensor
        posted = max(handle.posted_s, other.posted_s)
        done = self.cluster.transfer(src, dst, handle.nbytes, posted, tensor, handle.crossing or other.crossing)
        other.finish(done)
        handle.finish(done)


class SimTransport:
    """Rank ``rank`` of a :class:`SimWorld` (the Transport protocol; no tags, no backend calls)."""

    call_tags = False

    def __init__(self, world: SimWorld, rank: int):
        self.world = world
        self.rank = rank
        self.world_size = world.cluster.topology.world_size
        self.stats = TransportStats()
        self.locality = world.locality
        self.shared_memory_model = world.shared_memory

    def _post(self, tensor, peer: int, sending: bool) -> SimHandle:
        cluster = self.world.cluster
        if cluster._ready and cluster._ready[0][0] < cluster.current.now:
            cluster.keep_order()
        nbytes = tensor.numel() * tensor.element_size()
        handle = SimHandle(cluster, peer, nbytes, cluster.current.now, tensor)
        if sending:
            self.stats.record_send(nbytes)
            self.world.post(self.rank, peer, handle, True)
        else:
            self.stats.record_recv(nbytes)
            self.world.post(peer, self.rank, handle, False)
        return handle

    def isend(self, tensor, peer: int) -> SimHandle:
        return self._post(tensor, peer, True)

    def irecv(self, tensor, peer: int) -> SimHandle:
        return self._post(tensor, peer, False)

    def backend_all_reduce(self, tensor, timeout_s: float) -> None:
        raise ValueError("the simulator does not model the backend's own all_reduce (native); simulate one "
                         "of gradsync's algorithms (NCCL's are ring and tree)")

    def backend_broadcast(self, tensor, src: int, timeout_s: float) -> None:
        raise ValueError("the simulator does not model the backend's own broadcast")

    def backend_reduce_scatter(self, tensor, chunks, timeout_s: float) -> None:
        raise ValueError("the simulator does not model the backend's own reduce_scatter (native)")

    def backend_all_gather(self, tensor, chunks, timeout_s: float) -> None:
        raise ValueError("the simulator does not model the backend's own all_gather (native)")


def _members(transport) -> list[int]:
    """The simulated ranks of ``transport``'s group, in its rank order (through SubTransports)."""
    if isinstance(transport, SimTransport):
        return list(range(transport.world_size))
    parent = _members(transport.parent)
    return [parent[member] for member in transport.members]


class VirtualSharedMemory:
    """A formula for :mod:`gradsync.collectives.shm` on simulated ranks (the closed form:
    :func:`gradsync.collectives.cost.shm_formulas.shm_s`).

    AllReduce over p ranks of one host, per rank:

    * the lean path (:func:`~gradsync.collectives.cost.shm_formulas.shm_lean`: the group's own call of at most
      ``LEAN_MAX_BYTES``, as ``algorithm="shm"`` runs it): copy n in, one barrier (the layout check
      travels in it), add all p rows ((p-1)·n added); its fixed cost is the call's
      (``ShmModel.lean_call_overhead_s``, set by the engine);
    * else cells of ``ShmState.cell_bytes`` (:func:`~gradsync.collectives.cost.shm_formulas.shm_cells`), each
      (:func:`~gradsync.collectives.cost.shm_formulas.shm_cell_s`): p x ``ShmModel.cell_overhead_s``, stage the peers'
      chunks ((p-1)/p·n copied), a barrier, reduce its own chunk ((p-1)/p·n added, n/p copied into
      its region), a barrier, copy the other chunks out ((p-1)/p·n).

    Copies and adds of cells and mailboxes run at the in-cache rates while every rank has a core
    (:func:`~gradsync.collectives.cost.shm_formulas.shm_rates`), at the out-of-cache ones slowed by ranks/cores when
    they outnumber the cores; the host's memory traffic bounds each phase from
    below at ``ShmModel.memory_bandwidth_bytes_per_s``: 3 DRAM bytes per payload byte and rank
    (the input read in the copy in, the output's read for ownership and write-back where it is
    written; the cells stay in cache), 3 per byte a broadcast copies. A barrier costs
    ``Profile.shm_barrier_s`` (more when the ranks outnumber the cores). Not priced: the one
    layout-check barrier a verified (``verify=True``) call above the lean path runs before its
    cells (the sweep and DataParallel's buckets call with ``verify=False``), and the first call's
    segment set-up.
    """

    def __init__(self, cluster: VirtualCluster):
        self.cluster = cluster
        self._barriers: dict[tuple, int] = {}

    def _model(self):
        model = self.cluster.profile.shm
        if model is None:
            raise ValueError(f"profile {self.cluster.profile.name!r} has no shared-memory model (shm)")
        return model

    def _phase(self, members: list[int], copy_bytes: float, add_bytes: float, memory_bytes: float,
               fixed_s: float = 0.0, cached: bool = True) -> None:
        cluster, profile = self.cluster, self.cluster.profile
        state = cluster.current
        oversub = cluster.oversub[state.host]
        copy, gamma = shm_rates(profile, oversub, cached)
        cpu = (copy_bytes * copy + add_bytes * gamma) * oversub
        memory = len(members) * memory_bytes / self._model().memory_bandwidth_bytes_per_s
        state.now += fixed_s * oversub + max(cpu, memory)  # the fixed Python cost: on the core, not hidden

    def _barrier(self, members: list[int]) -> None:
        rank = self.cluster.current.rank
        key = (tuple(members), rank)
        count = self._barriers.get(key, 0)
        self._barriers[key] = count + 1
        self.cluster.barrier((tuple(members), count), members, self.cluster.profile.shm_barrier_s(len(members)))

    def all_reduce(self, flat, call) -> None:
        members = _members(call.transport)
        p, itemsize = len(members), flat.element_size()
        total = flat.numel() * itemsize
        if shm_lean(total, public=isinstance(call.transport, SimTransport)):
            self._phase(members, total, 0, total)
            self._barrier(members)
            self._phase(members, 0, (p - 1) * total, 2 * total)
            return
        state = call.options(ShmState)
        overhead = p * self._model().cell_overhead_s
        for n in shm_cells(total, itemsize, state.cell_bytes, state.region_bytes):
            share = n / p
            self._phase(members, n - share, 0, n - share, overhead)
            self._barrier(members)
            self._phase(members, share, (p - 1) * share, share)
            self._barrier(members)
            self._phase(members, n - share, 0, 2 * n)

    def broadcast(self, flat, src: int, call) -> None:
        members = _members(call.transport)
        for n in shm_slices(flat.numel() * flat.element_size(), flat.element_size()):
            mine = n if call.rank == src else 0
            self._phase(members, mine, 0, COPY_MEMORY_BYTES * mine, cached=False)
            self._barrier(members)
            theirs = n - mine
            self._phase(members, theirs, 0, COPY_MEMORY_BYTES * theirs, cached=False)
