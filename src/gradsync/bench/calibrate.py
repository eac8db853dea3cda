"""``gradsync calibrate``: the simulator's profile of this machine (or of its test hosts), measured.

Every number comes from the micro-benchmarks of :mod:`gradsync.bench.micro` at points
``gradsync simulate --validate`` never scores: none of its sizes (4 KiB, 64 KiB, 1 MiB,
16 MiB, 64 MiB) at any world size, in any collective (:func:`calibration_points` lists every
point; ``tests/test_sim_calibrate.py`` checks). With ``FULL`` settings:

* ``intra`` (and ``inter`` with ``--hosts``): α = the median one-way time of ping-pongs of
  ``Settings.small_sizes`` (4 B, 256 B, 2 KiB) through gradsync's own message path
  (``CollectiveCall`` over Gloo); bandwidth = 1 / the least-squares slope of the one-way time
  against the bytes over ``Settings.large_sizes`` (2, 4, 8, 12 MiB). Loopback TCP is
  ``cpu_bound``: the kernel copies the bytes on the sender's and the receiver's core, so a
  rank's sends and receives share its core (the simulator gives them one port); the check, a
  simultaneous exchange of 12 MiB, is recorded in ``sources``. The test hosts' link is bounded
  by its ``tc tbf`` shaper, not by a core.
* ``hop_alpha_s`` of each link (:mod:`gradsync.bench.fixed_costs`): chains of 1, 2, 4 and 8
  dependent 256 B exchanges (``send_recv``: a ring step's receive, send and two waits; a call
  per chain) between the pair, the slope per hop in each of ``Settings.hop_repeats`` (15)
  batches less the bytes' time, the median: what a message costs inside a multi-hop schedule
  when its receiver is sending too (a ring step; several ping-pong α here: every wait may sleep
  and be woken). ``one_way_hop_alpha_s``: the same of relays of 1, 2, 4, 8 one-way messages (each
  sent once the last arrived: a tree's edges), in the same batches.
* ``oversubscribed_hop_alpha_s`` / ``oversubscribed_one_way_hop_alpha_s`` (one host with fewer
  than 4 cores): the same chains and relays with 2 x cores ranks (4 here) in a ring (each hop a
  ring step of all of them; a relay around the ring); the
  simulator charges them, as measured, to every hop on a host of 2 ranks a core or more (ws 4
  here), and the straight line from the uncrowded figure in between (ws 3: half-way).
* ``call_overheads_s``: in the same batches as the chains (the fixed costs drift with the
  machine's load), 10 ``all_reduce`` calls (``verify=False``, as the sweep calls them) over
  the whole group of each algorithm the simulator runs at 256 B (``shm`` past its lean path:
  96 KiB, one cell), each less the simulated time of that call with that batch's hop and no
  overhead; the median over the batches. ``call_overhead_s`` (any other algorithm) is ring's;
  ``shm.lean_call_overhead_s`` the same for a 4 B ``shm`` call (the lean path; one host only).
* ``gamma_s_per_byte`` / ``copy_s_per_byte``: float32 ``add_`` and ``copy_`` in pieces of
  ``Settings.compute_bytes`` (4 MiB, the default ring segment) over buffers of
  ``Settings.memory_bytes`` (48 MiB: from memory, not cache, as the large messages whose time
  the terms decide), on one rank per core at once, per output byte.
* ``cores_per_host``: ``len(os.sched_getaffinity(0))``.
* ``shm``: one barrier of two ranks on a shared-memory segment, each on a core of its own, and
  (``oversubscribed_barrier_s``) both pinned to one core, as ranks that outnumber the cores are;
  memory bandwidth = DRAM bytes (3 per byte copied) of one rank per core copying
  ``Settings.memory_bytes`` at once; ``cell_overhead_s`` = one cell of two floats of the
  pipelined AllReduce (``Settings.cells`` per call, on ranks 0 and 1) less its two barriers, per
  rank (half of it); ``cache_gamma_s_per_byte`` / ``cache_copy_s_per_byte``: ``add_`` and
  ``copy_`` over buffers of a cell's size (``shm_setup.DEFAULT_CELL_BYTES``, 2 MiB) passed over
  ``Settings.cache_passes`` times (in cache).
* Each figure is the median of its batches (see :mod:`gradsync.bench.micro`).

With ``--hosts H --nproc L`` the measurements run as a torchrun job on H test hosts
(:mod:`gradsync.hosts`) and the profile goes, unless ``--out`` says otherwise, to the shipped
``collectives/cost/data/test-hosts.json`` (never edited by hand): ranks 0 and 1 on host 0 give
``intra``, the compute terms and the barrier; ranks 0 and L (host 1) give ``inter``; the calls
run over all H x L ranks (no ``shm`` call spans the hosts: ``lean_call_overhead_s`` is None). A
test host has one core (:meth:`TestHosts.cores <gradsync.hosts.netns.TestHosts.cores>`), so
ranks 0 and 1 share it: their α and 1/bandwidth are divided by that oversubscription (2), which
the simulator multiplies back; their hops are crowded ones (``oversubscribed_hop_alpha_s`` =
``hop_alpha_s``, the one-way's too), and the call overheads are divided by the 2 the simulator multiplies back.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gradsync.bench import fixed_costs, micro
from gradsync.bench.fixed_costs import measure_link
from gradsync.bench.sim_report import describe  # noqa: F401 (what --validate prints; here before)
from gradsync.bench.output import claim_json_path, write_json
from gradsync.collectives.communicator import Communicator
from gradsync.collectives.cost.profile import Link, Profile, ShmModel, load, save
from gradsync.collectives.shm_setup import DEFAULT_CELL_BYTES

KIB, MIB = 2**10, 2**20


@dataclass(frozen=True)
class Settings:
    """How long each micro-benchmark runs (sizes in bytes; none of them a size ``gradsync simulate
    --validate`` scores: see :func:`calibration_points`)."""

    small_sizes: tuple[int, ...] = (4, 256, 2 * KIB)
    large_sizes: tuple[int, ...] = (2 * MIB, 4 * MIB, 8 * MIB, 12 * MIB)
    repeats: int = 7
    batch_bytes: int = 32 * MIB     # iterations per batch: enough messages to move this much
    small_iterations: int = 200
    compute_bytes: int = 4 * MIB
    memory_bytes: int = 48 * MIB
    barriers: int = 2000
    cells: int = 500
    cell_bytes: int | None = None  # the in-cache rates' buffers (None: shm_setup.DEFAULT_CELL_BYTES)
    cache_passes: int = 20
    hop_counts: tuple[int, ...] = fixed_costs.HOP_COUNTS
    hop_repeats: int = 15  # batches of the fixed costs (each: every chain and call once)
    hop_chains: int = 5    # chains of each length per batch
    hop_calls: int = 10    # calls of each algorithm per batch


FULL = Settings()
QUICK = Settings(large_sizes=(2 * MIB, 4 * MIB), repeats=5, batch_bytes=8 * MIB, small_iterations=100,
                 memory_bytes=32 * MIB, barriers=500, cells=200, hop_repeats=9, cache_passes=10)
TINY = Settings(small_sizes=(4,), large_sizes=(32 * KIB, 128 * KIB), repeats=1, batch_bytes=128 * KIB,
                small_iterations=5, compute_bytes=32 * KIB, memory_bytes=256 * KIB, barriers=20,
                cells=10, cell_bytes=32 * KIB, cache_passes=2, hop_counts=(1, 2), hop_repeats=1, hop_chains=1,
                hop_calls=1)
SETTINGS = {"full": FULL, "quick": QUICK, "tiny": TINY}


def calibrate_comm(comm: Communicator, settings: Settings, *, name: str, layout: tuple[int, int] = (1, 0),
                   command: str = "") -> Profile | None:
    """Measure every term of the profile over ``comm`` (collective; needs >= 2 ranks, ranks 0 and 1
    on one host) and return it on rank 0 (None elsewhere).

    ``layout``: (hosts, ranks per host); with hosts > 1 also the link between rank 0 and the first
    rank of host 1 (rank ``ranks per host``).

    Raises:
        ValueError: fewer than 2 ranks, or hosts > 1 with fewer than 2 ranks per host.
    """
    hosts, per_host = layout
    per_host = per_host or comm.world_size
    if comm.world_size < 2 or (hosts > 1 and per_host < 2):
        raise ValueError(f"calibration needs two ranks on one host (and, across hosts, two per host); got "
                         f"{comm.world_size} ranks as {hosts} x {per_host}")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    intra, intra_raw = measure_link(comm, (0, 1), settings, cpu_bound=True)
    inter, inter_raw = (measure_link(comm, (0, per_host), settings, cpu_bound=False) if hosts > 1
                        else (None, None))
    pairs = [(0, 1)] + ([(0, per_host)] if inter is not None else [])
    cores = len(os.sched_getaffinity(0))
    workers = min(2, cores)
    gamma, copy = micro.compute_per_byte(comm, settings.compute_bytes, settings.memory_bytes,
                                         settings.repeats, workers)
    cache_gamma, cache_copy = micro.cache_per_byte(comm, settings.cell_bytes or DEFAULT_CELL_BYTES,
                                                   settings.cache_passes, settings.repeats, workers)
    memory = micro.memory_bandwidth(comm, settings.memory_bytes, settings.repeats, workers)
    barrier = micro.shm_barrier(comm, settings.barriers, settings.repeats, one_core=cores < 2)
    crowded = micro.shm_barrier(comm, max(settings.barriers // 10, 1), settings.repeats, one_core=True)
    cell = micro.shm_cell(comm, settings.cells, settings.repeats) if barrier is not None else 0.0
    micro.close_shm(comm)
    one_host = barrier is not None and hosts == 1
    costs = fixed_costs.measure(comm, pairs, [intra] + ([inter] if inter is not None else []), one_host,
                                repeats=settings.hop_repeats, chains=settings.hop_chains,
                                call_count=settings.hop_calls, counts=settings.hop_counts)
    intra = dataclasses.replace(intra, hop_alpha_s=costs.hop_s(pairs[0]), one_way_hop_alpha_s=costs.one_way_s(pairs[0]))
    if inter is not None:
        inter = dataclasses.replace(inter, hop_alpha_s=costs.hop_s(pairs[1]),
                                    one_way_hop_alpha_s=costs.one_way_s(pairs[1]))
    if comm.rank != 0:
        return None
    shared = max(1.0, 2 / cores)  # ranks 0 and 1 on one core (a test host): the pair measured is oversubscribed
    # the pair shares a core: its hop is the crowded one (charged as it is); α and 1/bandwidth are divided
    intra = dataclasses.replace(intra, alpha_s=intra.alpha_s / shared,
                                bandwidth_bytes_per_s=intra.bandwidth_bytes_per_s * shared,
                                oversubscribed_hop_alpha_s=intra.hop_alpha_s if shared > 1 else None,
                                oversubscribed_one_way_hop_alpha_s=intra.one_way_hop_alpha_s if shared > 1 else None)
    if inter is not None and shared > 1:
        inter = dataclasses.replace(inter, oversubscribed_hop_alpha_s=inter.hop_alpha_s,
                                    oversubscribed_one_way_hop_alpha_s=inter.one_way_hop_alpha_s)
    profile = Profile(
        name=name, description="", intra=intra, inter=inter, gamma_s_per_byte=gamma, copy_s_per_byte=copy,
        ranks_per_host=per_host, nics_per_host=1, cores_per_host=cores, call_overhead_s=0.0,
        shm=ShmModel(barrier_s=barrier, memory_bandwidth_bytes_per_s=memory, oversubscribed_barrier_s=crowded,
                     cell_overhead_s=max(cell - 2 * barrier, 0.0) / 2, lean_call_overhead_s=None,
                     cache_copy_s_per_byte=cache_copy, cache_gamma_s_per_byte=cache_gamma)
        if barrier is not None else None)
    # the simulator slows a call's overhead by the ranks-per-core oversubscription: take it out of the
    # measured one (the test hosts' ranks share a core)
    profile = fixed_costs.call_overheads(profile, costs, pairs[0], layout, comm.world_size,
                                         profile.oversubscription(per_host))
    description = (f"{'this machine' if hosts == 1 else f'{hosts} test hosts x {per_host} ranks'}: "
                   f"{cores} usable cores, Gloo over {'loopback' if hosts == 1 else 'veth'}, calibrated "
                   f"{started}")
    sources = (f"measured by `{command or 'gradsync calibrate'}` on {started} ({_host_text()}; load average "
               f"{load} when it started)",
               f"intra: alpha = median one-way time of ping-pongs of {list(settings.small_sizes)} B; "
               f"bandwidth = 1/slope of the one-way time of ping-pongs of {list(settings.large_sizes)} B "
               f"between ranks 0 and 1 (CollectiveCall over Gloo): {_raw_text(intra_raw)}",
               f"intra hop_alpha: slope per hop of chains of {list(settings.hop_counts)} dependent exchanges "
               f"(send_recv, one call a chain, {settings.hop_chains} a batch) of {fixed_costs.HOP_BYTES} B "
               f"between ranks 0 and 1, less the bytes' time, in each of {settings.hop_repeats} batches; the "
               f"median; one_way_hop_alpha: the same of relays of as many one-way messages (each sent once "
               f"the last arrived), in the same batches: {fixed_costs.hop_text(costs.chains[pairs[0]])}",
               *([f"intra: alpha and 1/bandwidth divided by {shared:g}, the oversubscription of the pair "
                  f"measured (2 ranks on {cores} core): the simulator multiplies it back for ranks that share a "
                  f"core; the hops are a crowded pair's: oversubscribed_hop_alpha = hop_alpha and "
                  f"oversubscribed_one_way_hop_alpha = one_way_hop_alpha (of inter too)"]
                 if shared > 1 else []),
               *([f"inter: the same between rank 0 (host 0) and rank {per_host} (host 1): "
                  f"{_raw_text(inter_raw)}; hops: {fixed_costs.hop_text(costs.chains[pairs[1]])}"]
                 if inter is not None else []),
               f"gamma, copy: float32 add_ / copy_ in {settings.compute_bytes} B pieces over {settings.memory_bytes} B "
               f"buffers (from memory, not cache) on {workers} rank(s) at once (one a core)",
               f"shm cache_gamma, cache_copy: the same on {settings.cell_bytes or DEFAULT_CELL_BYTES} B buffers "
               f"(a cell; in cache), {settings.cache_passes} passes per batch",
               f"cores_per_host: len(os.sched_getaffinity(0)) = {cores}",
               f"call_overheads_s: one all_reduce (verify=False, {settings.hop_calls} per batch, over all "
               f"{comm.world_size} ranks, batches interleaved with the hop chains) of each algorithm less its "
               f"simulated cost with that batch's hop and no overhead, the median"
               f"{f', divided by the ranks-per-core oversubscription {profile.oversubscription(per_host):g}' if profile.oversubscription(per_host) > 1 else ''}: "
               f"{fixed_costs.calls_text(costs)}; call_overhead_s = ring's"
               + ("; shm lean_call_overhead_s: the shm call of 4 B (the lean path)" if one_host else
                  "; shm lean_call_overhead_s: None (no shm call spans the hosts)"),
               f"shm: barrier of ranks 0 and 1 ({settings.barriers} per batch; oversubscribed: both pinned to one "
               f"core); cell overhead: a pipelined cell of two floats ({settings.cells} per call) = "
               f"{cell * 1e6:.1f} us minus its two barriers, per rank (/ 2); memory bandwidth: {workers} "
               f"rank(s) copying {settings.memory_bytes} B at once, 3 DRAM bytes per byte copied")
    return dataclasses.replace(profile, description=description, sources=sources)


def calibration_points(hosts: bool, settings: Settings | None = None) -> list[dict]:
    """Every point ``gradsync calibrate`` (``settings``, None: ``FULL``; ``hosts``: ``--hosts 2 --nproc 2``)
    measures a figure of the profile at (:func:`gradsync.bench.fixed_costs.points`: dicts of collective,
    algorithm, nbytes, world_size, hosts). ``gradsync simulate --validate`` scores none of them."""
    settings = settings or FULL
    return fixed_costs.points(hosts, settings.small_sizes, settings.large_sizes, settings.memory_bytes,
                              settings.cell_bytes or DEFAULT_CELL_BYTES, len(os.sched_getaffinity(0)))


def _raw_text(raw: dict) -> str:
    def us(table: dict) -> str:
        return ", ".join(f"{n} B {s * 1e6:.1f} us" for n, s in table.items())
    return f"one-way {us(raw['ping_pong_one_way_s'])}; exchange {us(raw['exchange_s'])}"


def _host_text() -> str:
    return f"{os.uname().nodename}, torch {torch.__version__}, {os.cpu_count()} CPUs"


# -- the command ---------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """``gradsync calibrate``: measure, write the profile to ``--out``, print it (``--json``: its figures as rows)."""
    json_path = getattr(args, "json", None)
    claim_json_path(json_path)
    if args.out is None:  # the shipped test-hosts profile is written by this command only, never by hand
        from gradsync.collectives.cost.profiles import shipped_path

        args.out = str(shipped_path("test-hosts")) if getattr(args, "hosts", None) else "profile.json"
    profile = calibrate(hosts=getattr(args, "hosts", None), nproc=getattr(args, "nproc", 2),
                        inter_host_gbit=getattr(args, "inter_host_gbit", None),
                        settings=SETTINGS[getattr(args, "settings", "full")], out=args.out,
                        name=getattr(args, "name", None))
    if profile is not None:
        print(describe(profile))
        print(f"# wrote {args.out}")
        if json_path:
            from gradsync.bench.sim_report import profile_figures
            write_json(json_path, profile_figures(profile))
    return 0


def calibrate(*, hosts: int | None, nproc: int, inter_host_gbit: float | None, settings: Settings,
              out: str | None, name: str | None = None) -> Profile | None:
    """Calibrate here (2 local processes), on test hosts (``hosts`` x ``nproc``), or as one torchrun
    worker of such a job; write the profile to ``out`` (rank 0) and return it (None on other workers).

    Raises:
        ValueError: bad options; HostsFailedError: the job across test hosts failed.
    """
    from gradsync.jobs.job import under_torchrun

    if under_torchrun():
        return _as_torchrun_worker(settings, out, name, inter_host_gbit)
    if out:
        claim_json_path(out, "--out")
    if hosts is not None and hosts > 1:
        return _on_hosts(hosts, nproc, inter_host_gbit, settings, out, name)
    from gradsync.launch import launch_local

    profile = Profile.from_dict(launch_local(2, _local_worker, settings, name or "this-machine",
                                             _command_text(None, 2, None, settings))[0])
    if profile.cores_per_host is not None and profile.cores_per_host < 4:
        crowded, one_way, chains = launch_local(2 * profile.cores_per_host, _crowded_worker, settings,
                                                profile.intra)[0]
        intra = dataclasses.replace(profile.intra, oversubscribed_hop_alpha_s=crowded,
                                    oversubscribed_one_way_hop_alpha_s=one_way)
        text = (f"intra oversubscribed_hop_alpha, oversubscribed_one_way_hop_alpha: the same chains and relays with {2 * profile.cores_per_host} ranks on "
                f"{profile.cores_per_host} cores in a ring (ring steps; relays around it), the slope per hop: "
                f"{fixed_costs.hop_text(chains)}")
        profile = dataclasses.replace(profile, intra=intra, sources=(*profile.sources, text))
    if out:
        save(profile, out)
    return profile


def _local_worker(settings: Settings, name: str, command: str) -> dict | None:
    import gradsync
    from gradsync.process_group import default_communicator

    torch.set_num_threads(1)
    gradsync.init()
    try:
        profile = calibrate_comm(default_communicator(), settings, name=name, command=command)
        return profile.as_dict() if profile is not None else None
    finally:
        gradsync.shutdown()


def _crowded_worker(settings: Settings, link: Link) -> tuple[float, float, dict] | None:
    import gradsync
    from gradsync.process_group import default_communicator

    torch.set_num_threads(1)
    gradsync.init()
    try:
        comm = default_communicator()
        found = fixed_costs.crowded_hop(comm, link, repeats=settings.hop_repeats, chains=settings.hop_chains,
                                        counts=settings.hop_counts)
        return found if comm.rank == 0 else None
    finally:
        gradsync.shutdown()


def _as_torchrun_worker(settings: Settings, out: str | None, name: str | None,
                        inter_host_gbit: float | None) -> Profile | None:
    import gradsync
    from gradsync.bench.across_hosts import world_layout
    from gradsync.process_group import default_communicator

    torch.set_num_threads(1)
    layout = world_layout()
    gradsync.init()
    try:
        profile = calibrate_comm(default_communicator(), settings, name=name or "test-hosts", layout=layout,
                                 command=_command_text(layout[0], layout[1], inter_host_gbit, settings))
    finally:
        gradsync.shutdown()
    if profile is not None and out:
        save(profile, out)
    return profile


def _on_hosts(hosts: int, nproc: int, inter_host_gbit: float | None, settings: Settings, out: str | None,
              name: str | None) -> Profile:
    import tempfile

    from gradsync.bench.across_hosts import check_host_options
    from gradsync.hosts.torchrun import DEFAULT_JOIN_TIMEOUT_S, remove_log_dir, run_on_hosts

    check_host_options(hosts, inter_host_gbit, DEFAULT_JOIN_TIMEOUT_S)
    if nproc < 2:
        raise ValueError(f"--nproc must be >= 2 with --hosts (the link inside a host is measured too), got {nproc}")
    target = Path(out) if out else Path(tempfile.mkstemp(prefix="gradsync-profile-", suffix=".json")[1])
    argv = ["calibrate", "--out", str(target.resolve()), "--settings", _settings_name(settings)]
    if inter_host_gbit is not None:
        argv += ["--inter-host-gbit", f"{inter_host_gbit:g}"]
    if name:
        argv += ["--name", name]
    try:
        job = run_on_hosts(hosts, nproc, argv, inter_host_gbit=inter_host_gbit, echo_host0=False)
        remove_log_dir(job)
        return load(target)
    finally:
        if not out:
            target.unlink(missing_ok=True)


def _settings_name(settings: Settings) -> str:
    return next(key for key, value in SETTINGS.items() if value == settings)


def _command_text(hosts: int | None, nproc: int, inter_host_gbit: float | None, settings: Settings) -> str:
    text = "gradsync calibrate"
    if hosts and hosts > 1:
        text += f" --hosts {hosts} --nproc {nproc}"
        if inter_host_gbit is not None:
            text += f" --inter-host-gbit {inter_host_gbit:g}"
    if settings != FULL:
        text += f" --settings {_settings_name(settings)}"
    return text
