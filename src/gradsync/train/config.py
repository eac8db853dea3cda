"""The training job's configuration: one dataclass (its values are checked by :mod:`~gradsync.train.validation`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from gradsync.parallel.deterministic import DEFAULT_MICRO_SHARDS
from gradsync.parallel.outer_optimizer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM
from gradsync.train.data import DEFAULT_NUM_SAMPLES
from gradsync.train.gpt import GPT_DEFAULT

MODES = ("sync", "async", "local-sgd")
OPTIMIZERS = ("sgd", "adamw", "lars", "lamb")
OPTIMIZER_ALIASES = {"adam": "adamw"}  # --optimizer adam (gradsync before LARS/LAMB) is AdamW
LR_SCHEDULES = ("cosine", "constant", "step")
LR_SCALINGS = ("none", "linear", "sqrt")
STEP_FRACTIONS = (1 / 3, 2 / 3, 8 / 9)  # --lr-schedule step: x0.1 at these fractions of the run (Goyal et al.'s
# 30, 60 and 80 of 90 epochs)
GPT_LR = 1e-3  # gradsync train's --lr for --model gpt: AdamW at 1e-2 or 3e-3 (no warm-up) stalls near predicting spaces


def default_lr(model: str) -> float:
    """``gradsync train``'s ``--lr`` when not given: 1e-2 (MNIST-1D's models), :data:`GPT_LR` for the gpt."""
    return GPT_LR if model == "gpt" else TrainConfig.lr


@dataclass
class TrainConfig:
    """What ``gradsync train`` runs. Defaults are the main job (docs/training.md)."""

    nproc: int = 4                  # worker processes on this machine (async adds one server process)
    mode: str = "sync"              # sync (AllReduce every step) | async (parameter server) | local-sgd
    max_staleness: int | None = None  # async: bound on an applied gradient's staleness (None: unbounded)
    staleness_lr: bool = True       # async: divide the lr by the gradient's staleness (Zhang et al. 2016)
    sync_every: int = 4             # local-sgd: optimizer steps between parameter averages (H)
    outer_optimizer: str = "none"   # local-sgd: none (average the parameters) | nesterov (DiLoCo's outer step)
    outer_lr: float = DILOCO_OUTER_LR  # local-sgd --outer-optimizer nesterov: outer lr (DiLoCo paper's 0.7)
    outer_momentum: float = DILOCO_OUTER_MOMENTUM  # ... and its momentum (the paper's 0.9)
    outer_compression: str = "fp32"  # local-sgd: outer deltas sent as fp32 | bf16 | fp16 | int8 (error feedback)
    outer_fragments: int = 1        # local-sgd: Streaming DiLoCo's fragments, each synced at its own step of H
    straggler: str | None = None    # "RANK:FACTOR": worker RANK's compute takes FACTOR times as long
    model: str = "cnn"              # logreg | mlp | cnn (MNIST-1D) | gpt (the corpus of gradsync.train.corpus)
    gpt_width: int = GPT_DEFAULT["width"]      # --model gpt: embedding width (a multiple of gpt_heads)
    gpt_depth: int = GPT_DEFAULT["depth"]      # --model gpt: transformer blocks
    gpt_heads: int = GPT_DEFAULT["heads"]      # --model gpt: attention heads per block
    gpt_context: int = GPT_DEFAULT["context"]  # --model gpt: tokens per sample (window length)
    epochs: int = 15                # passes over the training split
    batch_size: int = 32            # samples per worker per micro-batch
    accumulate: int = 1             # micro-batches per optimizer step (no_sync on all but the last)
    global_batch_size: int | None = None  # samples per optimizer step over all workers, whatever the world size
    deterministic: bool = False     # bitwise the same parameters at any world size (needs global_batch_size)
    micro_shards: int = DEFAULT_MICRO_SHARDS  # deterministic: pieces of each global batch, one backward each
    lr: float = 1e-2                # peak learning rate (gradsync train --model gpt: GPT_LR unless given)
    lr_schedule: str = "cosine"     # cosine decay to 0 over all steps, constant, or step (x0.1 at STEP_FRACTIONS)
    optimizer: str = "adamw"        # sgd (momentum 0.9) | adamw (alias adam) | lars | lamb
    lr_scaling: str = "none"        # none | linear | sqrt: --lr x (G / base_batch_size) or its square root
    base_batch_size: int | None = None  # --lr-scaling: the global batch --lr was tuned for
    warmup_steps: int | None = None     # linear warm-up over this many optimizer steps
    warmup_epochs: float | None = None  # ... or over this many epochs' steps (one of the two)
    weight_decay: float = 0.0
    algorithm: str = "auto"         # AllReduce algorithm for the gradients (auto: chosen per bucket size)
    bucket_cap_mb: float = 25.0     # MiB of gradients per bucket
    gradient_as_bucket_view: bool = False  # .grad is a view into its bucket (saves a gradient copy)
    debug: bool = False             # DataParallel's debug checks (GRADSYNC_DEBUG=1 also turns them on)
    compression: str = "none"       # none | fp16 | bf16 | onebit | topk | powersgd
    topk_ratio: float = 0.01        # fraction of each bucket that topk sends
    powersgd_rank: int = 2          # approximation rank of powersgd
    compression_warmup_steps: int = 0  # exact AllReduce for the first steps, then compression
    shard: str = "none"             # ZeRO level: none | optimizer (ZeRO-1) | gradients (ZeRO-2); sync, static
    clip_grad_norm: float | None = None  # clip the gradients' global 2-norm to this before each step
    trace: str | None = None        # Chrome trace file written at the end (rank 0 gathers all ranks)
    tensorboard: str | None = None  # TensorBoard event files' folder, written by the main rank (docs/tensorboard.md)
    seed: int = 0                   # model init, shuffling
    timeout: float = 300.0          # seconds any collective may wait for a peer
    memory_limit_mib: int | None = None  # each rank in its own memory cgroup with this limit (local, static)
    preflight: bool = True          # estimate one rank's memory before step 1 and refuse a run that cannot fit
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
    elastic_fault: str | None = None  # --elastic: "SLOT:WHERE:STEP" fault injection (gradsync.elastic.fault_points)

    def __post_init__(self) -> None:
        self.optimizer = OPTIMIZER_ALIASES.get(self.optimizer, self.optimizer)

    def lr_global_batch(self, workers: int) -> int:
        """``G`` of ``--lr-scaling``: samples per optimizer step over all ``workers`` (accumulation included);
        an elastic run's fixed global batch whatever the membership; one worker's batch x accumulate under
        async (the server applies each worker's gradient as one step)."""
        if self.mode == "async":
            return self.batch_size * self.accumulate
        if self.elastic:
            return self.elastic_global_batch()
        return self.samples_per_step(workers)

    def lr_scale(self, workers: int) -> float:
        """The factor ``--lr-scaling`` multiplies ``--lr`` by: 1, ``G / B`` (linear, Goyal et al. 2017) or
        ``sqrt(G / B)`` (sqrt, Krizhevsky 2014; Hoffer et al. 2017), ``B`` = ``base_batch_size``."""
        if self.lr_scaling == "none" or self.base_batch_size is None:
            return 1.0
        ratio = self.lr_global_batch(workers) / self.base_batch_size
        return ratio if self.lr_scaling == "linear" else math.sqrt(ratio)

    def warmup_steps_of(self, total_steps: int) -> int:
        """Optimizer steps of the warm-up in a run of ``total_steps``: ``warmup_steps``, or ``warmup_epochs``
        of its steps per epoch (rounded up); 0 without warm-up."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_epochs is not None:
            return math.ceil(self.warmup_epochs * total_steps / self.epochs - 1e-9)
        return 0

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

    def elastic_workers(self) -> int:
        """Workers an elastic run starts with: ``--nproc``, per host with ``--hosts``."""
        return self.nproc * (self.hosts or 1)

    def elastic_bounds(self) -> tuple[int, int]:
        """``(min_nproc, max_nproc)`` of an elastic run: workers in all (defaults 1 and the workers it starts)."""
        low = 1 if self.min_nproc is None else self.min_nproc
        high = self.elastic_workers() if self.max_nproc is None else self.max_nproc
        return low, high

    def elastic_global_batch(self) -> int:
        """Samples per optimizer step of an elastic run, whatever its world size."""
        return self.global_batch_size or self.batch_size * self.accumulate * self.elastic_workers()

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


def total_steps(config: TrainConfig, world_size: int, num_train: int) -> int:
    """Optimizer steps of a sync or local-sgd job (DistributedSampler pads to equal shares)."""
    if config.global_batch_size is not None:  # one permutation of the whole split, cut into global batches
        return num_train // config.global_batch_size * config.epochs
    per_rank = -(-num_train // world_size)
    return per_rank // config.batch_size // config.accumulate * config.epochs
