"""``gradsync explain`` without an algorithm: the seed's claims about scale, with the simulator's numbers.

Three claims, every number computed when the command runs from the
simulator's closed forms (:func:`gradsync.collectives.cost.formulas.predict_s`,
within 5% of the event simulation of the real code where both run, see
docs/simulator.md) and its step model (:mod:`gradsync.sim.training`), on a
shipped GPU profile (h100-ib: 8 H100s per host on NVLink, one 400 Gb/s
InfiniBand NIC per GPU):

1. :func:`ring_growth`: a flat ring's time for 4 KiB–1 MiB from 8 to 64 to
   4096 GPUs, and its latency term (``formulas.ring_latency_s``: the α on its critical path) beside it.
2. :func:`overtakes`: at each GPU count, the sizes at which hierarchical and
   double_binary_tree are faster than the ring.
3. :func:`step_levers`: a 10B-parameter model's step on 4096 GPUs (512
   hosts × 8) under pure data parallelism: compute 6·N·T / (F·MFU)
   (Kaplan et al. 2020's 6 FLOPs per parameter and token; F the GPU's dense
   BF16 peak from its datasheet, :data:`gradsync.sim.compute.PEAK_TFLOPS`),
   fp32 gradients in DataParallel's real buckets, and the communication's
   share of the step for each lever: bucket size and overlap with backward,
   hierarchical, fp16 gradients, PowerSGD rank r (Vogels et al. 2019: per
   weight matrix m × n, P (m × r) and Q (n × r) all-reduced instead of
   m·n), ZeRO-1/2 (a reduce-scatter of the gradients and an all-gather of
   the parameters) and ZeRO-3 (one more all-gather of the parameters,
   forward and backward each gather them; Rajbhandari et al. 2020, §7).

Shares (:class:`Lever`): ``comm / (comm + compute)`` where nothing
overlaps; ``exposed / step`` where DataParallel's buckets overlap backward
(its schedule and copies, :func:`gradsync.sim.step.overlap`); for ZeRO's
overlap, a bound: max(0, comm - the compute it runs beside) stays exposed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from gradsync.bench.scale import parse_sizes, topology_for
from gradsync.bench.scale_report import _size
from gradsync.collectives.cost.formulas import predict_s, ring_latency_s
from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.cost.topology import Topology
from gradsync.sim import get_profile
from gradsync.sim.compute import BLOCK_SHAPES, PEAK_TFLOPS, StepCompute, flops_compute, layered_params, peak_flops
from gradsync.sim.step import plan_step
from gradsync.sim.training import predict_step

PROFILE = "h100-ib"
GROWTH_GPUS = (8, 64, 4096)
GROWTH_SIZES = (4096, 65536, 2**20)
OVERTAKE_GPUS = (8, 64, 512, 4096)
OVERTAKE_SIZES = "4K-1G"
RIVALS = ("hierarchical", "double_binary_tree")
PARAMS, LAYERS = 10**10, 48  # a 10B transformer: 48 blocks of d ≈ 4166
TOKENS_PER_GPU, MFU = 4096, 0.4  # one 4096-token sequence per GPU per step, 40% of the peak
STEP_GPUS = 4096
POWERSGD_RANK = 4
SMALL_BUCKET_MB, LARGE_BUCKET_MB = 25.0, 1024.0
ONE_CALL_BUCKET = 2**30  # the ZeRO and PowerSGD collectives, in calls of at most 1 GiB


def ring_growth(profile: Profile) -> list[dict]:
    """Per size of :data:`GROWTH_SIZES` and GPU count of :data:`GROWTH_GPUS`: ``time_s`` of the flat ring,
    ``latency_s``: the streamed ring's time were bytes free (``formulas.ring_latency_s``: 2(p-1)·α on one host;
    across hosts the fill's crossings, or the reduce-scatter at its inbox's pace behind a host's edge)."""
    rows = []
    for nbytes in GROWTH_SIZES:
        for gpus in GROWTH_GPUS:
            topology = topology_for(gpus, profile)
            rows.append({"nbytes": nbytes, "gpus": gpus, "time_s": predict_s("ring", profile, topology, nbytes),
                         "latency_s": ring_latency_s(profile, topology)})
    return rows


@functools.lru_cache(maxsize=4)
def overtakes(profile: Profile) -> tuple[dict, ...]:
    """Per GPU count and size: every algorithm's time (``times``: ring and :data:`RIVALS`), ``fastest``."""
    rows = []
    for gpus in OVERTAKE_GPUS:
        topology = topology_for(gpus, profile)
        for nbytes in parse_sizes(OVERTAKE_SIZES):
            times = {name: predict_s(name, profile, topology, nbytes) for name in ("ring",) + RIVALS}
            rows.append({"gpus": gpus, "nbytes": nbytes, "times": times, "fastest": min(times, key=times.get)})
    return tuple(rows)


def _spans(sizes: list[int], wins: list[bool]) -> str:
    """Runs of consecutive winning sizes as text: "4K-1M, 1G"; "none"."""
    runs, start = [], None
    for index, win in enumerate(wins + [False]):
        if win and start is None:
            start = index
        elif not win and start is not None:
            runs.append(_size(sizes[start]) + ("" if index - 1 == start else f"-{_size(sizes[index - 1])}"))
            start = None
    return ", ".join(runs) or "none"


@dataclass(frozen=True)
class Lever:
    """One way to run the step (seconds): ``comm_s`` (all its collectives, ``calls`` of them), ``exposed_s``
    (what the step waits for them), ``step_s``; ``share`` = exposed / step."""

    name: str
    comm_s: float
    exposed_s: float
    step_s: float
    calls: int

    @property
    def share(self) -> float:
        return self.exposed_s / self.step_s


def step_compute(profile: Profile, dtype: torch.dtype = torch.float32) -> StepCompute:
    """The 10B model's compute per GPU and step (:func:`~gradsync.sim.compute.flops_compute`)."""
    return flops_compute(layered_params(PARAMS, LAYERS, dtype), TOKENS_PER_GPU, peak_flops(profile), MFU, profile)


def call_count(total_bytes: int) -> int:
    return math.ceil(total_bytes / ONE_CALL_BUCKET)


def calls_s(profile: Profile, topology: Topology, algorithm: str, total_bytes: int, collective: str = "all_reduce",
            itemsize: int = 4) -> float:
    """Seconds of ``collective`` over ``total_bytes`` in calls of at most :data:`ONE_CALL_BUCKET` bytes."""
    full, rest = divmod(total_bytes, ONE_CALL_BUCKET)
    seconds = full * predict_s(algorithm, profile, topology, ONE_CALL_BUCKET, itemsize=itemsize, collective=collective)
    rest -= rest % (itemsize * topology.world_size)
    return seconds + (predict_s(algorithm, profile, topology, rest, itemsize=itemsize, collective=collective)
                      if rest else 0.0)


def powersgd_bytes(num_params: int = PARAMS, layers: int = LAYERS, rank: int = POWERSGD_RANK) -> tuple[int, int]:
    """(P's, Q's) fp32 bytes PowerSGD all-reduces per step for :func:`~gradsync.sim.compute.layered_params`'
    matrices, m x n each (``BLOCK_SHAPES`` in units of d): Σ m·r and Σ n·r; the parameters outside the
    blocks' matrices go whole with P."""
    d = math.isqrt(num_params // (12 * layers))
    rows = sum(m for m, _ in BLOCK_SHAPES) * d * layers
    cols = sum(n for _, n in BLOCK_SHAPES) * d * layers
    rest = num_params - 12 * d * d * layers
    return 4 * (rows * rank + rest), 4 * cols * rank


# DataParallel's levers: (algorithm, bucket MiB, gradient dtype, overlapped with backward, rebuilt layout)
_S, _L = SMALL_BUCKET_MB, LARGE_BUCKET_MB
DP_LEVERS = (("ring", _S, torch.float32, False, True), ("ring", _S, torch.float32, True, True),
             ("ring", _L, torch.float32, True, True), ("ring", _L, torch.float32, True, False),
             ("hierarchical", _S, torch.float32, False, True), ("hierarchical", _S, torch.float32, True, True),
             ("hierarchical", _L, torch.float32, True, False), ("hierarchical", _S, torch.float16, True, True))


def _dp_name(algorithm: str, bucket_mb: float, dtype: torch.dtype, overlapped: bool, rebuilt: bool) -> str:
    return (f"{algorithm}, {bucket_mb:g} MiB buckets" + ("" if rebuilt else " (construction layout kept)")
            + (", fp16 gradients" if dtype == torch.float16 else "")
            + (", overlapped with backward" if overlapped else ", nothing overlapped"))


def _dp(profile: Profile, topology: Topology, algorithm: str, bucket_mb: float, dtype: torch.dtype,
        overlapped: bool, rebuilt: bool) -> Lever:
    """DataParallel's buckets (after its rebuild on the first backward unless not ``rebuilt``: then as
    ``set_layout`` keeps the construction's): overlapped, the step model's exposed and step time (copies
    into and out of the buckets included); not, every exchange after the compute."""
    compute = step_compute(profile, dtype)
    row = predict_step(compute, profile, topology, algorithm, bucket_mb, event_max_ranks=0, rebuilt=rebuilt)
    comm, name = row["comm_ms"] / 1e3, _dp_name(algorithm, bucket_mb, dtype, overlapped, rebuilt)
    if overlapped:
        return Lever(name, comm, row["exposed_comm_ms"] / 1e3, row["step_ms"] / 1e3, row["buckets"])
    return Lever(name, comm, comm, compute.compute_s + comm, row["buckets"])


def nccl_buckets(profile: Profile, topology: Topology, bucket_mb: float = SMALL_BUCKET_MB) -> Lever | None:
    """DataParallel's buckets, each AllReduce at the time NCCL's tuning model predicts for its own pick
    (:func:`gradsync.collectives.cost.nccl_tuning.nccl_choice`), nothing overlapped; None for a profile
    without NCCL's constants."""
    from gradsync.collectives.cost.nccl_tuning import nccl_choice
    compute = step_compute(profile)
    plan = plan_step(compute, bucket_mb, topology.world_size, profile.copy_s_per_byte)
    try:
        times = {numel: nccl_choice(profile, topology, 4 * numel).run_time_s for numel in set(plan.numels)}
    except ValueError:
        return None
    comm = sum(times[numel] for numel in plan.numels)
    return Lever(f"NCCL's choice, {bucket_mb:g} MiB buckets, nothing overlapped", comm, comm,
                 compute.compute_s + comm, len(plan.numels))


def hidden_behind(comm_s: float, window_s: float) -> float:
    """What stays exposed of ``comm_s`` run beside ``window_s`` of compute, at best: max(0, comm - window)."""
    return max(0.0, comm_s - window_s)


def step_levers(profile: Profile) -> tuple[StepCompute, list[Lever]]:
    """The 10B model's compute and each lever's communication on :data:`STEP_GPUS` GPUs."""
    topology = topology_for(STEP_GPUS, profile)
    compute = step_compute(profile)
    base = compute.compute_s
    levers = [_dp(profile, topology, *spec) for spec in DP_LEVERS]
    levers += [lever for lever in (nccl_buckets(profile, topology),) if lever is not None]
    p_bytes, q_bytes = powersgd_bytes()
    psgd = sum(calls_s(profile, topology, "hierarchical", nbytes) for nbytes in (p_bytes, q_bytes))  # P's, then Q's
    levers.append(Lever(f"hierarchical, PowerSGD rank {POWERSGD_RANK} ({(p_bytes + q_bytes) / 2**20:.0f} MiB), "
                        "after backward", psgd, psgd, base + psgd, call_count(p_bytes) + call_count(q_bytes)))
    grads = 4 * compute.num_params
    scatter = calls_s(profile, topology, "hierarchical", grads, "reduce_scatter")
    gather = calls_s(profile, topology, "hierarchical", grads, "all_gather")
    calls = call_count(grads)
    for name, comm, exposed, count in (
            ("ZeRO-1/2, hierarchical: reduce-scatter + all-gather, nothing overlapped", scatter + gather,
             scatter + gather, 2 * calls),
            ("ZeRO-2, reduce-scatter hidden behind backward at best", scatter + gather,
             hidden_behind(scatter, compute.backward_s) + gather, 2 * calls),
            ("ZeRO-3, hierarchical: reduce-scatter + 2 all-gathers, nothing overlapped", scatter + 2 * gather,
             scatter + 2 * gather, 3 * calls),
            ("ZeRO-3, gathers behind forward / backward at best", scatter + 2 * gather,
             hidden_behind(gather, compute.forward_s) + hidden_behind(gather + scatter, compute.backward_s),
             3 * calls)):
        levers.append(Lever(name, comm, exposed, base + exposed, count))
    return compute, levers


def render(profile_name: str = PROFILE) -> str:
    """The three claims as text (see the module docstring).

    Raises:
        ValueError: an unknown profile, or one without a known GPU peak.
    """
    profile = get_profile(profile_name)
    lines = [f"The seed's claims on profile {profile.name} ({profile.ranks_per_host} GPUs per host), from the "
             "simulator's closed forms (within 5% of the event simulation of the real code where both run)", ""]
    lines += _growth_lines(profile) + [""] + _overtake_lines(profile) + [""] + _step_lines(profile)
    return "\n".join(lines)


def _growth_lines(profile: Profile) -> list[str]:
    rows = ring_growth(profile)
    lines = ["1. A flat ring's small messages grow with the GPU count: 2(p-1) hops one after another, each at "
             "least its link's latency a (across hosts the reduce-scatter waits a between hosts per 2 hops).",
             f"   {'size':>6} " + " ".join(f"{f'{g} GPUs':>22}" for g in GROWTH_GPUS) + "   growth 8->64, 64->4096"]
    for nbytes in GROWTH_SIZES:
        mine = [row for row in rows if row["nbytes"] == nbytes]
        cells = " ".join(f"{row['time_s'] * 1e6:>11.1f} us ({row['latency_s'] / row['time_s']:>4.0%} a)"
                         for row in mine)
        lines.append(f"   {_size(nbytes):>6} {cells}   x{mine[1]['time_s'] / mine[0]['time_s']:.1f}, "
                     f"x{mine[2]['time_s'] / mine[1]['time_s']:.1f}")
    lines.append("   (x% a: the share of the ring's latency term, its time were bytes free)")
    return lines


def _overtake_lines(profile: Profile) -> list[str]:
    rows = overtakes(profile)
    sizes = parse_sizes(OVERTAKE_SIZES)
    lines = [f"2. Where hierarchical and double_binary_tree beat the flat ring ({OVERTAKE_SIZES}, sizes x4 apart; "
             "hierarchical is the ring inside one host):"]
    for gpus in OVERTAKE_GPUS:
        mine = [row for row in rows if row["gpus"] == gpus]
        parts = []
        for rival in RIVALS:
            wins = [row["times"][rival] < row["times"]["ring"] for row in mine]
            ratios = ", ".join(f"{_size(row['nbytes'])} x{row['times']['ring'] / row['times'][rival]:.3g}"
                               for row in (mine[0], mine[-1]))
            parts.append(f"{rival} at {_spans(sizes, wins)} (ring / it: {ratios})")
        fastest = _spans(sizes, [row["fastest"] == "ring" for row in mine])
        lines.append(f"   {gpus:>5} GPUs: " + "; ".join(parts) + f" (the ring the fastest at {fastest})")
    return lines


def _step_lines(profile: Profile) -> list[str]:
    compute, levers = step_levers(profile)
    flops = 6 * compute.num_params * TOKENS_PER_GPU
    hosts = topology_for(STEP_GPUS, profile).hosts
    lines = [f"3. A {compute.num_params / 1e9:.0f}B-parameter model (fp32 gradients, {LAYERS} blocks) on {STEP_GPUS} "
             f"GPUs ({hosts} hosts x {profile.ranks_per_host}), pure data parallelism:",
             f"   compute per step: 6 x N x T = 6 x {compute.num_params:.3g} x {TOKENS_PER_GPU} tokens per GPU = "
             f"{flops:.3g} FLOPs at {MFU:.0%} MFU of {PEAK_TFLOPS.get(profile.name, 0):g} TFLOP/s (dense BF16, "
             f"the GPU's datasheet) = {(compute.forward_s + compute.backward_s) * 1e3:.0f} ms, + Adam "
             f"{compute.optimizer_s * 1e3:.1f} ms at memory bandwidth = {compute.compute_s * 1e3:.0f} ms",
             f"   {'lever':<84} {'calls':>5} {'comm [ms]':>10} {'exposed [ms]':>12} {'share':>6}"]
    for lever in levers:
        lines.append(f"   {lever.name:<84} {lever.calls:>5} {lever.comm_s * 1e3:>10.1f} {lever.exposed_s * 1e3:>12.1f} "
                     f"{lever.share:>6.1%}")
    lines.append("   share = exposed / step; exposed: all of comm where nothing overlaps; DataParallel's buckets: "
                 "what the step waits for after backward (its step also copies the gradients into and out of "
                 "the buckets); 'at best': max(0, comm - the compute it runs beside). ZeRO's collectives in "
                 "calls of 1 GiB, fp32 parameters gathered.")
    return lines


def run(args) -> int:
    print(render(getattr(args, "profile", None) or PROFILE))
    return 0
