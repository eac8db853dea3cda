"""``gradsync train --mode async``: a parameter server (the last rank) and ``nproc`` workers.

The server hands out optimizer steps ``0 .. epochs * batches_per_epoch - 1``
in order; step ``k`` is batch ``k % batches_per_epoch`` of epoch
``k // batches_per_epoch`` of one global shuffle per epoch, whichever worker
computes it. So every sample is used once per epoch however fast each worker
is (a fast worker takes more batches, as in Downpour SGD's shared data
queue), and one step is one worker's batch of ``batch_size * accumulate``
samples. The server evaluates the full test split at each epoch boundary
(every ``batches_per_epoch`` applied gradients) and once more on the final
parameters; it writes the run folder. Workers keep rank 0 .. nproc-1, so
``--straggler 1:3`` names the same worker in every mode.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import gradsync
from gradsync.process_group import MIN_STARTUP_TIMEOUT_S
from gradsync.train.config import TrainConfig, validate_against_data
from gradsync.train.data import Splits, load
from gradsync.train.metrics import METRICS_FILE, MetricsLog
from gradsync.train.models import build_model
from gradsync.train.setup import (make_optimizer, make_scheduler, seed_everything, set_threads, straggle,
                                  straggler_factor)
from gradsync.train.summary import RunTotals, build_summary, pushed_gradient

# per-rank numbers gathered at the end: compute_s, wait_s, bytes_sent, bytes_received, pushes, straggler sleep
_STAT_FIELDS = 6


def batches_per_epoch(config: TrainConfig, num_train: int) -> int:
    return num_train // (config.batch_size * config.accumulate)


def step_indices(config: TrainConfig, num_train: int, step: int, cache: dict) -> torch.Tensor:
    """The sample indices of global ``step`` (the same on every rank, from the seed and the epoch)."""
    per_epoch = batches_per_epoch(config, num_train)
    epoch, batch = divmod(step, per_epoch)
    if epoch not in cache:
        cache.clear()
        cache[epoch] = torch.randperm(num_train, generator=torch.Generator().manual_seed(config.seed + epoch))
    samples = config.batch_size * config.accumulate
    return cache[epoch][batch * samples:(batch + 1) * samples]


def run_async_role(config: TrainConfig, data_path: Path, out_dir: Path) -> dict | None:
    """Serve (last rank) or work (the others); the server returns the summary, workers None."""
    rank, world_size = gradsync.rank(), gradsync.world_size()
    set_threads(world_size)
    seed_everything(config.seed)
    data = load(data_path)
    validate_against_data(config, world_size, len(data.y_train))
    model = build_model(config.model)
    server_rank = config.main_rank(world_size)
    if rank == server_rank:
        return _Server(config, model, data, Path(out_dir)).run()
    _work(config, model, data, server_rank)
    return None


def _work(config: TrainConfig, model: torch.nn.Module, data: Splits, server_rank: int) -> None:
    worker = gradsync.AsyncWorker(model, server_rank=server_rank, timeout=config.timeout)
    factor = straggler_factor(config, gradsync.rank())
    compute_s = slept_s = 0.0
    cache: dict = {}
    step = worker.pull(timeout=max(config.timeout, MIN_STARTUP_TIMEOUT_S))  # the server may still be starting
    while step is not None:
        started = time.perf_counter()
        indices = step_indices(config, len(data.y_train), step, cache)
        loss_sum = 0.0
        for micro in indices.split(config.batch_size):
            loss = F.cross_entropy(model(data.x_train[micro]), data.y_train[micro]) / config.accumulate
            loss.backward()
            loss_sum += loss.item()
        compute_s += time.perf_counter() - started
        slept_s += straggle(factor, time.perf_counter() - started)
        step = worker.push(loss_sum)
    stats = gradsync.comm_stats()
    _gather_stats([compute_s, worker.wait_s, stats["bytes_sent"], stats["bytes_received"], worker.pushes,
                   slept_s])


def _gather_stats(values: list[float]) -> torch.Tensor:
    """All ranks' stat rows, ``(world_size, _STAT_FIELDS)`` float64 (collective)."""
    return torch.stack(gradsync.all_gather(torch.tensor(values, dtype=torch.float64)))


class _Server:
    """The server rank: parameters, optimizer, evaluation, metrics and summary."""

    def __init__(self, config: TrainConfig, model: torch.nn.Module, data: Splits, out_dir: Path):
        self.config, self.model, self.data = config, model, data
        self.per_epoch = batches_per_epoch(config, len(data.y_train))
        self.total_steps = self.per_epoch * config.epochs
        optimizer = make_optimizer(model.parameters(), config)
        self.server = gradsync.ParameterServer(model, optimizer, self.total_steps,
                                               max_staleness=config.max_staleness,
                                               staleness_aware_lr=config.staleness_lr,
                                               scheduler=make_scheduler(optimizer, config, self.total_steps),
                                               timeout=config.timeout)
        self.log = MetricsLog(out_dir / METRICS_FILE)
        self.epochs: list[dict] = []
        self.eval_s = 0.0
        self.bar = tqdm(total=self.total_steps, desc="train (async)", unit="step", disable=not config.progress,
                        dynamic_ncols=True)

    def run(self) -> dict:
        self.started = time.perf_counter()
        try:
            self.server.serve(on_update=self._on_update)
        finally:
            self.bar.close()
            self.log.close()
        wall_s = time.perf_counter() - self.started
        stats = gradsync.comm_stats()
        rows = _gather_stats([0.0, 0.0, stats["bytes_sent"], stats["bytes_received"], 0, 0.0])
        return self._summary(rows, wall_s)

    def _on_update(self, worker: int, version: int, loss: float, staleness: int) -> None:
        lr = self.server.last_lr  # as applied: after the staleness scaling, before the scheduler step
        self.log.write({"kind": "step", "step": version, "worker": worker, "loss": loss,
                        "staleness": staleness, "lr": lr, "elapsed_s": time.perf_counter() - self.started})
        self.bar.update(1)
        if version % self.per_epoch == 0:
            self._end_epoch(version // self.per_epoch - 1)

    def _end_epoch(self, epoch: int) -> None:
        started = time.perf_counter()
        test_loss, test_accuracy = evaluate(self.model, self.data)
        self.eval_s += time.perf_counter() - started
        losses = self.server.losses[-self.per_epoch:]
        record = {"kind": "epoch", "epoch": epoch, "train_loss": sum(losses) / len(losses),
                  "test_loss": test_loss, "test_accuracy": test_accuracy,
                  "elapsed_s": time.perf_counter() - self.started, "version": self.server.version,
                  "staleness_mean": self.server.staleness.mean, "staleness_max": self.server.staleness.max}
        self.epochs.append(record)
        self.log.write(record)
        self.bar.set_postfix(loss=f"{record['train_loss']:.3f}", test_acc=f"{100 * test_accuracy:.1f}%")

    def _summary(self, rows: torch.Tensor, wall_s: float) -> dict:
        config, server = self.config, self.server
        workers = server.workers
        pushes = [int(rows[w, 4]) for w in workers]
        wait_s = rows[workers, 1].mean().item()  # a worker waits for every reply: all of it is exposed
        totals = RunTotals(
            world_size=server.world_size, num_workers=len(workers), steps=server.version,
            samples=server.version * config.batch_size * config.accumulate, wall_s=wall_s,
            train_wall_s=wall_s - self.eval_s, compute_s=rows[workers, 0].mean().item(),
            communication_s=wait_s, exposed_communication_s=wait_s,
            bytes_sent_per_step=rows[workers, 2].sum().item() / max(server.version, 1),
            bytes_sent_per_rank=[int(v) for v in rows[:, 2].tolist()],
            bytes_received_per_rank=[int(v) for v in rows[:, 3].tolist()],
            per_rank_compute_s=rows[:, 0].tolist(), per_rank_communication_s=rows[:, 1].tolist())
        extra = {"server_rank": server.rank, "max_staleness": config.max_staleness,
                 "staleness_lr": config.staleness_lr, "updates_applied": server.version,
                 "gradients_pushed": sum(pushes), "gradients_pushed_per_worker": pushes,
                 "updates_applied_per_worker": [server.applied_per_worker[w] for w in workers],
                 "eval_s": self.eval_s, "straggler_sleep_s": rows[workers, 5].tolist()}
        return build_summary(config, self.epochs, totals, server.staleness.as_dict(), pushed_gradient(self.model),
                             self.model, self.data, extra)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Splits) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on the whole test split (one process)."""
    was_training = model.training
    model.eval()
    logits = model(data.x_test)
    loss = F.cross_entropy(logits, data.y_test).item()
    accuracy = (logits.argmax(1) == data.y_test).float().mean().item()
    model.train(was_training)
    return loss, accuracy
