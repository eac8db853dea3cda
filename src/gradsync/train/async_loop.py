"""``gradsync train --mode async``: a parameter server and ``nproc`` workers, static or elastic.

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

One server role and one worker role serve both runs; what differs is a
:class:`Group`: :class:`StaticGroup` here (one fixed process group, the last
rank serves), or the elastic membership of :mod:`gradsync.train.elastic_async`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Protocol

import torch
from tqdm import tqdm

import gradsync
from gradsync.fault import checkpoint
from gradsync.process_group import MIN_STARTUP_TIMEOUT_S
from gradsync.train.config import TrainConfig
from gradsync.train.validation import validate_against_data
from gradsync.train.data import Splits, load
from gradsync.train.metrics import METRICS_FILE, MODEL_FILE, MetricsLog
from gradsync.train.task import make_model, position_counts, sample_loss
from gradsync.train.setup import (make_optimizer, make_scheduler, seed_everything, set_threads, straggle,
                                  straggler_factor)
from gradsync.train.schedule import lr_fields
from gradsync.train.summary import RunTotals, build_summary, pushed_gradient
from gradsync.train.tensorboard_events import TrainBoard

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


class Group(Protocol):
    """What differs between a static and an elastic async run, as the two roles see it."""

    world_size: int   # processes in the run, the server included
    is_server: bool   # whether this process serves
    index: int        # rank (static) or slot (elastic): workers 0 .. nproc-1 (what --straggler names), server nproc
    progress: bool    # whether the server shows a progress bar

    def open_server(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, total_steps: int,
                    options: dict, state: dict):
        """The parameter server (``options``: its keyword arguments) and the server role's state to use:
        ``state`` as given (fresh), or the one restored from a checkpoint."""

    def restart_record(self, server) -> dict | None:
        """The ``metrics.jsonl`` record saying the server started from a checkpoint, or None."""

    def serve(self, server, on_update: Callable[[int, int, float, int], None]) -> None:
        """Serve until every step is applied."""

    def report(self, server, shared: dict, wall_s: float, eval_s: float) -> tuple[RunTotals, dict]:
        """The run's totals and the mode's ``summary.json`` fields (``shared`` among them)."""

    def work(self, model: torch.nn.Module, role: WorkerRole) -> None:
        """Pull steps, ``role.compute`` them and push their gradients until the server stops this worker."""


def run_async_role(config: TrainConfig, data_path: Path, out_dir: Path) -> dict | None:
    """Serve (last rank) or work (the others); the server returns the summary, workers None."""
    return run_role(StaticGroup(config), config, data_path, out_dir)


def run_role(group: Group, config: TrainConfig, data_path: Path, out_dir: Path) -> dict | None:
    """Serve or work, as ``group`` says; the server returns the summary, workers None."""
    set_threads(group.world_size)
    seed_everything(config.seed)
    data = load(data_path)
    validate_against_data(config, group.world_size, len(data.y_train))
    model = make_model(config)
    if group.is_server:
        return ServerRole(config, model, data, Path(out_dir), group).run()
    group.work(model, WorkerRole(config, model, data, straggler_factor(config, group.index)))
    return None


class WorkerRole:
    """A worker's computation: step ``k``'s gradients into ``.grad``, timed, slowed by ``--straggler``."""

    def __init__(self, config: TrainConfig, model: torch.nn.Module, data: Splits, factor: float):
        self.config, self.model, self.data, self.factor = config, model, data, factor
        self.compute_s = self.slept_s = 0.0
        self.cache: dict = {}

    def compute(self, step: int) -> float:
        """Leave step ``step``'s gradients in ``.grad``; returns its loss."""
        config, data = self.config, self.data
        started = time.perf_counter()
        loss_sum = 0.0
        for micro in step_indices(config, len(data.y_train), step, self.cache).split(config.batch_size):
            loss = sample_loss(self.model(data.x_train[micro]), data.y_train[micro]) / config.accumulate
            loss.backward()
            loss_sum += loss.item()
        self.compute_s += time.perf_counter() - started
        self.slept_s += straggle(self.factor, time.perf_counter() - started)
        return loss_sum


class ServerRole:
    """The server: parameters, optimizer, evaluation, metrics and summary."""

    def __init__(self, config: TrainConfig, model: torch.nn.Module, data: Splits, out_dir: Path, group: Group):
        self.config, self.model, self.data, self.group = config, model, data, group
        self.per_epoch = batches_per_epoch(config, len(data.y_train))
        total_steps = self.per_epoch * config.epochs
        optimizer = make_optimizer(model.parameters(), config)
        options = {"max_staleness": config.max_staleness, "staleness_aware_lr": config.staleness_lr,
                   "scheduler": make_scheduler(optimizer, config, total_steps), "timeout": config.timeout}
        fresh = {"epochs": [], "eval_s": 0.0}  # what a restarted elastic server must get back
        self.server, self.state = group.open_server(model, optimizer, total_steps, options, fresh)
        self.out_dir = out_dir
        self.log = MetricsLog(out_dir / METRICS_FILE)
        restart = group.restart_record(self.server)
        if restart is not None:
            self.log.write(restart)
        self.bar = tqdm(total=total_steps, desc="train (async)", unit="step",
                        disable=not (group.progress and config.progress), dynamic_ncols=True)
        self.board = TrainBoard(config.tensorboard)  # --tensorboard: loss and samples/s per applied update

    def run(self) -> dict:
        self.started = time.perf_counter()
        self.board.open(self.model, True)
        try:
            self.group.serve(self.server, self._on_update)
        finally:
            self.bar.close()
            self.log.close()
            self.board.close()
        # the final parameters, as a sync run's folder holds them
        checkpoint.write_atomic(self.out_dir / MODEL_FILE, checkpoint.serialize(self.model.state_dict()))
        return self._summary(time.perf_counter() - self.started)

    def _on_update(self, worker: int, version: int, loss: float, staleness: int) -> None:
        lr = self.server.last_lr  # as applied: after the staleness scaling, before the scheduler step
        self.log.write({"kind": "step", "step": version, "worker": worker, "loss": loss,
                        "staleness": staleness, "lr": lr, "elapsed_s": time.perf_counter() - self.started})
        self.bar.update(1)
        self.board.update(version, loss, self.config.batch_size * self.config.accumulate)
        if version % self.per_epoch == 0:
            self._end_epoch(version // self.per_epoch - 1)

    def _end_epoch(self, epoch: int) -> None:
        state, server = self.state, self.server
        started = time.perf_counter()
        test_loss, test_accuracy = evaluate(self.model, self.data)
        state["eval_s"] += time.perf_counter() - started
        losses = server.losses[-self.per_epoch:]
        record = {"kind": "epoch", "epoch": epoch, "train_loss": sum(losses) / len(losses),
                  "test_loss": test_loss, "test_accuracy": test_accuracy,
                  "elapsed_s": time.perf_counter() - self.started, "version": server.version,
                  "staleness_mean": server.staleness.mean, "staleness_max": server.staleness.max}
        # a restarted elastic server replays the epochs after its checkpoint: the newest record counts
        state["epochs"] = [r for r in state["epochs"] if r["epoch"] != epoch] + [record]
        self.log.write(record)
        self.board.evaluation(server.version, test_loss, test_accuracy)
        self.bar.set_postfix(loss=f"{record['train_loss']:.3f}", test_acc=f"{100 * test_accuracy:.1f}%")

    def _summary(self, wall_s: float) -> dict:
        config, server = self.config, self.server
        shared = {"max_staleness": config.max_staleness, "staleness_lr": config.staleness_lr,
                  "updates_applied": server.version,
                  "lr": lr_fields(server.scheduler, config, config.nproc)}
        totals, extra = self.group.report(server, shared, wall_s, self.state["eval_s"])
        return build_summary(config, self.state["epochs"], totals, server.staleness.as_dict(),
                             pushed_gradient(self.model), self.model, self.data, extra)


class StaticGroup:
    """``--mode async``: one fixed process group; the last rank serves, ranks 0 .. nproc-1 work."""

    progress = True

    def __init__(self, config: TrainConfig):
        self.config = config
        self.index, self.world_size = gradsync.rank(), gradsync.world_size()
        self.server_rank = config.main_rank(self.world_size)
        self.is_server = self.index == self.server_rank

    def open_server(self, model, optimizer, total_steps, options, state) -> tuple[gradsync.ParameterServer, dict]:
        return gradsync.ParameterServer(model, optimizer, total_steps, **options), state

    def restart_record(self, server) -> None:
        return None

    def serve(self, server: gradsync.ParameterServer, on_update) -> None:
        server.serve(on_update=on_update)

    def work(self, model: torch.nn.Module, role: WorkerRole) -> None:
        worker = gradsync.AsyncWorker(model, server_rank=self.server_rank, timeout=self.config.timeout)
        step = worker.pull(timeout=max(self.config.timeout, MIN_STARTUP_TIMEOUT_S))  # the server may be starting
        while step is not None:
            step = worker.push(role.compute(step))
        stats = gradsync.comm_stats()
        _gather_stats([role.compute_s, worker.wait_s, stats["bytes_sent"], stats["bytes_received"],
                       worker.pushes, role.slept_s])

    def report(self, server: gradsync.ParameterServer, shared: dict, wall_s: float,
               eval_s: float) -> tuple[RunTotals, dict]:
        stats = gradsync.comm_stats()
        rows = _gather_stats([0.0, 0.0, stats["bytes_sent"], stats["bytes_received"], 0, 0.0])
        workers = server.workers
        pushes = [int(rows[w, 4]) for w in workers]
        wait_s = rows[workers, 1].mean().item()  # a worker waits for every reply: all of it is exposed
        totals = RunTotals(
            world_size=server.world_size, num_workers=len(workers), steps=server.version,
            samples=server.version * self.config.batch_size * self.config.accumulate, wall_s=wall_s,
            train_wall_s=wall_s - eval_s, compute_s=rows[workers, 0].mean().item(),
            communication_s=wait_s, exposed_communication_s=wait_s,
            bytes_sent_per_step=rows[workers, 2].sum().item() / max(server.version, 1),
            bytes_sent_per_rank=[int(v) for v in rows[:, 2].tolist()],
            bytes_received_per_rank=[int(v) for v in rows[:, 3].tolist()],
            per_rank_compute_s=rows[:, 0].tolist(), per_rank_communication_s=rows[:, 1].tolist())
        extra = {"server_rank": server.rank, **shared, "ps_link": server.link, "ps_link_fallback": server.link_fallback,
                 "gradients_pushed": sum(pushes), "gradients_pushed_per_worker": pushes,
                 "updates_applied_per_worker": [server.applied_per_worker[w] for w in workers],
                 "eval_s": eval_s, "straggler_sleep_s": rows[workers, 5].tolist()}
        return totals, extra


def _gather_stats(values: list[float]) -> torch.Tensor:
    """All ranks' stat rows, ``(world_size, _STAT_FIELDS)`` float64 (collective)."""
    return torch.stack(gradsync.all_gather(torch.tensor(values, dtype=torch.float64)))


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Splits) -> tuple[float, float]:
    """Mean cross-entropy and accuracy per position of ``model`` on the whole test split (one process)."""
    was_training = model.training
    model.eval()
    loss_sum, correct, count = position_counts(model(data.x_test), data.y_test)
    model.train(was_training)
    return loss_sum / count, correct / count
