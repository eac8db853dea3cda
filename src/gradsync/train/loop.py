"""The one training loop: shard, forward, backward + AllReduce, step, for every run but the parameter server's.

Launch (``gradsync train`` does the first for you)::

    gradsync train                                   # 4 local workers, MNIST-1D CNN
    torchrun --nproc-per-node=4 -m gradsync train    # the same under torchrun
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST0:29500 -m gradsync train  # two machines

Each optimizer step consumes ``accumulate`` micro-batches of ``batch_size``
samples per worker; all but the last run under ``no_sync()`` and the loss is
scaled by 1/accumulate, so one step equals one batch of
``batch_size * accumulate * world_size`` samples. With ``global_batch_size``
the step's samples are fixed instead (:mod:`~gradsync.train.global_batch`),
and ``deterministic`` computes them as micro-shards whose exact sum is the same
at any world size (:class:`~gradsync.parallel.deterministic.DeterministicDataParallel`).
Timing and byte counts live
in :class:`~gradsync.train.meter.StepMeter`, progress and counters in
:class:`~gradsync.train.state.TrainState`, checkpoints in ``resume.py``.

Who takes part is a membership's answer (:mod:`~gradsync.elastic.membership`):
a static run's never changes; an elastic run's is asked at every step
boundary, and each new membership starts with rank 0's state handed to
every member (:meth:`Trainer._adopt`), so survivors, replacements and a
member that missed a step continue from the same bits. An elastic run
always takes fixed global batches (``--global-batch-size``, else
``--batch-size`` x ``--accumulate`` x ``--nproc``), cut over the members of
the moment; a step interrupted by a failure is redone on the same batch.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import gradsync
from gradsync.elastic.membership import StaticMembership, View
from gradsync.elastic.state import broadcast_state, clone
from gradsync.fault import checkpoint
from gradsync.fault.events import EventLog
from gradsync.fault.injection import FaultPlan, attempt
from gradsync.parallel.timeline import Timeline, trace_events, write_trace
from gradsync.train import elastic_checkpoint, resume
from gradsync.train.config import TrainConfig, validate_against_data
from gradsync.train.data import load
from gradsync.train.global_batch import epoch_permutation, global_batches, split_contiguous, worker_micro_batches
from gradsync.train.meter import StepMeter
from gradsync.train.elastic_options import elastic_global_batch
from gradsync.train.metrics import METRICS_FILE, MODEL_FILE, MetricsLog
from gradsync.train.models import build_model
from gradsync.train.position import EpochOrder, order_steps, rank_steps, steps_taken
from gradsync.train.reshard import world_change
from gradsync.train.setup import (build_replica, make_optimizer, make_scheduler, seed_everything, set_threads,
                                  straggle, straggler_factor)
from gradsync.train.state import TrainState
from gradsync.train.summary import RunTotals, build_summary


class Trainer:
    """One worker of a sync or local-SGD run, static or elastic; the main rank also writes the run folder.

    ``membership``: who takes part (None: the static group ``gradsync.init()`` formed).
    """

    def __init__(self, config: TrainConfig, data_path: Path, out_dir: Path, membership=None):
        self.config = config
        self.membership = membership or StaticMembership()
        self.elastic = self.membership.elastic
        self.out_dir = Path(out_dir)
        set_threads(config.nproc if self.elastic else gradsync.world_size(), deterministic=config.deterministic)
        seed_everything(self.membership.seed(config.seed))
        self.data = load(data_path)
        self.num_train = len(self.data.y_train)
        self.local_sgd = config.mode == "local-sgd"
        self.global_loss = config.deterministic or self.elastic  # a step's loss is the global batch's already
        self.events = EventLog(self.out_dir)
        self.faults = FaultPlan(self.membership.slot, config.fault_rank_step("fail_at"),
                                config.fault_rank_step("hang_at"), self.events)
        self.state = TrainState()
        self.membership.attach(self.events, lambda: self.state.step + 1)
        self.timeline = Timeline(self.membership.slot) if config.trace else None
        self.model = self.log = None
        self.compression_state = None  # elastic: this rank's residuals as of its last committed step
        self._replica_check_due = False  # --check-replicas-every in local SGD: waiting for the next average
        self.world_change = self.resumed_from = None
        self.global_batch = config.global_batch_size
        self.resume_from = None  # elastic: (path, state) of the newest checkpoint, offered when joining
        if self.elastic:
            self.global_batch = elastic_global_batch(config)
            self.resume_from = elastic_checkpoint.latest(config)
            if self.resume_from is not None:  # the global batch the run was configured with, whatever --nproc
                self.global_batch = int(self.resume_from[1]["global_batch"])
            self.checkpoint_root = elastic_checkpoint.folder(config)
        else:
            self.checkpoint_root = Path(config.checkpoint_dir) if config.checkpointing() else None
        self.started = time.perf_counter()

    def _start(self, view: View) -> None:
        """Build this membership's replica: rank 0's state handed over (elastic), else restored from the
        newest checkpoint or fresh (collective)."""
        self.rank, self.world_size = view.rank, view.world_size
        self.is_main = self.rank == 0
        self.samples_per_step = self.global_batch or self.config.samples_per_step(self.world_size)
        if self.global_batch is not None:
            self.steps_per_epoch = self.num_train // self.global_batch
        else:  # DistributedSampler's order (position.py), batches dropped at the end
            self.steps_per_epoch = order_steps(self.num_train, EpochOrder(), self.world_size,
                                               self.config.batch_size, self.config.accumulate)
        if self.elastic:
            self._adopt(view)
        else:
            self._restore()
        self.straggler_factor = straggler_factor(self.config, self.membership.slot)
        self.model.timeline = self.timeline
        self.meter = StepMeter(self.model, self.timeline, comm_outside=self.local_sgd)

    def _restore(self) -> None:
        validate_against_data(self.config, self.world_size, self.num_train)
        self.model = build_replica(self.config)
        self._optimizer(self.model.parameters())
        self.state, metrics_text, self.resumed_from = resume.load_latest(
            self.checkpoint_root, self.config, self.replica, self.out_dir / METRICS_FILE if self.is_main else None)
        self.world_change = self._resharded()
        self.started = time.perf_counter()
        # a resumed log holds the checkpoint's records only: no step twice
        self.log = MetricsLog(self.out_dir / METRICS_FILE, resumed_text=metrics_text) if self.is_main else None
        if self.is_main:
            resume.announce(self.state, self.total_steps(), self.resumed_from and self.resumed_from.folder,
                            self.events, self.world_change)

    def _optimizer(self, params) -> None:
        self.optimizer = make_optimizer(params, self.config)
        self.scheduler = make_scheduler(self.optimizer, self.config, self.steps_per_epoch * self.config.epochs)
        self.replica = resume.Replica(self.model, self.optimizer, self.scheduler, self.local_sgd)

    def _adopt(self, view: View) -> None:
        """Take rank 0's state (collective), build the replica from it and check that every member holds
        the same bits (:class:`~gradsync.ReplicaDivergenceError` on every rank if not)."""
        started = time.perf_counter()
        fault = self.membership.handover_fault(view)
        handed = broadcast_state(self._snapshot() if view.rank == 0 else None, before_payload=fault)
        self.model = build_replica(self.config, handed["model"], self.compression_state)
        self._optimizer(self.model.parameters())
        self.optimizer.load_state_dict(handed["optimizer"])
        self.scheduler.load_state_dict(handed["scheduler"])
        self.state.adopt(handed["progress"])
        self.started = time.perf_counter()
        self.model.check_replicas(self.optimizer, step=self.state.step)
        self.membership.arm(self.model.module)
        self.log = MetricsLog(self.out_dir / METRICS_FILE) if self.is_main else None
        if self.is_main:
            self.events.write({"event": "resumed_training", "epoch": view.epoch, "world_size": view.world_size,
                               "step": self.state.step, "reason": view.record.reason,
                               "handover_s": time.perf_counter() - started,
                               "members": [m["slot"] for m in view.record.members],
                               "joined": view.record.record.get("joined", []), "replicas_equal": True})

    def _snapshot(self) -> dict:
        """What rank 0 hands over: model, optimizer, schedule and the shared part of :class:`TrainState`."""
        if self.model is None and self.resume_from is not None:  # a whole-job failure: the newest checkpoint
            return elastic_checkpoint.offer(self.resume_from, self.global_batch, gradsync.world_size(), self.events)
        if self.model is None:  # the first membership: rank 0 builds the seeded model
            torch.manual_seed(self.config.seed)
            module = build_model(self.config.model)
            optimizer = make_optimizer(module.parameters(), self.config)
            scheduler = make_scheduler(optimizer, self.config, self.steps_per_epoch * self.config.epochs)
            return {"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "progress": self.state.shared()}
        self.state.elapsed_before_s = self.elapsed_s()
        return {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "progress": self.state.shared()}

    def _resharded(self) -> dict | None:
        """After a resume at another world size: the cosine schedule ends at the new last step; returns
        :func:`~gradsync.train.reshard.world_change` (None when the world size is the checkpoint's)."""
        if self.resumed_from is None or self.resumed_from.world_size == self.world_size:
            return None
        resume.stretch_schedule(self.scheduler, self.total_steps())
        state = self.state
        left = 0 if state.epoch >= self.config.epochs else self.epoch_steps() - state.steps_in_epoch
        return world_change(self.resumed_from.world_size, self.world_size, self.config, state.samples_in_epoch,
                            state.epoch, self.num_train, left)

    def epoch_steps(self) -> int:
        """Optimizer steps of the epoch in progress: ``steps_per_epoch``, unless it continues at another
        world size (the steps done before, and the rest of the samples at this one)."""
        if self.global_batch is not None or self.state.order_start == 0:
            return self.steps_per_epoch
        order = EpochOrder(self.state.order_start)
        before = self.state.steps_in_epoch - steps_taken(self.state.samples_in_epoch, order, self.samples_per_step)
        return before + order_steps(self.num_train, order, self.world_size, self.config.batch_size,
                                    self.config.accumulate)

    def total_steps(self) -> int:
        """Optimizer steps of the whole run (more or fewer than planned after a resume at another world size)."""
        state = self.state
        if state.epoch >= self.config.epochs:
            return state.step
        return (state.step - state.steps_in_epoch + self.epoch_steps()
                + (self.config.epochs - state.epoch - 1) * self.steps_per_epoch)

    def elapsed_s(self) -> float:
        """Wall seconds of training so far, attempts before a resume included (their lost work not)."""
        return self.state.elapsed_before_s + time.perf_counter() - self.started

    def run(self) -> dict | None:
        """Train for ``config.epochs`` epochs; the main rank returns the summary, others (and an evicted
        elastic worker) None."""
        offered = self.resume_from[1]["progress"]["step"] if self.resume_from is not None else -1
        self.membership.join(offered)
        while True:
            view = self.membership.enter()
            if view is None:
                return None
            try:
                self._start(view)
                self._train()
                summary = self._finish()
                self.membership.wait_end()
                return summary
            except self.membership.recoverable as exc:
                self._leave(exc)
            except BaseException as exc:  # not caused by a peer: recovery would only repeat it
                self.membership.fail(exc)
                raise

    def _train(self) -> None:
        total = self.total_steps()
        bar = tqdm(total=total, initial=self.state.step, desc="train", unit="step",
                   disable=not (self.is_main and self.config.progress), dynamic_ncols=True)
        while self.state.epoch < self.config.epochs:
            self._train_epoch(bar)
            self._end_epoch(bar)
        bar.close()

    def _finish(self) -> dict | None:
        """Checkpoint the finished run, gather the summary; the main rank writes the model (collective)."""
        if self.checkpoint_root is not None:  # the finished job: running it again only writes the folder
            self._save_checkpoint()
        if self.elastic:
            self.model.check_replicas(self.optimizer, step=self.state.step)
        summary = self._summary()
        if self.log:
            self.log.close()
            self.log = None
            checkpoint.write_atomic(self.out_dir / MODEL_FILE, checkpoint.serialize(self.model.module.state_dict()))
            self.membership.finish()
        return summary

    def _leave(self, exc: BaseException) -> None:
        """An elastic member's step failed: close the log, count the bytes so far, hand back to the quorum."""
        if self.log is not None:
            self.log.close()
            self.log = None
        if self.model is not None:
            self.state.bytes_sent_offset += self.model.comm.stats.bytes_sent
            self.state.bytes_received_offset += self.model.comm.stats.bytes_received
        self.membership.leave(self.state.step, exc)

    def _micro_batch_groups(self):
        """The epoch's optimizer steps, each a list of ``accumulate`` micro-batches of sample indices.

        With ``deterministic``: this rank's micro-shards (``model.local_shards()``) of each global batch.
        """
        if self.global_batch is not None:
            for batch in global_batches(self.num_train, self.global_batch, self.config.seed, self.state.epoch):
                if self.config.deterministic:
                    shards = split_contiguous(batch, self.config.micro_shards)
                    yield [shards[index] for index in self.model.local_shards()]
                else:
                    yield worker_micro_batches(batch, self.world_size, self.rank, self.config.accumulate)
            return
        permutation = epoch_permutation(self.num_train, self.config.seed, self.state.epoch)
        yield from rank_steps(permutation, EpochOrder(self.state.order_start), self.world_size, self.rank,
                              self.config.batch_size, self.config.accumulate)

    def _train_epoch(self, bar) -> None:
        """Run the epoch's optimizer steps after those done before a resume (``state``'s data position)."""
        self.model.train()
        if self.global_batch is not None:
            done_before = self.state.steps_in_epoch
        else:
            done_before = steps_taken(self.state.samples_in_epoch, EpochOrder(self.state.order_start),
                                      self.samples_per_step)
        for number, micro_batches in enumerate(self._micro_batch_groups(), start=1):
            if number <= done_before:
                continue
            self.membership.at_step_boundary()
            self.membership.before_step(self.state.step, self.state.epoch, torch.cat(micro_batches).tolist())
            self.state.add_step_loss(self._step(micro_batches))
            self.state.steps_in_epoch += 1
            self.state.samples_in_epoch += self.samples_per_step
            self.state.samples += self.samples_per_step
            self.membership.committed(self.state.step - 1)
            if self.elastic and getattr(self.model, "compression", None) is not None:
                self.compression_state = clone(self.model.compression.state_dict())
            bar.update(1)
            if self._checkpoint_due():
                self._save_checkpoint()

    def _step(self, micro_batches: list[list[int]]) -> float:
        """One optimizer step over ``micro_batches`` (lists of sample indices); returns its loss."""
        self.faults.before_step(self.state.step + 1)
        meter = self.meter.start()
        if self.config.deterministic:
            step_loss = self._micro_shard_backward(micro_batches, meter)
        else:
            step_loss = self._backward(micro_batches, meter)
        straggle(self.straggler_factor, meter.compute_s())
        with meter.phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
        averaged = False
        if self.local_sgd:  # the gradient just applied had not seen the others' last local_steps steps
            self.state.staleness.record(self.model.local_steps)
            started = time.perf_counter()
            averaged = self.model.step()
            if averaged:
                meter.record("average", started, time.perf_counter())
        else:
            self.state.staleness.record(0)
        self._finish_step(meter, step_loss, lr)
        self._check_replicas(averaged)
        return step_loss

    def _check_replicas(self, averaged: bool) -> None:
        """``--check-replicas-every N``: every N steps (local SGD: at the first average after), record it."""
        every = self.config.check_replicas_every
        if not every:
            return
        self._replica_check_due = self._replica_check_due or self.state.step % every == 0
        if not self._replica_check_due or (self.local_sgd and not averaged):
            return
        self._replica_check_due = False
        if self.local_sgd:
            check = self.model.check_replicas(step=self.state.step)
        else:
            check = self.model.check_replicas(self.optimizer, step=self.state.step)
        if self.log:
            self.log.write({"kind": "replica_check", "step": self.state.step, "equal": True,
                            "tensors": check.tensors, "bytes": check.nbytes, "seconds": check.seconds})

    def _backward(self, micro_batches: list[list[int]], meter: StepMeter) -> float:
        """Forward and backward of each micro-batch, synchronising on the last; returns this rank's loss
        (elastic: the global batch's mean loss).

        With a global batch, each rank's loss is its samples' sum scaled by ``world_size / B``, so that
        DataParallel's average over ranks is the global batch's mean, weighted by samples, not by rank
        (an elastic run's shares are uneven when B does not divide)."""
        step_loss = torch.zeros(1, dtype=torch.float64)
        for index, indices in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            x, y = self.data.x_train[indices], self.data.y_train[indices]
            with nullcontext() if last else self.model.no_sync():
                with meter.phase("forward"):
                    if self.global_batch is None:
                        loss = F.cross_entropy(self.model(x), y) / len(micro_batches)
                    else:
                        loss = F.cross_entropy(self.model(x), y, reduction="sum") * (self.world_size / self.global_batch)
                with meter.phase("backward"):
                    loss.backward()  # the last micro-batch's AllReduces run inside it
            step_loss += loss.detach().double()
        if self.elastic:
            gradsync.all_reduce(step_loss, op="sum")
            step_loss /= self.world_size
        return float(step_loss[0])

    def _micro_shard_backward(self, shards: list, meter: StepMeter) -> float:
        """One backward per micro-shard of this rank, then the exact sum; returns the global batch's mean loss."""
        for index, indices in zip(self.model.local_shards(), shards):
            x, y = self.data.x_train[indices], self.data.y_train[indices]
            with self.model.micro_shard(index, self.state.step) as shard:
                with meter.phase("forward"):
                    loss = F.cross_entropy(self.model(x), y, reduction="sum")  # divided by B once, after the sum
                with meter.phase("backward"):
                    shard.backward(loss)
        with meter.phase("backward"):  # the exchange, as DataParallel's end-of-backward wait
            return self.model.synchronize(divisor=self.global_batch)

    def _finish_step(self, meter: StepMeter, step_loss: float, lr: float) -> None:
        record = meter.stop(self.state.times)
        self.state.step_bytes_sent += record.bytes_sent
        self.state.step += 1
        if self.log:
            bytes_total = self.state.bytes_sent_offset + self.model.comm.stats.bytes_sent
            self.log.write({"kind": "step", "epoch": self.state.epoch, "step": self.state.step, "loss": step_loss,
                            "lr": lr, **record.as_dict(), "bytes_sent_total": bytes_total,
                            "world_size": self.world_size, "time": time.time()})

    def _end_epoch(self, bar) -> None:
        """All-reduce the epoch's loss, evaluate, record the epoch; the state moves to the next epoch."""
        loss_sum = self.state.epoch_loss()
        if not self.global_loss:
            gradsync.all_reduce(loss_sum, op="sum")
        if self.local_sgd and self.model.local_steps:  # evaluate the average, as the paper does
            self.model.average()
        eval_started = time.perf_counter()
        test_loss, test_accuracy = self._evaluate()
        self.meter.record("eval", eval_started, time.perf_counter())
        self.state.eval_s += time.perf_counter() - eval_started
        record = {"kind": "epoch", "epoch": self.state.epoch, "train_loss": float(loss_sum[0] / loss_sum[1]),
                  "test_loss": test_loss, "test_accuracy": test_accuracy, "elapsed_s": self.elapsed_s(),
                  "world_size": self.world_size}
        self.state.epoch_records.append(record)
        if self.log:
            self.log.write(record)
        bar.set_postfix(loss=f"{record['train_loss']:.3f}", test_acc=f"{100 * test_accuracy:.1f}%")
        self.state.next_epoch()

    # -- checkpoints -----------------------------------------------------------------------------

    def _checkpoint_due(self) -> bool:
        last = self.state.epoch == self.config.epochs - 1 and self.state.steps_in_epoch == self.epoch_steps()
        # the last step's checkpoint is written after the last evaluation
        return (self.checkpoint_root is not None and self.state.step % self.config.checkpoint_every == 0
                and not last)

    def _save_checkpoint(self) -> None:
        started = time.perf_counter()
        if self.elastic:  # the replicated state, rank 0 alone: resumable at any world size
            if self.is_main:
                elastic_checkpoint.save(self.config, {**self._snapshot(), "global_batch": self.global_batch},
                                        self.world_size)
            return
        shared = None
        if self.is_main:
            shared = resume.shared_state(self.state, self.replica, self.config, self.log.position(),
                                         self.elapsed_s())
        checkpoint.save(self.checkpoint_root, self.state.step, shared, resume.rank_state(self.state, self.replica),
                        self.model.comm, keep=self.config.keep_checkpoints)
        self.state.checkpoint_s += time.perf_counter() - started
        if self.is_main:
            self.events.write({"event": "checkpoint", "step": self.state.step, "attempt": attempt(),
                               "seconds": time.perf_counter() - started})

    # -- evaluation and the end of the run -------------------------------------------------------

    @torch.no_grad()
    def _evaluate(self) -> tuple[float, float]:
        """Each rank scores its share of the test split; the sums are all-reduced.

        With ``deterministic`` the split is cut into the micro-shards' number of pieces, each scored
        on its own and gathered by piece, so the result does not depend on the world size either.
        """
        self.model.eval()
        pieces, mine = self.world_size, [self.rank]
        if self.config.deterministic:
            pieces, mine = self.config.micro_shards, list(self.model.local_shards())
        table = torch.zeros(pieces, 3, dtype=torch.float64)  # (piece, [loss sum, correct, samples])
        for index, shard in enumerate(torch.tensor_split(torch.arange(len(self.data.y_test)), pieces)):
            if index in mine:
                x, y = self.data.x_test[shard], self.data.y_test[shard]
                logits = self.model.module(x)
                table[index] = torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                                             (logits.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
        if self.config.deterministic:
            gradsync.all_reduce(table, op="sum")  # one rank's value and zeros per entry: exact in any order
            totals = table.sum(0)
        else:
            totals = table.sum(0)
            gradsync.all_reduce(totals, op="sum")
        loss_sum, correct, count = totals.tolist()
        return loss_sum / count, correct / count

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

    def _summary(self) -> dict | None:
        """Gather every rank's counters (collective); rank 0 returns the summary, others None."""
        wall_s = self.elapsed_s()
        state, t, stats = self.state, self.state.times, self.model.comm.stats
        own = torch.tensor([t.compute_s, t.comm_s, state.bytes_sent_offset + stats.bytes_sent,
                            state.bytes_received_offset + stats.bytes_received, t.exposed_comm_s,
                            t.forward_s, t.backward_s, t.optimizer_s, state.step_bytes_sent], dtype=torch.float64)
        per_rank = torch.stack(gradsync.all_gather(own))  # (world_size, 9)
        self._write_trace()
        if not self.is_main:
            return None
        mean = per_rank.mean(0).tolist()
        totals = RunTotals(
            world_size=self.world_size, num_workers=self.world_size, steps=state.step,
            samples=state.samples, wall_s=wall_s,
            train_wall_s=wall_s - state.eval_s, compute_s=mean[0], communication_s=mean[1],
            exposed_communication_s=mean[4],
            # inside the steps only: the start-up broadcast and evaluation sums are not per-step traffic
            bytes_sent_per_step=mean[8] / max(state.step, 1),
            bytes_sent_per_rank=[int(v) for v in per_rank[:, 2].tolist()],
            bytes_received_per_rank=[int(v) for v in per_rank[:, 3].tolist()],
            per_rank_compute_s=per_rank[:, 0].tolist(), per_rank_communication_s=per_rank[:, 1].tolist())
        extra = {"restarts": attempt(), "resumed_from_step": state.resumed_from_step,
                 "checkpoint_s": state.checkpoint_s, "forward_s": mean[5], "backward_s": mean[6],
                 "optimizer_s": mean[7], "per_rank_exposed_communication_s": per_rank[:, 4].tolist(),
                 "global_batch_size": self.global_batch, **self.membership.summary_fields()}
        if self.elastic:
            extra["replicas_equal"] = True  # checked before the summary (ReplicaDivergenceError otherwise)
        return build_summary(self.config, state.epoch_records, totals, state.staleness.as_dict(),
                             self.model.bucket_algorithms(), self.model.module, self.data, extra)
