"""``gradsync simulate --validate``: the simulator's prediction against a sweep measured in the same run.

1. Calibrate (:mod:`gradsync.bench.calibrate`, ``FULL`` settings: bandwidth from 1-16 MiB, out of cache as the large rows): this machine
   (2 processes over loopback) and, where test hosts can be made, 2 test hosts x 2
   ranks with links shaped to ``--inter-host-gbit`` (1 Gbit/s).
2. Measure the AllReduce sweep with the bench machinery (:func:`gradsync.bench.allreduce.sweep`:
   interleaved repetitions, slowest rank, median; ``verify=False``): world sizes
   2, 3, 4 on one host (``hierarchical`` then groups by real host: one node, shm
   inside, as the simulation of one host does) and 2 x 2 test hosts (shm only on one
   host; ``hierarchical`` = shm inside each host, halving_doubling across).
3. Predict every row with the event simulation (:func:`gradsync.sim.engine.simulate_all_reduce`)
   on the profile calibrated in step 1 and the row's topology, and print both with
   the error (predicted - measured) / measured.

Goal (issue 19): median |error| <= 10% over all rows, worst <= 25% over rows >= 64 KiB.

4. ``auto``'s choice against the measurement (:func:`auto_picks`): at every point, the candidate
   ``auto`` would run there (the flat algorithms, shm on one host, hierarchical across hosts) that
   the model predicts fastest, and the measured time of that pick over the measured fastest's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict, dataclass

from gradsync.bench.allreduce import parse_nbytes
from gradsync.bench.calibrate import FULL, calibrate, describe
from gradsync.bench.output import format_rows as table
from gradsync.sim import Profile

ALGORITHMS = ("ring", "tree", "halving_doubling", "hierarchical", "shm")
ONE_HOST_WORLD_SIZES = (2, 3, 4)
HOSTS, RANKS_PER_HOST = 2, 2
DEFAULT_SIZES = "4K,64K,1M,16M,64M"
LARGE_BYTES = 64 * 2**10  # the goal's worst-case bound counts rows from here up
MEDIAN_GOAL, WORST_GOAL = 0.10, 0.25


@dataclass
class ValidationRow:
    """One measured sweep row and its prediction (times in microseconds)."""

    algorithm: str
    nbytes: int
    world_size: int
    hosts: int
    predicted_us: float
    measured_us: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return relative_error(self.predicted_us, self.measured_us)

    def as_dict(self) -> dict:
        return dict(asdict(self), error=self.error)


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured.

    Raises:
        ValueError: ``measured`` is not positive.

    >>> relative_error(110.0, 100.0)
    0.1
    """
    if not measured > 0:
        raise ValueError(f"a measured time must be > 0, got {measured}")
    return (predicted - measured) / measured


@dataclass(frozen=True)
class Summary:
    rows: int
    median_abs_error: float
    large_rows: int
    worst_abs_error_large: float | None  # over rows >= LARGE_BYTES (None: no such row)
    worst_row: ValidationRow | None

    @property
    def meets_goal(self) -> bool:
        return (self.median_abs_error <= MEDIAN_GOAL
                and (self.worst_abs_error_large is None or self.worst_abs_error_large <= WORST_GOAL))


def summarize(rows: list[ValidationRow]) -> Summary:
    """The median |error| over all rows and the worst |error| over rows of at least ``LARGE_BYTES``.

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("no validation rows to summarize")
    large = [row for row in rows if row.nbytes >= LARGE_BYTES]
    worst = max(large, key=lambda row: abs(row.error)) if large else None
    return Summary(len(rows), statistics.median(abs(row.error) for row in rows), len(large),
                   abs(worst.error) if worst else None, worst)


def format_rows(rows: list[ValidationRow]) -> str:
    return table([{**asdict(row), "error_percent": 100 * row.error} for row in rows], [
        ("hosts", 6, lambda row: f"{row['hosts']}x{row['world_size'] // row['hosts']}"), ("size [B]", 10, "{nbytes}"),
        ("algorithm", 17, "{algorithm}"), ("predicted [us]", 15, "{predicted_us:.1f}"),
        ("measured [us]", 14, "{measured_us:.1f}"), ("error", 8, "{error_percent:+.1f}%")])


def format_summary(summary: Summary) -> str:
    worst = summary.worst_row
    where = (f" ({worst.hosts}x{worst.world_size // worst.hosts} {worst.algorithm} {worst.nbytes} B)"
             if worst else "")
    large = ("-" if summary.worst_abs_error_large is None else f"{100 * summary.worst_abs_error_large:.1f}%")
    return (f"# median |error| {100 * summary.median_abs_error:.1f}% over {summary.rows} rows (goal <= "
            f"{100 * MEDIAN_GOAL:.0f}%); worst |error| {large} over {summary.large_rows} rows >= "
            f"{LARGE_BYTES // 1024} KiB{where} (goal <= {100 * WORST_GOAL:.0f}%): "
            f"{'goal met' if summary.meets_goal else 'goal MISSED'}")


@dataclass(frozen=True)
class Pick:
    """At one point (hosts, world size, bytes): the candidate the model predicts fastest and the one
    measured fastest; ``slowdown`` = the measured time of the first over the second's (1.0: the same)."""

    hosts: int
    world_size: int
    nbytes: int
    predicted: str
    measured: str
    slowdown: float

    @property
    def right(self) -> bool:
        """The pick is the fastest, or within ``PICK_TOLERANCE`` of it (the sweep's noise)."""
        return self.slowdown <= 1 + PICK_TOLERANCE


PICK_TOLERANCE = 0.10


def auto_picks(rows: list[ValidationRow]) -> list[Pick]:
    """For every point of ``rows``: :class:`Pick` among ``auto``'s candidates there (``auto.FLAT``, plus
    shm on one host, hierarchical across hosts) that have a row; points with fewer than two skipped.
    The prediction is the event simulation's on the profile calibrated in the run (``auto`` itself
    uses the formulas, within 5% of it, on the shipped profile)."""
    from gradsync.collectives.auto import FLAT

    points: dict[tuple[int, int, int], dict[str, ValidationRow]] = {}
    for row in rows:
        candidates = FLAT + (("shm",) if row.hosts == 1 else ("hierarchical",))
        if row.algorithm in candidates:
            points.setdefault((row.hosts, row.world_size, row.nbytes), {})[row.algorithm] = row
    picks = []
    for (hosts, world_size, nbytes), by_name in sorted(points.items()):
        if len(by_name) < 2:
            continue
        predicted = min(by_name, key=lambda name: by_name[name].predicted_us)
        measured = min(by_name, key=lambda name: by_name[name].measured_us)
        picks.append(Pick(hosts, world_size, nbytes, predicted, measured,
                          by_name[predicted].measured_us / by_name[measured].measured_us))
    return picks


def format_picks(picks: list[Pick]) -> str:
    lines = [f"{'hosts':>6} {'size [B]':>10} {'auto (model)':>17} {'measured fastest':>17} {'slowdown':>9}"]
    for pick in picks:
        layout = f"{pick.hosts}x{pick.world_size // pick.hosts}"
        lines.append(f"{layout:>6} {pick.nbytes:>10} {pick.predicted:>17} {pick.measured:>17} "
                     f"{pick.slowdown:>8.2f}x")
    right = sum(pick.right for pick in picks)
    worst = max((pick.slowdown for pick in picks), default=1.0)
    lines.append(f"# auto's model picks the fastest (within {100 * PICK_TOLERANCE:.0f}%) at {right} of "
                 f"{len(picks)} points; worst pick {worst:.2f}x the fastest")
    return "\n".join(lines)


def predict(rows: list[dict], profile: Profile) -> list[ValidationRow]:
    """A :class:`ValidationRow` per bench row (``gradsync.bench.allreduce.Row`` dicts) of a simulated
    algorithm, predicted on ``profile`` with the row's topology (hosts x ranks per host)."""
    from gradsync.sim import SIMULATED, Topology, simulate_all_reduce

    out = []
    for row in rows:
        if row["algorithm"] not in SIMULATED:
            continue
        hosts = row.get("hosts", 1)
        topology = (Topology.uniform(hosts, row["world_size"] // hosts) if hosts > 1
                    else Topology((row["world_size"],)))
        result = simulate_all_reduce(row["algorithm"], row["nbytes"], profile, topology)
        out.append(ValidationRow(row["algorithm"], row["nbytes"], row["world_size"], hosts,
                                 result.time_s * 1e6, row["time_us"]))
    return out


def measure_one_host(world_size: int, sizes: list[int], repetitions: int) -> list[dict]:
    """The bench sweep on ``world_size`` local processes (hierarchical by real host: one node)."""
    from gradsync.bench.allreduce import run_worker
    from gradsync.launch import launch_local

    return launch_local(world_size, run_worker, sizes, list(ALGORITHMS), repetitions, None, None)[0]


def measure_hosts(sizes: list[int], repetitions: int, inter_host_gbit: float) -> list[dict]:
    """The bench sweep on 2 x 2 test hosts (``gradsync bench allreduce --hosts 2 --nproc 2``)."""
    from gradsync.bench.across_hosts import run_bench_on_hosts
    from gradsync.bench.allreduce import _worker_argv

    names = [name for name in ALGORITHMS if name != "shm"] + ["native"]
    argv = _worker_argv(",".join(map(str, sizes)), names, repetitions, None, inter_host_gbit)
    return run_bench_on_hosts(HOSTS, RANKS_PER_HOST, argv, inter_host_gbit=inter_host_gbit, join_timeout_s=60.0,
                              json_path=None)


def load_text() -> str:
    """This machine's load averages (1, 5, 15 min): other processes' share of the cores."""
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg())


def hosts_problem() -> str | None:
    from gradsync.hosts.netns import unavailable_reason

    return unavailable_reason()


def run(args: argparse.Namespace) -> int:
    """Calibrate, measure, predict, print; write ``--json`` rows. Returns 0 (the goal is reported, not enforced)."""
    sizes = [parse_nbytes(text) for text in getattr(args, "validate_sizes", DEFAULT_SIZES).split(",")]
    repetitions = getattr(args, "repetitions", 5)
    gbit = getattr(args, "inter_host_gbit", None) or 1.0
    if repetitions < 1:
        raise ValueError(f"--repetitions must be >= 1, got {repetitions}")
    skip_hosts = getattr(args, "no_hosts", False)
    problem = None if skip_hosts else hosts_problem()
    print(f"# gradsync simulate --validate: calibrating (quick micro-benchmarks; {load_text()})", flush=True)
    local = calibrate(hosts=None, nproc=2, inter_host_gbit=None, settings=FULL, out=None)
    print(describe(local), flush=True)
    remote = None
    if not skip_hosts and problem is None:
        remote = calibrate(hosts=HOSTS, nproc=RANKS_PER_HOST, inter_host_gbit=gbit, settings=FULL, out=None)
        print(describe(remote), flush=True)
    rows: list[ValidationRow] = []
    for world_size in ONE_HOST_WORLD_SIZES:
        print(f"# measuring 1 host x {world_size} ranks ({load_text()})", flush=True)
        rows += predict(measure_one_host(world_size, sizes, repetitions), local)
    if remote is not None:
        print(f"# measuring {HOSTS} test hosts x {RANKS_PER_HOST} ranks, {gbit:g} Gbit/s ({load_text()})", flush=True)
        rows += predict(measure_hosts(sizes, repetitions, gbit), remote)
    elif not skip_hosts:
        print(f"# no test hosts here ({problem}): only one-host rows", flush=True)
    print(f"# done ({load_text()})")
    print(format_rows(rows))
    print(format_summary(summarize(rows)))
    print(format_picks(auto_picks(rows)))
    if getattr(args, "json", None):
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump([row.as_dict() for row in rows], file, indent=2)
            file.write("\n")
    return 0
