"""Run a real AllReduce algorithm on simulated ranks and return its predicted time.

The function called is the one ``gradsync.all_reduce`` calls
(``collectives.registry.ALL_REDUCE[algorithm]``), with a real
:class:`~gradsync.collectives.call.CollectiveCall` per rank over a
:class:`~gradsync.sim.transport.SimTransport`, on
:class:`~gradsync.sim.virtual.VirtualTensor` s: the same chunks, segments,
peers and additions as a real run, priced instead of performed.

>>> from gradsync.collectives.cost.profiles import get_profile
>>> result = simulate_all_reduce("ring", 2**30, get_profile("h100-ib"), Topology.uniform(1, 8))
>>> result.world_size, 340 < result.busbw_gbps < 371  # a 1 GiB ring nears the 370.8 GB/s of an NVLink port
(8, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import SegmentOptions
from gradsync.collectives.cost.formulas import call_overhead_s
from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.cost.topology import Topology
from gradsync.collectives.hierarchical import HierarchicalOptions
from gradsync.collectives.options import AlgorithmOptions, OptionStore
from gradsync.collectives.registry import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from gradsync.sim.cluster import TraceEvent, VirtualCluster
from gradsync.sim.transport import SimWorld
from gradsync.sim.virtual import VirtualTensor, VirtualWorkspace
from gradsync.transport.base import TransportStats

SIMULATED = ("ring", "tree", "double_binary_tree", "halving_doubling", "hierarchical", "shm")
_TIMEOUT_S = 1e9  # a simulated call never times out: a deadlock is found by the scheduler instead


@dataclass
class SimResult:
    """A simulated AllReduce.

    ``time_s``: from the call's start on every rank to the last rank's end
    (simulated seconds, including the call overhead: ``formulas.call_overhead_s``); ``stats``:
    every rank's :class:`TransportStats`; ``trace``: the transfers and
    reductions, when asked for.
    """

    algorithm: str
    nbytes: int
    topology: Topology
    time_s: float
    stats: list[TransportStats]
    trace: list[TraceEvent] | None = field(default=None, repr=False)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def algbw_gbps(self) -> float:
        """nccl-tests' algbw: bytes / time, in GB/s (10^9)."""
        return self.nbytes / self.time_s / 1e9 if self.time_s > 0 else 0.0

    @property
    def busbw_gbps(self) -> float:
        """nccl-tests' busbw for all_reduce: algbw x 2(p-1)/p."""
        p = self.world_size
        return self.algbw_gbps * 2 * (p - 1) / p if p > 1 else 0.0


def check_algorithm(algorithm: str) -> None:
    if algorithm not in SIMULATED:
        raise ValueError(f"the simulator runs {', '.join(SIMULATED)}; got {algorithm!r}")


def simulate_all_reduce(algorithm: str, nbytes: int, profile: Profile, topology: Topology, *,
                        dtype: torch.dtype = torch.float32, segment_bytes: int | None = None,
                        options: Sequence[AlgorithmOptions] = (), device_type: str | None = None,
                        trace: bool = False, collective: str = "all_reduce") -> SimResult:
    """Predict one AllReduce of ``nbytes`` (a multiple of ``dtype``'s size) on ``topology``, or
    (``collective``) one reduce-scatter or all-gather of an ``nbytes`` flat buffer.

    Args:
        algorithm: one of ``SIMULATED``.
        nbytes: message bytes (>= 0).
        profile: the hardware (:mod:`gradsync.collectives.cost.profiles`).
        topology: ranks on hosts.
        dtype: the element type the algorithm reduces in (float32 by default).
        segment_bytes: the ring and the trees' pipelining unit (None: ``SegmentOptions``' default).
        options: more algorithm options (e.g. ``HierarchicalOptions``).
        device_type: what the tensors claim to live on ("cpu" makes ``hierarchical`` use shm inside
            on real hosts, as on CPU; None: "cpu" for a profile with a shared-memory model, else "meta").
        trace: keep every transfer and reduction in ``SimResult.trace``.
        collective: "all_reduce", "reduce_scatter" or "all_gather" (the registry's function of that
            collective; not "tree", nor "shm", whose shared memory the simulator models for the
            AllReduce only, nor shm inside ``hierarchical``).

    Raises:
        ValueError: an algorithm the simulator does not run, a bad ``nbytes``, "shm" across hosts,
        a profile that lacks a link the topology needs.
    """
    check_algorithm(algorithm)
    tables = {"all_reduce": ALL_REDUCE, "reduce_scatter": REDUCE_SCATTER, "all_gather": ALL_GATHER}
    if algorithm not in tables.get(collective, {}) or (collective != "all_reduce" and algorithm == "shm"):
        raise ValueError(f"the simulator runs no {collective} of {algorithm!r}")
    itemsize = dtype.itemsize
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0 or nbytes % itemsize:
        raise ValueError(f"nbytes must be an int >= 0 and a multiple of {itemsize} ({dtype}), got {nbytes!r}")
    if algorithm == "shm" and topology.hosts > 1:
        raise ValueError(f"shm needs every rank on one host; the topology has {topology.describe()}")
    cluster = VirtualCluster(profile, topology, trace=trace)
    world = SimWorld(cluster)
    device = torch.device(device_type or ("cpu" if profile.shm is not None else "meta"))
    store = OptionStore(_with_defaults(options, segment_bytes))
    transports = [world.transport(rank) for rank in range(topology.world_size)]
    function = tables[collective][algorithm]
    overhead_s = call_overhead_s(profile, algorithm, topology, nbytes, collective)

    def body(state):
        state.now = overhead_s
        if topology.world_size == 1 or nbytes == 0:
            return
        transport = transports[state.rank]
        call = CollectiveCall(transport, collective, algorithm, _TIMEOUT_S, VirtualWorkspace(cluster, device),
                              options=store, locality=world.locality)
        function(VirtualTensor.empty(nbytes // itemsize, dtype, cluster, device=device), call)

    time_s = cluster.run(body)
    return SimResult(algorithm, nbytes, topology, time_s, [t.stats for t in transports], cluster.trace)


def _with_defaults(options: Sequence[AlgorithmOptions], segment_bytes: int | None) -> list[AlgorithmOptions]:
    options = list(options)
    kinds = {type(option) for option in options}
    if segment_bytes is not None:
        if SegmentOptions in kinds:
            raise ValueError("give segment_bytes or SegmentOptions, not both")
        options.append(SegmentOptions(segment_bytes=segment_bytes))
    if HierarchicalOptions not in kinds:
        options.append(HierarchicalOptions())
    return options
