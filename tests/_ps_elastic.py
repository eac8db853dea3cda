"""An elastic one-hot parameter-server run in real processes: quorum service, one launcher per slot.

Slot ``nproc`` is the server, slots ``0 .. nproc-1`` the workers (as in
``gradsync train --mode async --elastic``). The gradient of step ``k`` is the
one-hot ``e_k`` and the server steps plain SGD with lr 1 on a zero vector,
so the final parameters are exactly -1 everywhere iff every step was applied
exactly once. A slot may kill itself with SIGKILL (by its own PID) at a
chosen point of its first incarnation, or stop (SIGSTOP: a hang, which the
timeouts find and the quorum evicts); its launcher starts it again.
Every process reports to ``<folder>/<slot>-<incarnation>.pt``.

Functions run in the launched processes must be top-level (picklable).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gradsync.elastic.launcher import Launcher
from gradsync.elastic.member import ElasticMember
from gradsync.elastic.service import QuorumService, ServiceSettings
from gradsync.elastic.run_store import connect
from gradsync.launch import start_forkserver
from gradsync.elastic.ps_worker import ElasticAsyncWorker
from gradsync.elastic.ps_server import ElasticParameterServer
from gradsync.train.elastic_async import serve_elastic, work_elastic
from _ps_helpers import Vector, one_hot

MEMBER_TIMEOUT_S = 5.0
HOLD_S = 3.0  # below the timeout: the server must not take a held worker for a hung one
REPLACED_KEY = "test/replaced"


@dataclass
class Plan:
    nproc: int                      # workers
    total_steps: int
    checkpoint_every: int
    folder: str                     # results and checkpoints
    compute_s: float = 0.002        # each worker's "compute" per step
    server_dies_at: int | None = None    # version after which the first server kills itself
    worker_dies: tuple[int, int] | None = None  # (slot, its n-th step) at which that worker kills itself
    hold_after: int = 5             # with worker_dies: the other workers, from their n-th step on, wait
                                    # (up to HOLD_S) for the replacement's first step or a membership change
    max_staleness: int | None = None
    hang: bool = False              # the dying slot stops (SIGSTOP) instead: a hang, found by timeouts
    timeout_s: float = 5.0          # members' and the quorum's timeout


def _suicide(hang: bool = False) -> None:
    os.kill(os.getpid(), signal.SIGSTOP if hang else signal.SIGKILL)


def _report(plan: Plan, slot: int, incarnation: int, record: dict) -> None:
    torch.save(record, Path(plan.folder) / f"{slot}-{incarnation}.pt")


def slot_main(slot: int, incarnation: int, host: str, port: int, plan: Plan) -> None:
    """A launched process: the server (slot ``plan.nproc``) or a worker."""
    torch.set_num_threads(1)
    member = ElasticMember(connect(host, port), slot, incarnation, timeout_s=plan.timeout_s, wait_s=30.0)
    model = Vector(plan.total_steps)
    if slot == plan.nproc:
        _serve(member, model, plan, incarnation)
    else:
        _work(member, model, plan, slot, incarnation)


def _serve(member: ElasticMember, model, plan: Plan, incarnation: int) -> None:
    server = ElasticParameterServer(model, torch.optim.SGD(model.parameters(), lr=1.0), plan.total_steps,
                                    Path(plan.folder) / "checkpoints", plan.checkpoint_every, keep=2,
                                    max_staleness=plan.max_staleness, timeout=plan.timeout_s)
    restored = server.restore()
    restored_version = server.version
    applied = []

    clock = []  # perf_counter of the first and the latest update

    def on_update(slot, version, loss, staleness):
        now = time.perf_counter()
        clock[:] = [clock[0] if clock else now, now]
        applied.append((slot, int(loss)))
        if incarnation == 0 and version == plan.server_dies_at:
            _suicide(plan.hang)

    serve_elastic(member, server, on_update)
    _report(plan, plan.nproc, incarnation, {
        "pid": os.getpid(), "params": model.weight.detach().clone(), "version": server.version,
        "applied": applied, "applied_per_slot": dict(server.applied_per_slot), "restored": restored,
        "restored_version": restored_version, "duplicates": server.ledger.duplicates,
        "memberships": server.memberships, "durable_seq": dict(server.durable_seq),
        "updates_s": clock[-1] - clock[0] if clock else 0.0})


def _work(member: ElasticMember, model, plan: Plan, slot: int, incarnation: int) -> None:
    worker = ElasticAsyncWorker(model, incarnation, timeout=plan.timeout_s)
    steps = []

    def compute(step: int) -> float:
        steps.append(step)
        if incarnation == 0 and plan.worker_dies == (slot, len(steps)):
            _suicide(plan.hang)
        if plan.worker_dies is not None:
            _hold_for_replacement(member, plan, slot, incarnation, len(steps))
        time.sleep(plan.compute_s)
        model.weight.grad = one_hot(plan.total_steps, step)
        return float(step)

    work_elastic(member, worker, plan.nproc, compute, connect_timeout=30.0)
    _report(plan, slot, incarnation, {"pid": os.getpid(), "params": model.weight.detach().clone(),
                                      "steps": steps, "pushes": worker.pushes, "replayed": worker.replayed,
                                      "kept": len(worker.kept), "version": worker.version})


def _hold_for_replacement(member: ElasticMember, plan: Plan, slot: int, incarnation: int, count: int) -> None:
    """So that the run cannot end before the replacement pushes, however slowly it starts."""
    if incarnation > 0:
        member.store.set(REPLACED_KEY, str(slot))
    elif slot != plan.worker_dies[0] and count >= plan.hold_after:
        deadline = time.monotonic() + HOLD_S
        while not (member.store.check([REPLACED_KEY]) or member.change_requested()) and time.monotonic() < deadline:
            time.sleep(0.005)


def run(plan: Plan, deadline_s: float = 40.0) -> dict:
    """Run the plan; returns :func:`run_slots`'s dict plus ``"reports"``: ``{(slot, incarnation): record}``."""
    out = run_slots(plan.nproc, slot_main, (plan,), plan.folder, deadline_s, plan.timeout_s)
    out["reports"] = {}
    for path in Path(plan.folder).glob("*-*.pt"):
        slot, incarnation = (int(part) for part in path.stem.split("-"))
        out["reports"][(slot, incarnation)] = torch.load(path, weights_only=True)
    return out


def train_slot_main(slot: int, incarnation: int, host: str, port: int, config, data_path: str, out_dir: str,
                    server_dies_at: int | None) -> None:
    """A launched process of ``gradsync train --mode async --elastic`` (run_elastic_async); the first
    server kills itself after update ``server_dies_at``; the server saves its summary to ``summary.pt``."""
    from gradsync.train import elastic_async

    if slot == config.nproc and incarnation == 0 and server_dies_at is not None:
        original = ElasticParameterServer.apply

        def apply(self, *args, **kwargs):
            applied = original(self, *args, **kwargs)
            if self.version == server_dies_at:
                _suicide()
            return applied

        ElasticParameterServer.apply = apply
    member = ElasticMember(connect(host, port), slot, incarnation, timeout_s=config.timeout, wait_s=30.0)
    summary = elastic_async.run_elastic_async(member, slot, config, Path(data_path), Path(out_dir))
    if summary is not None:
        torch.save({"summary": summary, "pid": os.getpid()}, Path(out_dir) / "summary.pt")


def run_slots(nproc: int, target, args: tuple, folder: str, deadline_s: float = 40.0,
              timeout_s: float = MEMBER_TIMEOUT_S) -> dict:
    """Quorum service plus one launcher per slot running ``target(slot, incarnation, host, port, *args)``;
    returns ``{"exitcodes": {slot: [...]}, "pids": {slot: [...]}}``. Ends every process it started by PID."""
    start_forkserver(target)
    slots = nproc + 1
    service = QuorumService(ServiceSettings(nproc=slots, min_nproc=1, max_nproc=slots, timeout_s=timeout_s,
                                            startup_s=30.0, rejoin_s=30.0), out_dir=folder)
    pids: dict[int, list[int]] = {slot: [] for slot in range(slots)}
    launchers = [Launcher(slot, target, ("127.0.0.1", service.port, *args),
                          lambda: connect("127.0.0.1", service.port), max_relaunches=2,
                          log=lambda r: r.get("event") == "launched" and pids[r["slot"]].append(r["pid"]))
                 for slot in range(slots)]
    try:
        for launcher in launchers:
            launcher.start()
        end = time.monotonic() + deadline_s
        for launcher in launchers:
            launcher.join(max(end - time.monotonic(), 0.1))
        hung = [launcher.slot for launcher in launchers if launcher.is_alive()]
        if hung:
            raise TimeoutError(f"slots {hung} still running after {deadline_s:g} s")
    finally:
        for launcher in launchers:
            launcher.stop()
        for launcher in launchers:
            launcher.join(5.0)
        service.stop()
    return {"exitcodes": {launcher.slot: launcher.exitcodes for launcher in launchers}, "pids": pids}
