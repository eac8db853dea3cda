"""Which values of :class:`~gradsync.train.config.TrainConfig` are valid, alone and together, before any
process starts (every message one line naming the option); where each option is honoured at all is
:mod:`gradsync.jobs.option_rules`'s table."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from gradsync.collectives.ops import ALGORITHMS
from gradsync.compression import COMPRESSIONS, make as make_compressor
from gradsync.hosts.netns import link_options_problem
from gradsync.parallel.fragments import check_fragments
from gradsync.parallel.option_names import FLAGS
from gradsync.parallel.outer_optimizer import check_outer_options
from gradsync.parallel.outer_sync import make_codec
from gradsync.parallel.shard_layout import IMPLEMENTED_LEVELS, SHARD_LEVELS, sharding_algorithm_problem
from gradsync.train.config import LR_SCHEDULES, MODES, OPTIMIZER_ALIASES, OPTIMIZERS, TrainConfig, total_steps
from gradsync.train.gpt import size_problem
from gradsync.train.models import MODELS
from gradsync.train.schedule import lr_problem, validate_lr_options, validate_scaled_lr
from gradsync.train.task import make_model

MAX_NUM_SAMPLES = 500_000
MAX_BUCKET_CAP_MB = 2**20  # 1 TiB: beyond any model, and keeps the byte count an int
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def validate(config: TrainConfig) -> None:
    """Raise ValueError with a one-line message naming the first bad option."""
    checks = [
        (config.nproc >= 1, f"--nproc must be >= 1, got {config.nproc}"),
        (config.epochs >= 1, f"--epochs must be >= 1, got {config.epochs}"),
        (config.hosts is None or 1 <= config.hosts <= 250, f"--hosts must be in [1, 250], got {config.hosts}"),
        (config.inter_host_gbit is None or config.hosts is not None, "--inter-host-gbit needs --hosts"),
        (link_options_problem(config.inter_host_gbit, config.join_timeout) is None,
         link_options_problem(config.inter_host_gbit, config.join_timeout)),
        (config.hosts is not None or config.join_timeout == TrainConfig.join_timeout,
         "--join-timeout applies to --hosts (torchrun's rendezvous across test hosts)"),
        (config.hosts is not None or (config.cut_link_at is None and config.kill_host_at is None),
         "--cut-link-at and --kill-host-at need --hosts (they act on test hosts)"),
        (config.hosts is None or config.hosts == 1 or config.algorithm != "shm",
         f"--algorithm shm needs every rank on one host; --hosts {config.hosts} puts the ranks on "
         f"{config.hosts} hosts (use hierarchical or auto)"),
        (config.hosts is None or config.mode == "sync", "--hosts runs --mode sync only (for now)"),
        (config.batch_size >= 1, f"--batch-size must be >= 1, got {config.batch_size}"),
        (config.accumulate >= 1, f"--accumulate must be >= 1, got {config.accumulate}"),
        (lr_problem(config.lr) is None, lr_problem(config.lr)),
        (0 <= config.weight_decay < math.inf,
         f"--weight-decay must be a finite number >= 0, got {config.weight_decay}"),
        (0 < config.bucket_cap_mb <= MAX_BUCKET_CAP_MB,
         f"--bucket-cap-mb must be in (0, {MAX_BUCKET_CAP_MB}], got {config.bucket_cap_mb}"),
        (0 < config.timeout <= MAX_TIMEOUT_S,
         f"--timeout must be in (0, {MAX_TIMEOUT_S}] seconds, got {config.timeout}"),
        (0 <= config.seed < 2**32, f"--seed must be in [0, 2**32), got {config.seed}"),
        (config.memory_limit_mib is None or (_is_int(config.memory_limit_mib) and config.memory_limit_mib >= 1),
         f"--memory-limit-mib must be an int >= 1 (MiB per rank), got {config.memory_limit_mib!r}"),
        (10 <= config.num_samples <= MAX_NUM_SAMPLES,
         f"--num-samples must be in [10, {MAX_NUM_SAMPLES}], got {config.num_samples} "
         f"(generation takes ~0.6 ms per sample)"),
        (config.model in MODELS, f"unknown --model {config.model!r}; choose one of {', '.join(MODELS)}"),
        (config.algorithm in ALGORITHMS,
         f"unknown --algorithm {config.algorithm!r}; choose one of {', '.join(ALGORITHMS)}"),
        (config.compression in COMPRESSIONS,
         f"unknown --compression {config.compression!r}; choose one of {', '.join(COMPRESSIONS)}"),
        (0 < config.topk_ratio <= 1, f"--topk-ratio must be in (0, 1], got {config.topk_ratio}"),
        (config.powersgd_rank >= 1, f"--powersgd-rank must be >= 1, got {config.powersgd_rank}"),
        (config.compression_warmup_steps >= 0,
         f"--compression-warmup-steps must be >= 0, got {config.compression_warmup_steps}"),
        (config.optimizer in OPTIMIZERS,
         f"unknown --optimizer {config.optimizer!r}; choose one of {', '.join(OPTIMIZERS)} "
         f"({', '.join(f'{alias} = {name}' for alias, name in OPTIMIZER_ALIASES.items())})"),
        (config.lr_schedule in LR_SCHEDULES,
         f"unknown --lr-schedule {config.lr_schedule!r}; choose one of {', '.join(LR_SCHEDULES)}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    if config.model == "gpt" and size_problem(config.gpt_width, config.gpt_depth, config.gpt_heads,
                                              config.gpt_context):
        raise ValueError(size_problem(config.gpt_width, config.gpt_depth, config.gpt_heads, config.gpt_context))
    _validate_mode(config)
    validate_lr_options(config)
    _validate_outer(config)
    _validate_sharding(config)
    _validate_trajectory(config)
    _validate_fault_tolerance(config)
    validate_elastic(config)
    if not _is_int(config.check_replicas_every) or config.check_replicas_every < 0:
        raise ValueError(f"--check-replicas-every must be an int >= 0 (optimizer steps), got "
                         f"{config.check_replicas_every}")
    if config.mode == "async" and config.check_replicas_every:
        raise ValueError("--check-replicas-every applies to --mode sync and local-sgd: async workers hold "
                         "different parameter versions by design")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_sharding(config: TrainConfig) -> None:
    """``--shard`` (ZeRO level) and ``--clip-grad-norm``: their values, and what sharding cannot combine with
    (where each is honoured at all is the option table's)."""
    shard, clip = config.shard, config.clip_grad_norm
    if shard not in SHARD_LEVELS:
        raise ValueError(f"unknown --shard {shard!r}; choose one of {', '.join(IMPLEMENTED_LEVELS)}")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip < math.inf):
        raise ValueError(f"--clip-grad-norm must be a finite number > 0, got {clip!r}")
    if shard == "none":
        return
    if config.compression in COMPRESSIONS and not getattr(make_compressor(config.compression), "can_reduce_scatter",
                                                          True):
        raise ValueError(f"--shard {shard} cannot combine with --compression {config.compression}: a reduce-scatter "
                         f"sums each rank's chunk of a bucket, and {config.compression} messages are not summable "
                         f"chunk by chunk; use --compression none, fp16 or bf16")
    if sharding_algorithm_problem(config.algorithm) is not None:
        raise ValueError(f"--shard {shard} cannot combine with --algorithm {config.algorithm}: "
                         f"{sharding_algorithm_problem(config.algorithm)}")
    if config.gradient_as_bucket_view:
        raise ValueError(f"--shard {shard} cannot combine with --gradient-as-bucket-view: the reduce-scatter leaves "
                         f"only this rank's chunk of each bucket averaged (the gradients live in the optimizer's "
                         f"shard)")


def _validate_fault_tolerance(config: TrainConfig) -> None:
    """Restarts, checkpoints and fault injection (issue-8 options)."""
    d = TrainConfig()
    if not _is_int(config.max_restarts) or config.max_restarts < 0:
        raise ValueError(f"--max-restarts must be an int >= 0, got {config.max_restarts}")
    if not _is_int(config.checkpoint_every) or config.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every must be an int >= 1 (optimizer steps), got {config.checkpoint_every}")
    if not _is_int(config.keep_checkpoints) or config.keep_checkpoints < 1:
        raise ValueError(f"--keep-checkpoints must be an int >= 1, got {config.keep_checkpoints}")
    if config.checkpoint_dir is not None and not str(config.checkpoint_dir).strip():
        raise ValueError("--checkpoint-dir needs a folder name, got an empty string")
    if not config.checkpointing():
        for flag, value, default in [("--checkpoint-every", config.checkpoint_every, d.checkpoint_every),
                                     ("--keep-checkpoints", config.keep_checkpoints, d.keep_checkpoints)]:
            if value != default:
                raise ValueError(f"{flag} needs --checkpoint-dir or --max-restarts")
    if config.mode == "async":
        for flag, used in [("--checkpoint-dir", config.checkpoint_dir is not None and not config.elastic),
                           ("--max-restarts", config.max_restarts > 0), ("--fail-at", config.fail_at is not None),
                           ("--hang-at", config.hang_at is not None)]:
            if used and config.elastic:
                raise ValueError(f"{flag} is not implemented for --mode async --elastic: kill a worker or the "
                                 f"server by its PID (events.jsonl lists them) to try a failure")
            if used:
                raise ValueError(f"{flag} applies to --mode sync and local-sgd (and --checkpoint-dir to "
                                 "--mode async --elastic): a parameter server without --elastic does not "
                                 "checkpoint (a restart would lose its updates)")
    config.fault_rank_step("fail_at")
    config.fault_rank_step("hang_at")


def _validate_trajectory(config: TrainConfig) -> None:
    """``--global-batch-size``, ``--deterministic`` and ``--micro-shards``: what they need and what they exclude."""
    d = TrainConfig()
    size = config.global_batch_size
    if size is not None and (not _is_int(size) or size < 1):
        raise ValueError(f"--global-batch-size must be an int >= 1, got {size!r}")
    if size is not None and config.batch_size != d.batch_size:
        raise ValueError(f"--batch-size {config.batch_size} and --global-batch-size {size} exclude each other: the "
                         "global batch fixes each worker's share (global batch / (world size x --accumulate))")
    if size is not None and config.mode == "async":
        raise ValueError("--global-batch-size applies to --mode sync and local-sgd: async workers step alone")
    if not _is_int(config.micro_shards) or config.micro_shards < 1:
        raise ValueError(f"--micro-shards must be an int >= 1, got {config.micro_shards!r}")
    if not config.deterministic:
        if config.micro_shards != d.micro_shards:
            raise ValueError("--micro-shards applies to --deterministic")
        return
    if size is None:
        raise ValueError("--deterministic needs --global-batch-size B: the global batch is what stays the same "
                         "whatever the world size")
    if config.micro_shards > size:
        raise ValueError(f"--micro-shards {config.micro_shards} is more than --global-batch-size {size}: every "
                         "micro-shard needs at least one sample")
    refused = [("--mode " + config.mode, config.mode != "sync",
                "async applies gradients in arrival order and local SGD steps each worker on its own data"),
               ("--compression " + config.compression, config.compression != d.compression,
                "a lossy compressor with per-rank error feedback makes the sum depend on the placement"),
               ("--accumulate", config.accumulate != d.accumulate,
                "each worker already runs its micro-shards one after the other (--micro-shards sets their number)"),
               ("--bucket-cap-mb", config.bucket_cap_mb != d.bucket_cap_mb,
                "the gradients travel as one exact int64 sum after the last micro-shard, not in buckets"),
               ("--gradient-as-bucket-view", config.gradient_as_bucket_view, "there are no buckets"),
               ("--debug", config.debug, "its checks watch DataParallel's buckets and input batches; "
                "DeterministicDataParallel checks its micro-shards itself")]
    for option, used, why in refused:
        if used:
            raise ValueError(f"--deterministic cannot be combined with {option}: {why}")


def _validate_mode(config: TrainConfig) -> None:
    """Mode-specific options: each belongs to one mode, and a straggler must be a worker."""
    d = TrainConfig()
    if config.mode not in MODES:
        raise ValueError(f"unknown --mode {config.mode!r}; choose one of {', '.join(MODES)}")
    only = {"async": [("--max-staleness", config.max_staleness, d.max_staleness),
                      ("--no-staleness-lr", config.staleness_lr, d.staleness_lr)],
            "local-sgd": [("--sync-every", config.sync_every, d.sync_every)],
            "sync": [("--compression", config.compression, d.compression),
                     ("--gradient-as-bucket-view", config.gradient_as_bucket_view, d.gradient_as_bucket_view),
                     ("--debug", config.debug, d.debug)]}
    for mode, options in only.items():
        for flag, value, default in options:
            if config.mode != mode and value != default:
                raise ValueError(f"{flag} applies to --mode {mode}, not --mode {config.mode}")
    if config.max_staleness is not None and (isinstance(config.max_staleness, bool)
                                             or not isinstance(config.max_staleness, int)
                                             or config.max_staleness < 0):
        raise ValueError(f"--max-staleness must be an int >= 0, got {config.max_staleness}")
    if isinstance(config.sync_every, bool) or not isinstance(config.sync_every, int) or config.sync_every < 1:
        raise ValueError(f"--sync-every must be an int >= 1, got {config.sync_every}")
    if config.mode == "async" and config.trace is not None:
        raise ValueError("--trace records bucket AllReduces: use it with --mode sync or local-sgd")
    if config.mode == "async" and config.algorithm != d.algorithm:
        raise ValueError("--algorithm applies to --mode sync and local-sgd: async sends gradients to the server")
    if config.mode != "sync" and config.bucket_cap_mb != d.bucket_cap_mb:
        raise ValueError(f"--bucket-cap-mb applies to --mode sync, not --mode {config.mode}")
    config.straggler_rank_factor()


def _validate_outer(config: TrainConfig) -> None:
    """DiLoCo's options: the outer optimizer and its lr / momentum, the compression, the fragments (they
    divide --sync-every and cut the model's parameter tensors)."""
    check_outer_options(config.outer_optimizer, config.outer_lr, config.outer_momentum, spelling=FLAGS)
    make_codec(config.outer_compression, spelling=FLAGS)
    if config.outer_fragments != 1:
        with torch.random.fork_rng(devices=[]):  # building the model draws from the global RNG
            tensors = sum(1 for p in make_model(config).parameters() if p.dtype.is_floating_point)
        check_fragments(config.outer_fragments, config.sync_every, tensors, spelling=FLAGS)


def validate_against_data(config: TrainConfig, world_size: int, num_train: int) -> None:
    """Check that every worker gets at least one full optimizer step per epoch, and the straggler exists."""
    if config.mode == "async" and world_size < 2:
        raise ValueError("--mode async needs a server and at least one worker: 2 or more processes")
    world_size = config.num_workers(world_size)  # the data is shared among the workers only
    validate_scaled_lr(config, world_size, num_train)
    straggler = config.straggler_rank_factor()
    if straggler is not None and straggler[0] >= world_size:
        raise ValueError(f"--straggler rank {straggler[0]} is not a worker: workers are ranks 0..{world_size - 1}")
    needed = config.batch_size * config.accumulate
    if config.mode == "async":  # the workers take batches from one shared shuffle
        if num_train < needed:
            raise ValueError(f"the {num_train} training samples are fewer than one step's --batch-size "
                             f"{config.batch_size} x --accumulate {config.accumulate} = {needed}")
        _validate_warmup_steps(config, run_steps(config, world_size, num_train))
        return
    if world_size > num_train:
        raise ValueError(f"world size {world_size} is larger than the {num_train} training samples")
    if config.global_batch_size is not None:
        _validate_global_batch(config, world_size, num_train)
    else:
        per_rank = -(-num_train // world_size)  # DistributedSampler pads to equal shares
        needed = config.batch_size * config.accumulate
        if per_rank < needed:
            raise ValueError(f"each of the {world_size} workers gets {per_rank} training samples, fewer than "
                             f"--batch-size {config.batch_size} x --accumulate {config.accumulate} = {needed}")
    last_step = total_steps(config, world_size, num_train)
    _validate_warmup_steps(config, run_steps(config, world_size, num_train))
    _validate_outer_rounds(config, last_step)
    for which in ("fail_at", "hang_at"):
        fault = config.fault_rank_step(which)
        flag = "--" + which.replace("_", "-")
        if fault is not None and fault[0] >= world_size:
            raise ValueError(f"{flag} rank {fault[0]} is not a worker: workers are ranks 0..{world_size - 1}")
        if fault is not None and fault[1] > last_step:
            raise ValueError(f"{flag} step {fault[1]} is after the job's last step {last_step}")
    _validate_elastic_fault(config, last_step)
    for which in ("cut_link_at", "kill_host_at"):
        fault = config.host_fault(which)
        if fault is not None and fault[1] > last_step:
            raise ValueError(f"--{which.replace('_', '-')} step {fault[1]} is after the job's last step {last_step}")


def run_steps(config: TrainConfig, workers: int, num_train: int) -> int:
    """Optimizer steps of the whole run for ``workers`` workers: the server's applied gradients under async,
    the fixed global batch's steps under ``--elastic``, else :func:`~gradsync.train.config.total_steps`."""
    if config.mode == "async":
        return num_train // (config.batch_size * config.accumulate) * config.epochs
    if config.elastic and config.mode == "sync":
        return num_train // config.elastic_global_batch() * config.epochs
    return total_steps(config, workers, num_train)


def _validate_outer_rounds(config: TrainConfig, steps: int) -> None:
    """DiLoCo (``--outer-optimizer nesterov``) needs an outer round within the run's ``steps`` optimizer steps;
    plain local SGD also averages at each epoch end, so its ``--sync-every`` may exceed the run."""
    if config.mode == "local-sgd" and config.outer_optimizer == "nesterov" and config.sync_every > steps:
        raise ValueError(f"--sync-every {config.sync_every} is longer than the run's {steps} optimizer steps: "
                         f"--outer-optimizer nesterov would take no outer step before the end")


def _validate_warmup_steps(config: TrainConfig, steps: int) -> None:
    if config.warmup_steps is not None and config.warmup_steps > steps:
        raise ValueError(f"--warmup-steps {config.warmup_steps} is longer than the run: {steps} optimizer steps "
                         f"({config.epochs} epochs)")


def _validate_global_batch(config: TrainConfig, world_size: int, num_train: int) -> None:
    """The global batch fits the data and splits over ``world_size`` workers (or micro-shards)."""
    size = config.global_batch_size
    if num_train < size:
        raise ValueError(f"the {num_train} training samples are fewer than one --global-batch-size {size}")
    if config.elastic and config.mode == "sync":  # any membership: uneven shares, weighted by samples
        world_size = config.elastic_bounds()[1]
        if not config.deterministic and size < world_size * config.accumulate:
            raise ValueError(f"--global-batch-size {size} is smaller than --max-nproc {world_size} x --accumulate "
                             f"{config.accumulate}: some worker would get no sample")
    if config.deterministic:
        if world_size > config.micro_shards:
            raise ValueError(f"--deterministic with --micro-shards {config.micro_shards} runs at most "
                             f"{config.micro_shards} workers (one micro-shard each at least), got world size "
                             f"{world_size}")
        if config.shard == "parameters" and config.micro_shards % world_size:
            raise ValueError(f"--deterministic --shard parameters needs --micro-shards a multiple of the world size "
                             f"{world_size}, got {config.micro_shards}: every worker gathers the parameters for "
                             f"each of its micro-shards, so all must run as many")
        return
    parts = world_size * config.accumulate
    if size % parts and not (config.elastic and config.mode == "sync"):
        raise ValueError(f"--global-batch-size {size} does not split evenly over world size {world_size} x "
                         f"--accumulate {config.accumulate} = {parts} micro-batches ({size / parts:.2f} samples "
                         f"each): choose a multiple of {parts}")


def _validate_elastic_fault(config: TrainConfig, last_step: int) -> None:
    """``--elastic-fault``'s slot is one the run can have and its step one it reaches."""
    if not config.elastic_fault:
        return
    from gradsync.elastic.fault_points import parse

    fault = parse(config.elastic_fault)
    slots = max(config.elastic_bounds()[1], config.elastic_workers())
    if fault is not None and fault[0] >= slots:
        raise ValueError(f"--elastic-fault slot {fault[0]} is not a worker slot: slots are 0..{slots - 1}")
    if fault is not None and fault[2] > last_step:
        raise ValueError(f"--elastic-fault step {fault[2]} is after the job's last step {last_step}")


def validate_elastic(config) -> None:
    if not config.elastic:
        for name in ("min_nproc", "max_nproc", "join", "elastic_fault"):
            if getattr(config, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} needs --elastic")
        return
    if config.elastic_fault is not None:
        from gradsync.elastic.fault_points import parse

        parse(config.elastic_fault)
    low, high = config.elastic_bounds()
    for name, value in (("--min-nproc", low), ("--max-nproc", high), ("--max-relaunches", config.max_relaunches)):
        if not _is_int(value) or value < (0 if name == "--max-relaunches" else 1):
            raise ValueError(f"{name} must be an int >= {0 if name == '--max-relaunches' else 1}, got {value}")
    if not low <= config.elastic_workers() <= high:
        what = f"--nproc {config.nproc}" + (f" x --hosts {config.hosts}" if config.hosts else "")
        raise ValueError(f"--elastic needs --min-nproc {low} <= {what} <= --max-nproc {high}")
    if config.max_restarts:
        raise ValueError("--elastic replaces --max-restarts: survivors go on and each worker's launcher starts "
                         "it again (--max-relaunches)")
    if config.hosts is not None and config.mode != "sync":
        raise ValueError("--elastic with --hosts runs --mode sync only")
    if config.mode == "local-sgd":
        raise ValueError("--elastic runs --mode sync or async (local-sgd is not elastic yet)")


def writable_folder(folder: str | Path, option: str) -> Path:
    """Create ``folder`` if needed and prove it writable by writing a file in it; returns its absolute path.

    A file is really written (``os.access`` says yes to root even on a read-only mount).

    Raises:
        ValueError: it is a file, or cannot be created or written (one line naming ``option``).
    """
    path = Path(folder).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {folder} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {folder} is not a writable folder: {exc.strerror or exc}") from None
    return path
