"""``gradsync simulate --validate``: print the split, calibrate, measure ``--repeat`` times, predict, print, write JSON.

The arithmetic (rows, errors, spreads, verdicts, summary) is :mod:`gradsync.bench.sim_validation`, the
points (which calibrate, which are predicted) :mod:`gradsync.bench.sim_validation_points`, ``auto``'s
picks :mod:`gradsync.bench.sim_validation_picks`, the tables :mod:`gradsync.bench.sim_report`. Each
collective is measured as ``gradsync bench allreduce --collective C --repeat R`` measures it
(:func:`gradsync.bench.allreduce.sweep`): at every size one warm-up call of each algorithm, then R
repetitions with the algorithms' order rotated, each repetition's time kept (``time_us_reps``). On one
host every collective of a world size runs in one launch of its processes; across test hosts each
collective is a job.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict

from gradsync.bench.allreduce import parse_nbytes
from gradsync.bench.calibrate import FULL, calibrate, describe
from gradsync.bench.output import claim_json_path, write_json
from gradsync.bench.sim_report import validation_tables
from gradsync.bench.sim_validation import DEFAULT_SIZES, HOSTS, RANKS_PER_HOST, ValidationRow, with_runs
from gradsync.bench.sim_validation_points import (Point, as_point, calibration_rows, check_disjoint, format_split,
                                                  plan, predict, split_rows, validation_points)
from gradsync.bench.spread import DEFAULT_REPEAT, check_repeat
from gradsync.collectives.cost.profile import Profile

Plan = dict[str, list[str]]  # collective -> the algorithms measured


def _sweeps_worker(sizes: list[int], by_collective: Plan, repeat: int) -> list[dict] | None:
    """One benchmark process: the sweep of every collective of ``by_collective`` (its algorithms interleaved,
    ``repeat`` repetitions); rank 0 returns the rows.

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
        rows = [row if isinstance(row, dict) else asdict(row) for collective, names in by_collective.items()
                for row in sweep(comm, sizes, names, repeat, collective=collective)]
        return rows if comm.rank == 0 else None
    finally:
        gradsync.shutdown()


def measure_one_host(world_size: int, sizes: list[int], by_collective: Plan, repeat: int) -> list[dict]:
    """The sweeps on ``world_size`` local processes (:func:`with_runs`' rows)."""
    from gradsync.launch import launch_local

    return with_runs(launch_local(world_size, _sweeps_worker, sizes, by_collective, repeat)[0])


def measure_hosts(sizes: list[int], by_collective: Plan, repeat: int, inter_host_gbit: float) -> list[dict]:
    """The sweeps on 2 x 2 test hosts (``gradsync bench allreduce --hosts 2 --nproc 2 --collective C
    --repeat R``), one job per collective (:func:`with_runs`' rows)."""
    from gradsync.bench.across_hosts import run_bench_on_hosts
    from gradsync.bench.allreduce import _worker_argv

    def job(collective: str, names: list[str]) -> list[dict]:
        argv = _worker_argv(",".join(map(str, sizes)), names, repeat, None, inter_host_gbit, collective)
        return run_bench_on_hosts(HOSTS, RANKS_PER_HOST, argv, inter_host_gbit=inter_host_gbit,
                                  join_timeout_s=60.0, json_path=None)

    return with_runs([row for collective, names in by_collective.items() for row in job(collective, names)])


def calibration_points(with_hosts: bool) -> list[Point]:
    """The points the run's calibrations measure: this machine's, and the test hosts' ``with_hosts``
    (:func:`gradsync.bench.calibrate.calibration_points`), each once.

    Raises:
        ValueError: the calibration lists no points (a gradsync without ``calibration_points``).
    """
    from gradsync.bench import calibrate as calibration

    listed = getattr(calibration, "calibration_points", None)
    if listed is None:
        raise ValueError("gradsync.bench.calibrate lists no calibration points (calibration_points): the split "
                         "between calibrated and validated points cannot be checked, so --validate does not run")
    found = listed(False) + (listed(True) if with_hosts else [])
    return list(dict.fromkeys(as_point(point) for point in found))


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
    """Print the split, calibrate, measure, predict, print; write ``--json`` rows (the validation rows, then
    the calibration's points with ``role`` "calibrate"). Returns 0 (the goals are reported, not enforced).

    Raises:
        ValueError: a bad option (``--repeat``, ``--validate-sizes``, ``--json``), or validated points among
        the calibration's, before anything runs.
    """
    sizes, repeat, gbit = _check_options(args)
    claim_json_path(getattr(args, "json", None))
    problem = None if getattr(args, "no_hosts", False) else hosts_problem()
    with_hosts = not getattr(args, "no_hosts", False) and problem is None
    validated, calibration = split(sizes, with_hosts)
    if problem is not None:
        print(f"# no test hosts here ({problem}): only one-host rows", flush=True)
    started = time.perf_counter()
    profiles = _calibrate(with_hosts, gbit)
    calibrated = time.perf_counter()
    rows, took = _measure(validated, sizes, repeat, gbit, profiles)
    print(f"# done ({load_text()}): calibrating took {calibrated - started:.0f} s, measuring "
          f"{time.perf_counter() - calibrated:.0f} s ({', '.join(took)}); measured figures: median (min-max) over "
          f"{repeat} repetitions")
    print("\n\n".join(validation_tables(rows)))
    if getattr(args, "json", None):
        write_json(args.json, [row.as_dict() for row in rows] + calibration_rows(calibration))
    return 0


def split(sizes: list[int], with_hosts: bool) -> tuple[list[Point], list[Point]]:
    """(validated points, calibration points), printed as a table; what the simulator runs is asked on the
    shipped profiles of the same shape (``this-machine``, ``test-hosts``).

    Raises:
        ValueError: a validated point among the calibration's (:func:`check_disjoint`).
    """
    from gradsync.collectives.cost.profiles import get_profile

    shapes = {1: get_profile("this-machine"), HOSTS: get_profile("test-hosts")}
    validated, calibration = validation_points(sizes, with_hosts, shapes), calibration_points(with_hosts)
    check_disjoint(validated, calibration)
    print(f"# gradsync simulate --validate: {len(calibration)} points calibrate, {len(validated)} other points are "
          f"predicted and measured", flush=True)
    print(format_split(split_rows(validated, calibration)), flush=True)
    return validated, calibration


def _calibrate(with_hosts: bool, gbit: float) -> dict[int, Profile]:
    """hosts -> the profile calibrated now (``FULL``): this machine, and ``with_hosts`` the test hosts."""
    print(f"# calibrating ({load_text()})", flush=True)
    profiles = {1: calibrate(hosts=None, nproc=2, inter_host_gbit=None, settings=FULL, out=None)}
    print(describe(profiles[1]), flush=True)
    if with_hosts:
        profiles[HOSTS] = calibrate(hosts=HOSTS, nproc=RANKS_PER_HOST, inter_host_gbit=gbit, settings=FULL, out=None)
        print(describe(profiles[HOSTS]), flush=True)
    return profiles


def _measure(validated: list[Point], sizes: list[int], repeat: int, gbit: float,
             profiles: dict[int, Profile]) -> tuple[list[ValidationRow], list[str]]:
    """The predicted rows of every layout of ``validated``, and how long each layout's measurement took."""
    rows: list[ValidationRow] = []
    took = []
    for (hosts, world_size), by_collective in plan(validated).items():
        print(f"# measuring {hosts} host(s) x {world_size // hosts} ranks, {repeat} repetitions ({load_text()})",
              flush=True)
        begun = time.perf_counter()
        measured = (measure_one_host(world_size, sizes, by_collective, repeat) if hosts == 1
                    else measure_hosts(sizes, by_collective, repeat, gbit))
        rows += predict(measured, profiles[hosts])
        took.append(f"{hosts}x{world_size // hosts} {time.perf_counter() - begun:.0f} s")
    return rows, took
