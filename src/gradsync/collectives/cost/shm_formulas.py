"""The shared-memory AllReduce's closed form (``algorithm="shm"``, and ``hierarchical``'s node sum).

The model of :mod:`gradsync.collectives.shm` as it runs: the lean path
(:mod:`~gradsync.collectives.shm_lean`) for a public call up to
``LEAN_MAX_BYTES``, else cache-sized cells
(:mod:`~gradsync.collectives.shm_pipeline`), each an owner-reduces
reduce-scatter and all-gather between two barriers. Per phase, a rank's
copies and adds on a core (in-cache rates while every rank has a core,
out-of-cache ones slowed by ranks/cores otherwise), bounded below by the
host's DRAM traffic: 3 bytes per payload byte and rank
(``SHM_MEMORY_BYTES_PER_PAYLOAD_BYTE``: the input read once, the output
written once with its read for ownership; the cells stay in cache).
:class:`~gradsync.sim.transport.VirtualSharedMemory` applies the same terms
on simulated ranks; :mod:`gradsync.collectives.cost.formulas` adds the call's overhead.
"""

from __future__ import annotations

import math

from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.cost.topology import Topology
from gradsync.collectives.shm_setup import DEFAULT_CELL_BYTES, LEAN_MAX_BYTES
from gradsync.transport.shm_segment import DEFAULT_REGION_BYTES


# DRAM bytes per byte a rank copies or writes out: the read of the source, the read for ownership of
# the destination's lines and their write-back (the staging cells themselves stay in cache)
COPY_MEMORY_BYTES = 3
# the shm AllReduce's DRAM bytes per payload byte and rank: the input read once (copy in), the output
# written once (read for ownership + write-back); the cells, the peers' copies and the sums stay in cache
SHM_MEMORY_BYTES_PER_PAYLOAD_BYTE = 3


def shm_lean(nbytes: int, public: bool = True) -> bool:
    """Whether an shm AllReduce of ``nbytes`` (in its working dtype) takes the lean path
    (:mod:`gradsync.collectives.shm_lean`): a public call of at most ``LEAN_MAX_BYTES``. A collective's own
    use of shm (``hierarchical``'s node sum, ``public=False``) always goes through cells."""
    return public and 0 < nbytes <= LEAN_MAX_BYTES


def shm_cells(nbytes: int, itemsize: int, cell_bytes: int = DEFAULT_CELL_BYTES,
              region_bytes: int = DEFAULT_REGION_BYTES) -> list[int]:
    """The bytes of each cell :mod:`gradsync.collectives.shm_pipeline` cuts an ``nbytes`` message into
    (``cell_bytes``, at most one region, whole elements; the last cell may be shorter)."""
    cell = max(1, min(cell_bytes, region_bytes) // itemsize) * itemsize
    full, rest = divmod(nbytes, cell)
    return [cell] * full + ([rest] if rest else [])


def shm_slices(nbytes: int, itemsize: int) -> list[int]:
    """The bytes of each slice the shm broadcast cuts an ``nbytes`` message into (regions of
    ``DEFAULT_REGION_BYTES`` per rank; the last slice may be shorter)."""
    region = DEFAULT_REGION_BYTES - DEFAULT_REGION_BYTES % itemsize
    full, rest = divmod(nbytes, region)
    return [region] * full + ([rest] if rest else [])


def shm_rates(profile: Profile, oversub: float, cached: bool) -> tuple[float, float]:
    """(copy, add) seconds per byte of a shared-memory phase: a cell's in cache
    (``ShmModel.cache_copy_s_per_byte`` / ``cache_gamma_s_per_byte``) while every rank has a core;
    the profile's out-of-cache rates for the broadcast's whole regions, when the cache rates are not
    known, and when ranks outnumber the cores (a rank that waited for a core finds its cells evicted
    by the rank that ran there)."""
    shm = profile.shm
    if cached and oversub <= 1 and shm.cache_copy_s_per_byte is not None and shm.cache_gamma_s_per_byte is not None:
        return shm.cache_copy_s_per_byte, shm.cache_gamma_s_per_byte
    return profile.copy_s_per_byte, profile.gamma_s_per_byte


def shm_phase_s(profile: Profile, ranks: int, copy_bytes: float, add_bytes: float, oversub: float,
                memory_bytes: float | None = None, cached: bool = False) -> float:
    """One phase of the shared-memory collective on one rank: its copies and adds on a core
    (:func:`shm_rates`, slowed by ``oversub``), bounded below by the host's memory traffic:
    ``memory_bytes`` DRAM bytes per rank (None: ``COPY_MEMORY_BYTES`` per byte copied) for all
    ``ranks`` of the host at ``ShmModel.memory_bandwidth_bytes_per_s``."""
    if memory_bytes is None:
        memory_bytes = COPY_MEMORY_BYTES * copy_bytes
    copy, gamma = shm_rates(profile, oversub, cached)
    cpu = (copy_bytes * copy + add_bytes * gamma) * oversub
    return max(cpu, ranks * memory_bytes / profile.shm.memory_bandwidth_bytes_per_s)


def shm_lean_s(profile: Profile, p: int, n: float, oversub: float) -> float:
    """The lean AllReduce of n bytes over p ranks (its call overhead apart): copy in (the input read
    from memory), one barrier (the layout check rides in it), every rank adds all p rows into its
    output ((p-1)·n added; the output written back: 2 DRAM bytes per byte)."""
    return (shm_phase_s(profile, p, n, 0, oversub, n, cached=True) + profile.shm_barrier_s(p)
            + shm_phase_s(profile, p, 0, (p - 1) * n, oversub, 2 * n, cached=True))


def shm_cell_s(profile: Profile, p: int, n: float, oversub: float) -> float:
    """One cell of n bytes of the pipelined shm AllReduce over p ranks
    (:mod:`gradsync.collectives.shm_pipeline`: owner-reduces reduce-scatter then all-gather, chunks
    of n/p), on one rank:

    * the cell's Python cost, ``p`` x ``ShmModel.cell_overhead_s`` (an add and a copy out per peer);
    * stage the peers' chunks ((p-1)/p·n copied; their bytes read from the input, 1 DRAM byte each);
    * barrier; reduce its own chunk from its tensor and the peers' copies ((p-1)/p·n added, its
      n/p read from the input) and write the sum into its region (n/p copied);
    * barrier; copy the other chunks out of their owners' regions ((p-1)/p·n copied; the whole
      output's read for ownership and write-back, 2 DRAM bytes per byte).

    The copies and adds run at the in-cache rates while every rank has a core (:func:`shm_rates`),
    slowed by ``oversub`` otherwise; DRAM traffic, 3 bytes per payload byte
    (``SHM_MEMORY_BYTES_PER_PAYLOAD_BYTE``: the cells stay in cache), bounds each phase from below.
    """
    share, barrier = n / p, profile.shm_barrier_s(p)
    python = p * profile.shm.cell_overhead_s * oversub
    stage = shm_phase_s(profile, p, n - share, 0, oversub, n - share, cached=True)
    reduce = shm_phase_s(profile, p, share, (p - 1) * share, oversub, share, cached=True)
    gather = shm_phase_s(profile, p, n - share, 0, oversub, 2 * n, cached=True)
    return python + stage + barrier + reduce + barrier + gather


def _moving_ranks(profile: Profile, topology: Topology, n: int) -> int | None:
    """The ranks of a shared-memory call of n bytes, or None when nothing moves (one rank, no bytes).

    Raises:
        ValueError: the ranks span hosts, or the profile has no shared-memory model.
    """
    if topology.hosts > 1:
        raise ValueError("shm needs every rank on one host")
    if topology.world_size == 1 or n == 0:
        return None
    if profile.shm is None:
        raise ValueError(f"profile {profile.name!r} has no shared-memory model (shm)")
    return topology.world_size


def shm_s(profile: Profile, topology: Topology, n: int, itemsize: int = 4, public: bool = True) -> float:
    """Shared memory on one host (the formula :class:`~gradsync.sim.transport.VirtualSharedMemory`
    uses): the lean path (:func:`shm_lean`), else :func:`shm_cell_s` per cell (:func:`shm_cells`).
    Small cells are bound by their Python cost and barrier, large messages by the copies and adds
    or the host's memory traffic (3 DRAM bytes per payload byte and rank)."""
    p = _moving_ranks(profile, topology, n)
    if p is None:
        return 0.0
    oversub = profile.oversubscription(p)
    if shm_lean(n, public):
        return shm_lean_s(profile, p, n, oversub)
    cells = shm_cells(n, itemsize)
    full = cells[0]
    count = len(cells) - (cells[-1] != full)
    return count * shm_cell_s(profile, p, full, oversub) + (shm_cell_s(profile, p, cells[-1], oversub)
                                                            if cells[-1] != full else 0.0)


def shm_shard_s(profile: Profile, topology: Topology, n: int, itemsize: int = 4,
                collective: str = "reduce_scatter") -> float:
    """Shared memory's reduce-scatter or all-gather of n bytes on one host
    (:mod:`gradsync.collectives.shm_shards`): rounds of one barrier each, a cell per round.

    * reduce-scatter round: every rank stages a piece of c/p bytes of each of the p-1 peers' chunks
      (read from its input), barrier, adds the p-1 copies of its own piece to its tensor (the piece read
      and written back);
    * all-gather round: every rank copies a piece of c bytes of its chunk in, barrier, copies the p-1
      peers' pieces out (each written back: 2 DRAM bytes per byte).

    Each round also costs ``p`` x ``ShmModel.cell_overhead_s`` of Python; rates as :func:`shm_cell_s`.
    """
    p = _moving_ranks(profile, topology, n)
    if p is None:
        return 0.0
    oversub, barrier = profile.oversubscription(p), profile.shm_barrier_s(p)
    cell = max(itemsize, min(DEFAULT_CELL_BYTES, DEFAULT_REGION_BYTES) // itemsize * itemsize)
    piece = max(itemsize, cell // p // itemsize * itemsize) if collective == "reduce_scatter" else cell

    def round_s(m: float) -> float:
        python = p * profile.shm.cell_overhead_s * oversub
        if collective == "reduce_scatter":
            stage = shm_phase_s(profile, p, (p - 1) * m, 0, oversub, (p - 1) * m, cached=True)
            return python + stage + barrier + shm_phase_s(profile, p, 0, (p - 1) * m, oversub, 2 * m, cached=True)
        copy_in = shm_phase_s(profile, p, m, 0, oversub, m, cached=True)
        return python + copy_in + barrier + shm_phase_s(profile, p, (p - 1) * m, 0, oversub, 2 * (p - 1) * m,
                                                        cached=True)

    share = math.ceil(n / itemsize / p) * itemsize
    full, rest = divmod(share, piece)
    return full * round_s(piece) + (round_s(rest) if rest else 0.0)
