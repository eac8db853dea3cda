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
``(slot, seq)`` (protocol: :mod:`gradsync.elastic.ps_server`). So
every step's gradient is applied exactly once; replays are applied in the
order they were computed, so under ``--max-staleness 0`` a server restart
leaves the run bitwise unchanged.

The server and worker roles are :mod:`gradsync.train.async_loop`'s, with
:class:`ElasticGroup` in place of its static group: step ``k`` is a fixed
batch, whoever computes it, so a replayed push is that step's gradient.
``metrics.jsonl`` gets a ``{"kind": "restart"}`` record when a server starts
from a checkpoint; the records it wrote after that checkpoint in its previous
life may then appear twice (``summary.json`` counts each update once).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from gradsync import process_group
from gradsync.elastic.member import RECOVERABLE, ElasticMember
from gradsync.fault import checkpoint as ckpt
from gradsync.elastic.ps_worker import ElasticAsyncWorker
from gradsync.elastic.ps_server import ElasticParameterServer
from gradsync.parallel.ps_protocol import MembershipChange
from gradsync.process_group import MIN_STARTUP_TIMEOUT_S
from gradsync.train import resume
from gradsync.train.async_loop import WorkerRole, run_role
from gradsync.train.config import TrainConfig
from gradsync.train.summary import RunTotals

POLL_S = 0.01


def run_elastic_async(member: ElasticMember, slot: int, config: TrainConfig, data_path: Path,
                      out_dir: Path) -> dict | None:
    """Serve (slot ``config.nproc``) or work (slots below) in an elastic async run.

    The server restores its newest checkpoint (``config.checkpoint_dir`` or ``<out>/checkpoints``)
    if there is one, writes ``metrics.jsonl`` and returns the summary dict; workers return None.
    """
    return run_role(ElasticGroup(member, slot, config, Path(out_dir)), config, data_path, out_dir)


class ElasticGroup:
    """The async roles' view of an elastic run: slot ``nproc`` serves, slots ``0 .. nproc-1`` work, in
    one membership after another; the server checkpoints and restarts from its newest checkpoint."""

    progress = False  # no bar: a relaunched server would start a second one part-way

    def __init__(self, member: ElasticMember, slot: int, config: TrainConfig, out_dir: Path):
        self.member, self.config, self.out_dir = member, config, out_dir
        self.index, self.world_size = slot, config.nproc + 1
        self.is_server = slot == config.nproc

    def open_server(self, model, optimizer, total_steps, options, state) -> tuple[ElasticParameterServer, dict]:
        config = self.config
        server = ElasticParameterServer(model, optimizer, total_steps, checkpoint_folder(config, self.out_dir),
                                        config.checkpoint_every, keep=config.keep_checkpoints, **options)
        server.user_state = {**state, "job": _job_fields(config)}
        server.restore(check=lambda saved, folder: check_compatible(config, saved, folder))
        return server, server.user_state

    def restart_record(self, server: ElasticParameterServer) -> dict | None:
        if server.restored_from is None:
            return None
        return {"kind": "restart", "version": server.version, "checkpoint": str(server.restored_from),
                "incarnation": self.member.incarnation}

    def serve(self, server: ElasticParameterServer, on_update) -> None:
        serve_elastic(self.member, server, on_update)

    def work(self, model: torch.nn.Module, role: WorkerRole) -> None:
        worker = ElasticAsyncWorker(model, self.member.incarnation, timeout=self.config.timeout)
        work_elastic(self.member, worker, self.config.nproc, role.compute,
                     max(self.config.timeout, MIN_STARTUP_TIMEOUT_S))

    def report(self, server: ElasticParameterServer, shared: dict, wall_s: float,
               eval_s: float) -> tuple[RunTotals, dict]:
        """Totals this server life saw: per-rank times and bytes are not kept across memberships (NaN)."""
        config = self.config
        totals = RunTotals(
            world_size=config.nproc + 1, num_workers=config.nproc, steps=server.version,
            samples=server.version * config.batch_size * config.accumulate, wall_s=wall_s,
            train_wall_s=max(wall_s - eval_s, 0.0), compute_s=float("nan"), communication_s=float("nan"),
            exposed_communication_s=float("nan"),
            bytes_sent_per_step=server.bytes_received / max(server.version, 1),
            bytes_sent_per_rank=[], bytes_received_per_rank=[], per_rank_compute_s=[], per_rank_communication_s=[])
        extra = {"server_rank": 0, "elastic": True, **shared,
                 "updates_applied_per_worker": [server.applied_per_slot.get(s, 0) for s in range(config.nproc)],
                 "duplicates_dropped": server.ledger.duplicates, "memberships": server.memberships,
                 "restored_from": None if server.restored_from is None else str(server.restored_from),
                 "eval_s": eval_s}
        return totals, extra


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
