"""Closed-form α-β-γ times of the AllReduce algorithms, on the event simulation's model.

Where the event simulation (:mod:`gradsync.sim.engine`) would take too long
(a ring beyond 512 ranks, anything beyond 4096) and where ``auto`` must decide
in microseconds, these formulas predict the same schedules from the same
profile: the same chunks and segments, the same links, the same NIC sharing
and core oversubscription. They agree with the event simulation within 5%
where both run (``tests/test_sim_formulas.py``).

Notation: p ranks, n message bytes, s segment bytes, k segments per
chunk; α, β (= 1/bandwidth) of the slowest link a step crosses, γ per byte
added, all CPU terms times the oversubscription ``ranks / cores`` (Hockney
1994; Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009 for the
pipelined ring; Sanders, Speck & Träff 2009 for pipelined trees).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradsync.collectives.chunking import DEFAULT_SEGMENT_BYTES
from gradsync.collectives.halving_doubling import SHORT_MESSAGE_BYTES as HD_SHORT_BYTES
from gradsync.collectives.shm import SMALL_MESSAGE_BYTES as SHM_SMALL_BYTES
from gradsync.sim.cluster import Topology
from gradsync.sim.profile import Profile
from gradsync.transport.shm_segment import DEFAULT_REGION_BYTES

FORMULAS = ("ring", "tree", "halving_doubling", "hierarchical", "shm")


@dataclass(frozen=True)
class Step:
    """Per-message latency and per-byte transfer and reduction time of one kind of step (seconds)."""

    alpha: float
    beta: float
    gamma: float


def _step(profile: Profile, topology: Topology, crosses_hosts: bool, sharing: float = 1.0,
          oversub: float | None = None, duplex: bool = False) -> Step:
    """The costs of a step whose messages cross hosts or not, ``sharing`` ranks to a NIC
    (``oversub``: the ranks-per-core slowdown, None: the topology's). ``duplex``: every rank sends
    and receives at once (ring hops, halving/doubling exchanges); over a ``cpu_bound`` link both go
    through the rank's one port, so its bytes take twice as long."""
    if oversub is None:
        oversub = max(profile.oversubscription(size) for size in topology.host_sizes)
    link = profile.link(not crosses_hosts)
    slow = oversub if link.cpu_bound else 1.0
    shared_port = 2.0 if duplex and link.cpu_bound and not crosses_hosts else 1.0
    return Step(link.alpha_s * slow,
                link.beta_s_per_byte * slow * (sharing if crosses_hosts else shared_port),
                profile.gamma_s_per_byte * oversub)


def _nic_sharing(profile: Profile, topology: Topology, active_per_host: int) -> float:
    """How many of a host's ``active_per_host`` ranks that cross hosts at once share one NIC."""
    return max(1.0, math.ceil(active_per_host / profile.nics_per_host))


def _segments(chunk_bytes: float, segment_bytes: int, itemsize: int) -> tuple[float, int]:
    """(segment bytes, segments) of a chunk, as ring and tree cut it."""
    s = min(segment_bytes - segment_bytes % itemsize or itemsize, max(chunk_bytes, itemsize))
    return s, max(1, math.ceil(chunk_bytes / s))


def ring_phases_s(p: int, n: float, step: Step, segment_bytes: int, itemsize: int) -> tuple[float, float]:
    """(reduce-scatter, all-gather) seconds of the pipelined ring over p ranks."""
    if p == 1 or n == 0:
        return 0.0, 0.0
    c = math.ceil(n / itemsize / p) * itemsize
    s, k = _segments(c, segment_bytes, itemsize)
    per = max(s * step.beta, s * step.gamma)
    scatter = (p - 1) * (step.alpha + s * step.beta + (k - 1) * per + s * step.gamma)
    gather = (p - 1) * (step.alpha + k * s * step.beta)
    return scatter, gather


def ring_s(profile: Profile, topology: Topology, n: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
           itemsize: int = 4, *, sharing: float = 1.0, oversub: float | None = None) -> float:
    """Flat ring: every hop is as slow as its slowest edge (an inter-host edge when there are hosts)."""
    step = _step(profile, topology, topology.hosts > 1, sharing, oversub, duplex=True)
    scatter, gather = ring_phases_s(topology.world_size, n, step, segment_bytes, itemsize)
    return scatter + gather


def tree_s(profile: Profile, topology: Topology, n: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
           itemsize: int = 4) -> float:
    """Heap-ordered binary tree, reduce to rank 0 then broadcast, both pipelined by segments.

    An inner rank receives two segments (its ingress carries 2s per segment) and adds both; the
    broadcast sends each segment twice. Depth D = floor(log2 p) levels.
    """
    p = topology.world_size
    if p == 1 or n == 0:
        return 0.0
    depth = int(math.log2(p))
    sharing = _nic_sharing(profile, topology, max(topology.host_sizes)) if topology.hosts > 1 else 1.0
    step = _step(profile, topology, topology.hosts > 1, sharing)
    s, k = _segments(n, segment_bytes, itemsize)
    fan = 2 if p > 2 else 1
    up = depth * (step.alpha + s * step.beta + fan * s * step.gamma) + (k - 1) * max(fan * s * step.beta,
                                                                                   fan * s * step.gamma)
    down = depth * (step.alpha + s * step.beta) + (k - 1) * fan * s * step.beta + (fan - 1) * s * step.beta
    return up + down


def halving_doubling_s(profile: Profile, topology: Topology, n: int, itemsize: int = 4, *,
                       sharing: float | None = None, oversub: float | None = None) -> float:
    """Recursive halving then doubling (long messages) or doubling of the whole vector (short), with
    the fold of the ranks beyond the largest power of two. A step at distance d crosses hosts when
    d >= ranks per host (hosts in blocks); then every rank of a host crosses at once."""
    p = topology.world_size
    if p == 1 or n == 0:
        return 0.0
    core = 1 << (p.bit_length() - 1)
    extra = p - core
    per_host = max(topology.host_sizes)
    if sharing is None:
        sharing = _nic_sharing(profile, topology, per_host)

    def step_at(distance: int) -> Step:
        return _step(profile, topology, topology.hosts > 1 and distance >= per_host, sharing, oversub, duplex=True)

    total = 0.0
    if extra:
        fold = _step(profile, topology, topology.hosts > 1 and per_host == 1, 1.0, oversub)
        total += 2 * (fold.alpha + n * fold.beta) + n * fold.gamma
    levels = int(math.log2(core))
    if n <= HD_SHORT_BYTES or n // itemsize < core:
        for level in range(levels):
            st = step_at(1 << level)
            total += st.alpha + n * (st.beta + st.gamma)
        return total
    m = float(n)
    for level in range(levels):  # halving: distance core/2, core/4, ..., 1
        st = step_at(core >> (level + 1))
        m /= 2
        total += 2 * (st.alpha + m * (st.beta + st.gamma)) - st.alpha - m * st.beta
    for level in range(levels):  # doubling: distance 1, 2, ..., core/2
        st = step_at(1 << level)
        total += st.alpha + m * st.beta
        m *= 2
    return total


def shm_slices(nbytes: int, itemsize: int) -> list[int]:
    """The bytes of each slice :mod:`gradsync.collectives.shm` cuts an ``nbytes`` message into (regions
    of ``DEFAULT_REGION_BYTES`` per rank; the last slice may be shorter)."""
    region = DEFAULT_REGION_BYTES - DEFAULT_REGION_BYTES % itemsize
    full, rest = divmod(nbytes, region)
    return [region] * full + ([rest] if rest else [])


def shm_phase_s(profile: Profile, ranks: int, copy_bytes: float, add_bytes: float, oversub: float) -> float:
    """One phase of the shared-memory collective on one rank: its copies and adds on a core, bounded
    below by the host's memory traffic (2 bytes moved per byte copied, 3 per byte added, all ranks)."""
    cpu = (copy_bytes * profile.copy_s_per_byte + add_bytes * profile.gamma_s_per_byte) * oversub
    memory = ranks * (2 * copy_bytes + 3 * add_bytes) / profile.shm.memory_bandwidth_bytes_per_s
    return max(cpu, memory)


def shm_s(profile: Profile, topology: Topology, n: int, itemsize: int = 4) -> float:
    """Shared memory on one host (the formula :class:`~gradsync.sim.transport.VirtualSharedMemory` uses)."""
    if topology.hosts > 1:
        raise ValueError("shm needs every rank on one host")
    p = topology.world_size
    if p == 1 or n == 0:
        return 0.0
    if profile.shm is None:
        raise ValueError(f"profile {profile.name!r} has no shared-memory model (shm)")
    oversub, barrier = profile.oversubscription(p), profile.shm_barrier_s(p)
    if n <= SHM_SMALL_BYTES:
        return shm_phase_s(profile, p, n, 0, oversub) + barrier + shm_phase_s(profile, p, 0, (p - 1) * n, oversub)
    return sum(2 * shm_phase_s(profile, p, s, 0, oversub) + 2 * barrier +
               shm_phase_s(profile, p, 0, (p - 1) * s / p, oversub) for s in shm_slices(n, itemsize))


def hierarchical_s(profile: Profile, topology: Topology, n: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                   itemsize: int = 4, shm_inside: bool | None = None) -> float:
    """Inside each host (ring reduce-scatter, or the shm sum), chunk j across hosts by local rank j
    (halving_doubling over a power-of-two number of hosts, else ring; all L local ranks at once, sharing
    the NICs), then inside again (ring all-gather, or shm broadcasts). Equal hosts only.

    Raises:
        ValueError: hosts of different sizes (the event simulation handles those).
    """
    if len(set(topology.host_sizes)) > 1:
        raise ValueError("the hierarchical formula needs equal hosts; simulate unequal ones with events")
    local, hosts = topology.host_sizes[0], topology.hosts
    if topology.world_size == 1 or n == 0:
        return 0.0
    one_host = Topology((local,))
    inside = shm_inside if shm_inside is not None else (profile.shm is not None and local > 1)
    chunk = math.ceil(n / itemsize / local) * itemsize
    across = Topology((1,) * hosts) if hosts > 1 else None
    sharing = _nic_sharing(profile, topology, local)
    oversub = profile.oversubscription(local)
    inter = 0.0
    if across is not None:
        if hosts & (hosts - 1) == 0:
            inter = halving_doubling_s(profile, across, chunk, itemsize, sharing=sharing, oversub=oversub)
        else:
            inter = ring_s(profile, across, chunk, segment_bytes, itemsize, sharing=sharing, oversub=oversub)
    if inside:
        if hosts == 1:
            return shm_s(profile, one_host, n, itemsize)
        spread = local * sum(profile.shm_barrier_s(local) + shm_phase_s(profile, local, s, 0, oversub)
                             for s in shm_slices(chunk, itemsize))
        return shm_s(profile, one_host, n, itemsize) + inter + spread
    step = _step(profile, one_host, False, duplex=True)
    scatter, gather = ring_phases_s(local, n, step, segment_bytes, itemsize)
    return scatter + inter + gather


def predict_s(algorithm: str, profile: Profile, topology: Topology, nbytes: int, *,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES, itemsize: int = 4) -> float:
    """Predicted seconds of one AllReduce of ``nbytes`` (the profile's call overhead included).

    Raises:
        ValueError: an algorithm without a formula, or one this topology cannot run.
    """
    if algorithm == "ring":
        body = ring_s(profile, topology, nbytes, segment_bytes, itemsize)
    elif algorithm == "tree":
        body = tree_s(profile, topology, nbytes, segment_bytes, itemsize)
    elif algorithm == "halving_doubling":
        body = halving_doubling_s(profile, topology, nbytes, itemsize)
    elif algorithm == "hierarchical":
        body = hierarchical_s(profile, topology, nbytes, segment_bytes, itemsize)
    elif algorithm == "shm":
        body = shm_s(profile, topology, nbytes, itemsize)
    else:
        raise ValueError(f"no formula for {algorithm!r}; choose one of {', '.join(FORMULAS)}")
    return profile.call_overhead_s + body
