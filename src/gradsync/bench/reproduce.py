"""``gradsync simulate --reproduce``: predicted against published nccl-tests all_reduce busbw.

What is compared with what. NCCL picks, per size, an algorithm (ring,
tree, NVLS, NVLSTree, ...) and a protocol (LL, LL128, Simple), and runs
several channels (parallel rings or trees). The prediction here is the
fastest of these candidates, each priced by gradsync's own simulator on the
curve's profile (:mod:`gradsync.collectives.cost.profiles`, numbers from datasheets and
NCCL's tuning model, none from the curves):

* ``ring/<proto>``: gradsync's ring (the real code, event simulation) as one
  of C channels: C = the host's NICs (8) across hosts, 1 inside a host;
  one channel carries n/C bytes over 1/C of the NVLink bandwidth and its own
  NIC, and the C channels run side by side, so its time is the call's.
* ``tree/<proto>``: gradsync's binary tree over all ranks (NCCL's tree is a
  chain inside a host and a double binary tree across hosts; gradsync's is
  one heap-ordered tree, so this is an approximation).
* ``hierarchical/<proto>`` (across hosts only): inside-across-inside, the
  counterpart of NCCL's two-level schemes.
* ``nvls`` (where the curve had NVLS on, one host): in-switch reduction, a
  formula: NCCL's NVLS latency (25 us) + n 2(p-1)/p / the profile's
  ``in_switch_reduction_bytes_per_s``. gradsync has no such algorithm.

Protocols change the profile's latencies and bandwidth to NCCL's own
constants (tuning.cc: hwLatencies per link, algorithm and protocol;
baseLatencies per call; LL moves half the bandwidth, capped at llMaxBw
141 GB/s on one Hopper node; LL128 0.92 of it). Taking the fastest
candidate assumes NCCL's choice is right; the winning candidate is printed.
NVLSTree (NVLS inside the hosts, a tree across) is not modelled.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from dataclasses import dataclass

from gradsync.bench.output import claim_json_path, write_json
from gradsync.bench.published import CURVES, LATENCY_BOUND_BYTES, PublishedCurve
from gradsync.bench.scale import estimated_wall_s
from gradsync.bench.scale_report import format_size
from gradsync.sim import Profile, Topology, get_profile, predict_s, simulate_all_reduce

# (intra-host step latency, inter-host step latency, per-call base latency), seconds: NCCL tuning.cc
# hwLatencies[NVLINK|NET][algorithm][protocol] and baseLatencies[algorithm][protocol].
NCCL_LATENCIES = {
    ("ring", "LL"): (0.6e-6, 2.7e-6, 6.6e-6), ("ring", "LL128"): (1.9e-6, 4.0e-6, 14.0e-6),
    ("ring", "Simple"): (3.4e-6, 14.0e-6, 8.4e-6),
    ("tree", "LL"): (0.6e-6, 5.0e-6, 6.8e-6), ("tree", "LL128"): (1.25e-6, 8.5e-6, 14.0e-6),
    ("tree", "Simple"): (4.0e-6, 14.0e-6, 8.4e-6),
}
PROTOCOL_BANDWIDTH = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}
LL_MAX_BUSBW = 141e9          # tuning.cc llMaxBws, Hopper, one node
NVLS_LATENCY_S = 25e-6        # tuning.cc hwLatencies[NVLINK][NVLS][Simple]; baseLatencies[NVLS] = 0
EVENT_WALL_LIMIT_S = 2.0      # per candidate run; beyond it the closed form


@dataclass
class ReproduceRow:
    source: str
    system: str
    nbytes: int
    published_busbw_gbps: float
    predicted_busbw_gbps: float
    error_pct: float            # (predicted - published) / published x 100
    candidate: str              # the fastest candidate, e.g. "ring/Simple", "nvls"
    method: str                 # "event", "formula" (the closed form), "nvls-formula"


def protocol_profile(profile: Profile, family: str, protocol: str, channels: int = 1,
                     hosts: int = 1) -> Profile:
    """``profile`` with NCCL's latencies and bandwidth of ``protocol`` for ``family`` ("ring", "tree"),
    and the intra-host bandwidth shared by ``channels`` channels."""
    intra_alpha, inter_alpha, base = NCCL_LATENCIES[(family, protocol)]
    factor = PROTOCOL_BANDWIDTH[protocol]
    intra_bw = profile.intra.bandwidth_bytes_per_s * factor
    if protocol == "LL" and hosts == 1:
        intra_bw = min(intra_bw, LL_MAX_BUSBW)
    intra = dataclasses.replace(profile.intra, alpha_s=intra_alpha, bandwidth_bytes_per_s=intra_bw / channels)
    inter = None
    if profile.inter is not None:
        inter = dataclasses.replace(profile.inter, alpha_s=inter_alpha,
                                    bandwidth_bytes_per_s=profile.inter.bandwidth_bytes_per_s * factor)
    return dataclasses.replace(profile, intra=intra, inter=inter, call_overhead_s=base)


def _price(algorithm: str, nbytes: int, profile: Profile, topology: Topology) -> tuple[float, str]:
    if estimated_wall_s(algorithm, topology, nbytes) <= EVENT_WALL_LIMIT_S:
        return simulate_all_reduce(algorithm, nbytes, profile, topology).time_s, "event"
    return predict_s(algorithm, profile, topology, nbytes), "formula"


def nvls_time_s(profile: Profile, ranks: int, nbytes: int) -> float:
    """In-switch reduction on one host: NCCL's NVLS latency plus busbw-limited transfer (seconds).

    Raises:
        ValueError: the profile has no in-switch reduction.
    """
    if profile.in_switch_reduction_bytes_per_s is None:
        raise ValueError(f"profile {profile.name!r} has no in-switch reduction (in_switch_reduction_bytes_per_s)")
    return NVLS_LATENCY_S + nbytes * 2 * (ranks - 1) / ranks / profile.in_switch_reduction_bytes_per_s


def candidates(curve: PublishedCurve, profile: Profile, nbytes: int) -> list[tuple[float, str, str]]:
    """(seconds, candidate, method) of every candidate for one size of ``curve``."""
    topology = Topology.uniform(curve.hosts, curve.ranks_per_host)
    channels = profile.nics_per_host if curve.hosts > 1 else 1
    result = []
    for protocol in PROTOCOL_BANDWIDTH:
        ring_profile = protocol_profile(profile, "ring", protocol, channels, curve.hosts)
        per_channel = -(-nbytes // (4 * channels)) * 4
        seconds, method = _price("ring", per_channel, ring_profile, topology)
        result.append((seconds, f"ring/{protocol}", method))
        seconds, method = _price("tree", nbytes, protocol_profile(profile, "tree", protocol, 1, curve.hosts),
                                 topology)
        result.append((seconds, f"tree/{protocol}", method))
        if curve.hosts > 1:
            seconds, method = _price("hierarchical", nbytes,
                                     protocol_profile(profile, "ring", protocol, 1, curve.hosts), topology)
            result.append((seconds, f"hierarchical/{protocol}", method))
    if curve.nvls and curve.hosts == 1:
        result.append((nvls_time_s(profile, curve.world_size, nbytes), "nvls", "nvls-formula"))
    return result


def compare(curve: PublishedCurve, profile: Profile | None = None, sizes: set[int] | None = None
            ) -> list[ReproduceRow]:
    """One row per published point (only ``sizes`` when given)."""
    profile = profile or get_profile(curve.profile)
    rows = []
    for nbytes, time_us in curve.points:
        if sizes is not None and nbytes not in sizes:
            continue
        seconds, candidate, method = min(candidates(curve, profile, nbytes))
        published = curve.busbw_gbps(nbytes, time_us)
        predicted = curve.busbw_gbps(nbytes, seconds * 1e6)
        rows.append(ReproduceRow(curve.key, curve.system, nbytes, published, predicted,
                                 (predicted - published) / published * 100, candidate, method))
    return rows


def summary_lines(rows: list[ReproduceRow]) -> list[str]:
    """Median and worst |error| per region (latency-bound <= 64 KiB, bandwidth region above)."""
    lines = []
    for name, part in (("<= 64 KiB", [r for r in rows if r.nbytes <= LATENCY_BOUND_BYTES]),
                       ("> 64 KiB", [r for r in rows if r.nbytes > LATENCY_BOUND_BYTES])):
        if part:
            errors = [abs(r.error_pct) for r in part]
            within = sum(e <= 15 for e in errors)
            lines.append(f"#   {name:>9}: median |error| {statistics.median(errors):.1f}%, worst "
                         f"{max(errors):.1f}%, {within}/{len(part)} points within 15%")
    return lines


def format_curve(rows: list[ReproduceRow | dict]) -> str:
    """The table of one curve's rows (published against predicted busbw, GB/s) and its summary lines."""
    rows = [row if isinstance(row, ReproduceRow) else ReproduceRow(**row) for row in rows]
    lines = [f"{'size':>6} {'published':>10} {'predicted':>10} {'error':>8}  candidate"]
    for row in rows:
        lines.append(f"{format_size(row.nbytes):>6} {row.published_busbw_gbps:>10.2f} {row.predicted_busbw_gbps:>10.2f} "
                     f"{row.error_pct:>+7.1f}%  {row.candidate} ({row.method})")
    return "\n".join(lines + summary_lines(rows))


def format_table(rows: list[dict]) -> str:
    """Every curve of the JSON rows of ``gradsync simulate --reproduce --json``: its name and system, then
    :func:`format_curve`."""
    parts = []
    for key in dict.fromkeys(row["source"] for row in rows):
        curve = [row for row in rows if row["source"] == key]
        parts.append(f"# {key}: {curve[0]['system']}\n" + format_curve(curve))
    return "\n".join(parts)


def run(args: argparse.Namespace) -> int:
    """The ``gradsync simulate --reproduce`` entry point."""
    claim_json_path(args.json)
    every = []
    for curve in CURVES:
        print(f"# {curve.key}: {curve.system}\n#   source: {curve.source}\n#   NVLS: "
              f"{ {True: 'on', False: 'off', None: 'not stated'}[curve.nvls] }; {curve.note}")
        rows = compare(curve)
        print(format_curve(rows))
        every.extend(rows)
    if args.json:
        write_json(args.json, [dataclasses.asdict(row) for row in every])
    return 0
