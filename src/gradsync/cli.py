"""Command line: ``gradsync train``, ``gradsync bench allreduce|train|compression|modes|faults|deterministic|replicas``,
``gradsync debug``
(argparse only)."""

from __future__ import annotations

import argparse
import sys

from gradsync import __version__
from gradsync.bench import record as bench_record
from gradsync.bench import report as bench_report
from gradsync.collectives.ops import ALGORITHMS
from gradsync.compression import COMPRESSIONS
from gradsync.errors import CollectiveMismatchError, CollectiveTimeoutError, GradsyncError
from gradsync.train.config import LR_SCHEDULES, MODES, OPTIMIZERS, TrainConfig
from gradsync.train.models import MODELS

_DEFAULTS = TrainConfig()


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad option as one line and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_train_options(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    add = parser.add_argument
    add("--nproc", type=int, default=d.nproc, help="worker processes on this machine (default %(default)s)")
    add("--mode", default=d.mode, metavar="{" + ",".join(MODES) + "}",
        help="sync: AllReduce the gradients every step; async: a parameter server (one extra process, the "
        "last rank) applies each worker's gradient on arrival; local-sgd: workers step alone and average "
        "parameters every --sync-every steps (default %(default)s)")
    add("--max-staleness", type=int, default=d.max_staleness, metavar="S", help="async: no applied gradient "
        "is more than S versions stale; faster workers wait (default: unbounded)")
    add("--staleness-lr", action=argparse.BooleanOptionalAction, default=d.staleness_lr,
        help="async: divide the learning rate by each gradient's staleness (Zhang et al. 2016); "
        "--no-staleness-lr applies every gradient at the full lr, as Downpour SGD (default: on)")
    add("--sync-every", type=int, default=d.sync_every, metavar="H", help="local-sgd: optimizer steps between "
        "parameter averages (default %(default)s)")
    add("--straggler", default=None, metavar="RANK:FACTOR", help="make worker RANK's compute take FACTOR "
        "times as long (it sleeps in proportion), e.g. 1:3")
    add("--model", default=d.model, metavar="{" + ",".join(MODELS) + "}", help="model (default %(default)s)")
    add("--epochs", type=int, default=d.epochs, help="passes over the training data (default %(default)s)")
    add("--batch-size", type=int, default=d.batch_size, help="samples per worker per micro-batch "
        "(default %(default)s)")
    add("--accumulate", type=int, default=d.accumulate, help="micro-batches per optimizer step "
        "(default %(default)s)")
    add("--global-batch-size", type=int, default=None, metavar="B", help="samples per optimizer step over all "
        "workers, whatever the world size (instead of --batch-size): each worker takes B / (world size x "
        "--accumulate), and the data order does not depend on the world size")
    add("--deterministic", action="store_true", help="bitwise the same parameters at any world size and "
        "placement for the same --global-batch-size, seed and thread count: the global batch is cut into "
        "--micro-shards pieces, one backward each, summed exactly (1 torch thread per worker)")
    add("--micro-shards", type=int, default=d.micro_shards, metavar="M", help="--deterministic: pieces of each "
        "global batch; up to M workers, equal shares when the world size divides M (default %(default)s)")
    add("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    add("--lr-schedule", default=d.lr_schedule, metavar="{" + ",".join(LR_SCHEDULES) + "}",
        help="learning-rate schedule (default %(default)s)")
    add("--optimizer", default=d.optimizer, metavar="{" + ",".join(OPTIMIZERS) + "}",
        help="optimizer: sgd (momentum 0.9) or adam (AdamW) (default %(default)s)")
    add("--weight-decay", type=float, default=d.weight_decay, help="(default %(default)s)")
    add("--algorithm", default=d.algorithm, metavar="{" + ",".join(ALGORITHMS) + "}",
        help="AllReduce algorithm for gradients (sync) or parameter averages (local-sgd); auto picks the "
        "fastest per bucket size, and the end of the run names what it chose (default %(default)s)")
    add("--bucket-cap-mb", type=float, default=d.bucket_cap_mb, help="MiB of gradients per bucket "
        "(default %(default)s)")
    add("--gradient-as-bucket-view", action="store_true",
        help="make each .grad a view into its bucket (one copy of the gradients fewer)")
    add("--debug", action="store_true", help="sync: DataParallel's debug checks (one small all_gather per "
        "forward): the same batch on every rank, gradients reduced twice or not at all, a loss not divided "
        "by --accumulate, a fixed epoch order; also GRADSYNC_DEBUG=1")
    add("--compression", default=d.compression, metavar="{" + ",".join(COMPRESSIONS) + "}",
        help="gradient compression: fp16/bf16 (16-bit values), onebit (signs + error feedback), topk "
        "(largest entries + error feedback), powersgd (low rank + error feedback) (default %(default)s)")
    add("--topk-ratio", type=float, default=d.topk_ratio, help="fraction of each bucket topk sends "
        "(default %(default)s)")
    add("--powersgd-rank", type=int, default=d.powersgd_rank, help="approximation rank of powersgd "
        "(default %(default)s)")
    add("--compression-warmup-steps", type=int, default=d.compression_warmup_steps, help="exact AllReduce "
        "for the first optimizer steps, compression after (1-bit Adam's warm-up) (default %(default)s)")
    add("--trace", default=None, metavar="FILE", help="write a Chrome trace (chrome://tracing, Perfetto) "
        "of forward, backward, bucket AllReduces and optimizer steps, one track per rank")
    add("--seed", type=int, default=d.seed, help="seed for model init and shuffling (default %(default)s)")
    add("--timeout", type=float, default=d.timeout, help="seconds a collective may wait for a peer "
        "(default %(default)s)")
    add("--max-restarts", type=int, default=d.max_restarts, help="restart the workers from the newest "
        "checkpoint up to this many times when one fails or hangs (default %(default)s)")
    add("--checkpoint-dir", default=None, metavar="DIR", help="write checkpoints here and resume from the "
        "newest complete one on start (default: <run folder>/checkpoints when --max-restarts > 0)")
    add("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="K", help="optimizer steps between "
        "checkpoints (default %(default)s)")
    add("--keep-checkpoints", type=int, default=d.keep_checkpoints, metavar="N", help="complete checkpoints "
        "to keep (default %(default)s)")
    add("--fail-at", default=None, metavar="RANK:STEP", help="fault injection: worker RANK dies at optimizer "
        "step STEP, on the first attempt only")
    add("--hang-at", default=None, metavar="RANK:STEP", help="fault injection: worker RANK hangs at optimizer "
        "step STEP, on the first attempt only (the others time out after --timeout)")
    add("--check-replicas-every", type=int, default=d.check_replicas_every, metavar="N", help="compare a "
        "checksum of every replica's parameters and optimizer state across ranks every N optimizer steps "
        "(local-sgd: at the first average after each N), recorded in metrics.jsonl; a divergence stops the job "
        "naming the tensor and the ranks (default 0: never)")
    add("--num-samples", type=int, default=d.num_samples, help="MNIST-1D samples to draw, 80%% train / "
        "20%% test (default %(default)s; 5000 is the paper's split)")
    add("--data-dir", default=None, help="cache for generated data (default $GRADSYNC_DATA_DIR or "
        "~/.cache/gradsync)")
    add("--out", default=None, help="run folder (default runs/<timestamp>)")
    add("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    add("--hosts", type=int, default=None, metavar="H", help="run on H test hosts (network, UTS, mount and PID "
        "namespaces on this machine, root needed) with --nproc workers each: one torchrun per host")
    add("--inter-host-gbit", type=float, default=None, metavar="G", help="--hosts: shape each host's link to "
        "G Gbit/s (tc tbf; default unshaped)")
    add("--join-timeout", type=float, default=d.join_timeout, metavar="S", help="--hosts: seconds the "
        "rendezvous waits for every host (default %(default)s)")
    add("--cut-link-at", default=None, metavar="HOST:STEP", help="--hosts fault injection: set HOST's link down "
        "at optimizer step STEP (up again after --timeout + 5 s when --max-restarts > 0)")
    add("--kill-host-at", default=None, metavar="HOST:STEP", help="--hosts fault injection: kill every process "
        "on HOST at optimizer step STEP (its agent is started again when --max-restarts > 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="gradsync", description="Data-parallel training with gradsync.")
    parser.add_argument("--version", action="version", version=f"gradsync {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    train = commands.add_parser("train", help="train a model on MNIST-1D across local workers",
                                description="Train on MNIST-1D data-parallel across --nproc local "
                                "workers (or under torchrun, across the workers it started).")
    _add_train_options(train)
    bench = commands.add_parser("bench", help="benchmarks that print tables")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=_OneLineParser)
    _add_allreduce_bench_options(benches.add_parser(
        "allreduce", help="nccl-tests-style AllReduce sweep over sizes and algorithms",
        description="Time every algorithm at every size across --nproc local processes, "
                    "interleaved with the backend's native all_reduce."))
    _add_train_bench_options(benches.add_parser(
        "train", help="training samples/s of gradsync DataParallel next to torch DDP",
        description="Train the same models with gradsync DataParallel (one row per algorithm) and "
                    "torch DistributedDataParallel on the same data, world size and thread count, "
                    "alternating them over rounds; report samples/s, the ratio to DDP, gradsync's "
                    "communication and exposed-communication time per step, the step overhead against "
                    "a compute-only run, and peak memory with gradient_as_bucket_view off and on."))
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
    return parser


def _add_replicas_bench_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--nproc", default="2", help="comma-separated world sizes, one local world each (default %(default)s)")
    add("--model", default="cnn,mlp", help="comma-separated bench models: cnn, mlp (default %(default)s)")
    add("--steps", type=int, default=50, help="timed steps per round for cnn; mlp runs steps // 5 "
        "(default %(default)s)")
    add("--checks", type=int, default=10, help="timed checks of each kind per round (default %(default)s)")
    add("--rounds", type=int, default=5, help="alternating rounds; the median is reported (default %(default)s)")
    add("--json", default=None, metavar="FILE", help="also write the rows as a JSON list")


def bench_replicas(args: argparse.Namespace) -> int:
    from gradsync.bench.replica_checks import run_bench

    run_bench(nproc=args.nproc, models=args.model, steps=args.steps, checks=args.checks, rounds=args.rounds,
              json_path=args.json)
    return 0


def _add_deterministic_bench_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    for option, default, meaning in (("--nproc", "2,4", "world sizes"), ("--model", "cnn,mlp", "models"),
                                     ("--micro-shards", "4,12", "micro-shard counts, a row each")):
        add(option, default=default, help=f"comma-separated {meaning} (default %(default)s)")
    add("--algorithm", default="auto", help="AllReduce algorithm of both modes (default %(default)s)")
    for option, default, meaning in (("--steps", 30, "timed steps for cnn; mlp runs steps // 5"),
                                     ("--warmup", 2, "untimed steps first"), ("--rounds", 3, "alternating rounds")):
        add(option, type=int, default=default, help=f"{meaning} (default %(default)s)")
    add("--no-memory", dest="memory", action="store_false", help="skip the peak-memory worlds")
    add("--json", default=None, metavar="FILE", help="also write the rows as a JSON list")


def _add_faults_bench_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--nproc", type=int, default=4, help="workers (default %(default)s)")
    add("--epochs", type=int, default=3, help="(default %(default)s)")
    add("--checkpoint-every", type=int, default=25, help="optimizer steps between checkpoints (default %(default)s)")
    add("--timeout", type=float, default=5.0, help="collective timeout, seconds: what a hang costs to detect "
        "(default %(default)s)")
    add("--fault-rank", type=int, default=1, help="the worker that dies or hangs (default %(default)s)")
    add("--fault-step", type=int, default=None, help="the step it dies or hangs at (default: mid-run, the step "
        "before a checkpoint, so the most steps are recomputed)")
    add("--num-samples", type=int, default=None, help="MNIST-1D samples (default: the main job's)")
    add("--out", default=None, help="folder for the run folders (default: a new temporary folder)")
    add("--json", default=None, metavar="FILE", help="also write the rows as a JSON list")


def _add_modes_bench_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--staleness-bounds", default="none,4,none+lr", help="async runs, one per --max-staleness value; none = "
        "unbounded; a +lr suffix adds --staleness-lr; empty: no async runs (default %(default)s)")
    add("--sync-every", default="4,16", help="local-sgd runs, one per H; empty: none (default %(default)s)")
    add("--straggler-factor", type=float, default=3.0, help="worker rank 1's compute takes this many times "
        "as long in the second set of runs; 1: skip them (default %(default)s)")
    add("--staleness-lr", action="store_true", help="every async run divides the lr by the staleness")
    add("--nproc", type=int, default=4, help="workers (default %(default)s)")
    add("--epochs", type=int, default=_DEFAULTS.epochs, help="(default %(default)s)")
    add("--lr", type=float, default=None, help="learning rate of every run (default: the main job's)")
    add("--num-samples", type=int, default=None, help="MNIST-1D samples (default: the main job's)")
    add("--target", type=float, default=0.85, help="test accuracy whose first crossing is timed "
        "(default %(default)s)")
    add("--out", default=None, help="folder for the run folders and the plot (default: a new temporary folder)")
    add("--json", default=None, metavar="FILE", help="also write the rows as a JSON list")


def _add_compression_bench_options(parser: argparse.ArgumentParser) -> None:
    from gradsync.bench.compression import DEFAULT_WARMUP_STEPS

    add = parser.add_argument
    add("--compressions", default=",".join(COMPRESSIONS), help="comma-separated (default %(default)s)")
    add("--nproc", type=int, default=4, help="workers of the accuracy runs (default %(default)s)")
    add("--epochs", type=int, default=_DEFAULTS.epochs, help="epochs of the accuracy runs (default %(default)s)")
    add("--num-samples", type=int, default=None, help="MNIST-1D samples of the accuracy runs (default: the "
        "main job's)")
    add("--compression-warmup-steps", dest="warmup_steps", type=int, default=DEFAULT_WARMUP_STEPS,
        help="exact steps before compression starts, accuracy runs (default %(default)s)")
    add("--throughput-nproc", type=int, default=4, help="workers of the MLP throughput part (default %(default)s)")
    add("--throughput-steps", type=int, default=5, help="timed MLP steps per round (default %(default)s)")
    add("--rounds", type=int, default=3, help="alternating MLP rounds; the median is reported "
        "(default %(default)s)")
    add("--no-accuracy", dest="accuracy", action="store_false", help="skip the accuracy runs")
    add("--no-throughput", dest="throughput", action="store_false", help="skip the MLP throughput part")
    add("--out", default=None, help="folder for the run folders and the plot (default: a new temporary folder)")
    add("--json", default=None, metavar="FILE", help="also write the rows as a JSON list")


def _add_allreduce_bench_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--nproc", type=int, default=4, help="processes (default %(default)s)")
    add("--sizes", default="4K,64K,1M,16M,64M", help="message sizes in bytes, K/M/G suffixes "
        "(default %(default)s)")
    add("--algorithms", default=None,
        help="comma-separated; native is always measured for the ratio; 'mpi' adds MPI_Allreduce "
        "measured in the same processes (needs pip install -e '.[mpi]' in the clone, or 'gradsync[mpi]') (default "
        "ring,tree,halving_doubling,hierarchical,shm,shm_zero_copy,native, plus mpi when mpi4py is "
        "installed; shm_zero_copy: shm on data already in shared memory, as zero-copy buckets)")
    add("--repetitions", type=int, default=5, help="timed repetitions per point; the median is "
        "reported (default %(default)s)")
    add("--ranks-per-node", type=int, default=None, help="pretend nodes of this many ranks for "
        "hierarchical (default: 2 when --nproc is even and >= 4, else --nproc)")
    add("--segment-bytes", type=int, default=None, help="pipelining segment of ring and tree "
        "(default: the library's)")
    add("--json", default=None, metavar="FILE", help="also write the rows as a JSON list")
    _add_bench_hosts_options(parser)


def _add_train_bench_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--nproc", default="2", help="comma-separated world sizes, one local world each (default %(default)s)")
    add("--model", default="cnn,mlp", help="comma-separated: cnn (MNIST-1D CNN, batch 128 per rank), "
        "mlp (1024-4096-4096-1024-10, ~25.2M parameters, batch 64 per rank) (default %(default)s)")
    add("--algorithms", default="ring,native", help="gradsync AllReduce algorithms, one row each; torch "
        "DDP is always measured; shm_zero_copy = shm with gradient_as_bucket_view (buckets in shared "
        "memory) (default %(default)s)")
    add("--steps", type=int, default=100, help="timed steps per measurement for cnn; mlp runs steps // 5 "
        "(default %(default)s)")
    add("--warmup", type=int, default=3, help="untimed steps before each measurement (default %(default)s)")
    add("--rounds", type=int, default=5, help="alternating rounds; the median is reported "
        "(default %(default)s)")
    add("--json", default=None, metavar="FILE", help="also write the rows as a JSON list")
    add("--no-memory", dest="memory", action="store_false", help="skip the peak-memory comparison of "
        "gradient_as_bucket_view False/True (largest model, world size 2)")
    _add_bench_hosts_options(parser)


def _add_bench_hosts_options(parser: argparse.ArgumentParser) -> None:
    from gradsync.hosts.torchrun import DEFAULT_JOIN_TIMEOUT_S

    add = parser.add_argument
    add("--hosts", type=int, default=None, help="run on this many test hosts (network namespaces, needs "
        "root), one torchrun each; --nproc is then the ranks per host")
    add("--inter-host-gbit", type=float, default=None, help="shape each test host's link to this rate "
        "(Gbit/s, tc tbf) (default: unshaped)")
    add("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT_S, help="seconds the hosts' rendezvous "
        "waits for every host (default %(default)s)")


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {name: value for name, value in vars(args).items() if name != "command"}
    return TrainConfig(**fields)


def train(args: argparse.Namespace) -> int:
    from gradsync.train.job import run_job
    from gradsync.train.summary import algorithm_line

    summary = run_job(_config_from_args(args))
    if summary is not None and args.hosts is None:  # across hosts, host 0's rank 0 printed it (relayed)
        print(algorithm_line(summary))
        print(f"test accuracy {100 * summary['final_test_accuracy']:.2f}% | "
              f"{summary['samples_per_s']:.0f} samples/s | {summary['wall_s']:.1f} s | "
              f"run folder {summary['config']['out']}")
    return 0


def bench_allreduce(args: argparse.Namespace) -> int:
    from gradsync.bench.allreduce import run_sweep

    run_sweep(nproc=args.nproc, sizes=args.sizes, algorithms=args.algorithms,
              repetitions=args.repetitions, ranks_per_node=args.ranks_per_node,
              segment_bytes=args.segment_bytes, json_path=args.json, hosts=args.hosts,
              inter_host_gbit=args.inter_host_gbit, join_timeout_s=args.join_timeout)
    return 0


def bench_train(args: argparse.Namespace) -> int:
    from gradsync.bench.train import run_bench

    run_bench(nproc=args.nproc, models=args.model, algorithms=args.algorithms, steps=args.steps,
              warmup=args.warmup, rounds=args.rounds, json_path=args.json, memory=args.memory,
              hosts=args.hosts, inter_host_gbit=args.inter_host_gbit, join_timeout_s=args.join_timeout)
    return 0


def bench_deterministic(args: argparse.Namespace) -> int:
    from gradsync.bench.determinism import run_bench

    run_bench(nproc=args.nproc, models=args.model, micro_shards=args.micro_shards, algorithm=args.algorithm,
              steps=args.steps, warmup=args.warmup, rounds=args.rounds, json_path=args.json, memory=args.memory)
    return 0


def bench_compression(args: argparse.Namespace) -> int:
    from gradsync.bench.compression import run_bench

    run_bench(compressions=args.compressions, nproc=args.nproc, epochs=args.epochs, warmup_steps=args.warmup_steps,
              throughput_nproc=args.throughput_nproc, throughput_steps=args.throughput_steps, rounds=args.rounds,
              out=args.out, json_path=args.json, num_samples=args.num_samples, accuracy=args.accuracy,
              throughput=args.throughput)
    return 0


def bench_modes(args: argparse.Namespace) -> int:
    from gradsync.bench.modes import run_bench

    run_bench(staleness_bounds=args.staleness_bounds, sync_every=args.sync_every,
              straggler_factor=args.straggler_factor, nproc=args.nproc, epochs=args.epochs,
              num_samples=args.num_samples, lr=args.lr, staleness_lr=args.staleness_lr, target=args.target,
              out=args.out, json_path=args.json)
    return 0


def bench_faults(args: argparse.Namespace) -> int:
    from gradsync.bench.faults import run_bench

    run_bench(nproc=args.nproc, epochs=args.epochs, checkpoint_every=args.checkpoint_every, timeout=args.timeout,
              fault_rank=args.fault_rank, fault_step=args.fault_step, num_samples=args.num_samples, out=args.out,
              json_path=args.json)
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
            "replicas": bench_replicas, "report": bench_report.run,
            "record": _record}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse like ``parse_args``, but an unknown option is reported by the command it was given to."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        command = " ".join(part for part in (args.command, getattr(args, "bench", None)) if part)
        print(f"gradsync {command}: error: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        sys.exit(2)
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gradsync`` console script; returns the exit code."""
    args = _parse(argv)
    try:
        if args.command == "bench":
            return _BENCHES[args.bench](args)
        if args.command == "debug":
            return debug(args)
        return train(args)
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
