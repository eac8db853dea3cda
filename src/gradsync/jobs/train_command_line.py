"""The ``gradsync train`` command's options and entry point (argparse only; ``gradsync.cli`` registers them)."""

from __future__ import annotations

import argparse
import sys

from gradsync.collectives.ops import ALGORITHMS
from gradsync.compression import COMPRESSIONS
from gradsync.errors import MissingExtraError
from gradsync.parallel.outer_optimizer import OUTER_OPTIMIZERS
from gradsync.parallel.outer_sync import OUTER_COMPRESSIONS
from gradsync.parallel.shard_layout import IMPLEMENTED_LEVELS
from gradsync.train.config import GPT_LR, LR_SCALINGS, LR_SCHEDULES, MODES, OPTIMIZERS, TrainConfig, default_lr
from gradsync.train.models import MODELS

_DEFAULTS = TrainConfig()


def add_train_options(parser: argparse.ArgumentParser) -> None:
    """Every ``gradsync train`` option on ``parser``, one per :class:`~gradsync.train.config.TrainConfig` field
    (defaults from ``TrainConfig()``; ``--lr``'s None means the model's)."""
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
    add("--outer-optimizer", default=d.outer_optimizer, metavar="{" + ",".join(OUTER_OPTIMIZERS) + "}",
        help="local-sgd: none averages the parameters every H steps; nesterov steps them with Nesterov momentum "
        "on the averaged pseudo-gradient (DiLoCo, Douillard et al. 2023) (default %(default)s)")
    add("--outer-lr", type=float, default=d.outer_lr, help="--outer-optimizer nesterov: outer learning rate "
        "(default %(default)s, the DiLoCo paper's)")
    add("--outer-momentum", type=float, default=d.outer_momentum, help="--outer-optimizer nesterov: outer "
        "momentum (default %(default)s, the DiLoCo paper's)")
    add("--outer-compression", default=d.outer_compression, metavar="{" + ",".join(OUTER_COMPRESSIONS) + "}",
        help="local-sgd: the outer deltas travel as fp32 (exact, --algorithm) or bf16, fp16, int8 (one absmax "
        "scale per chunk) with error feedback (default %(default)s)")
    add("--outer-fragments", type=int, default=d.outer_fragments, metavar="F", help="local-sgd: Streaming "
        "DiLoCo: F fragments of the parameters, each synced once per H steps at its own staggered step, its "
        "AllReduce overlapping the next inner step; F divides H (default %(default)s)")
    add("--straggler", default=None, metavar="RANK:FACTOR", help="make worker RANK's compute take FACTOR "
        "times as long (it sleeps in proportion), e.g. 1:3")
    add("--model", default=d.model, metavar="{" + ",".join(MODELS) + "}", help="model: logreg, mlp, cnn on "
        "MNIST-1D, or gpt (a decoder-only transformer) on Python's own help texts, next character (default "
        "%(default)s)")
    add("--gpt-width", type=int, default=d.gpt_width, metavar="W", help="--model gpt: embedding width, a multiple "
        "of --gpt-heads (default %(default)s)")
    add("--gpt-depth", type=int, default=d.gpt_depth, metavar="L", help="--model gpt: transformer blocks "
        "(default %(default)s)")
    add("--gpt-heads", type=int, default=d.gpt_heads, metavar="H", help="--model gpt: attention heads "
        "(default %(default)s)")
    add("--gpt-context", type=int, default=d.gpt_context, metavar="T", help="--model gpt: characters per sample "
        "(default %(default)s)")
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
    add("--lr", type=float, default=None, help=f"peak learning rate before --lr-scaling (default {d.lr}; {GPT_LR} "
        "with --model gpt)")
    add("--lr-schedule", default=d.lr_schedule, metavar="{" + ",".join(LR_SCHEDULES) + "}",
        help="after the warm-up: cosine decay towards 0 at the last step, constant, or step (x0.1 at 1/3, 2/3 and "
        "8/9 of the run's steps, Goyal et al.'s epochs 30, 60, 80 of 90) (default %(default)s)")
    add("--lr-scaling", default=d.lr_scaling, metavar="{" + ",".join(LR_SCALINGS) + "}",
        help="scale --lr from --base-batch-size B to the global batch G: x G/B (linear, Goyal et al. 2017) or x "
        "sqrt(G/B); G = samples per optimizer step over all workers (--batch-size x --accumulate x workers, or "
        "--global-batch-size); --elastic keeps G fixed whatever the membership, so the lr does not change when "
        "workers leave or join; async: one worker's batch x --accumulate (default %(default)s)")
    add("--base-batch-size", type=int, default=None, metavar="B", help="--lr-scaling: the global batch --lr was "
        "tuned for")
    add("--warmup-steps", type=int, default=None, metavar="N", help="linear warm-up over the first N optimizer "
        "steps, from lr/N at step 0 to the (scaled) lr at step N-1, then --lr-schedule")
    add("--warmup-epochs", type=float, default=None, metavar="E", help="the same warm-up over E epochs' optimizer "
        "steps (instead of --warmup-steps; Goyal et al. warm up over 5 epochs)")
    add("--optimizer", default=d.optimizer, metavar="{" + ",".join(OPTIMIZERS) + "}",
        help="sgd (momentum 0.9), adamw (adam is accepted as its alias), lars (You et al. 2017: SGD with "
        "momentum 0.9 and per-layer trust ratios, coefficient 0.001: give a large --lr, ~1-10), lamb (You et al. "
        "2019: AdamW's update with per-layer trust ratios); lars and lamb exempt biases and normalisation "
        "weights from weight decay and trust ratio (default %(default)s)")
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
    add("--shard", default=d.shard, metavar="{" + ",".join(IMPLEMENTED_LEVELS) + "}",
        help="ZeRO: each worker keeps the optimizer state (optimizer, ZeRO-1) or also the gradients (gradients, "
        "ZeRO-2) of its shard only; gradients are reduce-scattered and parameters all-gathered after the step; "
        "parameters (ZeRO-3) keeps only its shard of the parameters too, each unit (a transformer block) "
        "gathered for its forward and backward (default %(default)s)")
    add("--clip-grad-norm", type=float, default=None, metavar="MAX", help="scale the step's gradients so that "
        "their global 2-norm, over every shard, is at most MAX (torch.nn.utils.clip_grad_norm_'s rule)")
    add("--trace", default=None, metavar="FILE", help="write a Chrome trace (chrome://tracing, Perfetto) "
        "of forward, backward, bucket AllReduces and optimizer steps, one track per rank")
    add("--tensorboard", default=None, metavar="DIR", help="write TensorBoard event files into DIR (the main rank): "
        "per step loss, samples/s, communication share, exposed communication and bytes sent, accuracy at each "
        "evaluation, the algorithm per bucket (docs/tensorboard.md; needs gradsync[tensorboard])")
    add("--seed", type=int, default=d.seed, help="seed for model init and shuffling (default %(default)s)")
    add("--timeout", type=float, default=d.timeout, help="seconds a collective may wait for a peer "
        "(default %(default)s)")
    add("--memory-limit-mib", type=int, default=None, metavar="M", help="run each rank in a memory cgroup of its "
        "own (a child of this run's cgroup, removed afterwards) limited to M MiB: the kernel OOM-kills a rank that "
        "needs more (needs a writable memory cgroup controller, i.e. root)")
    add("--no-preflight", dest="preflight", action="store_false", help="skip the memory preflight: before step 1 "
        "every run estimates one rank's memory (parameters, gradients, optimizer state, buffers, activations of "
        "one measured micro-batch) and stops with one line naming what would fit when it exceeds the memory "
        "available (default: on)")
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
    add("--elastic", action="store_true", help="keep training through failures: the survivors of a dead or "
        "hung worker go on without a restart (at most one step redone), its replacement joins from a live peer, "
        "and a checkpoint resumes at any world size")
    add("--min-nproc", type=int, default=None, metavar="A", help="--elastic: fewest workers to train with "
        "(default 1)")
    add("--max-nproc", type=int, default=None, metavar="B", help="--elastic: most workers (default --nproc); "
        "joiners beyond it wait")
    add("--max-relaunches", type=int, default=d.max_relaunches, metavar="N", help="--elastic: times each "
        "worker's launcher starts it again after it dies (default %(default)s)")
    add("--elastic-fault", default=None, metavar="SLOT:WHERE:STEP", help="--elastic fault injection: worker "
        "SLOT dies at optimizer step STEP inside a bucket's AllReduce (WHERE=allreduce) or, as rank 0, inside "
        "the state hand-over to a joiner (WHERE=broadcast); once per run. For tests, ',WORLD:hold:STEP' may "
        "follow: from STEP, a membership of fewer than WORLD members waits for a joiner before its hand-over")
    add("--join", default=None, metavar="RUN", help="--elastic: add one worker to the running elastic job "
        "whose run folder is RUN")
    add("--join-timeout", type=float, default=d.join_timeout, metavar="S", help="--hosts: seconds the "
        "rendezvous waits for every host (default %(default)s)")
    add("--cut-link-at", default=None, metavar="HOST:STEP", help="--hosts fault injection: set HOST's link down "
        "at optimizer step STEP (up again after --timeout + 5 s when --max-restarts > 0)")
    add("--kill-host-at", default=None, metavar="HOST:STEP", help="--hosts fault injection: kill every process "
        "on HOST at optimizer step STEP (its agent is started again when --max-restarts > 0)")


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {name: value for name, value in vars(args).items() if name != "command"}
    if fields["lr"] is None:  # --lr not given: the model's
        fields["lr"] = default_lr(fields["model"])
    return TrainConfig(**fields)


def _given(argv: list[str] | None) -> set[str]:
    """The TrainConfig fields named on the command line, even with their default value (``--no-x`` names x)."""
    names = set()
    for token in sys.argv[1:] if argv is None else argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            names.add(name[3:] if name.startswith("no_") else name)
    return names


def train(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """``gradsync train``: run the job (:func:`~gradsync.jobs.job.run_job`); the main process prints the
    algorithm line, the preflight line and the result line. Returns the exit code (0).

    Raises:
        ValueError: a refused option, before any process starts (one line; ``gradsync`` exits 2), a missing
            extra (``--tensorboard`` without ``gradsync[tensorboard]``) included.
    """
    from gradsync.jobs.job import run_job
    from gradsync.train.memory_report import preflight_line
    from gradsync.train.summary import algorithm_line

    config = _config_from_args(args)
    try:
        summary = run_job(config, given={name for name in _given(argv) if hasattr(config, name)})
    except MissingExtraError as exc:  # the extras are checked before any process starts: a refused option
        raise ValueError(str(exc)) from None
    # across hosts under torchrun, host 0's rank 0 printed it (relayed); an elastic run's job has the summary
    if summary is not None and (args.hosts is None or args.elastic):
        print(algorithm_line(summary))
        if preflight_line(summary):
            print(preflight_line(summary))
        print(f"test accuracy {100 * summary['final_test_accuracy']:.2f}% | "
              f"{summary['samples_per_s']:.0f} samples/s | {summary['wall_s']:.1f} s | "
              f"run folder {summary['config']['out']}")
    return 0
