"""``gradsync simulate train``: predicted data-parallel step time and exposed communication at 8-4096 GPUs.

The options become a model's compute and the grid of GPU counts,
algorithms, bucket sizes and compressors; :mod:`gradsync.sim.training`
predicts each row (its fields are listed there, plus ``tokens_per_gpu``),
printed as a table and written with ``--json``.
"""

from __future__ import annotations

import argparse
import re

from gradsync.bench.output import format_rows as table
from gradsync.bench.output import optional, write_json
from gradsync.sim import Profile, get_profile
from gradsync.sim.compute import (StepCompute, flops_compute, layer_compute, layered_params, memory_per_gpu_bytes,
                                  peak_flops)
from gradsync.sim.training import predict_rows
from gradsync.sim.engine import SIMULATED

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


def format_rows(rows: list[dict]) -> str:
    """An aligned text table of the rows."""
    return table(rows, [
        ("tokens/GPU", 10, optional("tokens_per_gpu", "g")), ("gpus", 5, "{gpus}"), ("algorithm", 16, "{algorithm}"),
        ("bucket_MiB", 10, "{bucket_mb:g}"), ("compress", 8, "{compression}"), ("buckets", 7, "{buckets}"),
        ("step_ms", 9, "{step_ms:.2f}"), ("compute_ms", 10, "{compute_ms:.2f}"), ("comm_ms", 9, "{comm_ms:.2f}"),
        ("exposed_ms", 10, "{exposed_comm_ms:.2f}"), ("copy_ms", 8, "{copy_ms:.2f}"),
        ("comm %", 6, lambda r: f"{100 * r['comm_fraction']:.1f}"), ("method", 7, "{method}")])


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
    for name in algorithms:
        if name not in SIMULATED:
            raise ValueError(f"--algorithms {name}: simulate train runs {', '.join(SIMULATED)} (NCCL's choice is "
                             f"priced per AllReduce only: gradsync simulate, gradsync explain)")
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

