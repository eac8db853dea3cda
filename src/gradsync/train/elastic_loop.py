"""``gradsync train --elastic`` (sync mode): one worker's loop through memberships that change under it.

Each membership (:class:`~gradsync.elastic.member.Membership`) starts with a
state hand-over from its rank 0, the member with the most committed steps:
model, optimizer, schedule and progress (data position, the epoch's loss,
the finished epochs' records) are broadcast, and every member builds its
replica from them, so a survivor, a replacement and a member that missed a
step all continue from the same bits. What is per rank by nature stays
its own: a replacement's RNG stream is seeded from (seed, slot,
incarnation) and its error-feedback residuals start at zero; a survivor
keeps both (its residuals as they were before the interrupted step).

Data: every step takes a fixed global batch (``--global-batch-size``, or
``--batch-size`` x ``--accumulate`` x ``--nproc``) of the epoch's
permutation (:mod:`~gradsync.train.global_batch`), cut over the current
members with ``torch.tensor_split`` (uneven shares when it does not divide).
Each rank's loss is its samples' *sum* scaled by ``world_size / B``, so
DataParallel's average over ranks is the mean over the global batch's
samples, weighted by samples, not by rank. A step interrupted by a failure
is redone by the next membership on the same global batch; a step that some
member committed before the failure is not (the hand-over brings the others
forward). Each member appends to ``elastic/samples-<slot>.<incarnation>.jsonl``
the sample ids of each step it computes, and each step it commits, so that
samples lost or used twice can be counted (:mod:`~gradsync.train.elastic_samples`).
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

import gradsync
from gradsync.compression import make as make_compressor
from gradsync.elastic.member import (FATAL_AFTER, RECOVERABLE, ElasticMember, Evicted, MembershipChanged,
                                     transient)
from gradsync.fault import checkpoint
from gradsync.fault.events import EventLog
from gradsync.fault.injection import FaultPlan
from gradsync.train.elastic_faults import ElasticFault
from gradsync.train.config import TrainConfig
from gradsync.train.elastic_options import elastic_workers
from gradsync.train.data import load
from gradsync.train import elastic_checkpoint
from gradsync.train.elastic_samples import SAMPLES_FOLDER
from gradsync.train.elastic_state import broadcast_state, check_replicas_equal, clone
from gradsync.train.resume import say
from gradsync.train.global_batch import global_batches, split_contiguous
from gradsync.train.metrics import METRICS_FILE, MODEL_FILE, MetricsLog
from gradsync.train.models import build_model
from gradsync.train.setup import make_optimizer, make_scheduler, seed_everything, set_threads



def elastic_global_batch(config: TrainConfig) -> int:
    """Samples per optimizer step of an elastic run, whatever its world size."""
    return config.global_batch_size or config.batch_size * config.accumulate * elastic_workers(config)


def new_progress() -> dict:
    return {"step": 0, "epoch": 0, "steps_in_epoch": 0, "loss_sum": 0.0, "epoch_records": [],
            "started": time.time(), "train_s": 0.0}


class ElasticTrainer:
    """One worker of an elastic sync run; :meth:`run` returns the summary on the member that writes it."""

    def __init__(self, member: ElasticMember, config: TrainConfig, data_path: Path, out_dir: Path):
        self.member, self.config, self.out_dir = member, config, Path(out_dir)
        set_threads(config.nproc, deterministic=config.deterministic)
        seed_everything(config.seed * 1_000_003 + member.slot * 1009 + member.incarnation)  # own stream
        self.data = load(data_path)
        self.global_batch = elastic_global_batch(config)
        self.steps_per_epoch = len(self.data.y_train) // self.global_batch
        self.total_steps = self.steps_per_epoch * config.epochs
        self.progress = new_progress()
        self.model = self.module = self.optimizer = self.scheduler = None
        self.compression_state = None   # this rank's residuals as of its last committed step
        self.events = EventLog(self.out_dir)
        self.faults = FaultPlan(member.slot, config.fault_rank_step("fail_at"), config.fault_rank_step("hang_at"),
                                self.events)
        self.fault_in = ElasticFault.from_config(config.elastic_fault, member.slot, self.events,
                                                 lambda: self.progress["step"] + 1)
        samples_path = self.out_dir / SAMPLES_FOLDER / f"samples-{member.slot}.{member.incarnation}.jsonl"
        samples_path.parent.mkdir(exist_ok=True)
        # one handle for the run, a line each write (buffering=1): a kill loses at most a torn last line
        self.samples = open(samples_path, "a", encoding="utf-8", buffering=1)
        self._permutation = (None, None)
        self.log = None
        self.futile = (-1, 0)  # (step, times in a row it failed with an error no peer caused)
        self.resume_from = elastic_checkpoint.latest(config)  # (path, state) offered when this worker joins
        if self.resume_from is not None:  # the global batch the run was configured with, whatever --nproc
            self.global_batch = int(self.resume_from[1]["global_batch"])
            self.steps_per_epoch = len(self.data.y_train) // self.global_batch
            self.total_steps = self.steps_per_epoch * config.epochs

    # -- memberships -----------------------------------------------------------------------------

    def run(self) -> dict | None:
        offered = self.resume_from[1]["progress"]["step"] if self.resume_from is not None else -1
        self.member.join(step=offered)
        while True:
            try:
                membership = self.member.enter()
            except Evicted:
                return None
            try:
                self._adopt(membership)
                self._train()
                summary = self._finish()
                if self.member.wait_end():
                    gradsync.shutdown()
                    return summary
                raise MembershipChanged("the membership closed before the run ended")
            except RECOVERABLE as exc:
                self._leave(exc)
            except BaseException as exc:  # not caused by a peer: recovery would only repeat it
                self.member.fail(exc)
                raise

    def _leave(self, exc: BaseException) -> None:
        if not transient(exc):  # a mismatch, a divergence ...: bounded, not retried forever
            step = self.progress["step"]
            self.futile = (step, self.futile[1] + 1 if self.futile[0] == step else 1)
            if self.futile[1] >= FATAL_AFTER:
                self.member.fail(exc)
                raise exc
        self.events.write({"event": "left", "slot": self.member.slot, "incarnation": self.member.incarnation,
                           "epoch": self.member.membership.epoch, "step": self.progress["step"],
                           "error": f"{type(exc).__name__}: {exc}"[:300]})
        if self.log is not None:
            self.log.close()
            self.log = None
        self.member.leave(self.progress["step"], exc)

    def _adopt(self, membership) -> None:
        """Take rank 0's state (collective) and build this membership's replica from it."""
        started = time.perf_counter()
        fault = self.fault_in.broadcast_hook(membership)
        state = broadcast_state(self._snapshot() if membership.rank == 0 else None, before_payload=fault)
        self.progress = state["progress"]
        self._build(state)
        equal = check_replicas_equal(self.module)  # checked after every recovery (collective)
        self.log = MetricsLog(self.out_dir / METRICS_FILE) if membership.rank == 0 else None
        if membership.rank == 0:
            self.events.write({"event": "resumed_training", "epoch": membership.epoch,
                               "world_size": membership.world_size, "step": self.progress["step"],
                               "reason": membership.reason, "handover_s": time.perf_counter() - started,
                               "members": [m["slot"] for m in membership.members],
                               "joined": membership.record.get("joined", []), "replicas_equal": equal})

    def _snapshot(self) -> dict:
        if self.model is None and self.resume_from is not None:  # a whole-job failure: the newest checkpoint
            path, state = self.resume_from
            line = (f"elastic run resuming from step {state['progress']['step']} of {path}, written by "
                    f"{state['world_size']} workers, now {gradsync.world_size()}: the same global batch of "
                    f"{self.global_batch} samples and data position (epoch {state['progress']['epoch']}, step "
                    f"{state['progress']['steps_in_epoch']} of it); per-rank RNG streams and error-feedback "
                    f"residuals start fresh")
            say(line)
            self.events.write({"event": "resumed", "from_step": state["progress"]["step"], "checkpoint": str(path),
                               "world_size_from": state["world_size"], "world_size_to": gradsync.world_size(),
                               "line": line})
            return {name: state[name] for name in ("model", "optimizer", "scheduler", "progress")}
        if self.model is None:  # the first membership: everyone builds the same seeded model
            torch.manual_seed(self.config.seed)
            module = build_model(self.config.model)
            optimizer = make_optimizer(module.parameters(), self.config)
            scheduler = make_scheduler(optimizer, self.config, self.total_steps)
            return {"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "progress": self.progress}
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "progress": self.progress}

    def _build(self, state: dict) -> None:
        config = self.config
        module = build_model(config.model)
        module.load_state_dict(state["model"])
        if config.deterministic:
            model = gradsync.DeterministicDataParallel(module, config.micro_shards, algorithm=config.algorithm,
                                                       seed=config.seed)
        else:
            compressor = make_compressor(config.compression, config.topk_ratio, config.powersgd_rank,
                                         config.compression_warmup_steps)
            if compressor is not None and self.compression_state is not None:
                compressor.load_state_dict(self.compression_state)  # a survivor's own residuals
            model = gradsync.DataParallel(module, bucket_cap_mb=config.bucket_cap_mb, algorithm=config.algorithm,
                                          compression=compressor)
        optimizer = make_optimizer(module.parameters(), config)
        scheduler = make_scheduler(optimizer, config, self.total_steps)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        self.model, self.module, self.optimizer, self.scheduler = model, module, optimizer, scheduler
        self.fault_in.arm_allreduce(module)

    # -- training --------------------------------------------------------------------------------

    def _train(self) -> None:
        progress = self.progress
        while progress["epoch"] < self.config.epochs:
            if self.member.change_requested():
                raise MembershipChanged("the quorum closed this membership")
            if progress["steps_in_epoch"] < self.steps_per_epoch:
                self._step()
            else:
                self._end_epoch()

    def _global_batch(self) -> torch.Tensor:
        epoch, index = self.progress["epoch"], self.progress["steps_in_epoch"]
        if self._permutation[0] != epoch:
            self._permutation = (epoch, list(global_batches(len(self.data.y_train), self.global_batch,
                                                            self.config.seed, epoch)))
        return self._permutation[1][index]

    def _step(self) -> None:
        self.faults.before_step(self.progress["step"] + 1)
        started = time.perf_counter()
        batch = self._global_batch()
        if self.config.deterministic:
            shards = split_contiguous(batch, self.config.micro_shards)
            mine = [shards[index] for index in self.model.local_shards()]
            ids = torch.cat(mine) if mine else batch[:0]
            self._record({"m": self.member.membership.epoch, "step": self.progress["step"],
                          "epoch": self.progress["epoch"], "ids": ids.tolist()})
            loss = self._deterministic_backward(mine)
        else:
            rank, world_size = gradsync.rank(), gradsync.world_size()
            share = split_contiguous(batch, world_size)[rank]
            self._record({"m": self.member.membership.epoch, "step": self.progress["step"],
                          "epoch": self.progress["epoch"], "ids": share.tolist()})
            loss = self._backward(share, world_size)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self._commit(loss, lr, time.perf_counter() - started)

    def _backward(self, share: torch.Tensor, world_size: int) -> float:
        """Backward over this rank's share (``accumulate`` micro-batches); returns the global batch's mean loss."""
        micro_batches = split_contiguous(share, self.config.accumulate)
        scale = world_size / self.global_batch  # DataParallel divides by world_size: weighted by samples
        loss_sum = torch.zeros(1, dtype=torch.float64)
        for index, indices in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            x, y = self.data.x_train[indices], self.data.y_train[indices]
            with nullcontext() if last else self.model.no_sync():
                loss = F.cross_entropy(self.model(x), y, reduction="sum")
                (loss * scale).backward()
            loss_sum += loss.detach().double()
        gradsync.all_reduce(loss_sum, op="sum")
        return float(loss_sum[0]) / self.global_batch

    def _deterministic_backward(self, shards: list[torch.Tensor]) -> float:
        for index, indices in zip(self.model.local_shards(), shards):
            x, y = self.data.x_train[indices], self.data.y_train[indices]
            with self.model.micro_shard(index, self.progress["step"]) as shard:
                shard.backward(F.cross_entropy(self.model(x), y, reduction="sum"))
        return self.model.synchronize(divisor=self.global_batch)

    def _commit(self, loss: float, lr: float, seconds: float) -> None:
        progress = self.progress
        self._record({"m": self.member.membership.epoch, "commit": progress["step"]})
        progress["step"] += 1
        progress["steps_in_epoch"] += 1
        progress["loss_sum"] += loss
        progress["train_s"] += seconds
        compression = getattr(self.model, "compression", None)
        if compression is not None:
            self.compression_state = clone(compression.state_dict())
        if self.log is not None and self.config.checkpoint_dir and progress["step"] % self.config.checkpoint_every == 0:
            state = {**self._snapshot(), "global_batch": self.global_batch}
            elastic_checkpoint.save(self.config, state, gradsync.world_size())
        if self.log is not None:
            self.log.write({"kind": "step", "epoch": progress["epoch"], "step": progress["step"], "loss": loss,
                            "lr": lr, "world_size": gradsync.world_size(), "step_s": seconds,
                            "time": time.time()})

    def _record(self, record: dict) -> None:
        """Append to this member's samples file: the ids it computes a step on (before the step's
        collectives), then the step's commit (after): a member killed in between still counts, as long as
        some member committed that step in that membership (its gradient was in every member's sum)."""
        self.samples.write(json.dumps(record) + "\n")

    def _end_epoch(self) -> None:
        progress = self.progress
        test_loss, test_accuracy = self._evaluate()
        record = {"kind": "epoch", "epoch": progress["epoch"],
                  "train_loss": progress["loss_sum"] / max(progress["steps_in_epoch"], 1),
                  "test_loss": test_loss, "test_accuracy": test_accuracy,
                  "elapsed_s": time.time() - progress["started"], "world_size": gradsync.world_size()}
        progress["epoch_records"].append(record)
        if self.log is not None:
            self.log.write(record)
        progress["epoch"] += 1
        progress["steps_in_epoch"] = 0
        progress["loss_sum"] = 0.0

    @torch.no_grad()
    def _evaluate(self) -> tuple[float, float]:
        """Each rank scores its piece of the test split (micro-shard pieces with ``--deterministic``)."""
        self.module.eval()
        pieces, mine = gradsync.world_size(), [gradsync.rank()]
        if self.config.deterministic:
            pieces, mine = self.config.micro_shards, list(self.model.local_shards())
        table = torch.zeros(pieces, 3, dtype=torch.float64)
        for index, shard in enumerate(torch.tensor_split(torch.arange(len(self.data.y_test)), pieces)):
            if index in mine:
                logits = self.module(self.data.x_test[shard])
                y = self.data.y_test[shard]
                table[index] = torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                                             (logits.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
        gradsync.all_reduce(table, op="sum")  # one rank's value and zeros per entry: exact in any order
        self.module.train()
        loss_sum, correct, count = table.sum(0).tolist()
        return loss_sum / count, correct / count

    # -- the end ---------------------------------------------------------------------------------

    def _finish(self) -> dict | None:
        """Rank 0 writes the model and the summary, then tells the quorum; others just report."""
        equal = check_replicas_equal(self.module)
        if gradsync.rank() != 0:
            return None
        checkpoint.write_atomic(self.out_dir / MODEL_FILE, checkpoint.serialize(self.module.state_dict()))
        summary = self._summary(equal)
        self.member.finish()
        return summary

    def _summary(self, replicas_equal: bool) -> dict:
        progress = self.progress
        last = progress["epoch_records"][-1] if progress["epoch_records"] else {}
        wall_s = time.time() - progress["started"]
        samples = progress["step"] * self.global_batch
        return {"final_test_accuracy": last.get("test_accuracy"), "final_test_loss": last.get("test_loss"),
                "final_train_loss": last.get("train_loss"),
                "best_test_accuracy": max((r["test_accuracy"] for r in progress["epoch_records"]), default=None),
                "mode": "sync", "elastic": True, "world_size": gradsync.world_size(),
                "num_workers": gradsync.world_size(), "steps": progress["step"], "samples": samples,
                "global_batch_size": self.global_batch, "wall_s": wall_s,
                "samples_per_s": samples / progress["train_s"] if progress["train_s"] else None,
                "memberships": self.member.membership.epoch, "replicas_equal": replicas_equal,
                "algorithm": self.config.algorithm, "compression": self.config.compression,
                "algorithms": [{"bucket_nbytes": int(n), "algorithm": name} for n, name in
                               getattr(self.model, "bucket_algorithms", lambda: [])()],
                "config": asdict(self.config)}
