"""What every training role sets up the same way: threads, seeds, optimizer, schedule, straggler, replica,
and the optimizer step (global-norm clipping, a sharded optimizer).

Used by the sync / local-SGD trainer (``loop.py``), the parameter-server roles
(``async_loop.py``) and the benchmarks (``bench/``).
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import torch

import gradsync
from gradsync.compression import make as make_compressor
from gradsync.train.config import TrainConfig
from gradsync.train.schedule import make_lr_scheduler
from gradsync.train.task import make_model


def threads_per_worker(local_world_size: int) -> int:
    """One share of this machine's cores per local worker (at least one thread)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(local_world_size, 1))


DETERMINISTIC_THREADS = 1  # --deterministic: kernels block their sums by thread count, so it is fixed


def set_threads(world_size: int, deterministic: bool = False) -> None:
    """``torch.set_num_threads`` to this process's share (``LOCAL_WORLD_SIZE`` workers share the cores).

    ``deterministic``: :data:`DETERMINISTIC_THREADS` whatever the world size. (Not
    ``torch.use_deterministic_algorithms``: the CPU kernels of these models are
    deterministic already, and it imports torch's compiler stack, ~4-10 s per worker.)
    """
    if deterministic:
        torch.set_num_threads(DETERMINISTIC_THREADS)
        return
    torch.set_num_threads(threads_per_worker(int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_optimizer(params, config: TrainConfig) -> torch.optim.Optimizer:
    """``config.optimizer`` at ``config.lr`` (the schedule scales it) and ``config.weight_decay``: SGD with
    momentum 0.9, AdamW, LARS (momentum 0.9, trust coefficient 0.001) or LAMB (betas 0.9, 0.999, eps 1e-6);
    LARS and LAMB leave biases and normalisation weights out of weight decay and trust ratio."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=0.9, weight_decay=config.weight_decay)
    if config.optimizer == "lars":
        return gradsync.optim.LARS(params, lr=config.lr, weight_decay=config.weight_decay)
    if config.optimizer == "lamb":
        return gradsync.optim.LAMB(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def make_replica_optimizer(model: torch.nn.Module, config: TrainConfig):
    """:func:`make_optimizer` over the replica's parameters, sharded as the replica is: a
    :class:`~gradsync.ShardedOptimizer` over this rank's shard under ``--shard optimizer|gradients``
    (``model.shard_optimizer``), else the torch optimizer itself."""
    optimizer = make_optimizer(model.parameters(), config)
    shard = getattr(model, "shard_optimizer", None)  # LocalSGD has none: its workers step alone
    return optimizer if shard is None else shard(optimizer)


def step_optimizer(model: torch.nn.Module, optimizer, clip_grad_norm: float | None) -> float | None:
    """Clip the gradients' global 2-norm to ``clip_grad_norm`` (:func:`gradsync.clip_grad_norm_`: over every
    shard; under local SGD, this worker's own gradient), step, forget the gradients.

    Returns the norm before clipping (None without clipping). Collective for a sharded model.
    """
    norm = None
    if clip_grad_norm is not None:
        norm = float(gradsync.clip_grad_norm_(model, clip_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def make_scheduler(optimizer, config: TrainConfig, total_steps: int, workers: int | None = None):
    """The lr schedule over ``total_steps`` optimizer steps (:mod:`~gradsync.train.schedule`: ``--lr-scaling``
    for ``workers`` workers, warm-up, then cosine, constant or step), over the torch optimizer a
    :class:`~gradsync.ShardedOptimizer` wraps (their parameter groups, and so their lr, are the same)."""
    if isinstance(optimizer, gradsync.ShardedOptimizer):
        optimizer = optimizer.optimizer
    return make_lr_scheduler(optimizer, config, total_steps, workers)


def straggler_factor(config: TrainConfig, rank: int) -> float:
    """How many times as long this worker's compute takes (1.0 unless it is ``--straggler``'s rank)."""
    straggler = config.straggler_rank_factor()
    return straggler[1] if straggler is not None and straggler[0] == rank else 1.0


def straggle(factor: float, compute_s: float) -> float:
    """Sleep ``(factor - 1) * compute_s`` seconds (a slow worker's extra time); returns the seconds slept."""
    extra_s = (factor - 1.0) * compute_s
    if extra_s > 0:
        time.sleep(extra_s)
    return max(extra_s, 0.0)


def build_replica(config: TrainConfig, model_state: dict | None = None,
                  compression_state: dict | None = None) -> torch.nn.Module:
    """The model wrapped for the mode: DataParallel (sync), DeterministicDataParallel (``deterministic``)
    or LocalSGD (local-sgd) (collective); sync ones sharded at ``config.shard`` (ZeRO-1/2; then train with
    :func:`make_replica_optimizer`'s sharded optimizer).

    ``model_state``: the module's ``state_dict`` to start from (an elastic hand-over), loaded before
    wrapping; ``compression_state``: the compressor's own (a survivor's error-feedback residuals).
    """
    module = make_model(config)
    if model_state is not None:
        module.load_state_dict(model_state)
    if config.deterministic:
        return gradsync.DeterministicDataParallel(module, config.micro_shards, algorithm=config.algorithm,
                                                  seed=config.seed, shard=config.shard)
    if config.mode == "local-sgd":
        return gradsync.LocalSGD(module, sync_every=config.sync_every, algorithm=config.algorithm)
    compressor = make_compressor(config.compression, config.topk_ratio, config.powersgd_rank,
                                 config.compression_warmup_steps)
    if compressor is not None and compression_state is not None:
        compressor.load_state_dict(compression_state)
    return gradsync.DataParallel(module, bucket_cap_mb=config.bucket_cap_mb, algorithm=config.algorithm,
                                 gradient_as_bucket_view=config.gradient_as_bucket_view, compression=compressor,
                                 debug=True if config.debug else None,  # None: GRADSYNC_DEBUG decides
                                 shard=config.shard)
