"""``gradsync train --elastic`` and ``gradsync train --join RUN``: the quorum service, one launcher per slot.

The job process starts the quorum service (:mod:`gradsync.elastic.service`,
its own process: the run's store and its quorum), then one
:class:`~gradsync.elastic.launcher.Launcher` per worker slot (slots
``0 .. nproc-1``; async adds the server's slot ``nproc``), and waits for the
quorum's verdict (``q/done`` or ``q/failed``). It writes ``elastic.json``
into the run folder (the store's address and the run's configuration) so
that ``gradsync train --join RUN`` can add a worker to the running job: that
command takes the next free slot and launches one worker for it, which
joins at the next step boundary.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from gradsync.elastic import run_checkpoint as elastic_checkpoint
from gradsync.elastic.launcher import Launcher
from gradsync.elastic.service import QuorumService, ServiceSettings
from gradsync.elastic.run_store import connect, get_json
from gradsync.errors import GradsyncError
from gradsync.fault.events import EventLog
from gradsync.launch import start_forkserver
from gradsync.train import task
from gradsync.train.config import TrainConfig
from gradsync.jobs.worker import run_elastic_worker
from gradsync.train.metrics import SUMMARY_FILE
from gradsync.train import resume
from gradsync.train.resume import say

RUN_FILE = "elastic.json"
SLOTS_KEY = "q/slots"
POLL_S = 0.05


class ElasticRunFailed(GradsyncError):
    """The quorum gave up (fewer than ``--min-nproc`` workers and nobody rejoined), or every launcher ended."""


def slots_for(config: TrainConfig) -> int:
    return config.nproc + 1 if config.mode == "async" else config.nproc


class ElasticJob:
    """A running elastic job: ``launchers`` (by slot), ``service``; :meth:`wait` returns the summary."""

    def __init__(self, config: TrainConfig, data_path: Path, out_dir: Path):
        self.config, self.data_path, self.out_dir = config, Path(data_path), Path(out_dir)
        low, high = config.elastic_bounds()
        extra = 1 if config.mode == "async" else 0  # the server is a member too
        start_forkserver(run_elastic_worker)
        self.service = QuorumService(ServiceSettings(nproc=slots_for(config), min_nproc=low + extra,
                                                     max_nproc=high + extra, timeout_s=config.timeout),
                                     out_dir=self.out_dir)
        self.store = connect(self.service.host, self.service.port)
        self.store.set(SLOTS_KEY, "0")
        self.store.set("run/config", json.dumps(asdict(config)))
        self.store.set("run/data_path", str(self.data_path))
        self.events = EventLog(self.out_dir)
        self.launchers: dict[int, Launcher] = {}
        (self.out_dir / RUN_FILE).write_text(json.dumps({"host": self.service.host, "port": self.service.port,
                                                         "pid": os.getpid()}))
        for _ in range(slots_for(config)):
            self.add_worker()

    def add_worker(self) -> Launcher:
        """Launch one more worker slot (it joins at the next step boundary)."""
        slot = int(self.store.add(SLOTS_KEY, 1)) - 1
        launcher = make_launcher(slot, self.config, self.data_path, self.out_dir, self.service.host,
                                 self.service.port, self.events)
        self.launchers[slot] = launcher
        launcher.start()
        return launcher

    def worker_pids(self) -> dict[int, int]:
        """``{slot: pid}`` of the workers running now."""
        return {slot: launcher.pid for slot, launcher in self.launchers.items() if launcher.pid is not None}

    def wait(self, timeout_s: float | None = None) -> dict:
        """Wait for the run's end; returns the summary.

        Raises:
            ElasticRunFailed: the quorum gave up, the service died, or every worker's launcher ended.
            TimeoutError: ``timeout_s`` passed.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        told = False
        while True:
            if not told and self.store.check(["q/waiting"]):
                told = True
                waiting = get_json(self.store, "q/waiting")
                say(f"{waiting['workers']} workers left, fewer than --min-nproc {self.config.elastic_bounds()[0]}: "
                    f"waiting up to {waiting['rejoin_s']:g} s for a replacement or a joiner (gradsync train "
                    f"--elastic --join {self.out_dir})")
            if not self.service.alive():
                raise ElasticRunFailed("the elastic quorum service died")
            if self.store.check(["q/failed"]):
                raise ElasticRunFailed(f"the elastic run failed: {get_json(self.store, 'q/failed')['reason']}")
            if self.store.check(["q/done"]):
                return self._summary()
            if not any(launcher.is_alive() for launcher in self.launchers.values()):
                raise ElasticRunFailed(f"every worker ended without finishing the run (exit codes "
                                       f"{ {slot: l.exitcodes for slot, l in self.launchers.items()} }, "
                                       f"--max-relaunches {self.config.max_relaunches})")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the elastic run did not end within {timeout_s:g} s")
            time.sleep(POLL_S)

    def _summary(self) -> dict:
        path = self.out_dir / SUMMARY_FILE
        for launcher in self.launchers.values():  # rank 0 writes the summary, then exits
            launcher.join(30)
        return json.loads(path.read_text()) if path.exists() else {}

    def close(self) -> None:
        """Stop every launcher and its worker, then the service (all by PID); remove ``elastic.json``."""
        for launcher in self.launchers.values():
            launcher.stop()
        for launcher in self.launchers.values():
            launcher.join(10)
        self.service.stop()
        (self.out_dir / RUN_FILE).unlink(missing_ok=True)


def make_launcher(slot: int, config: TrainConfig, data_path: Path, out_dir: Path, host: str, port: int,
                  events: EventLog) -> Launcher:
    return Launcher(slot, run_elastic_worker, (config, str(data_path), str(out_dir), host, port),
                    lambda: connect(host, port), config.max_relaunches, log=events.write)


def check_resumable(config: TrainConfig) -> None:
    """Refuse, before any worker starts, an elastic checkpoint of another job (another model, lr, seed ...).

    Raises:
        ValueError: naming every option that differs.
    """
    found = elastic_checkpoint.latest(elastic_checkpoint.folder(config.checkpoint_dir))
    if found is not None:
        path, state = found
        saved = dict(state["config"])
        here = resume.config_fields(config)
        for name in ("batch_size", "accumulate"):  # the global batch is the checkpoint's, whatever --nproc
            saved[name] = here[name]
        resume.check_compatible(saved, config, 0, state["world_size"], path)


def run_elastic(config: TrainConfig, data_path: Path, out_dir: Path) -> dict:
    """The whole elastic job on this machine; returns the summary (written by the last rank 0)."""
    if config.mode == "async":
        from gradsync.train.elastic_async import check_resumable as check_async_resumable

        check_async_resumable(config, out_dir)
    elif config.checkpoint_dir:
        check_resumable(config)
    job = ElasticJob(config, data_path, out_dir)
    try:
        return job.wait()
    finally:
        job.close()


def _alive(pid: int) -> bool:
    from gradsync.transport.shm_segment import pid_alive

    return pid > 0 and pid_alive(pid)


def join_run(run: str, timeout_s: float = 10.0) -> dict:
    """``gradsync train --join RUN``: add one worker to the running elastic job whose folder is ``run``.

    Returns:
        ``{"slot": ..., "exitcodes": [...]}`` once the worker's launcher ends.

    Raises:
        ValueError: ``run`` is not the folder of a running elastic job.
    """
    from gradsync.train.config import TrainConfig

    path = Path(run) / RUN_FILE
    try:
        address = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ValueError(f"--join {run}: no running elastic job there ({RUN_FILE} is missing or unreadable)") \
            from None
    if not _alive(int(address.get("pid", 0))):
        raise ValueError(f"--join {run}: the elastic job that wrote {RUN_FILE} (pid {address.get('pid')}) is not "
                         f"running any more")
    try:
        store = connect(address["host"], int(address["port"]), timeout_s)
    except (TimeoutError, RuntimeError):
        raise ValueError(f"--join {run}: the job's quorum service at {address['host']}:{address['port']} does "
                         f"not answer") from None
    if store.check(["q/done"]) or store.check(["q/failed"]):
        raise ValueError(f"--join {run}: that elastic job has already ended")
    config = TrainConfig(**json.loads(store.get("run/config")))
    data_path = task.prepare_data(config)
    start_forkserver(run_elastic_worker)
    try:
        slot = int(store.add(SLOTS_KEY, 1)) - 1
    except (RuntimeError, ConnectionError):  # DistNetworkError: the job ended while this worker got ready
        raise ValueError(f"--join {run}: that elastic job has already ended") from None
    launcher = make_launcher(slot, config, data_path, Path(run), address["host"], int(address["port"]),
                             EventLog(Path(run)))
    launcher.start()
    try:
        launcher.join()
    finally:
        launcher.stop()
    return {"slot": slot, "exitcodes": launcher.exitcodes}
