"""The time of one bucket's gradient exchange: an AllReduce, or a compressor's two-phase exchange.

* No compression: the bucket's AllReduce with ``algorithm``, by the event
  simulation (:func:`~gradsync.sim.engine.simulate_all_reduce`, the real
  algorithm code) up to ``event_max_ranks`` ranks, by
  :func:`~gradsync.collectives.cost.formulas.predict_s` beyond.
* fp16, bf16, onebit: :mod:`gradsync.compression.two_phase` — whatever the
  algorithm — sends every rank's encoded chunks by ``all_to_all`` then
  ``ring.all_gather`` s the encoded averages: rows of
  ``two_phase.row_nbytes(codec, chunk numel)`` bytes, the codec's own
  ``payload_nbytes``. With ``two_phase_events`` (and up to
  ``event_max_ranks`` ranks) the real ``collectives.all_to_all.all_to_all``
  and ``collectives.ring.all_gather`` run on simulated ranks
  (:func:`simulate_two_phase`); by default :func:`two_phase_s` prices them:
  the event model reserves each transfer's two ports first come, first
  served, which serialises an all_to_all's concurrent messages into gaps
  (8 H100s, 1.6 MB rows: 78 us against the ports' bound of 29 us), where
  real links share their bandwidth among the flows. The last bucket's used flags are then summed by the
  algorithm's AllReduce (uint8 below 256 ranks, int32 from 256). The
  codecs' encode / decode kernels are not priced (a few passes over the
  bucket on a GPU; on this machine's CPUs they would matter).

A :class:`BucketPricer` caches by bytes: a model's buckets are mostly of one size.
"""

from __future__ import annotations

import math

import torch

from gradsync import compression as compressors
from gradsync.collectives import ring
from gradsync.collectives.all_to_all import all_to_all
from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.chunking import DEFAULT_SEGMENT_BYTES, SegmentOptions, chunk_bounds
from gradsync.collectives.cost.formulas import Step, predict_s, ring_phases_s
from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.options import OptionStore
from gradsync.compression.two_phase import row_nbytes
from gradsync.sim.cluster import Topology, VirtualCluster
from gradsync.sim.engine import check_algorithm, simulate_all_reduce
from gradsync.sim.transport import SimWorld
from gradsync.sim.virtual import VirtualTensor, VirtualWorkspace

COMPRESSIONS = ("none", "fp16", "bf16", "onebit")
_TIMEOUT_S = 1e9


def codec_of(compression: str):
    """The codec that ``gradsync.compression.make(compression)`` sends with (None for "none").

    Raises:
        ValueError: a compressor the simulator does not price (topk, powersgd) or an unknown one.
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"the training simulator prices compression {', '.join(COMPRESSIONS)}; got {compression!r}")
    made = compressors.make(compression)
    return None if made is None else made.codec


def encoded_row_nbytes(compression: str, numel: int, world_size: int) -> int:
    """Bytes of one rank's row in the two-phase exchange of a bucket of ``numel`` float32 gradients."""
    chunk = chunk_bounds(numel, world_size)[0]
    return row_nbytes(codec_of(compression), chunk[1] - chunk[0])


def simulate_two_phase(row: int, profile: Profile, topology: Topology,
                       segment_bytes: int = DEFAULT_SEGMENT_BYTES, stats: list | None = None) -> float:
    """Seconds of the real all_to_all of ``world_size`` rows of ``row`` bytes, then the real ring
    all_gather of them, on simulated ranks (two calls: two call overheads). ``stats``: a list to
    append every rank's :class:`~gradsync.transport.base.TransportStats` to."""
    cluster = VirtualCluster(profile, topology)
    world = SimWorld(cluster)
    p = topology.world_size
    device = torch.device("meta")
    store = OptionStore([SegmentOptions(segment_bytes=segment_bytes)])
    transports = [world.transport(rank) for rank in range(p)]

    def call(rank: int, op: str) -> CollectiveCall:
        return CollectiveCall(transports[rank], op, "ring", _TIMEOUT_S, VirtualWorkspace(cluster, device),
                              options=store, locality=world.locality)

    def body(state):
        state.now = profile.call_overhead_s
        if p == 1 or row == 0:
            return
        sends = VirtualTensor.empty(p * row, torch.uint8, cluster, root=1, device=device).view(p, row)
        receives = VirtualTensor.empty(p * row, torch.uint8, cluster, root=2, device=device).view(p, row)
        all_to_all(list(sends), list(receives), call(state.rank, "all_to_all"))
        cluster.advance_to(state.now + profile.call_overhead_s)
        gathered = VirtualTensor.empty(p * row, torch.uint8, cluster, root=3, device=device)
        ring.all_gather(gathered, call(state.rank, "all_gather"))

    seconds = cluster.run(body)
    if stats is not None:
        stats.extend(transport.stats for transport in transports)
    return seconds


def two_phase_s(row: int, profile: Profile, topology: Topology, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> float:
    """Closed form of :func:`simulate_two_phase` (equal hosts of L ranks, p ranks in all).

    all_to_all: all messages posted at once; a rank's L-1 rows to its host's ranks queue on its
    intra-host port, its p-L rows to other hosts on its NIC, shared by ceil(L / NICs) ranks; the
    two run side by side: max(α_intra + (L-1)·row·β_intra, α_inter + (p-L)·row·β_inter·share) plus
    the own row's copy. all_gather: the flat ring's all-gather phase over p·row bytes (each hop as
    slow as the ring's slowest link: inter-host when there are hosts), ``formulas.ring_phases_s``.
    CPU links and copies are slowed by the ranks-per-core oversubscription.
    """
    p, local = topology.world_size, max(topology.host_sizes)
    if p == 1 or row == 0:
        return profile.call_overhead_s
    oversub = profile.oversubscription(local)

    def step(same_host: bool, share: float = 1.0) -> Step:
        link = profile.link(same_host)
        slow = oversub if link.cpu_bound else 1.0
        return Step(link.hop_at(oversub), link.beta_s_per_byte * slow * share, profile.gamma_s_per_byte * oversub)

    intra = step(True)
    exchange = intra.alpha + (local - 1) * row * intra.beta if local > 1 else 0.0
    if topology.hosts > 1:
        inter = step(False, max(1.0, math.ceil(local / profile.nics_per_host)))
        exchange = max(exchange, inter.alpha + (p - local) * row * inter.beta)
    copy = row * profile.copy_s_per_byte * oversub
    ring_step = step(topology.hosts == 1)
    gather = ring_phases_s(p, p * row, ring_step, segment_bytes, 1)[1]
    return 2 * profile.call_overhead_s + copy + exchange + gather


class BucketPricer:
    """Seconds of a bucket's exchange on one topology, algorithm and compressor (cached per size).

    Args:
        profile, topology: the cluster.
        algorithm: the AllReduce (``engine.SIMULATED``).
        compression: one of :data:`COMPRESSIONS`.
        event_max_ranks: run the real code on simulated ranks up to this many ranks, formulas beyond.
        segment_bytes: the ring and tree's pipelining unit.
        two_phase_events: run the compressors' exchanges on simulated ranks too (else the formula).
    """

    def __init__(self, profile: Profile, topology: Topology, algorithm: str, compression: str = "none",
                 event_max_ranks: int = 64, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 two_phase_events: bool = False):
        check_algorithm(algorithm)
        codec_of(compression)
        self.profile, self.topology, self.algorithm = profile, topology, algorithm
        self.compression, self.segment_bytes = compression, segment_bytes
        self.event = topology.world_size <= event_max_ranks
        self.two_phase_event = self.event and two_phase_events
        self._cache: dict[tuple, float] = {}

    @property
    def method(self) -> str:
        """How the bucket exchanges are priced: "event" or "formula" (compressed: the exchange's)."""
        event = self.event if self.compression == "none" else self.two_phase_event
        return "event" if event else "formula"

    def all_reduce_s(self, nbytes: int, dtype: torch.dtype = torch.float32) -> float:
        """One AllReduce of ``nbytes`` of ``dtype``."""
        key = ("all_reduce", nbytes, dtype)
        if key not in self._cache:
            if self.event:
                self._cache[key] = simulate_all_reduce(self.algorithm, nbytes, self.profile, self.topology,
                                                       dtype=dtype, segment_bytes=self.segment_bytes).time_s
            else:
                self._cache[key] = predict_s(self.algorithm, self.profile, self.topology, nbytes,
                                             segment_bytes=self.segment_bytes, itemsize=dtype.itemsize)
        return self._cache[key]

    def bucket_s(self, numel: int, flags: int = 0, dtype: torch.dtype = torch.float32) -> float:
        """A bucket of ``numel`` gradients of ``dtype`` followed by ``flags`` flag elements (the last bucket)."""
        if self.topology.world_size == 1:
            return 0.0
        if self.compression == "none":
            return self.all_reduce_s((numel + flags) * dtype.itemsize, dtype)
        row = encoded_row_nbytes(self.compression, numel, self.topology.world_size)
        key = ("two_phase", row)
        if key not in self._cache:
            self._cache[key] = (simulate_two_phase if self.two_phase_event else two_phase_s)(
                row, self.profile, self.topology, self.segment_bytes)
        seconds = self._cache[key]
        if flags:
            counts = torch.uint8 if self.topology.world_size < 256 else torch.int32
            seconds += self.all_reduce_s(flags * counts.itemsize, counts)
        return seconds
