"""The one training loop: shard, forward, backward + AllReduce, step, for every run but the parameter server's.

Each optimizer step consumes ``accumulate`` micro-batches of ``batch_size`` samples per worker; all but the last
run under ``no_sync()`` and the loss is scaled by 1/accumulate, so one step equals one batch of ``batch_size *
accumulate * world_size`` samples. With ``global_batch_size`` the step's samples are fixed instead, and
``deterministic`` computes them as micro-shards whose exact sum is the same at any world size
(:mod:`~gradsync.train.forward_backward`); timing in :class:`~gradsync.train.meter.StepMeter`, progress in
:class:`~gradsync.train.state.TrainState`.

Who takes part is a membership's answer (:mod:`~gradsync.elastic.membership`): a static run's never changes; an
elastic run's is asked at every step boundary, and each new membership starts with rank 0's state handed to
every member (:meth:`Trainer._adopt`), so survivors, replacements and a member that missed a step continue from
the same bits. An elastic run always takes fixed global batches (``--global-batch-size``, else ``--batch-size``
x ``--accumulate`` x ``--nproc``), cut over the members of the moment; a step interrupted by a failure is redone
on the same batch.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

import gradsync
from gradsync.elastic.membership import StaticMembership, View
from gradsync.elastic.handover import broadcast_state, clone
from gradsync.fault import checkpoint
from gradsync.fault.events import EventLog
from gradsync.fault.injection import FaultPlan, attempt
from gradsync.parallel.timeline import Timeline
from gradsync.elastic import run_checkpoint as elastic_checkpoint
from gradsync.train import resume
from gradsync.train.config import TrainConfig
from gradsync.train.validation import validate_against_data
from gradsync.train.data import load
from gradsync.train.memory_report import MemoryReport
from gradsync.train.meter import StepMeter
from gradsync.train.metrics import METRICS_FILE, MODEL_FILE, MetricsLog
from gradsync.train.task import make_model
from gradsync.train.position import EpochOrder, StepPlan, steps_taken
from gradsync.train.reshard import world_change
from gradsync.train.schedule import lr_fields
from gradsync.train.setup import (build_replica, make_optimizer, make_replica_optimizer, make_scheduler,
                                  seed_everything, set_threads, step_optimizer, straggle, straggler_factor)
from gradsync.train.state import TrainState
from gradsync.train.forward_backward import backward, epoch_micro_batches, micro_shard_backward
from gradsync.train.evaluate import evaluate, gather_trace
from gradsync.train.summary import build_summary, gather_totals
from gradsync.train.tensorboard_events import TrainBoard


class Trainer:
    """One worker of a sync or local-SGD run, static or elastic; the main rank also writes the run folder.

    ``membership``: who takes part (None: the static group ``gradsync.init()`` formed); ``preemption``: a
    :class:`~gradsync.train.preemption.Preemption` whose signal stops every rank at one step with a checkpoint.
    """

    def __init__(self, config: TrainConfig, data_path: Path, out_dir: Path, membership=None, preemption=None):
        self.config = config
        self.preemption = preemption
        self.membership = membership or StaticMembership()
        self.elastic = self.membership.elastic
        self.out_dir = Path(out_dir)
        set_threads(config.nproc if self.elastic else gradsync.world_size(), deterministic=config.deterministic)
        seed_everything(self.membership.seed(config.seed))
        self.data = load(data_path)
        self.memory = MemoryReport(config)  # the baseline: after the data, before the model
        self.num_train = len(self.data.y_train)
        self.local_sgd = config.mode == "local-sgd"
        self.global_loss = config.deterministic or self.elastic  # a step's loss is the global batch's already
        self.events = EventLog(self.out_dir)
        self.faults = FaultPlan(self.membership.slot, config.fault_rank_step("fail_at"),
                                config.fault_rank_step("hang_at"), self.events)
        self.state = TrainState()
        self.membership.attach(self.events, lambda: self.state.step + 1)
        self.timeline = Timeline(self.membership.slot) if config.trace else None
        self.board = TrainBoard(config.tensorboard)  # --tensorboard: the main rank's event files
        self.model = self.log = self.world_change = self.resumed_from = None
        self.compression_state = None  # elastic: this rank's residuals as of its last committed step
        self._replica_check_due = False  # --check-replicas-every in local SGD: waiting for the next average
        self.global_batch = config.global_batch_size
        self.resume_from = None  # elastic: (path, state) of the newest checkpoint, offered when joining
        if self.elastic:
            self.global_batch = config.elastic_global_batch()
            self.resume_from = self._newest_elastic_checkpoint()
            if self.resume_from is not None:  # the global batch the run was configured with, whatever --nproc
                self.global_batch = int(self.resume_from[1]["global_batch"])
            self.checkpoint_root = elastic_checkpoint.folder(config.checkpoint_dir)
        else:
            self.checkpoint_root = Path(config.checkpoint_dir) if config.checkpointing() else None
        self.started = time.perf_counter()

    def _newest_elastic_checkpoint(self) -> tuple[Path, dict] | None:
        """The newest usable elastic checkpoint; each newer one skipped is said (a warning) and recorded."""
        found, skipped = elastic_checkpoint.scan(elastic_checkpoint.folder(self.config.checkpoint_dir))
        for line in skipped:
            warnings.warn(line, checkpoint.CheckpointWarning, stacklevel=2)
            self.events.write({"event": "checkpoint_skipped", "line": line})
        return found

    def _start(self, view: View) -> None:
        """Build this membership's replica: rank 0's state handed over (elastic), else restored from the
        newest checkpoint or fresh (collective)."""
        self.rank, self.world_size = view.rank, view.world_size
        self.is_main = self.rank == 0
        self.plan = StepPlan(self.num_train, self.world_size, self.config.epochs, self.config.batch_size,
                             self.config.accumulate, self.global_batch)
        if self.elastic:
            self._adopt(view)
        else:
            self._restore()
        self.straggler_factor = straggler_factor(self.config, self.membership.slot)
        self.model.timeline = self.timeline
        self.meter = StepMeter(self.model, self.timeline, comm_outside=self.local_sgd)
        self.board.open(self.model, self.is_main)

    def _restore(self) -> None:
        validate_against_data(self.config, self.world_size, self.num_train)
        self.model = build_replica(self.config)
        self._optimizer()
        self.memory.check(self.model, self.optimizer, self.data, self.world_size)  # before step 1, on every rank
        self.state, metrics_text, self.resumed_from = resume.load_latest(
            self.checkpoint_root, self.config, self.replica, self.out_dir / METRICS_FILE if self.is_main else None)
        self.world_change = self._resharded()
        self.started = time.perf_counter()
        # a resumed log holds the checkpoint's records only: no step twice
        self.log = MetricsLog(self.out_dir / METRICS_FILE, resumed_text=metrics_text) if self.is_main else None
        if self.is_main:
            resume.announce(self.state, self.total_steps(), self.resumed_from and self.resumed_from.folder,
                            self.events, self.world_change)

    def _optimizer(self) -> None:
        """The optimizer (sharded as the replica is) and schedule of a replica just built (bytes count from 0)."""
        self._bytes_counted = False
        self.optimizer = make_replica_optimizer(self.model, self.config)
        self.scheduler = make_scheduler(self.optimizer, self.config, self.plan.steps_per_epoch * self.config.epochs,
                                        self.world_size)
        self.replica = resume.Replica(self.model, self.optimizer, self.scheduler, self.local_sgd)

    def _adopt(self, view: View) -> None:
        """Take rank 0's state (collective), build the replica from it and check that every member holds
        the same bits (:class:`~gradsync.ReplicaDivergenceError` on every rank if not)."""
        started = time.perf_counter()
        fault = self.membership.handover_fault(view)
        handed = broadcast_state(self._snapshot() if view.rank == 0 else None, before_payload=fault)
        self.model = build_replica(self.config, handed["model"], self.compression_state)
        self._optimizer()
        self.optimizer.load_state_dict(handed["optimizer"])
        self.scheduler.load_state_dict(handed["scheduler"])
        self.state.adopt(handed["progress"])
        self.started = time.perf_counter()
        self.model.check_replicas(self.optimizer, step=self.state.step)
        self.membership.arm(self.model.module)
        self.log = MetricsLog(self.out_dir / METRICS_FILE) if self.is_main else None
        if self.is_main:
            self.events.write({"event": "resumed_training", "epoch": view.epoch, "world_size": view.world_size,
                               "step": self.state.step, "reason": view.quorum.reason,
                               "handover_s": time.perf_counter() - started,
                               "members": [m["slot"] for m in view.quorum.members],
                               "joined": view.quorum.record.get("joined", []), "replicas_equal": True})

    def _snapshot(self) -> dict:
        """What rank 0 hands over: model, optimizer, schedule and the shared part of :class:`TrainState`."""
        if self.model is None and self.resume_from is not None:  # a whole-job failure: the newest checkpoint
            handed, line = elastic_checkpoint.offer(self.resume_from, self.global_batch, gradsync.world_size())
            handed["progress"] = {**handed["progress"], "resumed_from_step": handed["progress"]["step"]}
            resume.say(line)
            self.events.write({"event": "resumed", "from_step": handed["progress"]["step"], "line": line,
                               "checkpoint": str(self.resume_from[0]), "world_size_to": gradsync.world_size(),
                               "world_size_from": self.resume_from[1]["world_size"]})
            return handed
        if self.model is None:  # the first membership: rank 0 builds the seeded model
            torch.manual_seed(self.config.seed)
            module = make_model(self.config)
            optimizer = make_optimizer(module.parameters(), self.config)
            scheduler = make_scheduler(optimizer, self.config, self.plan.steps_per_epoch * self.config.epochs,
                                       self.world_size)
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
        return self.plan.epoch_steps(self.state)

    def total_steps(self) -> int:
        return self.plan.total_steps(self.state)

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
        with resume.whole_parameters(self.model):  # ZeRO-3: every rank gathers them (the summary counts them)
            summary = self._summary()
            model_state = self.model.module.state_dict() if self.log else None
        self.board.close()
        if self.log:
            self.log.close()
            self.log = None
            checkpoint.write_atomic(self.out_dir / MODEL_FILE, checkpoint.serialize(model_state))
            self.membership.finish()
        return summary

    def _leave(self, exc: BaseException) -> None:
        """An elastic member's step failed: close the log, count the bytes so far, hand back to the quorum."""
        self.board.close()
        if self.log is not None:
            self.log.close()
            self.log = None
        if self.model is not None and not self._bytes_counted:  # a failed hand-over keeps the last model
            self.state.bytes_sent_offset += self.model.comm.stats.bytes_sent
            self.state.bytes_received_offset += self.model.comm.stats.bytes_received
            self._bytes_counted = True
        self.membership.leave(self.state.step, exc)

    def _train_epoch(self, bar) -> None:
        """Run the epoch's optimizer steps after those done before a resume (``state``'s data position)."""
        self.model.train()
        if self.global_batch is not None:
            done_before = self.state.steps_in_epoch
        else:
            done_before = steps_taken(self.state.samples_in_epoch, EpochOrder(self.state.order_start),
                                      self.plan.samples_per_step)
        local_shards = self.model.local_shards() if self.config.deterministic else None
        batches = epoch_micro_batches(self.config, self.num_train, self.global_batch, self.state.epoch,
                                      self.state.order_start, self.rank, self.world_size, local_shards)
        for number, micro_batches in enumerate(batches, start=1):
            if number <= done_before:
                continue
            self.membership.at_step_boundary()
            self.membership.before_step(self.state.step, self.state.epoch, micro_batches)  # ids: elastic only
            self.state.add_step_loss(self._step(micro_batches))
            self.state.steps_in_epoch += 1
            self.state.samples_in_epoch += self.plan.samples_per_step
            self.state.samples += self.plan.samples_per_step
            self.membership.committed(self.state.step - 1)
            if self.elastic and getattr(self.model, "compression", None) is not None:
                self.compression_state = clone(self.model.compression.state_dict())
            bar.update(1)
            if self._checkpoint_due():
                self._save_checkpoint()
            elif self.preemption is not None and not self._last_step() and self.preemption.requested(self.state.step):
                self._save_checkpoint()
                self.board.close()  # the metrics log is flushed at every record
                raise self.preemption.stop(self.state.step)

    def _step(self, micro_batches: list[list[int]]) -> float:
        """One optimizer step over ``micro_batches`` (lists of sample indices); returns its loss."""
        self.faults.before_step(self.state.step + 1)
        meter = self.meter.start()
        if self.config.deterministic:
            step_loss = micro_shard_backward(self.model, self.data, micro_batches, meter, self.state.step,
                                             self.global_batch)
        else:
            step_loss = backward(self.model, self.data, micro_batches, meter, self.global_batch, self.world_size,
                                 global_loss=self.elastic)
        straggle(self.straggler_factor, meter.compute_s())
        with meter.phase("optimizer"):
            norm = step_optimizer(self.model, self.optimizer, self.config.clip_grad_norm)
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
        self._finish_step(meter, step_loss, lr, norm)
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

    def _finish_step(self, meter: StepMeter, step_loss: float, lr: float, grad_norm: float | None) -> None:
        record = meter.stop(self.state.times)
        self.state.step_bytes_sent += record.bytes_sent
        self.state.step += 1
        self.board.step(self.state.step, step_loss, record, self.plan.samples_per_step, meter.started_s)
        if self.log:
            bytes_total = self.state.bytes_sent_offset + self.model.comm.stats.bytes_sent
            self.log.write({"kind": "step", "epoch": self.state.epoch, "step": self.state.step, "loss": step_loss,
                            "lr": lr, **({} if grad_norm is None else {"grad_norm": grad_norm}), **record.as_dict(),
                            "bytes_sent_total": bytes_total, "world_size": self.world_size, "time": time.time()})

    def _end_epoch(self, bar) -> None:
        """All-reduce the epoch's loss, evaluate, record the epoch; the state moves to the next epoch."""
        loss_sum = self.state.epoch_loss()
        if not self.global_loss:
            gradsync.all_reduce(loss_sum, op="sum")
        eval_started = time.perf_counter()
        shards = (self.config.micro_shards, self.model.local_shards()) if self.config.deterministic else None
        # local SGD: the average (as Lin et al. evaluate); DiLoCo: the global parameters, or at the end of the
        # run one more outer round of every fragment stepped since it was sent
        final = self.state.epoch == self.config.epochs - 1
        with self.model.evaluation(final) if self.local_sgd else contextlib.nullcontext():
            test_loss, test_accuracy = evaluate(self.model, self.data, self.rank, self.world_size, shards)
        self.meter.record("eval", eval_started, time.perf_counter())
        self.state.eval_s += time.perf_counter() - eval_started
        record = {"kind": "epoch", "epoch": self.state.epoch, "train_loss": float(loss_sum[0] / loss_sum[1]),
                  "test_loss": test_loss, "test_accuracy": test_accuracy, "elapsed_s": self.elapsed_s(),
                  "world_size": self.world_size}
        self.state.epoch_records.append(record)
        self.board.evaluation(self.state.step, test_loss, test_accuracy)
        if self.log:
            self.log.write(record)
        bar.set_postfix(loss=f"{record['train_loss']:.3f}", test_acc=f"{100 * test_accuracy:.1f}%")
        self.state.next_epoch()

    # -- checkpoints -----------------------------------------------------------------------------

    def _last_step(self) -> bool:
        return self.state.epoch == self.config.epochs - 1 and self.state.steps_in_epoch == self.epoch_steps()

    def _checkpoint_due(self) -> bool:
        # the last step's checkpoint is written after the last evaluation
        return (self.checkpoint_root is not None and self.state.step % self.config.checkpoint_every == 0
                and not self._last_step())

    def _save_checkpoint(self) -> None:
        started = time.perf_counter()
        if self.elastic:  # the replicated state, rank 0 alone: resumable at any world size
            if self.is_main:
                elastic_checkpoint.save(self.checkpoint_root, {**self._snapshot(), "global_batch": self.global_batch},
                                        self.world_size, self.config.keep_checkpoints,
                                        resume.config_fields(self.config))
            return
        with resume.whole_parameters(self.model):  # ZeRO-3: every rank gathers them
            own = resume.rank_state(self.state, self.replica)
            shared = None
            if self.is_main:
                shared = resume.shared_state(self.state, self.replica, self.config, self.log.position(),
                                             self.elapsed_s())
        checkpoint.save(self.checkpoint_root, self.state.step, shared, own, self.model.comm,
                        keep=self.config.keep_checkpoints)
        self.state.checkpoint_s += time.perf_counter() - started
        if self.is_main:
            self.events.write({"event": "checkpoint", "step": self.state.step, "attempt": attempt(),
                               "seconds": time.perf_counter() - started})

    # -- the end of the run ----------------------------------------------------------------------

    def _summary(self) -> dict | None:
        """Gather every rank's counters and timeline (collective); rank 0 returns the summary, others None."""
        totals, extra = gather_totals(self.state, self.model.comm.stats, self.world_size, self.elapsed_s())
        extra.update(self.memory.summary_fields())  # collective: every rank's measured peak
        gather_trace(self.timeline, self.config.trace, self.is_main)
        if not self.is_main:
            return None
        extra.update({"restarts": attempt(), "global_batch_size": self.global_batch,
                      "lr": lr_fields(self.scheduler, self.config, self.world_size),
                      **self.membership.summary_fields()})
        if self.elastic:
            extra["replicas_equal"] = True  # checked before the summary (ReplicaDivergenceError otherwise)
        if self.local_sgd:
            extra["local_sgd"] = self.model.summary_fields()
        return build_summary(self.config, self.state.epoch_records, totals, self.state.staleness.as_dict(),
                             self.model.bucket_algorithms(), self.model.module, self.data, extra)
