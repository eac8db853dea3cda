"""``gradsync simulate train``: predicted data-parallel step time and exposed communication at 8-4096 GPUs.

For every GPU count, algorithm, bucket size and compressor: the model's
compute (:mod:`gradsync.sim.compute`), DataParallel's real buckets and
their exchanges overlapped with backward (:mod:`gradsync.sim.step`), each
exchange priced by the simulator (:mod:`gradsync.sim.exchange`). Rows (and
``--json``): ``gpus``, ``algorithm``, ``bucket_mb``, ``compression``,
``step_ms``, ``compute_ms`` (forward + backward + optimizer), ``comm_ms``
(all exchanges), ``exposed_comm_ms``, ``comm_fraction`` (= exposed / step:
the share of the step spent only communicating), ``copy_ms`` (gradients
into and out of the buckets), ``buckets``, ``method`` (event or formula),
``tokens_per_gpu``.

>>> rows = predict_rows(flops_compute(layered_params(10**9, 8), 4096, 989e12, 0.4, get_profile("h100-ib")),
...                     get_profile("h100-ib"), [8], ["ring"], [25.0], ["none"])
>>> rows[0]["gpus"], rows[0]["buckets"] > 1
(8, True)
"""

from __future__ import annotations

import argparse
import re

from gradsync.bench.output import write_json
from gradsync.sim.cluster import Topology
from gradsync.sim.compute import (StepCompute, flops_compute, layer_compute, layered_params, memory_per_gpu_bytes,
                                  peak_flops)
from gradsync.sim.exchange import BucketPricer
from gradsync.sim.profile import Profile
from gradsync.sim.profiles import get_profile
from gradsync.sim.step import overlap, plan_step

_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_count(text: str, what: str = "--params") -> int:
    """``"10B"`` -> 10**10; K, M, B (or G), T are powers of 1000.

    Raises:
        ValueError: not a positive count.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMBGT]?)\s*", str(text).upper())
    if not match or float(match.group(1)) * _SUFFIX[match.group(2)] < 1:
        raise ValueError(f"{what}: {text!r} is not a positive count like 10B, 350M or 1500000")
    return int(float(match.group(1)) * _SUFFIX[match.group(2)])


def parse_list(text: str, kind, what: str) -> list:
    """Comma-separated values of ``kind``; ValueError names the option."""
    try:
        values = [kind(item.strip()) for item in str(text).split(",") if item.strip()]
    except ValueError as error:
        raise ValueError(f"{what}: {text!r}: {error}") from None
    if not values:
        raise ValueError(f"{what}: give at least one value")
    return list(dict.fromkeys(values))


def topology_for(gpus: int, ranks_per_host: int) -> Topology:
    """``gpus`` ranks in hosts of ``ranks_per_host`` (one host when fewer).

    Raises:
        ValueError: ``gpus`` < 1 or not a multiple of ``ranks_per_host``.
    """
    if gpus < 1 or ranks_per_host < 1:
        raise ValueError(f"need gpus >= 1 and ranks per host >= 1, got {gpus}, {ranks_per_host}")
    if gpus <= ranks_per_host:
        return Topology.uniform(1, gpus)
    if gpus % ranks_per_host:
        raise ValueError(f"--gpus {gpus} is not a multiple of {ranks_per_host} ranks per host")
    return Topology.uniform(gpus // ranks_per_host, ranks_per_host)


def predict_step(compute: StepCompute, profile: Profile, topology: Topology, algorithm: str, bucket_mb: float,
                 compression: str = "none", *, event_max_ranks: int = 64, bucket_view: bool = False,
                 rebuilt: bool = True, two_phase_events: bool = False) -> dict:
    """One row: the predicted steady-state step (see the module docstring for the fields)."""
    oversub = profile.oversubscription(max(topology.host_sizes))
    plan = plan_step(compute, bucket_mb, topology.world_size, profile.copy_s_per_byte * oversub, bucket_view,
                     rebuilt)
    pricer = BucketPricer(profile, topology, algorithm, compression, event_max_ranks,
                          two_phase_events=two_phase_events)
    dtypes = [compute.params[bucket[0]].dtype for bucket in plan.assignment]
    last = len(plan.numels) - 1
    comm = [pricer.bucket_s(numel, plan.flags if b == last else 0, dtypes[b]) for b, numel in enumerate(plan.numels)]
    sync = overlap(plan.ready_s, comm, plan.backward_s, plan.copy_out_s)
    step_s = compute.forward_s + sync.end_s + compute.optimizer_s
    copy_s = plan.copy_in_s + sum(plan.copy_out_s)
    return {"gpus": topology.world_size, "hosts": topology.hosts, "algorithm": algorithm, "bucket_mb": bucket_mb,
            "compression": compression, "step_ms": step_s * 1e3, "compute_ms": compute.compute_s * 1e3,
            "comm_ms": sum(comm) * 1e3, "exposed_comm_ms": sync.exposed_s * 1e3,
            "comm_fraction": sync.exposed_s / step_s if step_s > 0 else 0.0, "copy_ms": copy_s * 1e3,
            "buckets": len(plan.assignment), "layout": "rebuilt" if rebuilt else "initial", "method": pricer.method}


def predict_rows(compute: StepCompute, profile: Profile, gpus: list[int], algorithms: list[str],
                 bucket_mbs: list[float], compressions: list[str], *, ranks_per_host: int | None = None,
                 event_max_ranks: int = 64, bucket_view: bool = False, rebuilt: bool = True,
                 two_phase_events: bool = False) -> list[dict]:
    """Every combination, GPU count outermost."""
    per_host = ranks_per_host or profile.ranks_per_host
    rows = []
    for count in gpus:
        topology = topology_for(count, per_host)
        for algorithm in algorithms:
            for bucket_mb in bucket_mbs:
                for compression in compressions:
                    rows.append(predict_step(compute, profile, topology, algorithm, bucket_mb, compression,
                                             event_max_ranks=event_max_ranks, bucket_view=bucket_view,
                                             rebuilt=rebuilt, two_phase_events=two_phase_events))
    return rows


def format_rows(rows: list[dict]) -> str:
    """An aligned text table of the rows."""
    header = (f"{'tokens/GPU':>10} {'gpus':>5} {'algorithm':>16} {'bucket_MiB':>10} {'compress':>8} {'buckets':>7} "
              f"{'step_ms':>9} {'compute_ms':>10} {'comm_ms':>9} {'exposed_ms':>10} {'copy_ms':>8} "
              f"{'comm %':>6} {'method':>7}")
    lines = [header, "-" * len(header)]
    for r in rows:
        tokens = r.get("tokens_per_gpu")
        lines.append(f"{'-' if tokens is None else f'{tokens:g}':>10} {r['gpus']:>5} {r['algorithm']:>16} "
                     f"{r['bucket_mb']:>10g} {r['compression']:>8} {r['buckets']:>7} {r['step_ms']:>9.2f} "
                     f"{r['compute_ms']:>10.2f} {r['comm_ms']:>9.2f} {r['exposed_comm_ms']:>10.2f} "
                     f"{r['copy_ms']:>8.2f} {100 * r['comm_fraction']:>6.1f} {r['method']:>7}")
    return "\n".join(lines)


def _model_params(args: argparse.Namespace) -> tuple[list, str]:
    if args.model and args.params:
        raise ValueError("give --model or --params, not both")
    if args.params:
        num, layers = parse_count(args.params), args.layers
        return layered_params(num, layers), f"{num:.3g} parameters in {layers} transformer blocks"
    from gradsync.train.models import build_model
    module = build_model(args.model or "cnn")
    return [p.detach() for p in module.parameters() if p.requires_grad], f"model {args.model or 'cnn'}"


def _computes(args: argparse.Namespace, profile: Profile, params: list) -> list[tuple[float | None, StepCompute]]:
    """(tokens per GPU, compute) per requested batch."""
    if args.layer_ms is not None:
        if not args.params:
            raise ValueError("--layer-ms needs --params N --layers L")
        return [(None, layer_compute(params, args.layers, args.layer_ms / 1e3, profile))]
    if args.tokens_per_gpu is None:
        raise ValueError("give the compute: --tokens-per-gpu T (with --mfu, --peak-tflops) for "
                         "6*P*T/(F*MFU), or --layer-ms with --params; --validate measures it here")
    flops = peak_flops(profile, args.peak_tflops)
    return [(tokens, flops_compute(params, tokens, flops, args.mfu, profile))
            for tokens in parse_list(args.tokens_per_gpu, float, "--tokens-per-gpu")]


def run(args: argparse.Namespace) -> int:
    """Entry point of ``gradsync simulate train`` (``--validate`` goes to :mod:`gradsync.bench.train_validation`)."""
    profile = get_profile(args.profile or "h100-ib")
    gpus = parse_list(args.gpus, int, "--gpus")
    algorithms = parse_list(args.algorithms or "ring,tree,halving_doubling,hierarchical", str, "--algorithms")
    bucket_mbs = parse_list(args.bucket_mb, float, "--bucket-mb")
    compressions = parse_list(args.compression, str, "--compression")
    params, described = _model_params(args)
    computes = _computes(args, profile, params)
    num = sum(p.numel() for p in params)
    memory = memory_per_gpu_bytes(num, not args.bucket_view)
    print(f"# gradsync simulate train: {described} on {profile.name} ({profile.description}); "
          f"{args.ranks_per_host or profile.ranks_per_host} GPUs per host")
    print(f"# memory per GPU under pure data parallelism: {memory['state'] / 1e9:.1f} GB of weights, gradients "
          f"and Adam states (16 B/param, mixed precision) + {memory['buckets'] / 1e9:.1f} GB of gradsync buckets "
          f"= {memory['total'] / 1e9:.1f} GB, activations excluded")
    rows = []
    for tokens, compute in computes:
        print(f"# compute: {compute.source}: forward {compute.forward_s * 1e3:.2f} ms, backward "
              f"{compute.backward_s * 1e3:.2f} ms, optimizer {compute.optimizer_s * 1e3:.2f} ms")
        for row in predict_rows(compute, profile, gpus, algorithms, bucket_mbs, compressions,
                                ranks_per_host=args.ranks_per_host, event_max_ranks=args.event_max_gpus,
                                bucket_view=args.bucket_view, rebuilt=args.layout == "rebuilt",
                                two_phase_events=args.two_phase_events):
            rows.append({"tokens_per_gpu": tokens, **row})
    print(format_rows(rows))
    if args.json:
        write_json(args.json, rows)
    return 0

