"""``gradsync simulate --profile P --gpus ... --sizes ... --algorithms ...``: the at-scale table.

Which of ring, double_binary_tree, hierarchical and NCCL's own choice wins
from 8 to 4096 GPUs and 4 KiB to 1 GiB (the default algorithms); tree and
halving_doubling on request. ``nccl`` is not gradsync code: it is the
algorithm × protocol NCCL's tuning model would pick for that call and the
time that model predicts
(:func:`gradsync.collectives.cost.nccl_tuning.nccl_choice`, for a profile
that carries NCCL's constants; column ``detail`` names the pick).

For every GPU count, algorithm and message size, one AllReduce is predicted on
``Topology.uniform(gpus / R, R)`` (R = the profile's ``ranks_per_host``, 8 on
the GPU profiles; fewer GPUs than R: one host of that many): by the event
simulation (:func:`~gradsync.sim.engine.simulate_all_reduce`, the real
algorithm code) where it fits the budget, else by the closed form
(:func:`~gradsync.collectives.cost.formulas.predict_s`). Column ``method`` says which.

The budget: the event simulation runs ring up to ``EVENT_MAX_RANKS["ring"]``
(512) ranks and the others up to 4096 (issue 19, item 1), and only where its
estimated wall time (messages x ``SECONDS_PER_MESSAGE``, measured on this
2-core machine: 24-33 us per message for tree and ring at 512-4096 ranks) is
at most ``--event-budget-s`` (60 s); the cheapest size of every GPU count and
algorithm always runs, the other points are then taken cheapest first while
their estimated sum stays within ``--event-total-s`` (120 s), so the
default command ends in about 5 minutes even when other jobs share the two
cores (measured wall times run up to 2.5x the estimate then). Every event run's measured wall
time is printed (column ``wall_s``).

busbw = algbw x 2(p-1)/p, algbw = bytes / time (nccl-tests' definitions,
10^9 bytes per GB).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass

from gradsync.bench.allreduce import parse_nbytes
from gradsync.bench.output import claim_json_path, write_json
from gradsync.bench.scale_report import crossover_lines, format_fastest, format_size, plot
from gradsync.collectives.chunking import DEFAULT_SEGMENT_BYTES
from gradsync.sim import Profile, Topology, get_profile, predict_s, simulate_all_reduce

SCALE_ALGORITHMS = ("ring", "tree", "double_binary_tree", "halving_doubling", "hierarchical", "nccl")
DEFAULT_ALGORITHMS = "ring,double_binary_tree,hierarchical,nccl"
NCCL = "nccl"  # NCCL's choice by its own tuning model: never the event simulation
EVENT_MAX_RANKS = {"ring": 512, "tree": 4096, "double_binary_tree": 4096, "halving_doubling": 4096,
                   "hierarchical": 4096, NCCL: 0}
SECONDS_PER_MESSAGE = 35e-6  # event-simulation wall time per message, measured here (see report)
SECONDS_PER_RANK = 2e-4      # greenlet, transport and call set-up per rank
DEFAULT_EVENT_BUDGET_S = 60.0   # estimated wall seconds of one event run, at most
DEFAULT_TOTAL_BUDGET_S = 120.0  # estimated wall seconds of all event runs of one command
RANGE_FACTOR = 4


@dataclass
class ScaleRow:
    """One predicted AllReduce: ``time_us`` (microseconds), bandwidths in GB/s (10^9 B/s)."""

    gpus: int
    algorithm: str
    nbytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    method: str          # "event", "formula" or "nccl model"
    wall_s: float        # wall seconds the event simulation took (0 for the formula)
    detail: str = ""     # nccl: NCCL's pick, algorithm/protocol x channels


def parse_sizes(text: str) -> list[int]:
    """``"4K-1G"``: 4 KiB, 16 KiB, ... (x4) up to 1 GiB (the last size is always included);
    ``"4K,1M"``: a list. Suffixes K, M, G are powers of 1024 (:func:`gradsync.bench.allreduce.parse_nbytes`).

    >>> parse_sizes("4K-64K"), parse_sizes("1K,2M")
    ([4096, 16384, 65536], [1024, 2097152])

    Raises:
        ValueError: a bad size, a size not a multiple of 4 (float32), a range whose end is below its start.
    """
    text = text.strip()
    if "-" in text and "," not in text:
        first, _, last = text.partition("-")
        low, high = parse_nbytes(first), parse_nbytes(last)
        if low < 1 or high < low:
            raise ValueError(f"--sizes {text!r}: a range needs 1 <= first <= last")
        sizes = [low * RANGE_FACTOR ** i for i in range(int(math.log(high / low, RANGE_FACTOR) + 1e-9) + 1)]
        sizes = sizes + ([high] if sizes[-1] != high else [])
    else:
        sizes = [parse_nbytes(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ValueError("--sizes: no size given")
    bad = [size for size in sizes if size < 4 or size % 4]
    if bad:
        raise ValueError(f"--sizes: {bad[0]} bytes is not a positive multiple of 4 (float32 elements)")
    return sizes


def parse_gpus(text: str, profile: Profile) -> list[int]:
    """Comma-separated GPU counts: each >= 2 and, above ``ranks_per_host``, a multiple of it.

    Raises:
        ValueError: a bad count.
    """
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--gpus {text!r}: give comma-separated integers, e.g. 8,64,512") from None
    per_host = profile.ranks_per_host
    for count in counts:
        if count < 2 or (count > per_host and count % per_host):
            raise ValueError(f"--gpus: {count} is not >= 2 and, above one host, a multiple of {per_host} GPUs "
                             f"per host (profile {profile.name}; up to {per_host} GPUs run on one host)")
    if not counts:
        raise ValueError("--gpus: no GPU count given")
    return counts


def parse_algorithms(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCALE_ALGORITHMS]
    if unknown or not names:
        raise ValueError(f"--algorithms: {unknown[0] if unknown else text!r} is not one of "
                         f"{', '.join(SCALE_ALGORITHMS)}")
    return names


def topology_for(gpus: int, profile: Profile) -> Topology:
    """``gpus`` ranks on hosts of the profile's ``ranks_per_host`` (one smaller host below that)."""
    per_host = profile.ranks_per_host
    return Topology((gpus,)) if gpus <= per_host else Topology.uniform(gpus // per_host, per_host)


def estimated_messages(algorithm: str, topology: Topology, nbytes: int,
                       segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> float:
    """How many messages the event simulation of this call prices (an upper estimate, all ranks)."""
    p, per_host = topology.world_size, max(topology.host_sizes)
    if algorithm == "ring":
        return 2.0 * p * (p - 1) * max(1, math.ceil(nbytes / p / segment_bytes))
    if algorithm == "tree":
        return 2.0 * (p - 1) * max(1, math.ceil(nbytes / segment_bytes))
    if algorithm == "double_binary_tree":  # two trees of p - 1 edges, half the bytes each, up and down
        return 4.0 * (p - 1) * max(1, math.ceil(nbytes / 2 / segment_bytes))
    if algorithm == NCCL:
        return 0.0
    if algorithm == "halving_doubling":
        return 2.0 * p * (math.log2(p) + 1)
    inside = 2.0 * p * (per_host - 1) * max(1, math.ceil(nbytes / per_host / segment_bytes))
    return inside + 2.0 * p * (math.log2(max(2, topology.hosts)) + 1)


def estimated_wall_s(algorithm: str, topology: Topology, nbytes: int) -> float:
    return (estimated_messages(algorithm, topology, nbytes) * SECONDS_PER_MESSAGE
            + topology.world_size * SECONDS_PER_RANK)


def use_event(algorithm: str, topology: Topology, nbytes: int, budget_s: float) -> bool:
    """Whether the event simulation may run this point (rank limit and estimated wall time)."""
    return (topology.world_size <= EVENT_MAX_RANKS[algorithm]
            and estimated_wall_s(algorithm, topology, nbytes) <= budget_s)


def plan_events(points: list[tuple[int, str, int]], profile: Profile, budget_s: float = DEFAULT_EVENT_BUDGET_S,
                total_s: float = DEFAULT_TOTAL_BUDGET_S) -> set[tuple[int, str, int]]:
    """The (gpus, algorithm, nbytes) points the event simulation runs: each within the rank limit and
    ``budget_s`` (estimated); the cheapest size of every (gpus, algorithm) always (so every algorithm
    and GPU count the event simulation can run is checked once), then the others cheapest first
    while the estimated sum stays within ``total_s``."""
    costs = sorted((estimated_wall_s(a, topology_for(g, profile), n), (g, a, n)) for g, a, n in points
                   if use_event(a, topology_for(g, profile), n, budget_s))
    chosen, spent, pairs = set(), 0.0, set()
    for cost, point in costs:
        if point[:2] not in pairs:
            pairs.add(point[:2])
            chosen.add(point)
            spent += cost
    for cost, point in costs:
        if point in chosen:
            continue
        if spent + cost > total_s:
            break
        chosen.add(point)
        spent += cost
    return chosen


def formula_reason(row: ScaleRow, profile: Profile, budget_s: float) -> str:
    """Why a row used the closed form: the rank limit, the per-point budget or the total budget."""
    if row.algorithm == NCCL:
        return "NCCL's own tuning model (not gradsync code)"
    if row.gpus > EVENT_MAX_RANKS[row.algorithm]:
        return f"beyond the event simulation's {EVENT_MAX_RANKS[row.algorithm]}-rank limit for {row.algorithm}"
    estimate = estimated_wall_s(row.algorithm, topology_for(row.gpus, profile), row.nbytes)
    if estimate > budget_s:
        return f"event run estimated at {estimate:.0f} s > {budget_s:g} s"
    return f"event run estimated at {estimate:.0f} s, beyond the total budget"


def make_row(gpus: int, algorithm: str, nbytes: int, time_s: float, method: str, wall_s: float,
             detail: str = "") -> ScaleRow:
    """A row whose bandwidths are computed from ``time_s`` (nccl-tests' algbw and busbw)."""
    algbw = nbytes / time_s / 1e9
    busbw = algbw * 2 * (gpus - 1) / gpus
    return ScaleRow(gpus, algorithm, nbytes, time_s * 1e6, algbw, busbw, method, wall_s, detail)


def nccl_choice(profile: Profile, topology: Topology, nbytes: int):
    """NCCL's pick for one AllReduce (:func:`gradsync.collectives.cost.nccl_tuning.nccl_choice`).

    Raises:
        ValueError: the profile carries no NCCL constants.
    """
    from gradsync.collectives.cost.nccl_tuning import nccl_choice as choose
    return choose(profile, topology, nbytes)


def nccl_row(gpus: int, nbytes: int, profile: Profile) -> ScaleRow:
    """NCCL's choice as a row: its predicted time (NCCL's model plus the pipeline fill it leaves out,
    ``run_time_s``), ``detail`` = algorithm/protocol x channels."""
    choice = nccl_choice(profile, topology_for(gpus, profile), nbytes)
    return make_row(gpus, NCCL, nbytes, choice.run_time_s, "nccl model", 0.0,
                    f"{choice.algorithm}/{choice.protocol} x{choice.channels}")


def usable_algorithms(algorithms: list[str], profile: Profile, given: bool) -> tuple[list[str], list[str]]:
    """(the algorithms to sweep, notes): ``nccl`` left out with a note for a profile without NCCL's
    constants when it came from the default list.

    Raises:
        ValueError: ``nccl`` asked for (``given``) on a profile without NCCL's constants.
    """
    if NCCL not in algorithms:
        return algorithms, []
    try:
        nccl_choice(profile, topology_for(2, profile), 4096)
    except ValueError as error:
        if given:
            raise ValueError(f"--algorithms nccl: {error}") from None
        return [name for name in algorithms if name != NCCL], [f"# nccl left out: {error}"]
    return algorithms, []


def predict_row(algorithm: str, gpus: int, nbytes: int, profile: Profile, event: bool) -> ScaleRow:
    """One table row: the event simulation (``event``), else the formula."""
    if algorithm == NCCL:
        return nccl_row(gpus, nbytes, profile)
    topology = topology_for(gpus, profile)
    if event:
        started = time.perf_counter()
        time_s = simulate_all_reduce(algorithm, nbytes, profile, topology).time_s
        return make_row(gpus, algorithm, nbytes, time_s, "event", time.perf_counter() - started)
    return make_row(gpus, algorithm, nbytes, predict_s(algorithm, profile, topology, nbytes), "formula", 0.0)


def sweep(profile: Profile, gpus: list[int], sizes: list[int], algorithms: list[str],
          budget_s: float = DEFAULT_EVENT_BUDGET_S, total_s: float = DEFAULT_TOTAL_BUDGET_S,
          progress=None) -> list[ScaleRow]:
    """Every (GPU count, algorithm, size) row, in that order (:func:`plan_events` picks the method);
    ``progress(row)`` after each."""
    points = [(count, algorithm, nbytes) for count in gpus for algorithm in algorithms for nbytes in sizes]
    events = plan_events(points, profile, budget_s, total_s)
    rows = []
    for point in points:
        count, algorithm, nbytes = point
        rows.append(predict_row(algorithm, count, nbytes, profile, point in events))
        if progress is not None:
            progress(rows[-1])
    return rows


HEADER = (f"{'gpus':>5} {'algorithm':<18} {'size':>6} {'time_us':>12} {'algbw':>8} {'busbw':>8} {'method':<10} "
          f"{'wall_s':>6} detail")


def format_row(row: ScaleRow) -> str:
    return (f"{row.gpus:>5} {row.algorithm:<18} {format_size(row.nbytes):>6} {row.time_us:>12.1f} "
            f"{row.algbw_gbps:>8.2f} {row.busbw_gbps:>8.2f} {row.method:<10} {row.wall_s:>6.2f} {row.detail}")


def run(args: argparse.Namespace) -> int:
    """The ``gradsync simulate`` (at-scale) entry point: print the table and the crossovers."""
    profile = get_profile(args.profile)
    gpus, sizes = parse_gpus(args.gpus, profile), parse_sizes(args.sizes)
    given = args.algorithms is not None and args.algorithms != DEFAULT_ALGORITHMS
    algorithms, notes = usable_algorithms(parse_algorithms(args.algorithms or DEFAULT_ALGORITHMS), profile, given)
    budget = getattr(args, "event_budget_s", DEFAULT_EVENT_BUDGET_S)
    total = getattr(args, "event_total_s", DEFAULT_TOTAL_BUDGET_S)
    claim_json_path(args.json)
    if args.plot:
        claim_json_path(args.plot, "--plot")
    print(f"# profile {profile.name}: {profile.description}")
    print(f"# {profile.ranks_per_host} GPUs per host; event simulation up to {EVENT_MAX_RANKS['ring']} ranks "
          f"(ring) / 4096 (others), an estimated {budget:g} s per point and {total:g} s in all (cheapest "
          f"points first), else the closed form; nccl: NCCL's own tuning model's pick and time")
    for note in notes:
        print(note)
    print(HEADER)
    started = time.perf_counter()
    rows = sweep(profile, gpus, sizes, algorithms, budget, total, progress=lambda row: print(format_row(row), flush=True))
    events = [row for row in rows if row.method == "event"]
    print(f"# {len(events)} event runs ({sum(r.wall_s for r in events):.1f} s, slowest "
          f"{max((r.wall_s for r in events), default=0):.1f} s), {len(rows) - len(events)} formula rows; "
          f"total {time.perf_counter() - started:.1f} s")
    for row in rows:
        if row.method != "event" and row.algorithm != NCCL:
            print(f"# formula: {row.gpus} {row.algorithm} {format_size(row.nbytes)}: "
                  f"{formula_reason(row, profile, budget)}")
    print(format_fastest(rows))
    for line in crossover_lines(rows, profile):
        print(line)
    if args.json:
        write_json(args.json, [asdict(row) for row in rows])
    if args.plot:
        print(f"# plot: {plot(rows, args.plot, profile.name)}")
    return 0
