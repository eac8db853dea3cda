"""Closed-form α-β-γ times of the AllReduce algorithms, on the event simulation's model.

Where the event simulation (:mod:`gradsync.sim.engine`) would take too long
(a ring beyond 512 ranks, anything beyond 4096) and where ``auto`` must decide
in microseconds, these formulas predict the same schedules from the same
profile: the same chunks and segments, the same links, the same NIC sharing
and core oversubscription. They agree with the event simulation within 5%
where both run (``tests/test_sim.py``).

Every formula takes ``collective``: "all_reduce", or "reduce_scatter" /
"all_gather" (n the whole flat buffer), which the algorithms run as one of
their AllReduce's two phases: the ring's first (p-1) hops or its last,
halving_doubling's halving or its doubling (with the fold's one way in, the
chunk's back), hierarchical's scatter inside plus across or across plus
gather inside, shm's owner-adds round or its copy-out round
(:func:`~gradsync.collectives.cost.shm_formulas.shm_shard_s`). ``tree`` has neither.

Notation: p ranks, n message bytes, s segment bytes, k segments per
chunk; α, β (= 1/bandwidth) of the slowest link a step crosses, γ per byte
added, all CPU terms times the oversubscription ``ranks / cores`` (Hockney
1994; Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009 for the
pipelined ring; Sanders, Speck & Träff 2009 for pipelined trees).
"""

from __future__ import annotations

import dataclasses
import math

from gradsync.collectives.chunking import DEFAULT_SEGMENT_BYTES
from gradsync.collectives.cost.dbt_formula import double_binary_tree_s
from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.cost.ring_formula import Step, ring_phases_s, ring_stream_s, segment_cut
from gradsync.collectives.cost.shm_formulas import shm_lean, shm_phase_s, shm_s, shm_shard_s, shm_slices
from gradsync.collectives.cost.topology import Topology
from gradsync.collectives.halving_doubling import SHORT_MESSAGE_BYTES as HD_SHORT_BYTES

FORMULAS = ("ring", "tree", "double_binary_tree", "halving_doubling", "hierarchical", "shm")


def _step(profile: Profile, topology: Topology, crosses_hosts: bool, sharing: float = 1.0,
          oversub: float | None = None, duplex: bool = False) -> Step:
    """The costs of a step whose messages cross hosts or not, ``sharing`` ranks to a NIC
    (``oversub``: the ranks-per-core slowdown, None: the topology's). ``duplex``: every rank sends
    and receives at once (ring hops, halving/doubling exchanges): the latency is the exchange's hop
    (``Link.hop_at``), and over a ``cpu_bound`` link both directions go through the rank's one port,
    so its bytes take twice as long; else a one-way message's (``Link.one_way_at``: a tree's edge,
    halving_doubling's fold)."""
    if oversub is None:
        oversub = max(profile.oversubscription(size) for size in topology.host_sizes)
    link = profile.link(not crosses_hosts)
    slow = oversub if link.cpu_bound else 1.0
    shared_port = 2.0 if duplex and link.cpu_bound and not crosses_hosts else 1.0
    latency = link.hop_at(oversub) if duplex else link.one_way_at(oversub)  # an exchange's hop, or a one-way one
    ports = 1.0 if crosses_hosts else shared_port
    return Step(latency, link.beta_s_per_byte * slow * ports, profile.gamma_s_per_byte * oversub,
                sharing if crosses_hosts else 1.0, ports)


def _nic_sharing(profile: Profile, topology: Topology, active_per_host: int) -> float:
    """How many of a host's ``active_per_host`` ranks that cross hosts at once share one NIC."""
    return max(1.0, math.ceil(active_per_host / profile.nics_per_host))


def ring_latency_s(profile: Profile, topology: Topology) -> float:
    """The flat ring's latency term: its AllReduce time (:func:`ring_s`) were bytes free (β = γ = 0), the α of
    every message on its critical path. One host: 2(p-1)·α; hosts of L ranks: the fill's ⌈2(p-1)/L⌉ hops
    between hosts and the rest inside, or the reduce-scatter at the inbox's pace behind a host's edge,
    (p-1)·α_between / ``IN_FLIGHT``, then the all-gather's fill, whichever is longer."""
    p = topology.world_size
    if p == 1:
        return 0.0
    slow = _step(profile, topology, topology.hosts > 1, duplex=True)
    fast = _step(profile, topology, False, duplex=True) if topology.hosts > 1 and max(topology.host_sizes) > 1 else None
    free = {"beta": 0.0, "gamma": 0.0}
    return ring_stream_s(p, p, dataclasses.replace(slow, **free), 1, 1,
                         fast=dataclasses.replace(fast, **free) if fast is not None else None,
                         period=max(topology.host_sizes))


def _phases(scatter: float, gather: float, collective: str) -> float:
    """The time of ``collective`` from an AllReduce's (reduce-scatter, all-gather) phase times."""
    return {"all_reduce": scatter + gather, "reduce_scatter": scatter, "all_gather": gather}[collective]


def ring_s(profile: Profile, topology: Topology, n: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
           itemsize: int = 4, *, sharing: float = 1.0, oversub: float | None = None,
           collective: str = "all_reduce") -> float:
    """Flat ring (:func:`ring_stream_s`): its slowest edge (intra- or inter-host, whichever moves a chunk
    slower) sets the stream's pace; the fill crosses it once per host (ranks in host order)."""
    p = topology.world_size
    steps = [_step(profile, topology, topology.hosts > 1, sharing, oversub, duplex=True)]
    if topology.hosts > 1 and max(topology.host_sizes) > 1:
        steps.append(_step(profile, topology, False, 1.0, oversub, duplex=True))
    chunk = math.ceil(n / itemsize / p) * itemsize
    step = max(steps, key=lambda st: st.move_s(chunk))
    fast = min(steps, key=lambda st: st.move_s(chunk)) if len(steps) > 1 else None
    edges = {"fast": fast, "period": max(topology.host_sizes)}
    if collective == "all_reduce":
        return ring_stream_s(p, n, step, segment_bytes, itemsize, **edges)
    return _phases(*ring_phases_s(p, n, step, segment_bytes, itemsize, **edges), collective)


def tree_s(profile: Profile, topology: Topology, n: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
           itemsize: int = 4) -> float:
    """Heap-ordered binary tree (rank i's children 2i+1, 2i+2), reduce to rank 0 then broadcast, both
    pipelined by segments of s bytes.

    The first segment's way up and down is followed edge by edge (each edge intra- or inter-host,
    two children into one port one after the other, then their adds); the other k-1 segments follow
    at the pace of the busiest port or core: per segment, a port carries s for every edge through it
    (a parent's ingress both children, a shared NIC all its host's crossing edges) and a rank adds
    s per child.
    """
    p = topology.world_size
    if p == 1 or n == 0:
        return 0.0
    hosts = topology.host_of()
    local = _local_ranks(topology)
    oversub = max(profile.oversubscription(size) for size in topology.host_sizes)
    s, k = segment_cut(n, segment_bytes, itemsize)
    s_last = n - (k - 1) * s
    gamma = profile.gamma_s_per_byte * oversub
    loads: dict[tuple, float] = {}

    def edge(child: int) -> tuple[Step, tuple, tuple, tuple, tuple]:
        """(costs, child's port up, parent's port up, parent's port down, child's port down)."""
        parent = (child - 1) // 2
        crosses = hosts[child] != hosts[parent]
        step = _step(profile, topology, crosses, 1.0, oversub)
        if crosses:
            nics = profile.nics_per_host
            mine, theirs = (hosts[child], local[child] % nics), (hosts[parent], local[parent] % nics)
            return step, ("nic-out",) + mine, ("nic-in",) + theirs, ("nic-out",) + theirs, ("nic-in",) + mine
        if profile.intra.cpu_bound:  # one port per rank for both directions, as the event simulation
            return step, ("cpu", child), ("cpu", parent), ("cpu", parent), ("cpu", child)
        return step, ("out", child), ("in", parent), ("out", parent), ("in", child)

    edges = [None] + [edge(child) for child in range(1, p)]
    up = [0.0] * p
    port_free: dict[tuple, float] = {}
    for rank in range(p - 1, -1, -1):  # children before parents
        children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < p]
        arrived = {}
        for child in sorted(children, key=lambda c: (up[c], -c)):  # a tie: the right child's message first, as
            step, out_key, in_key = edges[child][:3]               # the event simulation orders them
            start = _reserve(port_free, up[child], out_key, in_key, s * step.beta)
            arrived[child] = start + s * step.beta + step.alpha
            for port in (out_key, in_key):
                loads[port] = loads.get(port, 0.0) + step.beta
        added = 0.0
        for child in children:  # the code waits for the left child, adds, then the right: an add overlaps a wait
            added = max(added, arrived[child]) + s * gamma
        up[rank] = added
    reduce_pace = max(max(loads.values()) * s, 2 * s * gamma if p > 2 else s * gamma)
    reduce_time = up[0] + (k - 1) * reduce_pace + (s_last - s) * reduce_pace / s
    down = [0.0] * p
    send_loads: dict[tuple, float] = {}
    port_free = {}
    for rank in range(p):
        for child in (2 * rank + 1, 2 * rank + 2):
            if child >= p:
                continue
            step, out_key, in_key = edges[child][0], edges[child][3], edges[child][4]
            start = _reserve(port_free, down[rank], out_key, in_key, s * step.beta)
            down[child] = start + s * step.beta + step.alpha
            for port in (out_key, in_key):
                send_loads[port] = send_loads.get(port, 0.0) + step.beta
    broadcast_pace = max(send_loads.values()) * s
    broadcast_time = max(down) + (k - 1) * broadcast_pace + (s_last - s) * broadcast_pace / s
    return reduce_time + broadcast_time


def _reserve(port_free: dict, ready: float, out_key: tuple, in_key: tuple, busy: float) -> float:
    """Each end's port in turn, as :meth:`VirtualCluster.transfer`; the transfer's start."""
    sending, receiving = max(ready, port_free.get(out_key, 0.0)), max(ready, port_free.get(in_key, 0.0))
    port_free[out_key], port_free[in_key] = sending + busy, receiving + busy
    return max(sending, receiving)


def _local_ranks(topology: Topology) -> list[int]:
    local = []
    for size in topology.host_sizes:
        local.extend(range(size))
    return local


def halving_doubling_s(profile: Profile, topology: Topology, n: int, itemsize: int = 4, *,
                       sharing: float | None = None, oversub: float | None = None,
                       collective: str = "all_reduce") -> float:
    """Recursive halving then doubling (long messages) or doubling of the whole vector (short), with
    the fold of the ranks beyond the largest power of two. Each step's pairs are placed exactly: a
    step crosses hosts when any pair does, and the ranks of a host that cross at once share its
    NICs (``sharing`` overrides the count). A reduce-scatter halves (whatever the size): the fold's
    vector in and its chunk back; an all-gather doubles: the chunk in and the vector back."""
    p = topology.world_size
    if p == 1 or n == 0:
        return 0.0
    core = 1 << (p.bit_length() - 1)
    extra = p - core
    hosts, local = topology.host_of(), _local_ranks(topology)
    members = [2 * c + 1 if c < extra else c + extra for c in range(core)]

    def step_for(pairs, duplex: bool = True) -> Step:
        crossing: dict[tuple, int] = {}
        for a, b in pairs:
            if hosts[a] != hosts[b]:
                key = (hosts[a], local[a] % profile.nics_per_host)
                crossing[key] = crossing.get(key, 0) + 1
        if not crossing:
            return _step(profile, topology, False, 1.0, oversub, duplex=duplex)
        return _step(profile, topology, True, sharing or max(crossing.values()), oversub, duplex=duplex)

    def step_at(distance: int) -> Step:
        return step_for((members[c], members[c ^ distance]) for c in range(core))

    total = 0.0
    if extra:
        fold = step_for([(2 * i, 2 * i + 1) for i in range(extra)], duplex=False)  # one way at a time
        chunk = math.ceil(n / itemsize / p) * itemsize
        total += {"all_reduce": 2 * fold.exchange_s(n) + n * fold.gamma,
                  "reduce_scatter": fold.exchange_s(n) + n * fold.gamma + fold.exchange_s(chunk),
                  "all_gather": fold.exchange_s(chunk) + fold.exchange_s(n)}[collective]
    levels = int(math.log2(core))
    if collective == "all_reduce" and (n <= HD_SHORT_BYTES or n // itemsize < core):
        for level in range(levels):
            st = step_at(1 << level)
            total += st.exchange_s(n) + n * st.gamma
        return total
    if collective != "all_reduce":  # the core's chunks are tensor_split's over p: a folded pair's are two
        shares = [(2 if c < extra else 1) * n / p for c in range(core)]
        for level in range(levels):
            st, distance = step_at(core >> (level + 1)), core >> (level + 1)
            gives = [sum(shares[c - c % (2 * distance) + (0 if c & distance else distance):][:distance])
                     for c in range(core)]  # what each core rank hands its partner (and gets its partner's)
            one_port = profile.intra.cpu_bound and all(hosts[members[c]] == hosts[members[c ^ distance]]
                                                       for c in range(core))  # send and receive share it
            m = max((give + gives[c ^ distance]) / 2 if one_port else give for c, give in enumerate(gives))
            total += st.exchange_s(m) + (max(gives) * st.gamma if collective == "reduce_scatter" else 0.0)
        return total
    m = float(n)
    for level in range(levels):  # halving: distance core/2, core/4, ..., 1
        st = step_at(core >> (level + 1))
        m /= 2
        total += st.exchange_s(m) + m * st.gamma
    for level in range(levels):  # doubling: distance 1, 2, ..., core/2
        st = step_at(1 << level)
        total += st.exchange_s(m)
        m *= 2
    return total


def call_overhead_s(profile: Profile, algorithm: str, topology: Topology, nbytes: int,
                    collective: str = "all_reduce") -> float:
    """The fixed cost of one call: ``ShmModel.lean_call_overhead_s`` for a public shm call on the lean
    path (its argument checks are cached per layout), else the algorithm's own
    (:meth:`Profile.call_overhead`: ``call_overheads_s``, else ``call_overhead_s``); all Python work
    on a core, slowed by the ranks-per-core oversubscription of the busiest host."""
    oversub = max(profile.oversubscription(size) for size in topology.host_sizes)
    if (algorithm == "shm" and collective == "all_reduce" and topology.world_size > 1 and shm_lean(nbytes)
            and profile.shm is not None
            and profile.shm.lean_call_overhead_s is not None):
        return profile.shm.lean_call_overhead_s * oversub
    return profile.call_overhead(algorithm) * oversub


def hierarchical_s(profile: Profile, topology: Topology, n: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                   itemsize: int = 4, shm_inside: bool | None = None, collective: str = "all_reduce") -> float:
    """Inside each host (ring reduce-scatter, or the shm sum), chunk j across hosts by local rank j
    (halving_doubling over a power-of-two number of hosts, else ring; all L local ranks at once, sharing
    the NICs), then inside again (ring all-gather, or shm broadcasts).

    Unequal hosts: the L_min ranks of the smallest host own the chunks; with the ring inside, each
    extra rank of a larger host hands its message to the owners and takes the result back (2 moves
    of n inside the host, and the owners add the extras' chunks); with shm inside the largest host's
    shared-memory sum and broadcasts set the pace.

    Reduce-scatter: inside (the lanes' ring reduce-scatter, or shm's), then across; all-gather: across,
    then inside. Unequal hosts: every rank of a host takes part in the ring inside, with chunks of
    n/L_min (none for the extra ranks), and each extra rank's chunk moves once more inside its host.
    """
    if topology.world_size == 1 or n == 0:
        return 0.0
    local, largest, hosts = min(topology.host_sizes), max(topology.host_sizes), topology.hosts
    inside = shm_inside if shm_inside is not None else (profile.shm is not None and largest > 1)
    chunk = math.ceil(n / itemsize / local) * itemsize
    oversub = profile.oversubscription(largest)
    inter = 0.0
    if hosts > 1:
        across = Topology((1,) * hosts)
        sharing = _nic_sharing(profile, topology, local)
        if hosts & (hosts - 1) == 0:
            inter = halving_doubling_s(profile, across, chunk, itemsize, sharing=sharing, oversub=oversub,
                                       collective=collective)
        else:
            inter = ring_s(profile, across, chunk, segment_bytes, itemsize, sharing=sharing, oversub=oversub,
                           collective=collective)
    if collective != "all_reduce":
        own = math.ceil(n / itemsize / topology.world_size) * itemsize
        staging = 0.0  # the lane-by-lane order is a copy of the message in and the chunk out (or the reverse)
        if hosts > 1 and local > 1:
            staging = (n + own) * profile.copy_s_per_byte * oversub
        return inter + staging + _inside_shards_s(profile, chunk, own, local, largest, inside, segment_bytes,
                                                  itemsize, collective)
    if inside:
        node = shm_s(profile, Topology((largest,)), n, itemsize, public=False)
        if hosts == 1:
            return node
        spread = local * sum(profile.shm_barrier_s(largest) + shm_phase_s(profile, largest, s, 0, oversub)
                             for s in shm_slices(chunk, itemsize))
        return node + inter + spread
    step = _step(profile, Topology((largest,)), False, duplex=True)
    scatter, gather = ring_phases_s(local, n, step, segment_bytes, itemsize)
    extras = 0.0
    if largest > local:
        extras = 2 * step.move_s(n) + (largest - local) * chunk * step.gamma
    return extras + scatter + inter + gather


def _inside_shards_s(profile: Profile, chunk: int, own: int, local: int, largest: int, shm_inside: bool,
                     segment_bytes: int, itemsize: int, collective: str) -> float:
    """hierarchical's step inside a host of a reduce-scatter or all-gather (the largest host sets the pace):
    ``chunk`` bytes per lane, ``own`` per rank, ``local`` lanes."""
    if largest == 1:
        return 0.0
    if shm_inside:
        return shm_shard_s(profile, Topology((largest,)), chunk * largest, itemsize, collective)
    step = _step(profile, Topology((largest,)), False, duplex=True)
    scatter, gather = ring_phases_s(largest, chunk * largest, step, segment_bytes, itemsize)
    extras = step.move_s(own) if largest > local else 0.0  # an extra rank's own chunk, once more
    return extras + (scatter if collective == "reduce_scatter" else gather)


def predict_s(algorithm: str, profile: Profile, topology: Topology, nbytes: int, *,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES, itemsize: int = 4, collective: str = "all_reduce") -> float:
    """Predicted seconds of one ``collective`` (see the module docstring) of ``nbytes`` (the whole flat
    buffer; the call's overhead included, :func:`call_overhead_s`).

    Raises:
        ValueError: an algorithm without a formula (for this collective), or one this topology cannot run.
    """
    if algorithm == "ring":
        body = ring_s(profile, topology, nbytes, segment_bytes, itemsize, collective=collective)
    elif algorithm == "tree" and collective == "all_reduce":
        body = tree_s(profile, topology, nbytes, segment_bytes, itemsize)
    elif algorithm == "double_binary_tree" and collective == "all_reduce":
        body = double_binary_tree_s(profile, topology, nbytes, segment_bytes, itemsize)
    elif algorithm == "halving_doubling":
        body = halving_doubling_s(profile, topology, nbytes, itemsize, collective=collective)
    elif algorithm == "hierarchical":
        body = hierarchical_s(profile, topology, nbytes, segment_bytes, itemsize, collective=collective)
    elif algorithm == "shm":
        body = shm_s(profile, topology, nbytes, itemsize) if collective == "all_reduce" else \
            shm_shard_s(profile, topology, nbytes, itemsize, collective)
    else:
        raise ValueError(f"no {collective} formula for {algorithm!r}; choose one of "
                         f"{', '.join(name for name in FORMULAS if collective == 'all_reduce' or 'tree' not in name)}")
    return call_overhead_s(profile, algorithm, topology, nbytes, collective) + body
