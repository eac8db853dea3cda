"""Command line: ``gradsync train`` (its options in :mod:`gradsync.jobs.train_command_line`), ``gradsync bench ...``
(its subcommands in :mod:`gradsync.bench.command_line`), ``gradsync debug``, ``gradsync checkpoint export``, and the
simulator's ``simulate`` / ``calibrate`` / ``explain`` (their options in :mod:`gradsync.bench.sim_commands`)
(argparse only)."""

from __future__ import annotations

import argparse
import os
import sys

from gradsync import __version__
from gradsync.bench import record as bench_record
from gradsync.bench.command_line import _add_bitwise_bench_options, bench_bitwise
from gradsync.bench.command_line import add_large_batch_bench_parser, bench_large_batch
from gradsync.bench.command_line import (_add_allreduce_bench_options, _add_compression_bench_options,
                                         _add_deterministic_bench_options, _add_faults_bench_options,
                                         _add_modes_bench_options, _add_replicas_bench_options,
                                         _add_train_bench_options, bench_allreduce, bench_compression,
                                         bench_deterministic, bench_faults, bench_modes, bench_replicas, bench_train)
from gradsync.bench.memory_command_line import (add_fit_bench_parser, add_memory_bench_parser,
                                                add_preflight_bench_parser, bench_fit, bench_memory, bench_preflight)
from gradsync.bench import report as bench_report
from gradsync.bench.sim_commands import ENTRY_POINTS as SIM_COMMANDS
from gradsync.bench.sim_commands import add_parsers as add_sim_parsers
from gradsync.errors import CollectiveMismatchError, CollectiveTimeoutError, GradsyncError
from gradsync.jobs.train_command_line import add_train_options, train


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad option as one line and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="gradsync", description="Data-parallel training with gradsync.")
    parser.add_argument("--version", action="version", version=f"gradsync {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    add_train_options(commands.add_parser(
        "train", help="train a model on MNIST-1D (or the gpt on a text) across local workers",
        description="Train on MNIST-1D (--model gpt: Python's help texts) data-parallel across --nproc local "
                    "workers (or under torchrun, across the workers it started)."))
    bench = commands.add_parser("bench", help="benchmarks that print tables")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=_OneLineParser)
    _add_allreduce_bench_options(benches.add_parser(
        "allreduce", help="nccl-tests-style AllReduce sweep over sizes and algorithms",
        description="Time every algorithm at every size across --nproc local processes, "
                    "interleaved with the backend's native all_reduce."))
    _add_train_bench_options(benches.add_parser(
        "train", help="training samples/s of gradsync DataParallel next to torch DDP",
        description="Train the same models compute-only (no gradient sync), with gradsync DataParallel "
                    "(one row per algorithm) and with torch DistributedDataParallel on the same data, world "
                    "size and thread count, alternating them in each of --repeat repetitions; report "
                    "samples/s, the step as a multiple of compute-only's (wall and CPU), the ratio to DDP, "
                    "gradsync's communication and exposed-communication time per step, each as the median "
                    "(min-max), and peak memory with gradient_as_bucket_view off and on."))
    _add_compression_bench_options(benches.add_parser(
        "compression", help="accuracy, bytes per step and speed of every gradient compressor",
        description="Train the main job (MNIST-1D CNN, 4 workers) once per compressor and print test "
                    "accuracy, bytes sent per step and samples/s relative to no compression, with a plot "
                    "of test accuracy per epoch; then time every compressor on the ~25M-parameter MLP."))
    _add_modes_bench_options(benches.add_parser(
        "modes", help="sync vs async (parameter server) vs local SGD, with and without a straggler",
        description="Train the main job (MNIST-1D CNN, 4 workers) in sync mode, async mode per staleness "
                    "bound and local SGD per H, each without and with worker rank 1 slowed down; print "
                    "samples/s, seconds to 85%% test accuracy, final accuracy and staleness, and plot test "
                    "accuracy against wall time."))
    _add_faults_bench_options(benches.add_parser(
        "faults", help="seconds to detect and recover from a killed and a hung worker, steps recomputed",
        description="Train the main job three times with checkpoints and --max-restarts 1: without a fault, "
                    "with a worker killed (--fail-at) and with a worker hung (--hang-at); print the seconds to "
                    "detect each fault and to be training again, the steps recomputed, and whether the final "
                    "parameters equal the run without a fault bit for bit."))
    _add_replicas_bench_options(benches.add_parser(
        "replicas", help="cost of a replica check against one training step",
        description="Train the bench models with DataParallel and time a training step, check_replicas() "
                    "and check_replicas(optimizer), alternating over rounds; print each check's share of a "
                    "step and the overhead of checking every 100 steps."))
    _add_deterministic_bench_options(benches.add_parser(
        "deterministic", help="the cost of --deterministic: samples/s and peak memory next to DataParallel",
        description="Train the MNIST-1D CNN (global batch 256) and the ~25M-parameter MLP (128) with DataParallel "
                    "and DeterministicDataParallel per --micro-shards, alternating over rounds, 1 torch thread per "
                    "rank; print samples/s, the ratio, communication per step and peak RSS per rank."))
    _add_bitwise_bench_options(benches.add_parser(
        "bitwise", help="--deterministic's promise at every shard level: model.pt's bits for every --shard and "
        "world size", description="Run gradsync train --deterministic (subprocesses) for every --model, --shard level "
        "and world size, hash each run's model.pt tensors (sha256) and compare them with world size 1, --shard none; "
        "exit 1 if any differs."))
    add_memory_bench_parser(benches)
    add_fit_bench_parser(benches)
    add_preflight_bench_parser(benches)
    add_large_batch_bench_parser(benches)
    bench_report.add_parser(benches)
    bench_record.add_parser(benches)
    debug = commands.add_parser(
        "debug", help="read every rank's flight record and say which rank stopped where",
        description="Read the flight records the ranks wrote when a collective timed out or the ranks "
                    "disagreed (rank-*.json in DIR or DIR/flight) and print, in one screen, which rank is in "
                    "which collective, the first collective the ranks disagree on, and where the peers' "
                    "records place a rank that wrote none.")
    debug.add_argument("dir", metavar="DIR", help="a gradsync train run folder, or the folder named by "
                       "GRADSYNC_FLIGHT_DIR")
    checkpoints = commands.add_parser("checkpoint", help="work with gradsync train checkpoints")
    checkpoint_commands = checkpoints.add_subparsers(dest="checkpoint_command", required=True,
                                                     parser_class=_OneLineParser)
    export = checkpoint_commands.add_parser(
        "export", help="write a checkpoint's whole state (model, optimizer consolidated from its shards) to one file",
        description="Read a gradsync train checkpoint, sharded (--shard optimizer|gradients: one optimizer shard "
                    "per rank file) or not, and write its model, the whole optimizer state dict, the schedule and "
                    "the step into OUT, loadable with torch.load(OUT, weights_only=True) and no gradsync (as "
                    "DeepSpeed's zero_to_fp32.py and FSDP's FULL_STATE_DICT give).")
    export.add_argument("dir", metavar="DIR", help="a checkpoint folder (step-NNNNNNNNN) or a --checkpoint-dir "
                        "(its newest complete checkpoint)")
    export.add_argument("out", metavar="OUT", help="the file to write")
    add_sim_parsers(commands)
    return parser


def checkpoint_export(args: argparse.Namespace) -> int:
    """``gradsync checkpoint export DIR OUT``: one line saying what was written."""
    from gradsync.train.sharded_checkpoint import export_checkpoint

    whole = export_checkpoint(args.dir, args.out)
    print(f"wrote {args.out}: step {whole['step']}, model and optimizer whole (written by {whole['world_size']} "
          f"rank{'s' if whole['world_size'] != 1 else ''}, --shard {whole['shard']})")
    return 0


def debug(args: argparse.Namespace) -> int:
    """``gradsync debug DIR``: 0 when it could analyze the dumps, 1 when DIR holds none (with why)."""
    from gradsync.debug.analyze import NoDumpsError, render

    try:
        print(render(args.dir))
    except NoDumpsError as exc:
        print(f"gradsync debug: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _record(args: argparse.Namespace) -> int:
    """``gradsync bench record``: the bench runs through this command line (parser and entry point)."""
    try:
        bench_record.record(args.name, args.bench_args, args.bench_dir,
                            parse=build_parser().parse_args, run=main)
    except RuntimeError as exc:  # the benchmark itself failed and printed why
        print(f"gradsync bench record: error: {exc}", file=sys.stderr)
        return 1
    return 0


_BENCHES = {"allreduce": bench_allreduce, "train": bench_train, "compression": bench_compression,
            "modes": bench_modes, "faults": bench_faults, "deterministic": bench_deterministic,
            "replicas": bench_replicas, "bitwise": bench_bitwise, "memory": bench_memory, "fit": bench_fit,
            "preflight": bench_preflight, "large-batch": bench_large_batch,
            "report": bench_report.run,
            "record": _record}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse like ``parse_args``, but an unknown option is reported by the command it was given to."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        command = " ".join(part for part in (args.command, getattr(args, "bench", None)) if part)
        print(f"gradsync {command}: error: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        sys.exit(2)
    return args


def _dispatch(args: argparse.Namespace, argv: list[str] | None) -> int:
    if args.command == "bench":
        return _BENCHES[args.bench](args)
    if args.command == "debug":
        return debug(args)
    if args.command == "checkpoint":
        return checkpoint_export(args)
    if args.command in SIM_COMMANDS:
        return SIM_COMMANDS[args.command](args)
    return train(args, argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gradsync`` console script; returns the exit code."""
    args = _parse(argv)
    try:
        code = _dispatch(args, argv)
        sys.stdout.flush()  # here, so that a reader gone away is a BrokenPipeError below, not at exit
        return code
    except BrokenPipeError:  # the reader went away (`gradsync explain ring | head -1`): nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's recipe: no error at exit
        return 1
    except (ValueError, TypeError) as exc:
        print(f"gradsync {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (GradsyncError, CollectiveTimeoutError, CollectiveMismatchError, OSError) as exc:
        print(f"gradsync {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"gradsync {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
