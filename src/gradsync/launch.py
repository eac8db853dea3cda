"""Start N local workers through torch's elastic agent and collect rank 0's result.

Rendezvous is torch's c10d rendezvous with its stores listening on 127.0.0.1
only (:mod:`gradsync.rendezvous`) and Gloo on the loopback device; restarts are
the agent's (``max_restarts``). A worker that raises brings the job down: the
agent stops the others and :class:`WorkerFailedError` carries the first
failing rank's exception text.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
from multiprocessing import forkserver
import os
import re
import signal
import socket
import sys
import tempfile
import uuid
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from gradsync.errors import GradsyncError
from gradsync.rendezvous import register_loopback_backend

_PR_SET_PDEATHSIG = 1
_WORKER_PRELOAD = ["gradsync.forkserver_preload", "torch", "torch._dynamo", "gradsync"]  # once, in the forkserver
_NOISY_LOGGERS = ("torch.distributed.elastic", "torch.distributed.elastic.agent.server.api",
                  "torch.multiprocessing", "torch.distributed.launcher")


class WorkerFailedError(GradsyncError):
    """A worker process failed; ``rank`` is the first one that did, ``message`` its error."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"worker rank {rank} failed: {message}")
        self.rank = rank
        self.message = message


def die_with_launcher() -> None:
    """Have the kernel kill this worker if the process that started it dies (Linux ``PR_SET_PDEATHSIG``).

    A launcher killed with SIGKILL cannot stop its workers; without this they
    would train on, then wait forever for the agent that is gone.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os._exit(1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_forkserver(entry: Callable, *also: str) -> None:
    """Start (once per process) the forkserver the workers fork from, with torch and ``entry``'s module imported.

    A spawned worker, and each restarted one, would import torch again and pay
    ~1.5 s for ``torch._dynamo`` alone (the first optimizer imports it); forked
    from this server they start at once. Benchmarks call it before timing
    anything so that every run they compare starts the same way; ``also``: more modules to import
    there (a benchmark's other workers). Only the first call of a process starts the server.
    """
    multiprocessing.set_forkserver_preload(_WORKER_PRELOAD + [entry.__module__, *also])
    forkserver.ensure_running()
    ready = multiprocessing.get_context("forkserver").Process(target=_ready, daemon=True)
    ready.start()  # served only once the server has imported what it preloads
    ready.join()


def _ready() -> None:
    """The forkserver's first child: proves the imports are done."""


def launch_local(nproc: int, entry: Callable, *args, max_restarts: int = 0) -> dict[int, Any]:
    """Run ``entry(*args)`` in ``nproc`` worker processes on this machine.

    Returns:
        ``{rank: return value}`` for every worker.

    Raises:
        WorkerFailedError: a worker raised or died (the root cause, see ``_root_cause``).
        KeyboardInterrupt: the launcher got SIGINT/SIGTERM (the workers are stopped).
    """
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    start_forkserver(entry)
    backend = register_loopback_backend()
    with tempfile.TemporaryDirectory(prefix="gradsync-elastic-") as log_dir:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                              rdzv_backend=backend, rdzv_endpoint=f"127.0.0.1:{free_port()}",
                              local_addr="127.0.0.1",
                              max_restarts=max_restarts, monitor_interval=0.1, start_method="forkserver",
                              logs_specs=DefaultLogsSpecs(log_dir=log_dir), shutdown_timeout=5)
        try:
            return elastic_launch(config, entry)(*args)
        except ChildFailedError as exc:
            rank, failure = _root_cause(exc.failures)
            text = _failure_text(failure)
            hung = re.search(r"peer rank (\d+) stopped responding", text)
            if hung and int(hung.group(1)) != rank:  # the timed-out rank is a witness, not the cause
                raise WorkerFailedError(int(hung.group(1)), f"it stopped responding; rank {rank} reported: "
                                                            f"{text}") from None
            raise WorkerFailedError(rank, text) from None
        except SignalException:
            raise KeyboardInterrupt from None


def _root_cause(failures: dict) -> tuple[int, object]:
    """The failure most likely to be the cause, not a consequence.

    A rank that fails on its own (an exception of its own) comes first; then
    ranks that timed out waiting for a peer (they point at it); last, ranks
    that saw a connection close because another rank had already died.
    Ties go to the earliest failure.
    """
    def rank_order(item):
        rank, failure = item
        text = _failure_text(failure)
        consequence = 2 if "connection closed" in text else 1 if "CollectiveTimeoutError" in text else 0
        return consequence, failure.timestamp, rank

    return min(failures.items(), key=rank_order)


def _failure_text(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if not message or message.startswith("To enable traceback see"):  # torch 2.13: no error file written
        from gradsync.fault.injection import INJECTED_EXIT_CODE

        cause = ("injected by --fail-at" if failure.exitcode == INJECTED_EXIT_CODE
                 else "killed or crashed without a Python error")
        message = f"exit code {failure.exitcode} ({cause})"
    return str(message).strip()
