"""NCCL's own cost model: which algorithm x protocol NCCL picks for a collective and the time it predicts.

Written from NVIDIA/nccl v2.24.3-1 (commit 6aae3792), the version the
published curves ran (:data:`~gradsync.collectives.cost.nccl_constants.NCCL_SOURCE`):

1. The topology search (search.cc ``ncclTopoCompute``) finds, per
   algorithm, a graph: channels and a bandwidth per channel inside the node
   (``bwIntra``) and to the network (``bwInter``). :func:`search_graphs`
   follows its steps for an NVSwitch node with rail NICs: try the speeds of
   the speed array from the highest that fits, keep the graph with the most
   channels x bandwidth, stop on the maximum channels or when the next speed
   is under 0.49 of the best; duplicate ring/tree channels
   (``ncclTopoDupChannels``); then try higher speeds with that many
   channels. A channel of a ring or tree takes its bandwidth on each GPU's
   NVLinks (and a NIC across nodes); an NVLS channel twice on its head GPU.
   Not modelled: PCIe-only nodes, CollNet (no SHARP switch in the systems
   shipped), the balanced tree's split NIC use.
2. The tuning model (tuning.cc ``ncclTopoTuneModel``): per algorithm and
   protocol a bus bandwidth (channels x bandwidth, then LL x 1/2 capped at
   ``llMaxBw``, LL128 x 0.92 capped per channel, the tree's 0.92 and per
   channel cap, tree LL / 3.8, tree LL128 7/9 on one node, NVLS 5/6) turned
   into an algorithm bandwidth (ring x nRanks/nSteps, tree x 1/2) and a
   latency (``baseLat`` + the per-step ``hwLat`` of each hop by link type).
   LL128 is enabled by default on NVLink Ampere/Hopper (its enable rules).
3. The time (``ncclTopoGetAlgoTime``): latency + bytes / bandwidth, the
   tree's ``treeCorrectionFactor`` per size, the ring's plateau x 1.4 across
   nodes; NCCL (enqueue.cc ``topoGetAlgoInfo``) runs the pair with the least
   time and lowers its channels while bytes < channels x threads x threshold.

The time is NCCL's own prediction, not a measurement: it leaves out the
kernel launch, the benchmark harness and the pipeline fill of NVLS and
NVLSTree (:mod:`~gradsync.collectives.cost.nccl_pipeline`, added in
``NcclChoice.fill_us`` and ``run_time_s``; the pick stays NCCL's).

Checks against published NCCL logs (channel counts only; nothing fitted):
one H100 node runs 2 x 12 = 24 ring channels (NVIDIA/nccl#1259 lists
channel 22 on 8 H100), NVLSTree 8 search channels on H100 nodes with 8 NICs
(NVIDIA/nccl#1041), 3 H100 nodes 2 x 8 = 16 ring channels ("Channel 05/16",
NVIDIA/nccl#1453). Uncertain: across nodes the ring's 8 channels carry 45
GB/s each here because every GPU's NVLinks carry each channel (PXN); a
search that enters and leaves each node through different GPUs' own NICs
(cross-NIC) would fit 8 x 48, 7% more.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from gradsync.collectives.cost import nccl_constants as K
from gradsync.collectives.cost.nccl_constants import NcclConstants
from gradsync.collectives.cost.nccl_pipeline import pipeline_fill_us
from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.cost.topology import Topology

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class Graph:
    """One algorithm's channels as NCCL's search leaves them: ``channels`` x (``bw_intra``, ``bw_inter``) GB/s."""

    channels: int
    bw_intra: float
    bw_inter: float


@dataclass(frozen=True)
class NcclChoice:
    """What NCCL runs for one call: algorithm, protocol, channels, its model's predicted time (seconds),
    latency (us) and algorithm bandwidth (GB/s), and the pipeline fill its model leaves out (us,
    :func:`~gradsync.collectives.cost.nccl_pipeline.pipeline_fill_us`)."""

    algorithm: str
    protocol: str
    channels: int
    time_s: float
    latency_us: float
    bandwidth_gbps: float
    fill_us: float = 0.0

    @property
    def pick(self) -> str:
        return f"{self.algorithm}/{self.protocol}/{self.channels}ch"

    @property
    def run_time_s(self) -> float:
        """The call's time: NCCL's model's time plus the pipeline fill (seconds)."""
        return self.time_s + self.fill_us * 1e-6


def _fits(nccl: NcclConstants, pattern: str, hosts: int, ngpus: int, intra: float, inter: float) -> int:
    """How many channels of (intra, inter) GB/s the node's links carry for ``pattern`` (one GPU per node:
    no NVLink traffic, the NICs alone)."""
    per_gpu = math.floor(nccl.nvlink_gbps / intra + 1e-9) if ngpus > 1 else K.MAX_CHANNELS
    channels = min(ngpus, per_gpu - 1) if pattern == "nvls" else per_gpu
    if hosts > 1:
        channels = min(channels, nccl.nics * math.floor(nccl.net_gbps / inter + 1e-9))
    return max(channels, 0)


def _search(nccl: NcclConstants, pattern: str, hosts: int, ngpus: int, min_channels: int) -> Graph | None:
    """search.cc ncclTopoCompute for ``pattern`` ("ring", "tree", "nvls"), simplified to NVSwitch nodes."""
    max_channels = ngpus if pattern == "nvls" else (K.MAX_CHANNELS // 2 if pattern == "ring" else min_channels)
    if pattern == "nvls" and hosts == 1:
        min_channels = max_channels = ngpus          # pull evenly from every GPU
    hopper = nccl.compute_capability >= 90
    if hosts == 1:
        speeds, max_bw = (K.SM90_SPEEDS_INTRA if hopper else K.SPEEDS_INTRA), nccl.nvlink_gbps
    else:
        speeds, max_bw = (K.SM90_SPEEDS_INTER if hopper else K.SPEEDS_INTER), nccl.net_gbps
    total_bw = nccl.nvlink_gbps * (1 if pattern == "ring" or ngpus == 1 else ngpus / (ngpus - 1))
    index = 0
    while index < len(speeds) - 1 and (speeds[index] > max_bw or speeds[index] * min_channels > total_bw):
        index += 1
    best = None
    while True:
        speed = speeds[index]
        channels = min(_fits(nccl, pattern, hosts, ngpus, speed, speed), max_channels)
        if channels >= min_channels and (best is None or _better(pattern, channels, speed, best)):
            best = Graph(channels, speed, speed)
        if best is not None and (best.channels == max_channels or best.channels * best.bw_inter >= nccl.nvlink_gbps):
            break
        if index < len(speeds) - 1 and (best is None or speeds[index + 1] / best.bw_inter > .49):
            index += 1
        else:
            break
    if best is None:
        return None
    if pattern != "nvls":
        best = _duplicate(best, nccl, max_channels)
    return _raise(best, nccl, pattern, hosts, ngpus, speeds)


def _better(pattern: str, channels: int, speed: float, best: Graph) -> bool:
    if pattern == "nvls":   # ncclTopoCompareGraphs: NVLS wants more channels first
        return channels > best.channels or channels * speed > best.channels * best.bw_inter
    return channels * speed > best.channels * best.bw_intra


def _duplicate(graph: Graph, nccl: NcclConstants, max_channels: int) -> Graph:
    """search.cc ncclTopoDupChannels."""
    if graph.bw_intra < 25.0 or (nccl.compute_capability > 80 and graph.bw_intra < 50.0 and graph.channels > 4):
        return graph
    channels = min(graph.channels * 2, max_channels)
    split = math.ceil(channels / graph.channels)
    return Graph(channels, graph.bw_intra / split, graph.bw_inter / split)


def _raise(graph: Graph, nccl: NcclConstants, pattern: str, hosts: int, ngpus: int, speeds) -> Graph:
    """Pass 2 of the search: higher speeds with the channels found (ring: both; tree: intra; NVLS: inter)."""
    for speed in reversed([s for s in speeds if s > min(graph.bw_intra, graph.bw_inter)]):
        if pattern == "ring":
            trial = Graph(graph.channels, speed, speed)
        elif pattern == "nvls":
            trial = Graph(graph.channels, graph.bw_intra, speed)
        else:
            if not graph.bw_intra < 2 * graph.bw_inter:
                break
            trial = Graph(graph.channels, speed, graph.bw_inter)
        if _fits(nccl, pattern, hosts, ngpus, trial.bw_intra, trial.bw_inter) < graph.channels:
            break
        graph = trial
    return graph


@functools.lru_cache(maxsize=256)
def search_graphs(nccl: NcclConstants, topology: Topology) -> dict[str, Graph]:
    """NCCL's graphs for ``topology`` (uniform hosts): "ring", "tree", and "nvls" where NVLS is on (cached:
    do not modify the dict returned)."""
    hosts, ngpus = topology.hosts, topology.host_sizes[0]
    ring = _search(nccl, "ring", hosts, ngpus, 1)
    graphs = {"ring": ring, "tree": _search(nccl, "tree", hosts, ngpus, ring.channels)}
    if nccl.nvls and nccl.nvswitch and nccl.compute_capability >= 90 and ngpus > 1:
        nvls = _search(nccl, "nvls", hosts, ngpus, 1)
        if nvls is not None and nvls.channels >= 2:
            graphs["nvls"] = graphs["nvls_tree"] = nvls
    return graphs


@dataclass(frozen=True)
class _Entry:
    bandwidth: float   # algorithm bandwidth, GB/s (0: not available)
    latency: float     # us


def _ll128_enabled(nccl: NcclConstants) -> bool:
    """tuning.cc's default for LL128: NVLink inside the node (no PCIe-only paths), Ampere or Hopper."""
    return nccl.nvswitch and nccl.compute_capability in (80, 90)


@functools.lru_cache(maxsize=256)
def tuning_table(nccl: NcclConstants, topology: Topology, collective: str = "all_reduce"
                 ) -> dict[tuple[str, str], _Entry]:
    """tuning.cc ncclTopoTuneModel: (algorithm, protocol) -> algorithm bandwidth and latency, for every pair
    NCCL would consider for ``collective`` on ``topology`` (cached: do not modify the dict returned)."""
    graphs = search_graphs(nccl, topology)
    nodes, ranks = topology.hosts, topology.world_size
    ppn = ranks / nodes
    gen, col = nccl.generation, min(nodes, 3) - 1
    ll_max = K.LL_MAX_BW[gen if nodes == 1 else (1 if nccl.cpu_vendor == "amd" else 0)][col]
    steps = 2 * (ranks - 1) if collective == "all_reduce" else ranks - 1
    hw = "NVLINK" if nccl.nvswitch else "PCI"
    table = {}
    for algorithm in ("tree", "ring", "nvls", "nvls_tree"):
        graph = graphs.get(algorithm)
        if graph is None or (collective != "all_reduce" and algorithm not in ("ring", "nvls")):
            continue
        if algorithm == "nvls" and nodes > 1:          # NVLS across nodes needs CollNet (SHARP)
            continue
        if algorithm == "nvls_tree" and nodes == 1:
            continue
        for p, protocol in enumerate(K.PROTOCOLS):
            if algorithm.startswith("nvls") and protocol != "Simple":
                continue
            if protocol == "LL128" and not _ll128_enabled(nccl):
                continue
            table[(algorithm, protocol)] = _Entry(
                _bus_bandwidth(nccl, graph, algorithm, p, nodes, gen, col, ll_max, collective, ranks, steps),
                _latency(nccl, graph, algorithm, p, nodes, ppn, hw, steps, collective))
    return table


def _bus_bandwidth(nccl, graph, algorithm, p, nodes, gen, col, ll_max, collective, ranks, steps) -> float:
    bw = graph.bw_intra if nodes <= 2 else graph.bw_inter
    if algorithm == "nvls":
        bw = min(graph.bw_intra, graph.bw_inter)
    if algorithm == "nvls_tree":
        bw = min(graph.bw_intra, graph.bw_inter if nodes <= 2 else graph.bw_inter / 2)
    bus = graph.channels * bw
    if algorithm == "ring" and p == 0:
        bus = min(ll_max, bus * .5)
    if algorithm == "ring" and p == 1:
        bus = min(bus * .92, graph.channels * K.PER_CH_MAX_RING_LL128_BW[gen][col])
    if algorithm == "tree" and collective == "all_reduce":
        bus = min(bus * .92, graph.channels * K.PER_CH_MAX_TREE_BW[gen][col])
    if algorithm == "tree" and p == 0:
        bus = min(bus / 3.8, ll_max)
    if algorithm == "tree" and p == 1:
        bus = min(bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0),
                  graph.channels * K.PER_CH_MAX_TREE_LL128_BW[gen][col])
    if algorithm == "tree" and ranks == nodes:      # one GPU per node: the search's pattern is TREE, x 0.85
        bus *= .85
    if algorithm == "ring":
        return bus * ranks / steps
    if algorithm.startswith("nvls"):
        return bus * K.NVLS_AR_RATIO if collective == "all_reduce" else bus
    return bus * .5


def _latency(nccl, graph, algorithm, p, nodes, ppn, hw, steps, collective) -> float:
    base = K.BASE_LATENCY_US.get(algorithm, (0, 0, 0))[p]
    intra = K.HW_LATENCY_US[hw][algorithm][p]
    inter = K.HW_LATENCY_US["NET"]["tree" if ppn == 1 else algorithm][p]   # latencyInter: 0 for IB
    if algorithm == "ring":
        if nodes > 1:
            intra = max(intra, (1.0 if nccl.cpu_vendor == "intel" else 2.0) * (3 if p == 2 else 1))
        inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if collective == "all_reduce" else nodes - 1)
        return base + (steps - inter_steps) * intra + inter_steps * inter
    if algorithm == "tree":
        return base + 2 * ((ppn - 1) * intra + math.floor(math.log2(nodes)) * inter)
    if algorithm == "nvls":
        return intra + (inter if nodes > 1 else 0)
    return base + intra + 2 * math.floor(math.log2(nodes)) * inter      # nvls_tree


def algorithm_time_us(nccl: NcclConstants, topology: Topology, table, algorithm: str, protocol: str,
                      nbytes: int, collective: str = "all_reduce") -> float:
    """tuning.cc ncclTopoGetAlgoTime for one pair (microseconds; -1 where NCCL has no such pair)."""
    entry = table.get((algorithm, protocol))
    if entry is None or entry.bandwidth <= 0:
        return -1.0
    bw, lat = entry.bandwidth, entry.latency
    p = K.PROTOCOLS.index(protocol)
    log_size = int(math.log2(nbytes >> 6)) if nbytes >= 64 else -1
    if algorithm == "tree" and collective == "all_reduce" and 0 <= log_size < 23:
        bw *= K.TREE_CORRECTION[p][log_size]
    ring_channels = search_graphs(nccl, topology)["ring"].channels
    comm_channels = min(K.MAX_CHANNELS, 2 * ring_channels)
    if (algorithm == "ring" and protocol == "Simple" and topology.hosts > 1 and collective == "all_reduce"
            and nbytes // (comm_channels * topology.world_size) >= 64):
        lat *= 1.4 if nccl.compute_capability >= 80 else 1.9           # "plateau effect of ring"
    return lat + nbytes / (1000 * bw)


def _channels_used(nccl: NcclConstants, topology: Topology, algorithm: str, protocol: str, nbytes: int) -> int:
    """enqueue.cc topoGetAlgoInfo: NVLS runs NVLS_NCHANNELS; ring/tree drop channels while
    bytes < channels x threads x threshold."""
    if algorithm.startswith("nvls"):
        return K.NVLS_CHANNELS
    p = K.PROTOCOLS.index(protocol)
    channels = min(K.MAX_CHANNELS, 2 * search_graphs(nccl, topology)["ring"].channels)
    threshold = K.THREAD_THRESHOLDS[p] * (topology.world_size if algorithm == "ring" and p == 0 else 1)
    while nbytes < channels * K.MAX_THREADS[p] * threshold and channels >= 2:
        channels -= 1
    return channels


def nccl_choice(profile: Profile, topology: Topology, nbytes: int, collective: str = "all_reduce") -> NcclChoice:
    """The algorithm x protocol NCCL 2.24 picks for ``nbytes`` (per rank) on ``topology``, with its time.

    ``profile.nccl`` gives the hardware NCCL sees; hosts of ``topology`` must all hold the same number of
    GPUs. The pick and ``time_s`` are NCCL's own model (microseconds in NCCL, seconds here); ``fill_us`` and
    ``run_time_s`` add the pipeline fill NCCL's model leaves out (:mod:`~gradsync.collectives.cost.nccl_pipeline`).

    Raises:
        ValueError: the profile has no NCCL constants or no NVSwitch, a bad collective or size, uneven hosts.
    """
    nccl = getattr(profile, "nccl", None)
    if nccl is None:
        raise ValueError(f"profile {profile.name!r} has no NCCL constants (profile.nccl): NCCL's model "
                         f"applies to GPU profiles ({', '.join(('h100-ib', 'h200-ib', 'a100-ib'))})")
    if not nccl.nvswitch:
        raise ValueError(f"profile {profile.name!r}: NCCL's topology search is modelled for NVSwitch nodes only "
                         f"(nccl.nvswitch is False)")
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}, got {collective!r}")
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    if len(set(topology.host_sizes)) != 1 or topology.world_size < 2:
        raise ValueError(f"NCCL's model needs >= 2 ranks and hosts of equal size, got {topology.describe()}")
    table = tuning_table(nccl, topology, collective)
    best = None
    for (algorithm, protocol), entry in table.items():
        time_us = algorithm_time_us(nccl, topology, table, algorithm, protocol, nbytes, collective)
        if time_us >= 0 and (best is None or time_us < best[0]):
            best = (time_us, algorithm, protocol, entry)
    time_us, algorithm, protocol, entry = best
    fill = pipeline_fill_us(profile, topology, algorithm, nbytes, search_graphs(nccl, topology).get(algorithm),
                            collective)
    return NcclChoice(algorithm, protocol, _channels_used(nccl, topology, algorithm, protocol, nbytes),
                      time_us * 1e-6, entry.latency, entry.bandwidth, fill)
