"""nccl-tests-style AllReduce sweep: time per call, algbw, busbw, and the ratio to the native call.

Definitions (nccl-tests, doc/PERFORMANCE.md): for a message of ``nbytes``
bytes taking ``t`` seconds, algbw = nbytes / t and busbw = algbw · 2(p-1)/p,
the per-link bandwidth a ring would need, comparable across world sizes.
``--collective reduce_scatter|all_gather`` times those collectives instead,
with nccl-tests' message size and busbw = algbw · (p-1)/p for them
(:mod:`gradsync.bench.sweep_collectives`) and, in the ``mpi`` row,
MPI_Reduce_scatter_block / MPI_Allgather (:mod:`gradsync.bench.mpi_collectives`).
``ratio_to_native`` = native time / algorithm time (above 1: faster than the
backend's own call). Algorithms are interleaved inside every one of the
``--repeat R`` repetitions so they see the same machine noise (in an order
rotated by one each repetition, so that none always follows the same one); the time of a
repetition is the slowest rank's, a ratio is formed within each repetition,
and every figure is reported as the median with its min and max over the
repetitions (:mod:`gradsync.bench.allreduce_rows`; OSU-style warm-up first,
fewer iterations for large messages). ``auto`` rows are also set against the
fastest algorithm auto may choose (:mod:`gradsync.bench.auto_rows`).

With ``--hosts H`` the sweep runs on H test hosts (:mod:`gradsync.bench.across_hosts`);
rows then also give ``link_gbps``: the bytes host 0's interface sent during a
row's timed calls (headers included) over their time, and ``link_fraction`` =
link_gbps / the shaped rate (``--inter-host-gbit``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import gradsync
from gradsync.bench.across_hosts import (LinkMeter, check_host_options, print_rank0_rows, run_bench_on_hosts,
                                        world_layout)
from gradsync.bench.allreduce_options import ZERO_COPY, parse_nbytes, parse_options
from gradsync.bench.allreduce_rows import bound_spread, format_table, row_figures
from gradsync.bench.auto_rows import annotate_auto_rows, auto_rows, format_auto_table
from gradsync.bench.output import claim_json_path, write_json
from gradsync.bench.memory_bound import bound_fraction, bytes_per_payload_byte, measure_bandwidth
from gradsync.bench.mpi import (MPI_COLUMN, check_mpi_options, join_from_mpi, mpi_available, mpi_tables,
                                run_under_each_mpi, write_mpi_rows)
from gradsync.bench.mpi_collectives import check_mpi_results, mpi_call
from gradsync.bench.sweep_collectives import ALL_REDUCE, SIZE_MEANING, input_numel, message_numel, run_call
from gradsync.collectives import HierarchicalOptions, SegmentOptions, ShmState, ops
from gradsync.collectives.communicator import Communicator
from gradsync.process_group import default_communicator
from gradsync.jobs.job import under_torchrun

TARGET_BYTES_PER_REP = 8 * 2**20  # iterations per repetition: enough calls to move ~8 MiB
MAX_ITERATIONS = 100


@dataclass
class Row:
    """A row's setting and traffic; its times, bandwidths and ratios come from
    :func:`gradsync.bench.allreduce_rows.row_figures`."""

    algorithm: str
    world_size: int
    nbytes: int
    bytes_sent_per_call: float   # payload bytes this rank sent per call (rank 0)
    repeat: int
    iterations: int
    hosts: int = 1
    nproc_per_host: int = 1
    link_gbps: float | None = None      # host 0's interface, during the timed calls (hosts > 1)
    link_fraction: float | None = None  # link_gbps / --inter-host-gbit (shaped links only)
    bound_fraction: float | None = None  # shm designs: the memory-traffic bound's time / time (bench.memory_bound)
    memory_gbps: float | None = None     # the machine's memory traffic rate that bound uses
    collective: str = ALL_REDUCE         # --collective: all_reduce, reduce_scatter or all_gather


def _iterations(nbytes: int) -> int:
    return max(1, min(MAX_ITERATIONS, TARGET_BYTES_PER_REP // max(nbytes, 1)))


def _row_communicators(comm: Communicator, algorithms: list[str]) -> dict[str, Communicator]:
    """Rows that run on a communicator of their own: ``shm@<cells>`` (``ShmState(cell_bytes=...)``) and
    ``auto``, which decides from the group's real hosts, not from the pretend nodes of ``hierarchical``.

    ``auto`` runs as a user's call does, on the group the other rows run on: ``comm`` itself unless its
    pretend nodes split the group, else a communicator sharing ``comm``'s segment settings and shared
    memory (the shm row's segment and cells, not a second segment of its own).
    """
    rows = {name: Communicator(comm.transport, comm.timeout_s, options=[ShmState(cell_bytes=parse_nbytes(name[4:]))])
            for name in algorithms if name.startswith("shm@")}
    if "auto" in algorithms:
        pretend = comm.options(HierarchicalOptions).ranks_per_node
        rows["auto"] = comm if pretend is None or pretend >= comm.world_size else Communicator(
            comm.transport, comm.timeout_s, options=[comm.options(SegmentOptions), comm.options(ShmState)])
    return rows


def _time_once(comm: Communicator, tensor: torch.Tensor, algorithm: str, iterations: int,
               mpi_run=None, shared: torch.Tensor | None = None, meter: LinkMeter | None = None,
               cells: dict[str, Communicator] | None = None, collective: str = ALL_REDUCE) -> float:
    ops.all_reduce(torch.zeros(1), comm, algorithm="native", verify=False)  # line the ranks up
    if meter is not None:
        meter.start()
    started = time.perf_counter()
    for _ in range(iterations):
        if algorithm == MPI_COLUMN:
            mpi_run(tensor)
        elif algorithm == ZERO_COPY:
            ops.all_reduce(shared, comm, algorithm="shm", verify=False)
        elif cells and algorithm in cells:
            run_call(collective, tensor, cells[algorithm], "auto" if algorithm == "auto" else "shm")
        else:
            run_call(collective, tensor, comm, algorithm)
    seconds = time.perf_counter() - started
    if meter is not None:
        meter.stop(algorithm)
    return seconds / iterations


def _warm_up(time_once, algorithms: list[str]) -> None:
    """One untimed call of each row (buffers, connections, caches). A call the library refuses (on every rank,
    as collectives do) raises ValueError naming the row: one line from the launcher, not a traceback."""
    for name in algorithms:
        try:
            time_once(name, 1)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--algorithms {name}: {exc}") from None


def rotated(names: list[str], repetition: int) -> list[str]:
    """The order of ``names`` in repetition k: rotated by k, so no algorithm always follows the same one.

    >>> rotated(["ring", "shm", "native"], 1)
    ['shm', 'native', 'ring']
    """
    shift = repetition % len(names)
    return names[shift:] + names[:shift]


def _slowest_rank(comm: Communicator, seconds: float) -> float:
    return max(float(t) for t in ops.all_gather(torch.tensor([seconds], dtype=torch.float64), comm))


def sweep(comm: Communicator, sizes: list[int], algorithms: list[str], repeat: int,
          layout: tuple[int, int] | None = None, link_gbit: float | None = None,
          collective: str = ALL_REDUCE) -> list[dict]:
    """Measure every (size, algorithm) ``repeat`` times, interleaved; returns the rows (every rank the same).

    Collective: every rank calls it with the same arguments.

    ``collective``: what each row times (:mod:`gradsync.bench.sweep_collectives`: the message of each size
    and busbw's factor). ``"mpi"`` among ``algorithms`` times MPI's call of it (MPI_Allreduce,
    MPI_Reduce_scatter_block, MPI_Allgather; the processes must run under mpiexec).
    ``layout``: (hosts, ranks per host), default (1, world size); with hosts > 1 rank 0 also
    reads its host's interface counters (``link_gbps``), over ``link_gbit`` when shaped.
    """
    hosts, per_host = layout or (1, comm.world_size)
    mpi_run = mpi_call(collective) if MPI_COLUMN in algorithms else None
    arena = None
    if ZERO_COPY in algorithms:  # the data already lies in shared memory, as DataParallel's buckets do
        arena = ops.shared_buffer(comm, max(max(sizes), 4), "shm")
        if arena is None:
            raise ValueError(f"{ZERO_COPY} needs every rank on one machine")
    cells = _row_communicators(comm, algorithms)
    shm_rows = (collective == ALL_REDUCE and hosts == 1  # the memory-bound models are AllReduce's
                and any(bytes_per_payload_byte(name, comm.world_size) for name in algorithms))
    bandwidth = measure_bandwidth(comm) if shm_rows else None
    rows = []
    world_size = comm.world_size
    for nbytes in sizes:
        numel = message_numel(collective, nbytes, world_size)
        tensor = torch.zeros(input_numel(collective, numel, world_size), dtype=torch.float32)
        shared = arena[:numel * 4].view(torch.float32) if arena is not None else None
        iterations = _iterations(nbytes)
        times: dict[str, list[float]] = {name: [] for name in algorithms}
        sent: dict[str, float] = {}
        meter = LinkMeter() if hosts > 1 and comm.rank == 0 else None
        _warm_up(lambda name, count: _time_once(comm, tensor, name, count, mpi_run, shared, cells=cells,
                                                collective=collective), algorithms)
        for repetition in range(repeat):
            for name in rotated(algorithms, repetition):
                before = comm.stats.bytes_sent
                seconds = _time_once(comm, tensor, name, iterations, mpi_run, shared, meter, cells, collective)
                sent[name] = (comm.stats.bytes_sent - before) / iterations
                times[name].append(_slowest_rank(comm, seconds))
        figures = row_figures(times, numel * 4, world_size, collective)
        for name in algorithms:
            link = meter.gbps(name) if meter is not None else None
            fraction = link / link_gbit if link is not None and link_gbit else None
            bound = bound_fraction(name, world_size, numel * 4, figures[name]["time_us"] * 1e-6,
                                   bandwidth) if bandwidth and world_size > 1 else None  # alone, nothing moves
            row = Row(name, world_size, numel * 4, sent[name], repeat, iterations, hosts, per_host, link,
                      fraction, bound, bandwidth / 1e9 if bound is not None else None, collective)
            rows.append({**asdict(row), **figures[name], **bound_spread(bound, figures[name])})
    return annotate_auto_rows(rows)


def run_worker(sizes: list[int], algorithms: list[str], repeat: int, ranks_per_node: int | None,
               segment_bytes: int | None, layout: tuple[int, int] | None = None,
               link_gbit: float | None = None, collective: str = ALL_REDUCE) -> list[dict] | None:
    """Entry point of one benchmark process; rank 0 returns the rows.

    ``ranks_per_node`` None: hierarchical groups ranks by real host (the group's locality).
    """
    torch.set_num_threads(1)
    gradsync.init()
    try:
        base = default_communicator()
        segments = SegmentOptions(segment_bytes) if segment_bytes else base.options(SegmentOptions)
        comm = Communicator(base.transport, base.timeout_s,
                            options=[segments, HierarchicalOptions(ranks_per_node=ranks_per_node)])
        rows = sweep(comm, sizes, algorithms, repeat, layout, link_gbit, collective)
        return rows if comm.rank == 0 else None
    finally:
        gradsync.shutdown()


def tables_text(rows: list[dict]) -> str:
    """What the bench prints for ``rows``: the sweep's table, then auto against the fastest when auto ran.

    Rows of another collective than all_reduce (one per run) are headed by what their size and busbw mean.
    """
    judged = auto_rows(rows)
    table = collective_header(rows) + format_table(rows)
    if not judged and any(row["algorithm"] == "auto" for row in rows):
        return table + "\n\n# auto not judged: no algorithm it may choose was measured beside it"
    return table + ("\n\n" + format_auto_table(judged) if judged else "")


def collective_header(rows: list[dict]) -> str:
    """The lines above the table of a reduce_scatter or all_gather run (empty for all_reduce, as before)."""
    collective = rows[0].get("collective", ALL_REDUCE) if rows else ALL_REDUCE
    if collective == ALL_REDUCE:
        return ""
    header = f"# {collective}: {SIZE_MEANING[collective]}; busbw = algbw x (p-1)/p (nccl-tests)\n"
    if not any(row["algorithm"] == "native" for row in rows):
        header += f"# no native row: the gradsync that ran this refuses {collective} with native\n"
    return header


def _worker_argv(sizes: str, names: list[str], repeat: int, segment_bytes: int | None,
                 inter_host_gbit: float | None, collective: str = ALL_REDUCE) -> list[str]:
    """The bench command each torchrun worker runs (without --hosts; the rate only labels link %).

    No --nproc: torchrun's own parser would take it for a prefix of its --nproc-per-node (ambiguous).
    """
    argv = ["bench", "allreduce", "--sizes", sizes, "--algorithms", ",".join(names),
            "--repeat", str(repeat)]
    if segment_bytes:
        argv += ["--segment-bytes", str(segment_bytes)]
    if inter_host_gbit is not None:
        argv += ["--inter-host-gbit", f"{inter_host_gbit:g}"]
    if collective != ALL_REDUCE:
        argv += ["--collective", collective]
    return argv


def run_sweep(*, nproc: int, sizes: str, algorithms: str | None, repeat: int, ranks_per_node: int | None,
              segment_bytes: int | None, json_path: str | None, hosts: int | None = None,
              inter_host_gbit: float | None = None, join_timeout_s: float = 30.0,
              shm_cells: str | None = None, mpi: str | None = None, mpi_settings: str = "auto",
              collective: str = ALL_REDUCE) -> list[dict]:
    """Validate the options, run the sweep, print the table, write JSON; returns the rows.

    Local: ``nproc`` processes on this machine. ``hosts``: ``nproc`` ranks on each of
    ``hosts`` test hosts (rank 0 prints and writes). Under torchrun (a worker of such a
    run, or of the user's own): this process is one rank of the sweep. With the ``mpi`` column:
    one run under each MPI library of ``mpi`` ("mpich,openmpi"; None: every installed one), given
    ``mpi_settings`` ("auto": yield settings when ranks outnumber cores; "defaults"), one table each.
    ``collective``: all_reduce, reduce_scatter or all_gather (:mod:`gradsync.bench.sweep_collectives`).
    """
    if under_torchrun():
        return _run_as_torchrun_worker(nproc, sizes, algorithms, repeat, ranks_per_node, segment_bytes,
                                       json_path, hosts, inter_host_gbit, collective)
    check_host_options(hosts, inter_host_gbit, join_timeout_s)
    if hosts and (mpi is not None or mpi_settings != "auto"):
        raise ValueError("--mpi/--mpi-settings: MPI does not run across --hosts (mpiexec starts one host's ranks)")
    checked = parse_options(nproc, sizes, algorithms, repeat, ranks_per_node, segment_bytes, hosts, shm_cells,
                            collective, mpi_available)
    names, ranks_per_node = checked.names, checked.ranks_per_node
    check_mpi_options(mpi, mpi_settings, MPI_COLUMN in names)
    claim_json_path(json_path)
    what = "" if collective == ALL_REDUCE else f" --collective {collective}"
    if hosts:
        shaping = f"{inter_host_gbit:g} Gbit/s per host link" if inter_host_gbit else "unshaped links"
        print("\n".join([f"# gradsync bench allreduce{what}: {hosts} test hosts x {nproc} ranks, {shaping}",
                         *checked.notes]), flush=True)
        return run_bench_on_hosts(hosts, nproc, _worker_argv(sizes, names, repeat, segment_bytes, inter_host_gbit,
                                                             collective),
                                  inter_host_gbit=inter_host_gbit, join_timeout_s=join_timeout_s,
                                  json_path=json_path)
    print("\n".join([f"# gradsync bench allreduce{what}: world_size={nproc} ranks_per_node={ranks_per_node} "
                     f"float32, 1 thread per rank, {_repeat_text(repeat)}", *checked.notes]), flush=True)
    from gradsync.launch import launch_local

    if MPI_COLUMN in names:  # MPI_COMM_WORLD needs processes started by mpiexec: one run per MPI library
        rows = run_under_each_mpi(nproc, mpi, mpi_settings, dict(
            sizes=checked.sizes, algorithms=names, repeat=repeat, ranks_per_node=ranks_per_node,
            segment_bytes=segment_bytes, collective=collective))
    else:
        rows = launch_local(nproc, run_worker, checked.sizes, names, repeat, ranks_per_node, segment_bytes,
                            None, None, collective)[0]
    print("\n\n".join(mpi_tables(rows, tables_text)))
    if json_path:
        write_json(json_path, rows)
    return rows


def _repeat_text(repeat: int) -> str:
    return f"median (min-max) of {repeat} interleaved repetitions"


def _run_as_torchrun_worker(nproc, sizes, algorithms, repeat, ranks_per_node, segment_bytes,
                            json_path, hosts, inter_host_gbit, collective=ALL_REDUCE) -> list[dict]:
    """One rank started by torchrun: hosts and ranks per host come from its environment."""
    if hosts:
        raise ValueError("--hosts starts torchrun on test hosts; this process already runs under torchrun")
    layout = world_layout()  # torchrun's --nproc-per-node decides; --nproc only counts for a local run
    checked = parse_options(layout[1], sizes, algorithms, repeat, None, segment_bytes, hosts=layout[0],
                            collective=collective, mpi_available=mpi_available)
    rows = run_worker(checked.sizes, checked.names, repeat, ranks_per_node, segment_bytes, layout, inter_host_gbit,
                      collective)
    if rows is not None:
        print_rank0_rows(f"# gradsync bench allreduce: {layout[0]} hosts x {layout[1]} ranks, float32, 1 thread "
                         f"per rank, {_repeat_text(repeat)}", tables_text(rows), rows, json_path)
    return rows or []


def _main_under_mpiexec(options_path: str, rows_path: str) -> None:
    """One process under mpiexec: set up the gradsync group from MPI, check MPI's results (sums, blocks, gathered
    parts), run the sweep, rank 0 writes rows."""
    options = json.loads(Path(options_path).read_text())
    placements, sum_error = join_from_mpi(), check_mpi_results(options.get("collective", ALL_REDUCE))
    try:
        rows = run_worker(**options)
    except ValueError as exc:  # a row refused on every rank (_warm_up): rank 0 hands the one line on
        if placements is not None:
            Path(rows_path).write_text(json.dumps({"error": str(exc)}))
        return
    if rows is not None:
        write_mpi_rows(rows_path, rows, placements, sum_error)


if __name__ == "__main__":
    _main_under_mpiexec(*sys.argv[1:3])  # started by bench.mpi.run_with_mpiexec
