"""``gradsync explain ALG``: how an AllReduce moves the data, read off a run of the real code.

The algorithm runs on simulated ranks with a trace
(:func:`~gradsync.sim.engine.simulate_all_reduce`); every transfer the real
code posted and every addition it made is an event. Transfers that start at
the same instant form a step (for the ring: one hop of every rank at once).
Each step lists who sends which elements to whom (and which chunk and
segment they are), and the step's share of the predicted time split into
its α (latency), β (bytes on the link), γ (additions) and waiting; the
shares add up to the predicted time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gradsync.bench.allreduce import parse_nbytes
from gradsync.collectives.chunking import DEFAULT_SEGMENT_BYTES, chunk_bounds
from gradsync.collectives.cost.formulas import call_overhead_s
from gradsync.collectives.double_binary_tree import links
from gradsync.sim import SimResult, Topology, get_profile, simulate_all_reduce
from gradsync.sim.cluster import TraceEvent

_SHOWN_PER_STEP = 8  # transfers listed per step (the rest counted)
_MAX_STEPS = 64


@dataclass
class Step:
    """Transfers starting at ``start_s``, the additions that follow them, and the step's time terms."""

    start_s: float
    sends: list[TraceEvent] = field(default_factory=list)
    adds: list[TraceEvent] = field(default_factory=list)
    terms: dict = field(default_factory=dict)


def steps_of(result: SimResult, call_overhead_s: float) -> list[Step]:
    """Group the trace into steps (step k: every rank's k-th send) and split the time among them: a step
    lasts from its first transfer's start to the next step's, the last one to the end; the time before
    the first transfer is the call's."""
    by_rank: dict[int, list[TraceEvent]] = {}
    for event in sorted((e for e in result.trace if e.kind == "send"), key=lambda e: (e.start_s, e.src)):
        by_rank.setdefault(event.src, []).append(event)
    steps: list[Step] = []
    for events in by_rank.values():
        for index, event in enumerate(events):
            while len(steps) <= index:
                steps.append(Step(float("inf")))
            steps[index].sends.append(event)
            steps[index].start_s = min(steps[index].start_s, event.start_s)
    for step in steps:
        step.sends.sort(key=lambda e: e.src)
    for index in range(1, len(steps)):  # a step starts no earlier than the one before it
        steps[index].start_s = max(steps[index].start_s, steps[index - 1].start_s)
    for event in (e for e in result.trace if e.kind != "send"):
        index = max((i for i, step in enumerate(steps) if step.start_s <= event.start_s + 1e-12), default=0)
        if steps:
            steps[index].adds.append(event)
    ends = [step.start_s for step in steps[1:]] + [result.time_s]
    for step, end in zip(steps, ends):
        span = end - step.start_s
        first = step.sends[0].terms
        alpha = min(first["alpha"], span)
        beta = min(first["beta"], span - alpha)
        gamma = min(max((a.end_s - a.start_s for a in step.adds), default=0.0), span - alpha - beta)
        step.terms = {"alpha": alpha, "beta": beta, "gamma": gamma, "wait": span - alpha - beta - gamma}
    if steps:
        steps[0].terms["call"] = steps[0].start_s
    return steps


def _where(event: TraceEvent, algorithm: str, chunks: list[tuple[int, int]], segment_numel: int) -> str:
    if event.root != 0:
        return "a scratch buffer"
    a, b = event.offset, event.offset + event.numel
    if algorithm == "tree":
        return f"elements [{a}, {b}) = segment {a // segment_numel}"
    if algorithm == "double_binary_tree":
        halves = chunk_bounds(sum(stop - start for start, stop in chunks), 2)
        tree = 0 if a < halves[0][1] else 1
        return f"elements [{a}, {b}) = tree {tree + 1} segment {(a - halves[tree][0]) // segment_numel}"
    chunk = next((index for index, (start, stop) in enumerate(chunks) if start <= a < stop), None)
    if algorithm != "ring" or chunk is None:
        return f"elements [{a}, {b})"
    segment = (a - chunks[chunk][0]) // segment_numel
    return f"elements [{a}, {b}) = chunk {chunk} segment {segment}"


def render(algorithm: str, nproc: int, nbytes: int, profile_name: str, hosts: int = 1,
           segment_bytes: int | None = None) -> str:
    """The explanation as text (see the module docstring).

    Raises:
        ValueError: a bad algorithm, size, profile, or ranks that do not split over the hosts.
    """
    if hosts < 1:
        raise ValueError(f"--hosts must be >= 1, got {hosts}")
    if nproc < 1 or nproc % hosts:
        raise ValueError(f"--nproc {nproc} must be >= 1 and a multiple of --hosts {hosts}")
    if nbytes < 4 or nbytes % 4:
        raise ValueError(f"--size {nbytes}: give a positive multiple of 4 bytes (float32 elements)")
    profile = get_profile(profile_name)
    topology = Topology.uniform(hosts, nproc // hosts)
    result = simulate_all_reduce(algorithm, nbytes, profile, topology, segment_bytes=segment_bytes, trace=True)
    numel = nbytes // 4
    segment_numel = max(1, (segment_bytes or DEFAULT_SEGMENT_BYTES) // 4)
    chunks = chunk_bounds(numel, nproc)
    if algorithm == "ring":
        segment_numel = min(segment_numel, max(chunks[0][1] - chunks[0][0], 1))
    lines = [f"{algorithm} AllReduce of {nbytes} bytes ({numel} float32) over {nproc} ranks "
             f"({topology.describe()}), profile {profile.name}"]
    if algorithm == "ring":
        lines.append(f"chunks (rank r owns chunk r): {', '.join(f'[{a}, {b})' for a, b in chunks[:8])}"
                     f"{' ...' if nproc > 8 else ''}; segments of {segment_numel} elements")
    elif algorithm == "tree":
        lines.append(f"rank i's children: 2i+1 and 2i+2; segments of {segment_numel} elements flow up to rank 0, "
                     f"then down")
    elif algorithm == "double_binary_tree":
        lines.append(f"tree 1 reduces elements [0, {chunk_bounds(numel, 2)[0][1]}) to its root, tree 2 the rest, "
                     f"both at once in segments of {segment_numel} elements, then back down; (parent, children) "
                     "of each rank: " + ", ".join(f"{rank}: {links(rank, nproc, 0)} / {links(rank, nproc, 1)}"
                                                  for rank in range(min(nproc, 8))) + (" ..." if nproc > 8 else ""))
    elif algorithm in ("shm", "hierarchical") and profile.shm is not None:
        lines.append("shared-memory steps are priced by a formula (per cell: stage the peers' chunks, barrier, "
                     "each rank reduces its own chunk, barrier, copy out; one round for a small message), not by "
                     "messages: see gradsync.sim.transport.VirtualSharedMemory")
    slow = profile.oversubscription(nproc // hosts)
    if slow > 1:
        lines.append(f"{nproc // hosts} ranks share {profile.cores_per_host} cores per host: adds, copies and "
                     f"{'the link' if profile.intra.cpu_bound else 'nothing on the link'} run {slow:g}x slower "
                     f"(alpha below is the link's times {slow:g})")
    lines.append("'waiting': time a step's ranks wait for transfers queued behind others on a port, or for peers")
    lines.append("")
    overhead_s = call_overhead_s(profile, algorithm, topology, nbytes)
    steps = steps_of(result, overhead_s)
    for number, step in enumerate(steps[:_MAX_STEPS]):
        terms = step.terms
        lines.append(f"step {number}: at {step.start_s * 1e6:.1f} us, {len(step.sends)} transfers "
                     f"(alpha {terms['alpha'] * 1e6:.1f} + beta {terms['beta'] * 1e6:.1f} + gamma "
                     f"{terms['gamma'] * 1e6:.1f} + waiting {terms['wait'] * 1e6:.1f} us)")
        for event in step.sends[:_SHOWN_PER_STEP]:
            lines.append(f"  rank {event.src} -> rank {event.dst}: {_where(event, algorithm, chunks, segment_numel)}, "
                         f"{event.nbytes} B")
        if len(step.sends) > _SHOWN_PER_STEP:
            lines.append(f"  ... and {len(step.sends) - _SHOWN_PER_STEP} more")
        added = [a for a in step.adds if a.kind == "reduce"]
        if added:
            ranks = sorted({a.src for a in added})
            lines.append(f"  then ranks {', '.join(map(str, ranks[:_SHOWN_PER_STEP]))}"
                         f"{' ...' if len(ranks) > _SHOWN_PER_STEP else ''} add what they received "
                         f"({added[0].nbytes} B each)")
    if len(steps) > _MAX_STEPS:
        lines.append(f"... and {len(steps) - _MAX_STEPS} more steps")
    total = {key: sum(step.terms.get(key, 0.0) for step in steps) for key in ("call", "alpha", "beta", "gamma", "wait")}
    if not steps:  # shared memory only: no message to show
        total["call"] = overhead_s
        total["wait"] = result.time_s - overhead_s
        lines.append("no messages: the shared-memory formula's copies, adds and barriers are the waiting below")
    lines += ["", f"predicted time {result.time_s * 1e6:.1f} us = call overhead {total['call'] * 1e6:.1f} + alpha "
              f"{total['alpha'] * 1e6:.1f} + beta {total['beta'] * 1e6:.1f} + gamma {total['gamma'] * 1e6:.1f} + "
              f"waiting {total['wait'] * 1e6:.1f} us; busbw {result.busbw_gbps:.2f} GB/s",
              f"link: alpha {profile.intra.alpha_s * 1e6:.2f} us per message, "
              f"{profile.intra.bandwidth_bytes_per_s / 1e9:.2f} GB/s per port inside a host"
              + (f"; {profile.inter.bandwidth_bytes_per_s / 1e9:.3f} GB/s between hosts" if profile.inter else "")]
    return "\n".join(lines)


def run(args) -> int:
    try:
        nbytes = parse_nbytes(args.size)
    except ValueError:
        raise ValueError(f"--size {args.size!r}: use a number of bytes with an optional K, M or G suffix") from None
    print(render(args.algorithm, args.nproc, nbytes, args.profile or "this-machine", args.hosts, args.segment_bytes))
    return 0
