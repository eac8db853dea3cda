"""The training job's configuration: one dataclass, validated before any process starts."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from gradsync.collectives.ops import ALGORITHMS
from gradsync.compression import COMPRESSIONS
from gradsync.hosts.netns import link_options_problem
from gradsync.parallel.deterministic import DEFAULT_MICRO_SHARDS
from gradsync.train.data import DEFAULT_NUM_SAMPLES
from gradsync.train.elastic_options import elastic_bounds, validate_elastic
from gradsync.train.models import MODELS

MODES = ("sync", "async", "local-sgd")
OPTIMIZERS = ("sgd", "adam")
LR_SCHEDULES = ("cosine", "constant")
MAX_NUM_SAMPLES = 500_000
MAX_BUCKET_CAP_MB = 2**20  # 1 TiB: beyond any model, and keeps the byte count an int
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass
class TrainConfig:
    """What ``gradsync train`` runs. Defaults are the main job (DESIGN.md §4)."""

    nproc: int = 4                  # worker processes on this machine (async adds one server process)
    mode: str = "sync"              # sync (AllReduce every step) | async (parameter server) | local-sgd
    max_staleness: int | None = None  # async: bound on an applied gradient's staleness (None: unbounded)
    staleness_lr: bool = True       # async: divide the lr by the gradient's staleness (Zhang et al. 2016)
    sync_every: int = 4             # local-sgd: optimizer steps between parameter averages (H)
    straggler: str | None = None    # "RANK:FACTOR": worker RANK's compute takes FACTOR times as long
    model: str = "cnn"              # logreg | mlp | cnn
    epochs: int = 15                # passes over the training split
    batch_size: int = 32            # samples per worker per micro-batch
    accumulate: int = 1             # micro-batches per optimizer step (no_sync on all but the last)
    global_batch_size: int | None = None  # samples per optimizer step over all workers, whatever the world size
    deterministic: bool = False     # bitwise the same parameters at any world size (needs global_batch_size)
    micro_shards: int = DEFAULT_MICRO_SHARDS  # deterministic: pieces of each global batch, one backward each
    lr: float = 1e-2                # peak learning rate
    lr_schedule: str = "cosine"     # cosine decay to 0 over all steps, or constant
    optimizer: str = "adam"         # sgd (momentum 0.9) | adam
    weight_decay: float = 0.0
    algorithm: str = "auto"         # AllReduce algorithm for the gradients (auto: chosen per bucket size)
    bucket_cap_mb: float = 25.0     # MiB of gradients per bucket
    gradient_as_bucket_view: bool = False  # .grad is a view into its bucket (saves a gradient copy)
    debug: bool = False             # DataParallel's debug checks (GRADSYNC_DEBUG=1 also turns them on)
    compression: str = "none"       # none | fp16 | bf16 | onebit | topk | powersgd
    topk_ratio: float = 0.01        # fraction of each bucket that topk sends
    powersgd_rank: int = 2          # approximation rank of powersgd
    compression_warmup_steps: int = 0  # exact AllReduce for the first steps, then compression
    trace: str | None = None        # Chrome trace file written at the end (rank 0 gathers all ranks)
    seed: int = 0                   # model init, shuffling
    timeout: float = 300.0          # seconds any collective may wait for a peer
    max_restarts: int = 0           # times the elastic agent restarts the workers after a failure
    checkpoint_dir: str | None = None  # checkpoints (default <out>/checkpoints when --max-restarts > 0)
    checkpoint_every: int = 100     # optimizer steps between checkpoints
    keep_checkpoints: int = 2       # complete checkpoints kept; older ones are pruned
    fail_at: str | None = None      # "RANK:STEP": that worker dies at that step (first attempt only)
    hang_at: str | None = None      # "RANK:STEP": that worker hangs at that step (first attempt only)
    check_replicas_every: int = 0   # optimizer steps between replica checks (0: none; local-sgd: after an average)
    num_samples: int = DEFAULT_NUM_SAMPLES  # MNIST-1D samples drawn (80% train, 20% test)
    data_dir: str | None = None     # cache for the generated arrays
    out: str | None = None          # run folder (default runs/<timestamp>)
    progress: bool = True           # tqdm bar on rank 0
    hosts: int | None = None        # test hosts (namespaces) with --nproc workers each, one torchrun per host
    inter_host_gbit: float | None = None  # --hosts: egress rate of each host's link (tc tbf), Gbit/s
    join_timeout: float = 30.0      # --hosts: seconds torchrun's rendezvous waits for every host
    cut_link_at: str | None = None  # "HOST:STEP": the harness sets that host's link down at that step
    kill_host_at: str | None = None  # "HOST:STEP": the harness kills every process on that host at that step
    elastic: bool = False           # survivors go on without a restart; replacements join from a live peer
    min_nproc: int | None = None    # --elastic: fewest workers the run trains with (default 1)
    max_nproc: int | None = None    # --elastic: most workers (default --nproc); joiners beyond it wait
    max_relaunches: int = 100       # --elastic: times each worker slot's launcher starts its process again
    join: str | None = None         # --elastic: run folder of a running elastic job to add one worker to
    elastic_fault: str | None = None  # --elastic: "SLOT:WHERE:STEP" fault injection (gradsync.elastic.faults)

    def samples_per_step(self, world_size: int) -> int:
        """Samples in one optimizer step over all workers: ``global_batch_size``, else batch x accumulate x workers."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        return self.batch_size * self.accumulate * world_size

    def per_worker_batch_size(self, world_size: int) -> int:
        """Samples per worker per micro-batch (``global_batch_size`` split evenly; validated to divide)."""
        if self.global_batch_size is None:
            return self.batch_size
        return self.global_batch_size // (world_size * self.accumulate)

    def num_workers(self, world_size: int) -> int:
        """Processes that compute gradients: all of them, except the server in async mode."""
        return world_size - 1 if self.mode == "async" else world_size

    def world_size(self) -> int:
        """Processes ``gradsync train`` starts for ``nproc`` workers (per host with ``hosts``)."""
        if self.hosts is not None:
            return self.hosts * self.nproc
        return self.nproc + 1 if self.mode == "async" else self.nproc

    def host_fault(self, name: str) -> tuple[int, int] | None:
        """``(host, step)`` of ``--cut-link-at`` / ``--kill-host-at`` (``name``: the field), or None."""
        text = getattr(self, name)
        if text is None:
            return None
        option = "--" + name.replace("_", "-")
        host, _, step = text.partition(":")
        if not (host.isdigit() and step.isdigit()):
            raise ValueError(f"{option} must be HOST:STEP (two integers), got {text!r}")
        if self.hosts is None or int(host) >= self.hosts:
            raise ValueError(f"{option} {text}: needs --hosts H with HOST in [0, H)")
        if int(step) < 1:
            raise ValueError(f"{option} {text}: STEP must be >= 1")
        return int(host), int(step)

    def main_rank(self, world_size: int) -> int:
        """The rank that writes the run folder: the server (last rank) in async mode, else rank 0."""
        return world_size - 1 if self.mode == "async" else 0

    def straggler_rank_factor(self) -> tuple[int, float] | None:
        """``(rank, factor)`` parsed from ``straggler`` (ValueError if malformed), or None."""
        if self.straggler is None:
            return None
        rank, factor = _rank_pair(self.straggler, "--straggler", "FACTOR", float, "1:3")
        if rank < 0 or not 1 <= factor < math.inf:
            raise ValueError(f"--straggler {self.straggler}: RANK must be >= 0 and FACTOR a finite number >= 1")
        return rank, factor

    def fault_rank_step(self, which: str) -> tuple[int, int] | None:
        """``(rank, step)`` parsed from ``fail_at`` or ``hang_at`` (ValueError if malformed), or None."""
        text = getattr(self, which)
        if text is None:
            return None
        flag = "--" + which.replace("_", "-")
        rank, step = _rank_pair(text, flag, "STEP", int, "1:40")
        if rank < 0 or step < 1:
            raise ValueError(f"{flag} {text}: RANK must be >= 0 and STEP >= 1 (steps count from 1)")
        return rank, step

    def checkpointing(self) -> bool:
        """Whether this job writes checkpoints (it does when it may restart; an elastic async run's
        server always does: it restarts from its newest checkpoint)."""
        return self.checkpoint_dir is not None or self.max_restarts > 0 or (self.elastic and self.mode == "async")

    def to_dict(self) -> dict:
        return asdict(self)


def _rank_pair(text, flag: str, second: str, kind, example: str) -> tuple:
    """Parse ``"RANK:VALUE"`` into ``(int, kind)``; ValueError naming ``flag`` if malformed."""
    rank_text, sep, value_text = str(text).partition(":")
    try:
        if not sep:
            raise ValueError
        return int(rank_text), kind(value_text)
    except ValueError:
        raise ValueError(f"{flag} must be RANK:{second} (e.g. {example}), got {text!r}") from None


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
        (0 < config.lr < math.inf, f"--lr must be a finite number > 0, got {config.lr}"),
        (0 <= config.weight_decay < math.inf,
         f"--weight-decay must be a finite number >= 0, got {config.weight_decay}"),
        (0 < config.bucket_cap_mb <= MAX_BUCKET_CAP_MB,
         f"--bucket-cap-mb must be in (0, {MAX_BUCKET_CAP_MB}], got {config.bucket_cap_mb}"),
        (0 < config.timeout <= MAX_TIMEOUT_S,
         f"--timeout must be in (0, {MAX_TIMEOUT_S}] seconds, got {config.timeout}"),
        (0 <= config.seed < 2**32, f"--seed must be in [0, 2**32), got {config.seed}"),
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
         f"unknown --optimizer {config.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}"),
        (config.lr_schedule in LR_SCHEDULES,
         f"unknown --lr-schedule {config.lr_schedule!r}; choose one of {', '.join(LR_SCHEDULES)}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    _validate_mode(config)
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


def total_steps(config: TrainConfig, world_size: int, num_train: int) -> int:
    """Optimizer steps of a sync or local-sgd job (DistributedSampler pads to equal shares)."""
    if config.global_batch_size is not None:  # one permutation of the whole split, cut into global batches
        return num_train // config.global_batch_size * config.epochs
    per_rank = -(-num_train // world_size)
    return per_rank // config.batch_size // config.accumulate * config.epochs


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


def validate_against_data(config: TrainConfig, world_size: int, num_train: int) -> None:
    """Check that every worker gets at least one full optimizer step per epoch, and the straggler exists."""
    if config.mode == "async" and world_size < 2:
        raise ValueError("--mode async needs a server and at least one worker: 2 or more processes")
    world_size = config.num_workers(world_size)  # the data is shared among the workers only
    straggler = config.straggler_rank_factor()
    if straggler is not None and straggler[0] >= world_size:
        raise ValueError(f"--straggler rank {straggler[0]} is not a worker: workers are ranks 0..{world_size - 1}")
    needed = config.batch_size * config.accumulate
    if config.mode == "async":  # the workers take batches from one shared shuffle
        if num_train < needed:
            raise ValueError(f"the {num_train} training samples are fewer than one step's --batch-size "
                             f"{config.batch_size} x --accumulate {config.accumulate} = {needed}")
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
    for which in ("fail_at", "hang_at"):
        fault = config.fault_rank_step(which)
        flag = "--" + which.replace("_", "-")
        if fault is not None and fault[0] >= world_size:
            raise ValueError(f"{flag} rank {fault[0]} is not a worker: workers are ranks 0..{world_size - 1}")
        if fault is not None and fault[1] > last_step:
            raise ValueError(f"{flag} step {fault[1]} is after the job's last step {last_step}")
    for which in ("cut_link_at", "kill_host_at"):
        fault = config.host_fault(which)
        if fault is not None and fault[1] > last_step:
            raise ValueError(f"--{which.replace('_', '-')} step {fault[1]} is after the job's last step {last_step}")


def _validate_global_batch(config: TrainConfig, world_size: int, num_train: int) -> None:
    """The global batch fits the data and splits over ``world_size`` workers (or micro-shards)."""
    size = config.global_batch_size
    if num_train < size:
        raise ValueError(f"the {num_train} training samples are fewer than one --global-batch-size {size}")
    if config.elastic and config.mode == "sync":  # any membership: uneven shares, weighted by samples
        world_size = elastic_bounds(config)[1]
        if not config.deterministic and size < world_size * config.accumulate:
            raise ValueError(f"--global-batch-size {size} is smaller than --max-nproc {world_size} x --accumulate "
                             f"{config.accumulate}: some worker would get no sample")
    if config.deterministic:
        if world_size > config.micro_shards:
            raise ValueError(f"--deterministic with --micro-shards {config.micro_shards} runs at most "
                             f"{config.micro_shards} workers (one micro-shard each at least), got world size "
                             f"{world_size}")
        return
    parts = world_size * config.accumulate
    if size % parts and not (config.elastic and config.mode == "sync"):
        raise ValueError(f"--global-batch-size {size} does not split evenly over world size {world_size} x "
                         f"--accumulate {config.accumulate} = {parts} micro-batches ({size / parts:.2f} samples "
                         f"each): choose a multiple of {parts}")
