"""The Trainer's work beside its steps: checkpoints, rank 0's hand-over snapshot, replica checks, the summary.

Each function takes the :class:`~gradsync.train.loop.Trainer` whose run it serves and reads (or, where said,
updates) its fields; none runs a step. The collectives are said per function: every rank calls those.
"""

from __future__ import annotations

import time

import torch

import gradsync
from gradsync.elastic import run_checkpoint as elastic_checkpoint
from gradsync.fault import checkpoint
from gradsync.fault.injection import attempt
from gradsync.train import resume
from gradsync.train.evaluate import gather_trace
from gradsync.train.schedule import lr_fields
from gradsync.train.setup import make_optimizer, make_scheduler
from gradsync.train.summary import build_summary, gather_totals
from gradsync.train.task import make_model


def snapshot(trainer) -> dict:
    """What rank 0 hands over: model, optimizer, schedule and the shared part of
    :class:`~gradsync.train.state.TrainState` (state dicts, CPU or the replica's device)."""
    config, state = trainer.config, trainer.state
    if trainer.model is None and trainer.resume_from is not None:  # a whole-job failure: the newest checkpoint
        handed, line = elastic_checkpoint.offer(trainer.resume_from, trainer.global_batch, gradsync.world_size())
        handed["progress"] = {**handed["progress"], "resumed_from_step": handed["progress"]["step"]}
        resume.say(line)
        trainer.events.write({"event": "resumed", "from_step": handed["progress"]["step"], "line": line,
                              "checkpoint": str(trainer.resume_from[0]), "world_size_to": gradsync.world_size(),
                              "world_size_from": trainer.resume_from[1]["world_size"]})
        return handed
    if trainer.model is None:  # the first membership: rank 0 builds the seeded model
        torch.manual_seed(config.seed)
        module = make_model(config)
        optimizer = make_optimizer(module.parameters(), config)
        scheduler = make_scheduler(optimizer, config, trainer.plan.steps_per_epoch * config.epochs,
                                   trainer.world_size)
        return {"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "progress": state.shared()}
    state.elapsed_before_s = trainer.elapsed_s()
    return {"model": trainer.model.module.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(), "progress": state.shared()}


def checkpoint_due(trainer) -> bool:
    """Whether the step just taken is a ``--checkpoint-every`` one (the last step's checkpoint is written after
    the last evaluation, by :meth:`~gradsync.train.loop.Trainer.run`'s end)."""
    return (trainer.checkpoint_root is not None and trainer.state.step % trainer.config.checkpoint_every == 0
            and not trainer.last_step())


def save_checkpoint(trainer) -> None:
    """Write the checkpoint of the step just taken (collective for a static run: every rank writes its own
    part; elastic: rank 0 alone writes the replicated state, resumable at any world size)."""
    started = time.perf_counter()
    config, state = trainer.config, trainer.state
    if trainer.elastic:
        if trainer.is_main:
            state_dict = {**snapshot(trainer), "global_batch": trainer.global_batch}
            elastic_checkpoint.save(trainer.checkpoint_root, state_dict, trainer.world_size, config.keep_checkpoints,
                                    resume.config_fields(config))
        return
    with resume.whole_parameters(trainer.model):  # ZeRO-3: every rank gathers them
        own = resume.rank_state(state, trainer.replica)
        shared = None
        if trainer.is_main:
            shared = resume.shared_state(state, trainer.replica, config, trainer.log.position(), trainer.elapsed_s())
    checkpoint.save(trainer.checkpoint_root, state.step, shared, own, trainer.model.comm, keep=config.keep_checkpoints)
    state.checkpoint_s += time.perf_counter() - started
    if trainer.is_main:
        trainer.events.write({"event": "checkpoint", "step": state.step, "attempt": attempt(),
                              "seconds": time.perf_counter() - started})


def check_replicas(trainer, averaged: bool) -> None:
    """``--check-replicas-every N``: every N steps (local SGD: at the first average after), compare the replicas
    (collective; :class:`~gradsync.ReplicaDivergenceError` on every rank if they differ) and record it.

    ``averaged``: whether this step averaged the local-SGD replicas; updates ``trainer._replica_check_due``.
    """
    every = trainer.config.check_replicas_every
    if not every:
        return
    step = trainer.state.step
    trainer._replica_check_due = trainer._replica_check_due or step % every == 0
    if not trainer._replica_check_due or (trainer.local_sgd and not averaged):
        return
    trainer._replica_check_due = False
    if trainer.local_sgd:
        check = trainer.model.check_replicas(step=step)
    else:
        check = trainer.model.check_replicas(trainer.optimizer, step=step)
    if trainer.log:
        trainer.log.write({"kind": "replica_check", "step": step, "equal": True,
                           "tensors": check.tensors, "bytes": check.nbytes, "seconds": check.seconds})


def summary(trainer) -> dict | None:
    """Gather every rank's counters and timeline (collective); rank 0 returns the summary, others None."""
    config, state, model = trainer.config, trainer.state, trainer.model
    totals, extra = gather_totals(state, model.comm.stats, trainer.world_size, trainer.elapsed_s())
    extra.update(trainer.memory.summary_fields())  # collective: every rank's measured peak
    gather_trace(trainer.timeline, config.trace, trainer.is_main)
    if not trainer.is_main:
        return None
    extra.update({"restarts": attempt(), "global_batch_size": trainer.global_batch,
                  "lr": lr_fields(trainer.scheduler, config, trainer.world_size),
                  **trainer.membership.summary_fields()})
    if trainer.elastic:
        extra["replicas_equal"] = True  # checked before the summary (ReplicaDivergenceError otherwise)
    if trainer.local_sgd:
        extra["local_sgd"] = model.summary_fields()
    return build_summary(config, state.epoch_records, totals, state.staleness.as_dict(),
                         model.bucket_algorithms(), model.module, trainer.data, extra)
