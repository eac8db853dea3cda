"""A hardware profile: the numbers the simulator costs every message, reduction and copy with.

The model is the α-β-γ model of Hockney (1994) and Thakur, Rabenseifner &
Gropp (2005), with two links and the resources that bound them:

* ``intra``: between ranks of one host (NVLink through NVSwitch on a GPU
  node; loopback TCP through the kernel on this machine). Every rank has its
  own port in each direction, ``bandwidth_bytes_per_s`` each.
* ``inter``: between hosts (InfiniBand; the veth bridge of the test hosts).
  A host has ``nics_per_host`` NICs, each ``bandwidth_bytes_per_s`` per
  direction; the rank of local rank j sends and receives through NIC
  ``j % nics_per_host``, so ranks that outnumber the NICs share one.
* a message of n bytes over a link costs ``hop_alpha_s + n / bandwidth`` and
  keeps the ports it crosses busy for ``n / bandwidth``: ``hop_alpha_s`` is
  what a message costs inside a multi-hop schedule (each hop waits for the
  last), which over Gloo is well above the one-way ping-pong's ``alpha_s``
  (None: ``alpha_s``; GPU profiles).
* ``gamma_s_per_byte``: time to add n bytes into a buffer (per output byte);
  ``copy_s_per_byte``: time to copy them.
* ``cores_per_host``: when a host runs more ranks than cores, its ranks wait
  for one: their reductions, copies and (for a link with ``cpu_bound``, whose
  bytes the CPU moves, as loopback TCP) their transfers take
  ``ranks / cores`` times longer. None: ranks never wait (GPUs).
* ``call_overhead_s``: what one collective call costs beyond its messages,
  barriers and copies (argument checks, the call's set-up, a kernel
  launch); ``call_overheads_s`` the same per algorithm where it was measured
  for each (``gradsync calibrate``: a tiny call of each, less its simulated
  cost); the shm lean path's own figure is ``ShmModel.lean_call_overhead_s``.
* ``shm``: the shared-memory collective's costs (:class:`ShmModel`), None
  where it does not exist.

A profile's :meth:`digest` names it exactly: ranks compare it, with the
algorithm ``auto`` chose, before a call, so they cannot decide from
different numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from gradsync.collectives.cost.nccl_constants import NcclConstants


CROWDED_RATIO = 2.0  # ranks per core at which gradsync calibrate measures the crowded hops (4 on 2; 2 on 1)


def _crowded(alone: float, crowded: float | None, oversub: float, cpu_bound: bool) -> float:
    """A hop's latency at ``oversub`` ranks per core from its figure ``alone`` and, where measured, its
    ``crowded`` one (at ``CROWDED_RATIO``): linear in between, flat beyond; else ``alone`` x ``oversub``
    on a CPU-bound link."""
    if oversub <= 1:
        return alone
    if crowded is None:
        return alone * (oversub if cpu_bound else 1.0)
    share = min(1.0, (oversub - 1) / (CROWDED_RATIO - 1))
    return alone + (crowded - alone) * share


@dataclass(frozen=True)
class Link:
    """One kind of link.

    Args:
        alpha_s: seconds per message (latency, > 0).
        bandwidth_bytes_per_s: bytes per second per port and direction (> 0).
        cpu_bound: the CPU moves the bytes (loopback TCP): slower when ranks outnumber cores, and a
            rank's sends and receives share one port (its core), ``bandwidth_bytes_per_s`` being
            the one-way rate of a single stream.
        hop_alpha_s: seconds per message inside a multi-hop schedule (>= 0), the latency the
            simulator and the formulas charge every message; ``gradsync calibrate``: the slope per
            hop of the time of a chain of dependent exchanges (a ring step's receive, send and two
            waits, through ``CollectiveCall``) over 1 to 8 hops. None: ``alpha_s`` (GPU profiles,
            old profile files).
        oversubscribed_hop_alpha_s: the same when the host's ranks outnumber its cores (a ``cpu_bound``
            link; ``gradsync calibrate``: four ranks on two cores in a ring, chains of ring steps, the
            slope per step). The simulator charges it as measured at 2 ranks a core, the
            straight line from ``hop_s`` below that (ws 3 on 2 cores: half-way), not slowed by
            ranks/cores (a hop's time is mostly waiting to be woken, not work). None: ``hop_s``
            slowed by the ranks-per-core oversubscription.
        one_way_hop_alpha_s, oversubscribed_one_way_hop_alpha_s: the same for a one-way message inside a
            schedule (its receiver not sending at the same time: a tree's edges), from chains of
            dependent one-way messages (a relay: each rank sends once the other's message arrived)
            measured in the same batches; None: the exchange's figures.
    """

    alpha_s: float
    bandwidth_bytes_per_s: float
    cpu_bound: bool = False
    hop_alpha_s: float | None = None
    oversubscribed_hop_alpha_s: float | None = None
    one_way_hop_alpha_s: float | None = None
    oversubscribed_one_way_hop_alpha_s: float | None = None

    def __post_init__(self):
        if not self.alpha_s >= 0 or not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"a link needs alpha_s >= 0 and bandwidth_bytes_per_s > 0, got {self}")
        for value in (self.hop_alpha_s, self.oversubscribed_hop_alpha_s, self.one_way_hop_alpha_s,
                      self.oversubscribed_one_way_hop_alpha_s):
            if value is not None and not value >= 0:
                raise ValueError(f"a link needs hop_alpha_s and oversubscribed_hop_alpha_s >= 0 (or None), got {self}")

    @property
    def hop_s(self) -> float:
        """Seconds of latency per message inside a schedule: ``hop_alpha_s``, else ``alpha_s``."""
        return self.alpha_s if self.hop_alpha_s is None else self.hop_alpha_s

    def hop_at(self, oversub: float) -> float:
        """Seconds of latency per message inside a schedule when the ranks of a host are ``oversub``
        times its cores (>= 1): :attr:`hop_s` alone; with ``oversubscribed_hop_alpha_s`` (measured at
        ``CROWDED_RATIO`` ranks a core) the straight line between the two up to that ratio, the crowded
        figure beyond (ws 3 on 2 cores: half-way); without it :attr:`hop_s` slowed by ``oversub`` where
        the CPU moves the bytes."""
        return _crowded(self.hop_s, self.oversubscribed_hop_alpha_s, oversub, self.cpu_bound)

    def one_way_at(self, oversub: float) -> float:
        """Seconds of latency of a one-way message inside a schedule (its receiver not sending meanwhile)
        at ``oversub`` ranks per core, as :meth:`hop_at` from ``one_way_hop_alpha_s`` and
        ``oversubscribed_one_way_hop_alpha_s``; :meth:`hop_at` where the one-way figure is not measured."""
        if self.one_way_hop_alpha_s is None:
            return self.hop_at(oversub)
        return _crowded(self.one_way_hop_alpha_s, self.oversubscribed_one_way_hop_alpha_s, oversub, self.cpu_bound)

    @property
    def beta_s_per_byte(self) -> float:
        return 1.0 / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class ShmModel:
    """Costs of the shared-memory collective (``algorithm="shm"``, :mod:`gradsync.collectives.shm`;
    the model: :mod:`gradsync.collectives.cost.shm_formulas`).

    Args:
        barrier_s: one barrier of the host's ranks (seconds), each rank on a core of its own.
        memory_bandwidth_bytes_per_s: the host's whole memory (DRAM) traffic bound; the copies
            and adds of all its ranks share it. A copy moves 3 bytes per byte (the source's read,
            the destination's read for ownership and write-back); the pipelined AllReduce 3 per
            payload byte (its cells stay in cache).
        oversubscribed_barrier_s: one barrier when the host's ranks outnumber its cores (a
            rank that spins waits for the late one to get the core: the kernel's scheduling,
            not the memory, sets it); None: ``barrier_s``.
        cell_overhead_s: the Python and dispatch cost of one cell of the pipelined AllReduce
            per rank of the group (its calls grow with the ranks: an add and a copy out per peer;
            its barriers and bytes apart), each rank on a core.
        lean_call_overhead_s: the fixed cost of a public shm AllReduce on the lean path (its
            checks cached per layout; its copy, barrier and adds apart); None: the profile's
            ``call_overhead_s``.
        cache_copy_s_per_byte, cache_gamma_s_per_byte: a copy and an add per byte on buffers of a
            cell's size that stay in cache (the cells' rates while every rank has a core); None:
            the profile's out-of-cache ``copy_s_per_byte`` and ``gamma_s_per_byte``.
    """

    barrier_s: float
    memory_bandwidth_bytes_per_s: float
    oversubscribed_barrier_s: float | None = None
    cell_overhead_s: float = 0.0
    lean_call_overhead_s: float | None = None
    cache_copy_s_per_byte: float | None = None
    cache_gamma_s_per_byte: float | None = None


@dataclass(frozen=True)
class Profile:
    """A modelled cluster's hardware (see the module docstring for the model).

    Args:
        name: what ``--profile`` takes.
        description: the system, and where every number comes from.
        intra: the link inside a host.
        inter: the link between hosts (None: the profile has one host).
        gamma_s_per_byte: seconds to add one byte (of the output) into a buffer.
        copy_s_per_byte: seconds to copy one byte.
        ranks_per_host: ranks (GPUs) per host in the profile's own topology.
        nics_per_host: NICs per host for ``inter``.
        cores_per_host: cores a host's ranks share (None: not a limit).
        call_overhead_s: fixed seconds per collective call (an algorithm without its own figure in
            ``call_overheads_s``).
        call_overheads_s: (algorithm, fixed seconds per call of it) pairs, measured per algorithm
            (``gradsync calibrate``: a call of a few hundred bytes less its simulated cost without
            overhead); () where not measured (GPU profiles).
        shm: the shared-memory collective's costs (None: no such path).
        in_switch_reduction_bytes_per_s: busbw of in-switch reduction inside a host
            (NVLink SHARP / NVLS), None where the profile has none.
        sources: where the numbers come from (specifications, measurements).
        nccl: what NCCL's topology search and tuning model see of the system
            (:class:`~gradsync.collectives.cost.nccl_constants.NcclConstants`; GPU profiles only), for
            :func:`~gradsync.collectives.cost.nccl_tuning.nccl_choice`; None elsewhere.
    """

    name: str
    description: str
    intra: Link
    inter: Link | None
    gamma_s_per_byte: float
    copy_s_per_byte: float
    ranks_per_host: int
    nics_per_host: int = 1
    cores_per_host: int | None = None
    call_overhead_s: float = 0.0
    shm: ShmModel | None = None
    in_switch_reduction_bytes_per_s: float | None = None
    sources: tuple[str, ...] = field(default=())
    nccl: NcclConstants | None = None
    call_overheads_s: tuple[tuple[str, float], ...] = field(default=())

    def call_overhead(self, algorithm: str) -> float:
        """Fixed seconds of one call of ``algorithm`` (its own figure, else ``call_overhead_s``), each
        rank on a core of its own."""
        for name, seconds in self.call_overheads_s:
            if name == algorithm:
                return seconds
        return self.call_overhead_s

    def link(self, same_host: bool) -> Link:
        """The link a message between two ranks takes.

        Raises:
            ValueError: two hosts, and the profile has no ``inter`` link.
        """
        if same_host:
            return self.intra
        if self.inter is None:
            raise ValueError(f"profile {self.name!r} describes a single host: it has no link between hosts")
        return self.inter

    def oversubscription(self, ranks_on_host: int) -> float:
        """How many times slower a rank's CPU work runs when ``ranks_on_host`` share the cores (>= 1)."""
        if self.cores_per_host is None:
            return 1.0
        return max(1.0, ranks_on_host / self.cores_per_host)

    def shm_barrier_s(self, ranks_on_host: int) -> float:
        """Seconds of one shared-memory barrier of ``ranks_on_host`` ranks (the ``shm`` model's
        oversubscribed figure when they outnumber the cores).

        Raises:
            ValueError: the profile has no shared-memory model.
        """
        if self.shm is None:
            raise ValueError(f"profile {self.name!r} has no shared-memory model (shm)")
        if self.oversubscription(ranks_on_host) > 1 and self.shm.oversubscribed_barrier_s is not None:
            return self.shm.oversubscribed_barrier_s
        return self.shm.barrier_s

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["call_overheads_s"] = dict(self.call_overheads_s)
        return data

    def digest(self) -> str:
        """16 hex digits of SHA-256 over the profile's numbers (what ranks compare)."""
        text = json.dumps(self.as_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        """The profile written by :meth:`as_dict` (a JSON file of ``gradsync calibrate``).

        Raises:
            ValueError: a missing or unknown field, or a bad number.
        """
        data = dict(data)
        try:
            data["intra"] = Link(**data["intra"])
            data["inter"] = Link(**data["inter"]) if data.get("inter") else None
            data["shm"] = ShmModel(**data["shm"]) if data.get("shm") else None
            data["sources"] = tuple(data.get("sources", ()))
            data["nccl"] = NcclConstants.from_dict(data["nccl"]) if data.get("nccl") else None
            overheads = data.get("call_overheads_s") or {}
            data["call_overheads_s"] = tuple((str(name), float(seconds)) for name, seconds in
                                             (overheads.items() if isinstance(overheads, dict) else overheads))
            return cls(**data)
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a gradsync profile: {error}") from error


def save(profile: Profile, path: str | Path) -> Path:
    """Write ``profile`` as JSON to ``path`` (atomically) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(profile.as_dict(), indent=2) + "\n")
    partial.replace(path)
    return path


def load(path: str | Path) -> Profile:
    """Read a profile JSON file.

    Raises:
        FileNotFoundError; ValueError: the file is not a profile.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not a gradsync profile (not JSON: {error})") from error
    try:
        return Profile.from_dict(data)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
