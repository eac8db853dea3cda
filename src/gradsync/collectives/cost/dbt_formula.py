"""Closed-form α-β-γ time of the double binary tree AllReduce, on the event simulation's model.

The schedule is :mod:`gradsync.collectives.double_binary_tree`'s: two
complementary in-order binary trees over p ranks (Sanders, Speck & Träff
2009, "Two-tree algorithms for full bandwidth broadcast, reduction and
scan"; NCCL 2.4's double binary trees), each reducing then broadcasting half
of the n bytes in k segments of s bytes. A rank is an inner node in at most
one tree, so in each phase it sends and receives about n bytes in all,
where a single tree's inner rank receives 2n.

Cost (each phase, reduce then broadcast): the first segment of each tree
followed edge by edge up (down), a child's segment costing α + s·β and its
add s·γ at the parent, children in turn through the parent's port; then the
other k - 1 segments at the pace of the busiest port (every edge of both
trees puts s bytes per round through its two ends' ports; a shared NIC
carries all its host's crossing edges) or the busiest adder (2·s·γ per
round at an inner rank). Without contention and with one segment per half
(s = n/2, p = 2^m... ), the phase is about d·(α + (n/2)·β) + d·n·γ/2 up and
d·(α + (n/2)·β) down for trees of depth d; pipelined with many segments,
≈ 2·(d·(α + s·β) + (n/s)·s·β), i.e. about n·β per phase (the ring:
(p-1)/p·n·β), with a tree's log-depth latency.

The ports are the event simulation's (:class:`gradsync.sim.cluster.VirtualCluster`):
an egress and an ingress port per rank on the intra-host link (one port for
both directions when the link is ``cpu_bound``), an egress and an ingress
port per NIC across hosts; CPU terms slowed by the ranks-per-core
oversubscription. Agrees with the event simulation within 5%
(``tests/test_cost_alpha_beta.py``, ``tests/test_sim.py``).
"""

from __future__ import annotations

import functools

from gradsync.collectives.chunking import DEFAULT_SEGMENT_BYTES, chunk_bounds
from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.cost.topology import Topology
from gradsync.collectives.double_binary_tree import links


def _local_ranks(topology: Topology) -> list[int]:
    return [local for size in topology.host_sizes for local in range(size)]


class _Edges:
    """The ports and costs of the edges (child -> parent) of one topology, as the event simulation prices them."""

    def __init__(self, profile: Profile, topology: Topology):
        self.profile = profile
        self.hosts = topology.host_of()
        self.local = _local_ranks(topology)
        self.oversub = [profile.oversubscription(topology.host_sizes[h]) for h in range(topology.hosts)]
        self._costs: dict[tuple[int, int], tuple[float, float, tuple, tuple]] = {}

    def cost(self, src: int, dst: int) -> tuple[float, float, tuple, tuple]:
        """(α seconds, β seconds per byte, sender's port, receiver's port) of a message src -> dst."""
        known = self._costs.get((src, dst))
        if known is None:
            known = self._costs[src, dst] = self._cost(src, dst)
        return known

    def _cost(self, src: int, dst: int) -> tuple[float, float, tuple, tuple]:
        same = self.hosts[src] == self.hosts[dst]
        link = self.profile.link(same)
        slow = self.oversub[self.hosts[src]] if link.cpu_bound else 1.0
        if not same:
            nics = self.profile.nics_per_host
            ports = (("nic-out", self.hosts[src], self.local[src] % nics),
                     ("nic-in", self.hosts[dst], self.local[dst] % nics))
        elif link.cpu_bound:
            ports = (("cpu", src), ("cpu", dst))
        else:
            ports = (("out", src), ("in", dst))
        # a rank sends in one tree while it receives in the other: every message is one side of an exchange
        # (Link.hop_at: the calibrated hop in a schedule; alpha_s x ranks/cores where none is measured)
        return link.hop_at(self.oversub[self.hosts[src]]), link.beta_s_per_byte * slow, ports[0], ports[1]


@functools.lru_cache(maxsize=16)
def _edges(profile: Profile, topology: Topology) -> _Edges:
    return _Edges(profile, topology)


def _reserve(port_free: dict, ready: float, out_key: tuple, in_key: tuple, busy: float) -> float:
    """Each end's port in turn, as :meth:`VirtualCluster.transfer`; the transfer's start."""
    sending, receiving = max(ready, port_free.get(out_key, 0.0)), max(ready, port_free.get(in_key, 0.0))
    port_free[out_key], port_free[in_key] = sending + busy, receiving + busy
    return max(sending, receiving)


def _levels(tree_links: list[tuple], root: int) -> list[list[int]]:
    """The ranks of one tree by depth from the root (root first)."""
    levels, level = [], [root]
    while level:
        levels.append(level)
        level = [child for rank in level for child in tree_links[rank][1]]
    return levels


@functools.lru_cache(maxsize=64)
def _trees(p: int) -> tuple[list[list[tuple]], list[list[list[int]]]]:
    """Both trees' ``links`` per rank and their levels (root first), for p ranks."""
    trees = [[links(rank, p, tree) for rank in range(p)] for tree in (0, 1)]
    roots = [next(rank for rank in range(p) if trees[tree][rank][0] is None) for tree in (0, 1)]
    return trees, [_levels(tree_links, root) for tree_links, root in zip(trees, roots)]


def _phase_s(edges: _Edges, trees: list[list[tuple]], levels: list[list[list[int]]], s: list[float], rounds: float,
             gamma: list[float], up: bool) -> float:
    """One phase (reduce if ``up`` else broadcast) of both trees: the first segments edge by edge, level
    by level (both trees' levels together, through the same ports), then ``rounds`` more segments at the
    busiest port's or adder's pace. ``s[t]``: tree t's segment bytes."""
    loads: dict[tuple, float] = {}
    adds = [0.0] * len(gamma)
    ready = [[0.0] * len(gamma) for _ in trees]
    port_free: dict[tuple, float] = {}
    levels = [tree_levels[::-1] if up else tree_levels for tree_levels in levels]  # leaves first going up
    for step in range(max(len(tree_levels) for tree_levels in levels)):
        nodes = [(tree, rank) for tree, tree_levels in enumerate(levels) if step < len(tree_levels)
                 for rank in tree_levels[step]]
        for tree, rank in sorted(nodes, key=lambda node: ready[node[0]][node[1]]):
            size, times = s[tree], ready[tree]
            for child in trees[tree][rank][1]:
                src, dst = (child, rank) if up else (rank, child)
                alpha, beta, out_key, in_key = edges.cost(src, dst)
                start = _reserve(port_free, times[src], out_key, in_key, size * beta)
                for port in (out_key, in_key):
                    loads[port] = loads.get(port, 0.0) + size * beta
                if up:  # children waited in turn, each added on arrival
                    times[rank] = max(times[rank], start + size * beta + alpha) + size * gamma[rank]
                    adds[rank] += size * gamma[rank]
                else:
                    times[child] = start + size * beta + alpha
    pace = max(max(loads.values(), default=0.0), max(adds) if up else 0.0)
    return max(max(times) for times in ready) + rounds * pace


def double_binary_tree_s(profile: Profile, topology: Topology, n: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                         itemsize: int = 4) -> float:
    """Seconds of one double binary tree AllReduce of ``n`` bytes (``itemsize``-byte elements, segments of
    ``segment_bytes``) on ``topology``, the call's fixed overhead excluded (see the module docstring).

    Raises:
        ValueError: the topology crosses hosts and the profile has no link between them.
    """
    p = topology.world_size
    if p == 1 or n == 0:
        return 0.0
    numel = n // itemsize
    segment_numel = max(1, segment_bytes // itemsize)
    halves = [(stop - start) * itemsize for start, stop in chunk_bounds(numel, 2)]
    s = [min(h, segment_numel * itemsize) for h in halves]
    rounds = max(h / size for h, size in zip(halves, s) if size) - 1  # after the first; the last one partial
    trees, levels = _trees(p)
    edges = _edges(profile, topology)
    gamma = [profile.gamma_s_per_byte * edges.oversub[host] for host in edges.hosts]
    return sum(_phase_s(edges, trees, levels, s, rounds, gamma, up) for up in (True, False))
