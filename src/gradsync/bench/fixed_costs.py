"""The measurements of ``gradsync calibrate`` beyond compute: a link, a hop inside a schedule, a call per algorithm, the points.

A ping-pong's one-way time (``Link.alpha_s``) is not what a message costs inside a multi-hop
schedule over Gloo: there every hop posts a receive and a send and waits for both, and each wait
may sleep and be woken. Two terms close that gap (the LogP model's per-message overhead, Culler et
al. 1993, and the fixed cost of a call, which α-β-γ leaves out):

* ``Link.hop_alpha_s`` (:func:`measure`): chains of H dependent exchanges (``CollectiveCall.send_recv``,
  a ring step at two ranks: receive posted, send posted, both waited) of ``HOP_BYTES`` in one call
  each, H in ``HOP_COUNTS``; in every batch the least-squares slope of the chain's time over H, less
  the exchange's bytes at the link's rate; the median over the batches.
* ``Link.one_way_hop_alpha_s``: the same of relays of H one-way messages (each sent once the
  previous one arrived: a tree's edges), in the same batches.
* ``Profile.call_overheads_s`` (:func:`call_overheads`): for every algorithm the simulator runs, one
  ``all_reduce`` (``verify=False``, as the sweep calls it) of ``CALL_BYTES[algorithm]`` bytes over
  the whole group, in the same batches as the chains (the fixed costs drift with the machine's load),
  less the time the simulation gives that call with that batch's hop, every other term just
  measured and no call overhead; the median over the batches. ``Profile.call_overhead_s`` (any
  other algorithm) is ring's.

:func:`calibration_points` lists every point the calibration measures, so that ``gradsync simulate
--validate`` can show none of them is a point it scores.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from gradsync.bench import micro
from gradsync.collectives.communicator import Communicator
from gradsync.collectives.cost.profile import Link, Profile

KIB, MIB = 2**10, 2**20
HOP_COUNTS = (1, 2, 4, 8)
HOP_BYTES = 256
# a call per algorithm: small enough that its fixed cost dominates, never a validated size; shm past its
# lean path (LEAN_MAX_BYTES = 64 KiB): 96 KiB, one cell
CALL_BYTES = {"ring": 256, "tree": 256, "double_binary_tree": 256, "halving_doubling": 256,
              "hierarchical": 256, "shm": 96 * KIB}
LEAN_BYTES = 4  # the shm lean path's call (ShmModel.lean_call_overhead_s)


def fit_line(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """(intercept s, slope s/unit) of the least-squares line through (x, seconds).

    Raises:
        ValueError: fewer than two distinct x.

    >>> fit_line([1, 2, 3], [1.0, 2.0, 3.0])
    (0.0, 1.0)
    """
    if len(set(sizes)) < 2:
        raise ValueError(f"a line needs two distinct sizes, got {sizes}")
    mean_x, mean_y = sum(sizes) / len(sizes), sum(seconds) / len(seconds)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds))
             / sum((x - mean_x) ** 2 for x in sizes))
    return mean_y - slope * mean_x, slope


@dataclass(frozen=True)
class FixedCosts:
    """What :func:`measure` found: per batch, the hop of each pair measured and each call's seconds."""

    hops: dict[tuple[int, int], list[float]]      # pair -> seconds of an exchange's hop, per batch
    one_way: dict[tuple[int, int], list[float]]   # pair -> seconds of a one-way hop, per batch
    chains: dict[tuple[int, int], dict]           # pair -> hops (or ("one-way", hops)) -> median seconds
    calls: dict[str, list[float]]                 # label -> seconds of one call, per batch

    def hop_s(self, pair: tuple[int, int]) -> float:
        return statistics.median(self.hops[pair])

    def one_way_s(self, pair: tuple[int, int]) -> float:
        return statistics.median(self.one_way[pair])


def _slopes(batches: dict, keys: list, counts: tuple[int, ...], moved: float, repeats: int) -> list[float]:
    """Each batch's slope per hop of the chains ``keys`` (one per count), less ``moved`` seconds of bytes."""
    return [max(fit_line(list(counts), [batches[key][i] for key in keys])[1] - moved, 0.0) for i in range(repeats)]


def measure_link(comm: Communicator, pair: tuple[int, int], settings, cpu_bound: bool) -> tuple[Link, dict]:
    """The link between the ranks of ``pair``: α from ping-pongs of ``settings.small_sizes``, bandwidth from
    the slope of the one-way time of ``settings.large_sizes`` (collective; ``settings``: a
    :class:`gradsync.bench.calibrate.Settings`). Returns (link, raw seconds)."""
    def iterations(nbytes: int) -> int:
        return max(1, min(settings.small_iterations, settings.batch_bytes // max(nbytes, 1)))

    small = {n: micro.ping_pong(comm, pair, n, iterations(n), settings.repeats) for n in settings.small_sizes}
    large = {n: micro.ping_pong(comm, pair, n, iterations(n), settings.repeats) for n in settings.large_sizes}
    both = max(settings.large_sizes)
    exchanged = micro.exchange(comm, pair, both, iterations(both), settings.repeats)
    _, slope = fit_line(list(large), list(large.values()))
    if slope <= 0:  # a noisy machine: fall back to the largest size's mean rate
        slope = large[both] / both
    alpha = sorted(small.values())[len(small) // 2]
    raw = {"ping_pong_one_way_s": {str(n): s for n, s in {**small, **large}.items()},
           "exchange_s": {str(both): exchanged}}
    return Link(alpha_s=alpha, bandwidth_bytes_per_s=1.0 / slope, cpu_bound=cpu_bound), raw


def measure(comm: Communicator, pairs: list[tuple[int, int]], links: list[Link], one_host: bool, *,
            repeats: int, chains: int, call_count: int, counts: tuple[int, ...] = HOP_COUNTS,
            nbytes: int = HOP_BYTES) -> FixedCosts:
    """Measure the hop of every pair (its link as measured: the bytes' time, both directions on one
    port when ``cpu_bound``, is taken out of the slope) and, side by side with the first pair's chains,
    one call of every :func:`overhead_algorithms` at its ``CALL_BYTES`` and ("shm lean") the shm lean
    path's (collective; every rank gets it)."""
    calls = {name: (name, CALL_BYTES[name] // 4) for name in overhead_algorithms(one_host)}
    if one_host:
        calls["shm lean"] = ("shm", LEAN_BYTES // 4)
    hops, one_way, medians, measured = {}, {}, {}, {}
    for index, (pair, link) in enumerate(zip(pairs, links)):
        batches = micro.fixed_cost_batches(comm, [pair], nbytes, counts, chains, calls if index == 0 else {},
                                           call_count, repeats)
        moved = nbytes * link.beta_s_per_byte
        hops[pair] = _slopes(batches, list(counts), counts, moved * (2 if link.cpu_bound else 1), repeats)
        one_way[pair] = _slopes(batches, [("one-way", h) for h in counts], counts, moved, repeats)
        medians[pair] = {key: statistics.median(batches[key]) for key in batches if key not in calls}
        if index == 0:
            measured = {label: batches[label] for label in calls}
    return FixedCosts(hops, one_way, medians, measured)


def crowded_hop(comm: Communicator, link: Link, *, repeats: int, chains: int,
                counts: tuple[int, ...] = HOP_COUNTS, nbytes: int = HOP_BYTES) -> tuple[float, float, dict]:
    """The hop inside a schedule when a host's ranks outnumber its cores: every rank of ``comm`` (one
    host, twice the cores) in a ring, chains of ring steps (each rank sends right and receives from the
    left at once, as a ring's hops); the slope per hop, each batch's, less the bytes' time; the median
    (collective); the same of relays around the ring (one-way hops), and the chains' median seconds."""
    batches = micro.fixed_cost_batches(comm, [], nbytes, counts, chains, {}, 0, repeats)  # [] : a ring of all
    moved = nbytes * link.beta_s_per_byte
    hop = _slopes(batches, list(counts), counts, moved * (2 if link.cpu_bound else 1), repeats)
    one_way = _slopes(batches, [("one-way", h) for h in counts], counts, moved, repeats)
    return statistics.median(hop), statistics.median(one_way), {key: statistics.median(v) for key, v in batches.items()}


def points(hosts: bool, small_sizes, large_sizes, memory_bytes: int, cell_bytes: int, cores: int) -> list[dict]:
    """The points of :func:`gradsync.bench.calibrate.calibration_points` (its settings' sizes; ``cores``:
    this machine's, the crowded hop's ranks being twice as many), as dicts with keys collective ("p2p",
    "all_reduce", "shm", "compute"), algorithm (what ran: "pingpong", "exchange", "hop_chain", an
    all_reduce algorithm, "barrier", "cell", "add", "copy", "memory"), nbytes (a message's bytes; a
    buffer's for compute), world_size (the ranks taking part) and hosts (the hosts they span)."""
    def point(collective: str, algorithm: str, nbytes: int, world_size: int = 2, spans: int = 1) -> dict:
        return dict(collective=collective, algorithm=algorithm, nbytes=nbytes, world_size=world_size, hosts=spans)

    found = []
    for spans in ([1, 2] if hosts else [1]):  # the pair inside host 0, and (hosts) the one between hosts 0 and 1
        found += [point("p2p", "pingpong", n, 2, spans) for n in (*small_sizes, *large_sizes)]
        found += [point("p2p", "exchange", max(large_sizes), 2, spans), point("p2p", "hop_chain", HOP_BYTES, 2, spans)]
    if not hosts and cores < 4:  # the crowded hop: pairs chaining at once on 2 x the cores
        found.append(point("p2p", "hop_chain", HOP_BYTES, 2 * cores))
    found += [point("compute", kind, memory_bytes) for kind in ("add", "copy", "memory")]
    found += [point("compute", kind, cell_bytes) for kind in ("add", "copy")]
    found += [point("shm", "barrier", 0), point("shm", "cell", 8)]
    group = (4, 2) if hosts else (2, 1)
    found += [point("all_reduce", name, CALL_BYTES[name], *group) for name in overhead_algorithms(not hosts)]
    if not hosts:
        found.append(point("all_reduce", "shm", LEAN_BYTES))
    return found


def hop_text(chains: dict[int, float], nbytes: int = HOP_BYTES) -> str:
    """A pair's chains as text (us)."""
    def name(key) -> str:
        return f"{key[1]} one-way" if isinstance(key, tuple) else f"{key} exchanges"
    return f"{nbytes} B: " + ", ".join(f"{name(key)} {s * 1e6:.0f} us" for key, s in chains.items())


def overhead_algorithms(one_host: bool) -> list[str]:
    """The algorithms whose call is measured: the simulator's (shm on one host only)."""
    from gradsync.sim import SIMULATED

    return [name for name in CALL_BYTES if name in SIMULATED and (one_host or name != "shm")]


def call_overheads(profile: Profile, costs: FixedCosts, pair: tuple[int, int], layout: tuple[int, int],
                   world_size: int, crowding: float) -> Profile:
    """``profile`` with ``call_overheads_s`` (``call_overhead_s`` = ring's; the shm lean path's figure)
    from ``costs``: in each batch, each call less its simulated time with that batch's hop (of ``pair``,
    the link ``profile.intra``'s) and no call overhead, the median over the batches, divided by
    ``crowding`` (the ranks-per-core slowdown the simulator multiplies back)."""
    bare = dataclasses.replace(profile, call_overhead_s=0.0, call_overheads_s=())
    if bare.shm is not None:
        bare = dataclasses.replace(bare, shm=dataclasses.replace(bare.shm, lean_call_overhead_s=0.0))
    overheads = {}
    for label, seconds in costs.calls.items():
        algorithm, nbytes = ("shm", LEAN_BYTES) if label == "shm lean" else (label, CALL_BYTES[label])
        rest = []
        for batch, hop, one_way in zip(seconds, costs.hops[pair], costs.one_way[pair]):
            shared = bare.intra.oversubscribed_hop_alpha_s is not None  # a pair on one core: the hop is crowded
            model = dataclasses.replace(bare, intra=dataclasses.replace(
                bare.intra, hop_alpha_s=hop, one_way_hop_alpha_s=one_way,
                oversubscribed_hop_alpha_s=hop if shared else None,
                oversubscribed_one_way_hop_alpha_s=one_way if shared else None))
            rest.append(batch - _modelled_time(model, algorithm, world_size, layout, nbytes))
        overheads[label] = max(statistics.median(rest), 0.0) / crowding
    lean = overheads.pop("shm lean", None)
    profile = dataclasses.replace(profile, call_overhead_s=overheads.get("ring", 0.0),
                                  call_overheads_s=tuple(overheads.items()))
    if profile.shm is not None:
        profile = dataclasses.replace(profile, shm=dataclasses.replace(profile.shm, lean_call_overhead_s=lean))
    return profile


def calls_text(costs: FixedCosts) -> str:
    """Each call's median seconds as text."""
    return ", ".join(f"{label} {LEAN_BYTES if label == 'shm lean' else CALL_BYTES[label]} B "
                     f"{statistics.median(seconds) * 1e6:.1f} us" for label, seconds in costs.calls.items())


def _modelled_time(profile: Profile, algorithm: str, world_size: int, layout: tuple[int, int], nbytes: int) -> float:
    """Simulated seconds of an ``nbytes`` ``algorithm`` all_reduce on ``profile`` (its overheads as set)."""
    from gradsync.sim import Topology, simulate_all_reduce

    hosts, per_host = layout
    topology = Topology.uniform(hosts, per_host) if hosts > 1 else Topology((world_size,))
    return simulate_all_reduce(algorithm, nbytes, profile, topology).time_s
