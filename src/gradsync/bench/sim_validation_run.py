"""``gradsync simulate --validate``: calibrate, measure the sweep ``--repeat`` times, predict, print, write JSON.

The arithmetic (rows, errors, summary, ``auto``'s picks) is :mod:`gradsync.bench.sim_validation`.
One repetition is one sweep of every size and algorithm, interleaved
(:func:`gradsync.bench.allreduce.sweep` with one repetition): on one host the R sweeps of a world
size run in one launch of its processes, across test hosts each is a job of its own.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict

from gradsync.bench.allreduce import parse_nbytes
from gradsync.bench.calibrate import FULL, calibrate, describe
from gradsync.bench.output import claim_json_path, write_json
from gradsync.bench.sim_validation import (ALGORITHMS, DEFAULT_SIZES, HOSTS, ONE_HOST_WORLD_SIZES, RANKS_PER_HOST,
                                           ValidationRow, auto_picks, format_picks, format_rows, format_summary,
                                           merge_repetitions, predict, summarize)
from gradsync.bench.spread import DEFAULT_REPEAT, check_repeat


def _sweeps_worker(sizes: list[int], algorithms: list[str], repeat: int) -> list[list[dict]] | None:
    """One benchmark process: ``repeat`` sweeps of one repetition each; rank 0 returns their rows.

    The communicator is the one ``gradsync bench allreduce`` builds (hierarchical groups by real host).
    """
    import torch

    import gradsync
    from gradsync.bench.allreduce import sweep
    from gradsync.collectives import HierarchicalOptions, SegmentOptions
    from gradsync.collectives.communicator import Communicator
    from gradsync.process_group import default_communicator

    torch.set_num_threads(1)
    gradsync.init()
    try:
        base = default_communicator()
        comm = Communicator(base.transport, base.timeout_s,
                            options=[base.options(SegmentOptions), HierarchicalOptions(ranks_per_node=None)])
        runs = [[row if isinstance(row, dict) else asdict(row) for row in sweep(comm, sizes, algorithms, 1)]
                for _ in range(repeat)]
        return runs if comm.rank == 0 else None
    finally:
        gradsync.shutdown()


def measure_one_host(world_size: int, sizes: list[int], repeat: int) -> list[dict]:
    """The sweep on ``world_size`` local processes, ``repeat`` times (:func:`merge_repetitions`'s rows)."""
    from gradsync.launch import launch_local

    return merge_repetitions(launch_local(world_size, _sweeps_worker, sizes, list(ALGORITHMS), repeat)[0])


def measure_hosts(sizes: list[int], repeat: int, inter_host_gbit: float) -> list[dict]:
    """The sweep on 2 x 2 test hosts (``gradsync bench allreduce --hosts 2 --nproc 2``), one job per repetition."""
    from gradsync.bench.across_hosts import run_bench_on_hosts
    from gradsync.bench.allreduce import _worker_argv

    names = [name for name in ALGORITHMS if name != "shm"] + ["native"]
    argv = _worker_argv(",".join(map(str, sizes)), names, 1, None, inter_host_gbit)
    return merge_repetitions([run_bench_on_hosts(HOSTS, RANKS_PER_HOST, argv, inter_host_gbit=inter_host_gbit,
                                                 join_timeout_s=60.0, json_path=None) for _ in range(repeat)])


def load_text() -> str:
    """This machine's load averages (1, 5, 15 min): other processes' share of the cores."""
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg())


def hosts_problem() -> str | None:
    from gradsync.hosts.netns import unavailable_reason

    return unavailable_reason()


def _check_options(args: argparse.Namespace) -> tuple[list[int], int, float]:
    """(sizes, repeat, Gbit/s) of the options. Raises ValueError naming a bad option."""
    try:
        sizes = [parse_nbytes(text) for text in getattr(args, "validate_sizes", DEFAULT_SIZES).split(",")]
    except ValueError as exc:
        raise ValueError(f"--validate-sizes: {exc}") from None
    repeat = check_repeat(getattr(args, "repeat", DEFAULT_REPEAT))
    gbit = getattr(args, "inter_host_gbit", None) or 1.0
    if not gbit > 0:
        raise ValueError(f"--inter-host-gbit must be > 0, got {gbit}")
    return sizes, repeat, gbit


def run(args: argparse.Namespace) -> int:
    """Calibrate, measure, predict, print; write ``--json`` rows. Returns 0 (the goal is reported, not enforced).

    Raises:
        ValueError: a bad option (``--repeat``, ``--validate-sizes``, ``--json``), before anything runs.
    """
    sizes, repeat, gbit = _check_options(args)
    claim_json_path(getattr(args, "json", None))
    skip_hosts = getattr(args, "no_hosts", False)
    problem = None if skip_hosts else hosts_problem()
    print(f"# gradsync simulate --validate: calibrating ({load_text()})", flush=True)
    local = calibrate(hosts=None, nproc=2, inter_host_gbit=None, settings=FULL, out=None)
    print(describe(local), flush=True)
    remote = None
    if not skip_hosts and problem is None:
        remote = calibrate(hosts=HOSTS, nproc=RANKS_PER_HOST, inter_host_gbit=gbit, settings=FULL, out=None)
        print(describe(remote), flush=True)
    rows: list[ValidationRow] = []
    for world_size in ONE_HOST_WORLD_SIZES:
        print(f"# measuring 1 host x {world_size} ranks, {repeat} repetitions ({load_text()})", flush=True)
        rows += predict(measure_one_host(world_size, sizes, repeat), local)
    if remote is not None:
        print(f"# measuring {HOSTS} test hosts x {RANKS_PER_HOST} ranks, {gbit:g} Gbit/s, {repeat} repetitions "
              f"({load_text()})", flush=True)
        rows += predict(measure_hosts(sizes, repeat, gbit), remote)
    elif not skip_hosts:
        print(f"# no test hosts here ({problem}): only one-host rows", flush=True)
    print(f"# done ({load_text()}); measured figures: median (min-max) over {repeat} repetitions")
    print(format_rows(rows))
    print(format_summary(summarize(rows)))
    print(format_picks(auto_picks(rows)))
    if getattr(args, "json", None):
        write_json(args.json, [row.as_dict() for row in rows])
    return 0
