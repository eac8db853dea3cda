"""The worker entry of every ``gradsync train`` job: join the group (static) or the run (elastic), run the
role, and the main rank writes the run folder.

Each worker's flight recorder writes into ``<run folder>/flight`` when a
collective times out or the ranks disagree (``gradsync debug <run folder>`` reads it).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from tqdm import tqdm

import gradsync
from gradsync.debug.flight import FLIGHT_FOLDER
from gradsync.fault.events import EventLog
from gradsync.fault.injection import attempt
from gradsync.hosts import memory_children
from gradsync.elastic.member import ElasticMember
from gradsync.elastic.membership import ElasticMembership
from gradsync.elastic.run_store import connect
from gradsync.launch import die_with_launcher
from gradsync.process_group import default_communicator
from gradsync.train import resume
from gradsync.train.async_loop import run_async_role
from gradsync.train.elastic_async import run_elastic_async
from gradsync.train.config import TrainConfig
from gradsync.train.loop import Trainer
from gradsync.train.metrics import METRICS_FILE, SUMMARY_FILE, private_files, read_metrics, write_summary
from gradsync.train.plots import plot_run
from gradsync.train.tensorboard_events import write_run_summary

ECHO_DELAY_S = 3.0


def run_worker(config: TrainConfig, data_path: str, out_dir: str, memory_cgroups: str | None = None,
               preemption=None) -> dict | None:
    """Join the group, train (sync / local-sgd trainer, or an async role), leave; the main rank returns the summary.

    ``memory_cgroups``: the run's folder of per-rank memory cgroups (``--memory-limit-mib``,
    :class:`~gradsync.hosts.memory_children.ChildCgroups`); this rank moves itself into ``rank-<RANK>``
    there before it builds anything, and the main rank's summary says which cgroup, its limit and peak.
    Everything it writes (run folder, checkpoints, trace, plots) is private (:func:`private_files`).
    ``preemption``: the trainer's :class:`~gradsync.train.preemption.Preemption` (srun), or None.
    """
    with private_files():
        return _run_worker(config, data_path, out_dir, memory_cgroups, preemption)


def _run_worker(config: TrainConfig, data_path: str, out_dir: str, memory_cgroups: str | None,
                preemption) -> dict | None:
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Ctrl-C reaches the whole process group; the elastic agent stops the
        # workers itself, so a worker's own KeyboardInterrupt would only print a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        die_with_launcher()
    cgroup = None
    if memory_cgroups is not None:
        cgroup = memory_children.join(memory_children.rank_cgroup(memory_cgroups, int(os.environ["RANK"])))
    # tqdm's default lock is a multiprocessing semaphore; a worker that is killed (a fault, a
    # restart) cannot unregister it, and the launcher then warns about "leaked semaphore objects".
    tqdm.set_lock(threading.RLock())
    gradsync.init(timeout=config.timeout)
    if config.out:  # None: a torchrun rank that does not know rank 0's folder ($GRADSYNC_FLIGHT_DIR then)
        default_communicator().flight.folder = Path(config.out).resolve() / FLIGHT_FOLDER
    try:
        if config.mode == "async":
            summary = run_async_role(config, Path(data_path), Path(out_dir))
        else:
            summary = Trainer(config, Path(data_path), Path(out_dir), preemption=preemption).run()
    except gradsync.CollectiveTimeoutError as exc:
        _report_timeout(config, out_dir, exc)
        raise
    finally:
        gradsync.shutdown()
    if summary is not None and cgroup is not None:
        summary["memory_cgroup"] = memory_children.usage_record(cgroup)
    _write_run_folder(summary, Path(out_dir))
    return summary


def run_elastic_worker(slot: int, incarnation: int, config: TrainConfig, data_path: str, out_dir: str,
                       store_host: str, store_port: int) -> None:
    """Train as slot ``slot`` of an elastic run (incarnation ``incarnation``: 0 at first, +1 per relaunch),
    through as many memberships as the run has; what each slot's launcher starts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the job stops its workers itself
    die_with_launcher()
    tqdm.set_lock(threading.RLock())
    with private_files():
        member = ElasticMember(connect(store_host, store_port), slot, incarnation, timeout_s=config.timeout)
        if config.mode == "async":
            summary = run_elastic_async(member, slot, config, Path(data_path), Path(out_dir))
        else:
            membership = ElasticMembership(member, Path(out_dir), config.elastic_fault)
            summary = Trainer(config, Path(data_path), Path(out_dir), membership).run()
        _write_run_folder(summary, Path(out_dir))


def _write_run_folder(summary: dict | None, out: Path) -> None:
    """The main rank's summary (rank 0; the server in async mode) and plots; others pass None."""
    if summary is None:
        return
    write_summary(out / SUMMARY_FILE, summary)
    write_run_summary(summary)  # --tensorboard: the run's totals beside the steps'
    try:
        plot_run(read_metrics(out / METRICS_FILE), summary, out)
    except (KeyError, ValueError, TypeError):  # the plots are a convenience; the summary is written
        pass


def _report_timeout(config: TrainConfig, out_dir: str, exc: gradsync.CollectiveTimeoutError) -> None:
    if config.checkpointing() or config.fail_at or config.hang_at:
        EventLog(out_dir).write({"event": "detected", "rank": gradsync.rank(), "peer": exc.peer,
                                 "timed_out": exc.timed_out, "error": str(exc), "attempt": attempt()})
    if exc.timed_out:  # a hang: say which rank, as the agent's restart does not
        resume.say(f"{type(exc).__name__}: {exc}")
    else:
        # A closed connection is the echo of another worker's failure: let
        # that worker's exit reach the launcher first, so it reports the cause.
        time.sleep(ECHO_DELAY_S)
