"""``gradsync train --mode async --elastic``: the parameter server and its workers in one elastic run.

The server is slot ``nproc`` and the workers are slots ``0 .. nproc-1`` of
one quorum (:mod:`gradsync.elastic`); every membership holds the server (it
joins with the most committed steps, so it is rank 0 and its ``finished``
ends the run) and the workers alive at that moment. When a worker dies the
membership re-forms around the running server, which keeps its state in
memory; the relaunched worker joins the next membership and starts by
asking for parameters. When the server dies its launcher starts it again:
it loads its newest checkpoint and the workers replay every push that
checkpoint does not hold; the server drops those it applied already, by
``(slot, seq)`` (protocol: :mod:`gradsync.parallel.elastic_server`). So
every step's gradient is applied exactly once; replays are applied in the
order they were computed, so under ``--max-staleness 0`` a server restart
leaves the run bitwise unchanged.

Data as in :mod:`gradsync.train.async_loop`: step ``k`` is a fixed batch,
whoever computes it, so a replayed push is that step's gradient.
``metrics.jsonl`` gets a ``{"kind": "restart"}`` record when a server starts
from a checkpoint; the records it wrote after that checkpoint in its previous
life may then appear twice (``summary.json`` counts each update once).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from gradsync import process_group
from gradsync.elastic.member import RECOVERABLE, ElasticMember
from gradsync.fault import checkpoint as ckpt
from gradsync.parallel.elastic_async_worker import ElasticAsyncWorker
from gradsync.parallel.elastic_server import ElasticParameterServer
from gradsync.parallel.ps_protocol import MembershipChange
from gradsync.process_group import MIN_STARTUP_TIMEOUT_S
from gradsync.train import resume
from gradsync.train.async_loop import batches_per_epoch, evaluate, step_indices
from gradsync.train.config import TrainConfig, validate_against_data
from gradsync.train.data import load
from gradsync.train.metrics import METRICS_FILE, MetricsLog
from gradsync.train.models import build_model
from gradsync.train.setup import (make_optimizer, make_scheduler, seed_everything, set_threads, straggle,
                                  straggler_factor)
from gradsync.train.summary import RunTotals, build_summary, pushed_gradient

POLL_S = 0.01


def serve_elastic(member: ElasticMember, server: ElasticParameterServer, on_update: Callable | None = None) -> None:
    """The server's life in an elastic run: serve one membership after another until the run is done.

    Raises:
        Evicted: the run failed or this server was evicted. ValueError: a worker broke the protocol.
    """
    member.join(step=server.version + 1)  # more than any worker offers (-1): the server is rank 0
    while True:
        membership = member.enter()
        try:
            slots = [m["slot"] for m in membership.members]
            server.serve(process_group.default_communicator(), slots, member.change_requested, on_update)
            member.finish()
            if member.wait_end():
                process_group.shutdown()
                return
            raise MembershipChange("the membership changed after the last update")
        except RECOVERABLE as exc:
            member.leave(server.version + 1, exc)


def work_elastic(member: ElasticMember, worker: ElasticAsyncWorker, server_slot: int,
                 compute: Callable[[int], float], connect_timeout: float | None = None) -> None:
    """A worker's life in an elastic run: in each membership, replay, then compute and push until stopped.

    ``compute(step)`` leaves the step's gradients in ``.grad`` and returns its loss.

    Raises:
        Evicted: the run failed or this worker was evicted.
    """
    member.join(-1)
    while True:
        membership = member.enter()
        try:
            server_rank = membership.rank_of(server_slot)
            if server_rank is None:  # the server is being relaunched: its join closes this membership
                _wait_for_change(member)
                raise MembershipChange("no parameter server in this membership")
            step = worker.connect(process_group.default_communicator(), server_rank, connect_timeout)
            while step is not None:
                step = worker.push(compute(step))
            if member.wait_end():
                process_group.shutdown()
                return
            raise MembershipChange("the membership changed after the stop")
        except RECOVERABLE as exc:
            member.leave(-1, exc)


def _wait_for_change(member: ElasticMember) -> None:
    deadline = time.monotonic() + member.wait_s
    while not (member.change_requested() or member.done()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"slot {member.slot}: no parameter server joined within {member.wait_s:g} s")
        time.sleep(POLL_S)


def run_elastic_async(member: ElasticMember, slot: int, config: TrainConfig, data_path: Path,
                      out_dir: Path) -> dict | None:
    """Serve (slot ``config.nproc``) or work (slots below) in an elastic async run.

    The server restores its newest checkpoint (``config.checkpoint_dir`` or ``<out>/checkpoints``)
    if there is one, writes ``metrics.jsonl`` and returns the summary dict; workers return None.
    """
    set_threads(config.nproc + 1)
    seed_everything(config.seed)
    data = load(data_path)
    validate_against_data(config, config.nproc + 1, len(data.y_train))
    model = build_model(config.model)
    if slot == config.nproc:
        return _ServerRole(config, model, data, Path(out_dir), member).run()
    worker = ElasticAsyncWorker(model, member.incarnation, timeout=config.timeout)
    factor, cache = straggler_factor(config, slot), {}

    def compute(step: int) -> float:
        started = time.perf_counter()
        loss_sum = 0.0
        for micro in step_indices(config, len(data.y_train), step, cache).split(config.batch_size):
            loss = F.cross_entropy(model(data.x_train[micro]), data.y_train[micro]) / config.accumulate
            loss.backward()
            loss_sum += loss.item()
        straggle(factor, time.perf_counter() - started)
        return loss_sum

    work_elastic(member, worker, config.nproc, compute, max(config.timeout, MIN_STARTUP_TIMEOUT_S))
    return None


def checkpoint_folder(config: TrainConfig, out_dir: Path) -> Path:
    return Path(config.checkpoint_dir) if config.checkpoint_dir else Path(out_dir) / "checkpoints"


def _job_fields(config: TrainConfig) -> dict:
    """What a server's checkpoint must share with the job resuming it (``--nproc`` may differ: step ``k``
    is the same batch whoever computes it)."""
    return {**resume.config_fields(config), "max_staleness": config.max_staleness,
            "staleness_lr": config.staleness_lr}


def check_compatible(config: TrainConfig, saved: dict, folder: Path) -> None:
    """Refuse a server checkpoint of another job (another model, lr, seed, staleness bound ...).

    Raises:
        ValueError: naming every option that differs.
    """
    fields = saved.get("job")
    if fields is None:
        raise ValueError(f"checkpoint {folder} does not say which job wrote it: use another --checkpoint-dir")
    here = _job_fields(config)
    differences = [f"--{name.replace('_', '-')} {fields.get(name)!r} there, {value!r} here"
                   for name, value in here.items() if fields.get(name) != value]
    if differences:
        raise ValueError(f"checkpoint {folder} belongs to another job: " + "; ".join(differences)
                         + ". Use the same options, or another --checkpoint-dir")


def check_resumable(config: TrainConfig, out_dir: Path) -> None:
    """Before any process starts: refuse a newest server checkpoint in the checkpoint folder that another
    job wrote (what the elastic job calls for ``--mode async``, instead of the sync checks)."""
    found = ckpt.latest(checkpoint_folder(config, out_dir))
    if found is not None:
        check_compatible(config, dict(found.load_shared().get("user_state", {})), found.folder)


class _ServerRole:
    """The server slot: the elastic parameter server, evaluation, metrics and the summary."""

    def __init__(self, config: TrainConfig, model: torch.nn.Module, data, out_dir: Path, member: ElasticMember):
        self.config, self.model, self.data, self.member = config, model, data, member
        self.per_epoch = batches_per_epoch(config, len(data.y_train))
        total_steps = self.per_epoch * config.epochs
        optimizer = make_optimizer(model.parameters(), config)
        self.server = ElasticParameterServer(
            model, optimizer, total_steps, checkpoint_folder(config, out_dir), config.checkpoint_every,
            keep=config.keep_checkpoints, max_staleness=config.max_staleness,
            staleness_aware_lr=config.staleness_lr, scheduler=make_scheduler(optimizer, config, total_steps),
            timeout=config.timeout)
        self.server.user_state = {"epochs": [], "eval_s": 0.0, "job": _job_fields(config)}
        restored = self.server.restore(check=lambda saved, folder: check_compatible(config, saved, folder))
        self.log = MetricsLog(out_dir / METRICS_FILE)
        if restored:
            self.log.write({"kind": "restart", "version": self.server.version,
                            "checkpoint": str(self.server.restored_from), "incarnation": member.incarnation})

    def run(self) -> dict:
        self.started = time.perf_counter()
        try:
            serve_elastic(self.member, self.server, self._on_update)
        finally:
            self.log.close()
        return self._summary(time.perf_counter() - self.started)

    def _on_update(self, slot: int, version: int, loss: float, staleness: int) -> None:
        self.log.write({"kind": "step", "step": version, "worker": slot, "loss": loss, "staleness": staleness,
                        "lr": self.server.last_lr, "elapsed_s": time.perf_counter() - self.started})
        if version % self.per_epoch == 0:
            self._end_epoch(version // self.per_epoch - 1)

    def _end_epoch(self, epoch: int) -> None:
        state, server = self.server.user_state, self.server
        started = time.perf_counter()
        test_loss, test_accuracy = evaluate(self.model, self.data)
        state["eval_s"] += time.perf_counter() - started
        losses = server.losses[-self.per_epoch:]
        record = {"kind": "epoch", "epoch": epoch, "train_loss": sum(losses) / len(losses),
                  "test_loss": test_loss, "test_accuracy": test_accuracy,
                  "elapsed_s": time.perf_counter() - self.started, "version": server.version,
                  "staleness_mean": server.staleness.mean, "staleness_max": server.staleness.max}
        state["epochs"] = [r for r in state["epochs"] if r["epoch"] != epoch] + [record]
        self.log.write(record)

    def _summary(self, wall_s: float) -> dict:
        config, server = self.config, self.server
        slots = list(range(config.nproc))
        eval_s = server.user_state["eval_s"]
        totals = RunTotals(
            world_size=config.nproc + 1, num_workers=config.nproc, steps=server.version,
            samples=server.version * config.batch_size * config.accumulate, wall_s=wall_s,
            train_wall_s=max(wall_s - eval_s, 0.0), compute_s=float("nan"), communication_s=float("nan"),
            exposed_communication_s=float("nan"),
            bytes_sent_per_step=server.bytes_received / max(server.version, 1),
            bytes_sent_per_rank=[], bytes_received_per_rank=[], per_rank_compute_s=[], per_rank_communication_s=[])
        extra = {"server_rank": 0, "elastic": True, "max_staleness": config.max_staleness,
                 "staleness_lr": config.staleness_lr, "updates_applied": server.version,
                 "updates_applied_per_worker": [server.applied_per_slot.get(s, 0) for s in slots],
                 "duplicates_dropped": server.ledger.duplicates, "memberships": server.memberships,
                 "restored_from": None if server.restored_from is None else str(server.restored_from),
                 "eval_s": eval_s}
        return build_summary(config, server.user_state["epochs"], totals, server.staleness.as_dict(),
                             pushed_gradient(self.model), self.model, self.data, extra)
