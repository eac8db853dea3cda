"""The training loop every worker runs: shard, forward, backward + AllReduce, step.

Launch (``gradsync train`` does the first for you)::

    gradsync train                                   # 4 local workers, MNIST-1D CNN
    torchrun --nproc-per-node=4 -m gradsync train    # the same under torchrun
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST0:29500 -m gradsync train  # two machines

Each optimizer step consumes ``accumulate`` micro-batches of ``batch_size``
samples per worker; all but the last run under ``no_sync()`` and the loss is
scaled by 1/accumulate, so one step equals one batch of
``batch_size * accumulate * world_size`` samples.
"""

from __future__ import annotations

import math
import os
import random
import signal
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DistributedSampler
from tqdm import tqdm

import gradsync
from gradsync.compression import make as make_compressor
from gradsync.launch import die_with_launcher
from gradsync.fault import checkpoint
from gradsync.fault.events import EventLog
from gradsync.fault.injection import FaultPlan, attempt
from gradsync.train import resume
from gradsync.train.config import TrainConfig, validate_against_data
from gradsync.train.data import load
from gradsync.train.metrics import (METRICS_FILE, SUMMARY_FILE, MetricsLog, StepTimes, read_metrics,
                                    write_summary)
from gradsync.parallel.staleness import StalenessStats
from gradsync.parallel.timeline import Timeline, trace_events, write_trace
from gradsync.train.models import build_model
from gradsync.train.plots import plot_run


ECHO_DELAY_S = 3.0
MODEL_FILE = "model.pt"  # the final model's state_dict, written by rank 0


def threads_per_worker(local_world_size: int) -> int:
    """One share of this machine's cores per local worker (at least one thread)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(local_world_size, 1))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_optimizer(params, config: TrainConfig) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=0.9, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def make_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int):
    if config.lr_schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total_steps, 1))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


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


def build_replica(config: TrainConfig) -> torch.nn.Module:
    """The model wrapped for the mode: DataParallel (sync) or LocalSGD (local-sgd)."""
    module = build_model(config.model)
    if config.mode == "local-sgd":
        return gradsync.LocalSGD(module, sync_every=config.sync_every, algorithm=config.algorithm)
    compressor = make_compressor(config.compression, config.topk_ratio, config.powersgd_rank,
                                 config.compression_warmup_steps)
    return gradsync.DataParallel(module, bucket_cap_mb=config.bucket_cap_mb, algorithm=config.algorithm,
                                 gradient_as_bucket_view=config.gradient_as_bucket_view, compression=compressor)


class Trainer:
    """One worker's view of a sync or local-sgd job (rank 0 also writes the run folder)."""

    def __init__(self, config: TrainConfig, data_path: Path, out_dir: Path):
        self.config = config
        self.rank, self.world_size = gradsync.rank(), gradsync.world_size()
        self.is_main = self.rank == 0
        self.out_dir = Path(out_dir)
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        torch.set_num_threads(threads_per_worker(local_world_size))
        seed_everything(config.seed)
        self.data = load(data_path)
        validate_against_data(config, self.world_size, len(self.data.y_train))
        self.model = build_replica(config)
        self.local_sgd = config.mode == "local-sgd"
        self.straggler_factor = straggler_factor(config, self.rank)
        self.staleness = StalenessStats()  # sync: 0; local-sgd: local steps since the last average
        self.timeline = Timeline(self.rank) if config.trace else None
        self.model.timeline = self.timeline
        self.optimizer = make_optimizer(self.model.parameters(), config)
        self.sampler = DistributedSampler(self.data.train_dataset(), num_replicas=self.world_size,
                                          rank=self.rank, shuffle=True, seed=config.seed)
        self.batches = BatchSampler(self.sampler, config.batch_size, drop_last=True)
        self.steps_per_epoch = len(self.batches) // config.accumulate
        self.scheduler = make_scheduler(self.optimizer, config, self.steps_per_epoch * config.epochs)
        self.times = StepTimes()
        self.step = 0
        self.step_bytes_sent = 0  # bytes this rank sent inside optimizer steps (gradient sync)
        self.bytes_offset = (0, 0)  # (sent, received) before this attempt's transport counted (a resume)
        self.epoch_records: list[dict] = []
        self.eval_s = 0.0
        self.checkpoint_s = 0.0
        self.started = time.perf_counter()
        self.events = EventLog(self.out_dir)
        self.faults = FaultPlan(self.rank, config.fault_rank_step("fail_at"), config.fault_rank_step("hang_at"),
                                self.events)
        self.checkpoint_root = Path(config.checkpoint_dir) if config.checkpointing() else None
        self.resumed_from = None  # the checkpoint this attempt started from
        self.position, metrics_text = resume.load_latest(self)  # (epoch, steps done in it, its running loss)
        if self.is_main:  # a resumed log holds the checkpoint's records only: no step twice
            self.log = MetricsLog(self.out_dir / METRICS_FILE, resumed_text=metrics_text)
        else:
            self.log = None

    # -- checkpoints -----------------------------------------------------------------------------

    def _save_checkpoint(self, epoch: int, steps_in_epoch: int, epoch_loss: torch.Tensor) -> None:
        started = time.perf_counter()
        shared = resume.shared_state(self, epoch, steps_in_epoch) if self.is_main else None
        checkpoint.save(self.checkpoint_root, self.step, shared, resume.rank_state(self, epoch_loss), self.model.comm,
                        keep=self.config.keep_checkpoints)
        self.checkpoint_s += time.perf_counter() - started
        if self.is_main:
            self.events.write({"event": "checkpoint", "step": self.step, "attempt": attempt(),
                               "seconds": time.perf_counter() - started})

    def elapsed_s(self) -> float:
        """Wall seconds of training so far, attempts before a resume included (their lost work not)."""
        return time.perf_counter() - self.started

    def run(self) -> dict | None:
        """Train for ``config.epochs`` epochs; rank 0 returns the summary, others None."""
        bar = tqdm(total=self.steps_per_epoch * self.config.epochs, initial=self.step, desc="train", unit="step",
                   disable=not (self.is_main and self.config.progress), dynamic_ncols=True)
        if self.is_main:
            resume.announce(self)
        first_epoch, steps_done, epoch_loss = self.position
        for epoch in range(first_epoch, self.config.epochs):
            skip = steps_done if epoch == first_epoch else 0
            loss = epoch_loss if epoch == first_epoch else torch.zeros(2, dtype=torch.float64)
            train_loss = self._train_epoch(epoch, bar, skip, loss)
            if self.local_sgd and self.model.local_steps:  # evaluate the average, as the paper does
                self.model.average()
            eval_started = time.perf_counter()
            test_loss, test_accuracy = self._evaluate()
            self._record("eval", eval_started, time.perf_counter())
            self.eval_s += time.perf_counter() - eval_started
            record = {"kind": "epoch", "epoch": epoch, "train_loss": train_loss, "test_loss": test_loss,
                      "test_accuracy": test_accuracy, "elapsed_s": self.elapsed_s()}
            self.epoch_records.append(record)
            if self.log:
                self.log.write(record)
            bar.set_postfix(loss=f"{train_loss:.3f}", test_acc=f"{100 * test_accuracy:.1f}%")
        bar.close()
        if self.checkpoint_root is not None:  # the finished job: running it again only writes the folder
            self._save_checkpoint(self.config.epochs, 0, torch.zeros(2, dtype=torch.float64))
        wall_s = self.elapsed_s()
        summary = self._summary(self.epoch_records, wall_s, wall_s - self.eval_s)
        if self.log:
            self.log.close()
            checkpoint.write_atomic(self.out_dir / MODEL_FILE, checkpoint.serialize(self.model.module.state_dict()))
        return summary

    def _train_epoch(self, epoch: int, bar, skip_steps: int, loss_sum: torch.Tensor) -> float:
        """Run the epoch's optimizer steps after the first ``skip_steps`` (done before a resume)."""
        self.sampler.set_epoch(epoch)
        self.model.train()
        loss_sum = loss_sum.clone()  # (sum of step losses, steps)
        micro_batches = []
        steps_in_epoch = 0
        for indices in self.batches:
            micro_batches.append(indices)
            if len(micro_batches) < self.config.accumulate:
                continue
            steps_in_epoch += 1
            if steps_in_epoch <= skip_steps:
                micro_batches = []
                continue
            loss = self._optimizer_step(epoch, micro_batches)
            micro_batches = []
            loss_sum += torch.tensor([loss, 1.0], dtype=torch.float64)
            bar.update(1)
            last = epoch == self.config.epochs - 1 and steps_in_epoch == self.steps_per_epoch  # saved after eval
            if self.checkpoint_root is not None and self.step % self.config.checkpoint_every == 0 and not last:
                self._save_checkpoint(epoch, steps_in_epoch, loss_sum)
        gradsync.all_reduce(loss_sum, op="sum")
        return float(loss_sum[0] / loss_sum[1])

    def _optimizer_step(self, epoch: int, micro_batches: list[list[int]]) -> float:
        self.faults.before_step(self.step + 1)
        forward_s = backward_s = 0.0
        comm_before, exposed_before = self.model.comm_seconds, self.model.exposed_comm_seconds
        bytes_before = self.model.comm.stats.bytes_sent
        step_loss = 0.0
        for index, indices in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            x, y = self.data.x_train[indices], self.data.y_train[indices]
            with nullcontext() if last else self.model.no_sync():
                t0 = time.perf_counter()
                loss = F.cross_entropy(self.model(x), y) / len(micro_batches)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
            self._record("forward", t0, t1)
            self._record("backward", t1, t2)
            forward_s += t1 - t0
            backward_s += t2 - t1
            step_loss += loss.item()
        exposed_s = self.model.exposed_comm_seconds - exposed_before
        straggle(self.straggler_factor, forward_s + backward_s - exposed_s)
        t3 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        t4 = time.perf_counter()
        self._record("optimizer", t3, t4)
        if self.local_sgd:  # the gradient just applied had not seen the others' last local_steps steps
            self.staleness.record(self.model.local_steps)
            if self.model.step():
                self._record("average", t4, time.perf_counter())
        else:
            self.staleness.record(0)
        comm_s = self.model.comm_seconds - comm_before
        exposed_s = self.model.exposed_comm_seconds - exposed_before
        # local SGD communicates only in the average, after the optimizer step: not inside backward
        self.times.add(forward_s, backward_s, comm_s, exposed_s, t4 - t3,
                       outside_comm_s=exposed_s if self.local_sgd else 0.0)
        step_bytes = self.model.comm.stats.bytes_sent - bytes_before
        self.step_bytes_sent += step_bytes
        self.step += 1
        if self.log:
            bytes_total = self.bytes_offset[0] + self.model.comm.stats.bytes_sent
            self.log.write({"kind": "step", "epoch": epoch, "step": self.step, "loss": step_loss, "lr": lr,
                            "forward_s": forward_s, "backward_s": backward_s, "comm_s": comm_s,
                            "exposed_comm_s": exposed_s, "optimizer_s": t4 - t3,
                            "bytes_sent": step_bytes, "bytes_sent_total": bytes_total})
        return step_loss

    def _record(self, kind: str, start_s: float, end_s: float) -> None:
        if self.timeline is not None:
            self.timeline.add(kind, start_s, end_s)

    def _write_trace(self) -> None:
        """Gather every rank's timeline to rank 0, which writes ``config.trace`` (collective)."""
        if self.timeline is None:
            return
        rows = self.timeline.rows()
        counts = gradsync.all_gather(torch.tensor([rows.shape[0]]))
        padded = torch.zeros(int(max(counts)), rows.shape[1], dtype=torch.float64)
        padded[:rows.shape[0]] = rows
        gathered = gradsync.all_gather(padded)
        if self.is_main:
            write_trace(Path(self.config.trace),
                        trace_events(part[:int(count)] for part, count in zip(gathered, counts)))

    @torch.no_grad()
    def _evaluate(self) -> tuple[float, float]:
        """Each rank scores its share of the test split; the sums are all-reduced."""
        self.model.eval()
        shard = torch.tensor_split(torch.arange(len(self.data.y_test)), self.world_size)[self.rank]
        x, y = self.data.x_test[shard], self.data.y_test[shard]
        logits = self.model.module(x)
        totals = torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                               (logits.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
        gradsync.all_reduce(totals, op="sum")
        loss_sum, correct, count = totals.tolist()
        return loss_sum / count, correct / count

    def _summary(self, epochs: list[dict], wall_s: float, train_wall_s: float) -> dict | None:
        stats = self.model.comm.stats
        t = self.times
        bytes_sent, bytes_received = self.bytes_offset[0] + stats.bytes_sent, self.bytes_offset[1] + stats.bytes_received
        own = torch.tensor([t.compute_s, t.comm_s, bytes_sent, bytes_received, t.exposed_comm_s,
                            t.forward_s, t.backward_s, t.optimizer_s, self.step_bytes_sent], dtype=torch.float64)
        per_rank = torch.stack(gradsync.all_gather(own))  # (world_size, 9)
        self._write_trace()
        if not self.is_main:
            return None
        samples = self.step * self.config.global_batch_size(self.world_size)
        compute_s, comm_s = per_rank[:, 0].mean().item(), per_rank[:, 1].mean().item()
        exposed_s = per_rank[:, 4].mean().item()
        return {
            "final_test_accuracy": epochs[-1]["test_accuracy"],
            "best_test_accuracy": max(r["test_accuracy"] for r in epochs),
            "final_test_loss": epochs[-1]["test_loss"],
            "final_train_loss": epochs[-1]["train_loss"],
            "world_size": self.world_size,
            "mode": self.config.mode,
            "num_workers": self.world_size,
            "compression": self.config.compression,
            **self.staleness.as_dict(),
            "steps": self.step,
            "restarts": attempt(),
            "resumed_from_step": self.resumed_from.step if self.resumed_from else None,
            "checkpoint_s": self.checkpoint_s,
            "samples": samples,
            "samples_per_s": samples / train_wall_s if train_wall_s > 0 else math.nan,
            "wall_s": wall_s,
            "train_wall_s": train_wall_s,
            "compute_s": compute_s,
            "communication_s": comm_s,
            "exposed_communication_s": exposed_s,
            "exposed_communication_fraction": exposed_s / comm_s if comm_s > 0 else 0.0,
            "forward_s": per_rank[:, 5].mean().item(),
            "backward_s": per_rank[:, 6].mean().item(),
            "optimizer_s": per_rank[:, 7].mean().item(),
            # inside the steps only: the start-up broadcast and evaluation sums are not per-step traffic
            "bytes_sent_per_step": per_rank[:, 8].mean().item() / max(self.step, 1),
            "bytes_sent_per_rank": [int(v) for v in per_rank[:, 2].tolist()],
            "bytes_received_per_rank": [int(v) for v in per_rank[:, 3].tolist()],
            "per_rank_compute_s": per_rank[:, 0].tolist(),
            "per_rank_communication_s": per_rank[:, 1].tolist(),
            "per_rank_exposed_communication_s": per_rank[:, 4].tolist(),
            "num_parameters": sum(p.numel() for p in self.model.module.parameters()),
            "train_samples": len(self.data.y_train),
            "test_samples": len(self.data.y_test),
            "config": self.config.to_dict(),
        }


def run_worker(config: TrainConfig, data_path: str, out_dir: str) -> dict | None:
    """Entry point of one worker process: join the group, train, leave."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Ctrl-C reaches the whole process group; the elastic agent stops the
        # workers itself, so a worker's own KeyboardInterrupt would only print a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        die_with_launcher()
    # tqdm's default lock is a multiprocessing semaphore; a worker that is killed (a fault, a
    # restart) cannot unregister it, and the launcher then warns about "leaked semaphore objects".
    tqdm.set_lock(threading.RLock())
    gradsync.init(timeout=config.timeout)
    try:
        if config.mode == "async":
            from gradsync.train.async_loop import run_async_role
            summary = run_async_role(config, Path(data_path), Path(out_dir))
        else:
            summary = Trainer(config, Path(data_path), Path(out_dir)).run()
    except gradsync.CollectiveTimeoutError as exc:
        if config.checkpointing() or config.fail_at or config.hang_at:
            EventLog(out_dir).write({"event": "detected", "rank": gradsync.rank(), "peer": exc.peer,
                                     "timed_out": exc.timed_out, "error": str(exc), "attempt": attempt()})
        if exc.timed_out:  # a hang: say which rank, as the agent's restart does not
            resume.say(f"{type(exc).__name__}: {exc}")
        if not exc.timed_out:
            # A closed connection is the echo of another worker's failure: let
            # that worker's exit reach the launcher first, so it reports the cause.
            time.sleep(ECHO_DELAY_S)
        raise
    finally:
        gradsync.shutdown()
    if summary is not None:  # rank 0 writes the run folder
        write_summary(Path(out_dir) / SUMMARY_FILE, summary)
        plot_run(read_metrics(Path(out_dir) / METRICS_FILE), summary, Path(out_dir))
    return summary
