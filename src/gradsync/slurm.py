"""SLURM's ``srun`` variables: this task's rank, the world size, the rendezvous host and port; the requeue.

Under ``srun`` (one worker per task) each task has ``SLURM_PROCID`` (its rank),
``SLURM_NTASKS`` (the world size), ``SLURM_LOCALID`` (its rank on its node),
``SLURM_NODELIST`` (the job's nodes, compressed: ``node[01-04,07]``) and
``SLURM_JOB_ID``. The rendezvous host is the first node of the expanded list
(python-hostlist's ``expand_hostlist``, the ``slurm`` extra), where task 0 runs
and hosts the store; the port follows Lightning's ``SLURMEnvironment``: the
job id's last four digits + 15000, so every task derives the same one. A
``MASTER_ADDR`` / ``MASTER_PORT`` in the environment takes precedence (as
there), and torchrun's variables (``RANK``, ``WORLD_SIZE``) win over SLURM's
altogether. A job named ``bash`` or ``interactive`` (``srun --pty bash``,
``salloc``) is not read, as Lightning does not. See docs/slurm.md.

``gradsync train`` under srun catches SLURM's preemption signals from its
first import (:func:`catch_preemption_early`, before torch loads), so a
signal during start-up is remembered for the trainer instead of killing
the task.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Mapping

from gradsync.errors import import_extra

VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODELIST", "SLURM_JOB_ID")
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE")  # torchrun's task variables: with either set, torchrun's win
INTERACTIVE_JOB_NAMES = ("bash", "interactive")  # Lightning's rule: such a job is a shell, not a launch
PORT_BASE = 15000  # Lightning's SLURMEnvironment.main_port: int(job_id[-4:]) + 15000 (ports 15000..24999)
DEFAULT_PORT = 12910  # ... and its port when SLURM_JOB_ID is not set


@dataclass(frozen=True)
class SlurmTask:
    """One ``srun`` task as a worker: its place in the group and where the group meets.

    ``rank`` in [0, ``world_size``); ``local_rank``: the task's rank on its node (the GPU it takes);
    ``nodes``: SLURM_NODELIST expanded, in order; ``master_addr`` / ``master_port``: the rendezvous
    (the first node and the job id's port, unless MASTER_ADDR / MASTER_PORT are set).
    """

    rank: int
    world_size: int
    local_rank: int
    job_id: str
    nodes: tuple[str, ...]
    master_addr: str
    master_port: int


def under_srun(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``environ`` (default ``os.environ``) is a SLURM task's and torchrun's variables are absent.

    Any of :data:`VARIABLES` set counts as SLURM (a partial set is then refused by :func:`read`),
    except in a job named ``bash`` or ``interactive``.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in TORCHRUN_VARIABLES):
        return False
    if environ.get("SLURM_JOB_NAME") in INTERACTIVE_JOB_NAMES:
        return False
    return any(name in environ for name in VARIABLES)


def port_of(job_id: str | None) -> int:
    """The rendezvous port of job ``job_id``, as Lightning derives it: its last four digits + 15000.

    >>> port_of("4242"), port_of("1234567"), port_of("7"), port_of(None)
    (19242, 19567, 15007, 12910)

    Raises:
        ValueError: the job id does not end in digits.
    """
    if job_id is None:
        return DEFAULT_PORT
    tail = job_id[-4:]
    if not tail.isdigit():
        raise ValueError(f"SLURM_JOB_ID={job_id!r} does not end in four digits or fewer; cannot derive the "
                         f"rendezvous port (set MASTER_PORT)")
    return int(tail) + PORT_BASE


def expand_nodes(nodelist: str) -> list[str]:
    """``SLURM_NODELIST`` expanded by python-hostlist: ``node[01-02,07]`` -> node01, node02, node07.

    Raises:
        MissingExtraError: python-hostlist is not installed (the ``slurm`` extra).
        ValueError: the list is empty or malformed.
    """
    hostlist = import_extra("hostlist", "slurm", "SLURM's SLURM_NODELIST")
    try:
        nodes = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as exc:
        raise ValueError(f"SLURM_NODELIST={nodelist!r} is not a SLURM host list: {exc}") from None
    if not nodes:
        raise ValueError(f"SLURM_NODELIST={nodelist!r} names no node")
    return nodes


def read(environ: Mapping[str, str] | None = None) -> SlurmTask:
    """This task's :class:`SlurmTask` from ``environ`` (default ``os.environ``).

    Raises:
        ValueError: one of :data:`VARIABLES` is missing (the line names every missing one), not an
        integer, or out of range; a malformed node list or job id.
        MissingExtraError: python-hostlist is not installed.
    """
    environ = os.environ if environ is None else environ
    missing = [name for name in VARIABLES if name not in environ]
    if missing:
        raise ValueError(f"SLURM environment incomplete: {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set (srun sets all of "
                         f"{', '.join(VARIABLES)} for each task: launch the workers with srun)")
    rank, world_size, local_rank = (_integer(environ, name) for name in VARIABLES[:3])
    if not 0 <= rank < world_size:
        raise ValueError(f"SLURM_PROCID={rank} must be in [0, SLURM_NTASKS={world_size})")
    if local_rank < 0:
        raise ValueError(f"SLURM_LOCALID={local_rank} must be >= 0")
    nodes = expand_nodes(environ["SLURM_NODELIST"])
    job_id = environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9]+", job_id):  # it names the run folder: runs/slurm-<id>
        raise ValueError(f"SLURM_JOB_ID={job_id!r} is not a SLURM job id (srun sets the job's number: digits "
                         f"only; an array job's task has its own number too)")
    port = _integer(environ, "MASTER_PORT") if "MASTER_PORT" in environ else port_of(job_id)
    return SlurmTask(rank, world_size, local_rank, job_id, tuple(nodes), environ.get("MASTER_ADDR", nodes[0]), port)


def _integer(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def check_resolves(task: SlurmTask) -> None:
    """Fail fast, in one line, when the rendezvous node's name does not resolve (no wait for a timeout).

    Raises:
        ValueError: naming the node, the port and where the name came from.
    """
    try:
        socket.getaddrinfo(task.master_addr, task.master_port, type=socket.SOCK_STREAM)
    except OSError as exc:
        source = "MASTER_ADDR" if task.master_addr not in task.nodes else "the first node of SLURM_NODELIST"
        raise ValueError(f"the rendezvous node {task.master_addr}:{task.master_port} ({source}) does not "
                         f"resolve: {exc.strerror or exc}") from None


def port_in_use_hint(task: SlurmTask, environ: Mapping[str, str] | None = None) -> str:
    """Why task 0 may find its rendezvous port taken, and what to do (one clause, for the bind error)."""
    environ = os.environ if environ is None else environ
    source = ("MASTER_PORT" if "MASTER_PORT" in environ
              else f"{PORT_BASE} + the last four digits of SLURM_JOB_ID={task.job_id}")
    return (f"the port is {source}; another task of this job has the same SLURM_PROCID={task.rank} (check the "
            f"srun line), or another job on {task.master_addr} uses that port (set MASTER_PORT to a free one)")


EARLY_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)  # as gradsync.train.preemption.SIGNALS
_early: dict = {"received": None}


def catch_preemption_early(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Under srun, in the ``gradsync train`` command only (``argv``, default ``sys.argv``: ``gradsync train
    ...`` or ``python -m gradsync train ...``), make SIGUSR1 and SIGTERM only remember that they came
    (:func:`early_signal`) until the trainer's :class:`~gradsync.train.preemption.Preemption` takes them
    over; returns whether it did. Called first thing by ``import gradsync``; a library user's own script
    keeps the default actions.
    """
    argv = sys.argv if argv is None else argv
    command = len(argv) > 1 and argv[1] == "train" and (argv[0] == "-m" or os.path.basename(argv[0]) == "gradsync")
    if not command or not under_srun(environ) or threading.current_thread() is not threading.main_thread():
        return False
    for number in EARLY_SIGNALS:
        signal.signal(number, _remember)
        signal.siginterrupt(number, False)
    return True


def _remember(number: int, frame) -> None:
    if _early["received"] is None:
        _early["received"] = number


def early_signal() -> int | None:
    """The first preemption signal caught by :func:`catch_preemption_early`'s handler (None: none came)."""
    return _early["received"]


def take_early_signal() -> int | None:
    """:func:`early_signal`, then cleared: the trainer's Preemption takes it over once."""
    received, _early["received"] = _early["received"], None
    return received


def requeue_job_id(environ: Mapping[str, str] | None = None) -> str:
    """The id ``scontrol requeue`` takes: ``<array job>_<task>`` for an array job, else SLURM_JOB_ID
    (Lightning's rule).

    Raises:
        ValueError: no job id, or one that is not digits, ``_`` and ``-``.
    """
    environ = os.environ if environ is None else environ
    if "SLURM_ARRAY_JOB_ID" in environ:
        job_id = f"{environ['SLURM_ARRAY_JOB_ID']}_{environ.get('SLURM_ARRAY_TASK_ID', '')}"
    else:
        job_id = environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_-]+", job_id):
        raise ValueError(f"cannot requeue: SLURM job id {job_id!r} is not digits, '_' and '-'")
    return job_id


def requeue(environ: Mapping[str, str] | None = None) -> str:
    """Run ``scontrol requeue <job>`` when ``scontrol`` is on PATH (as Lightning's SLURM auto-requeue);
    returns one line saying what happened. Call it on one task only (rank 0), after the checkpoint.

    Raises:
        ValueError: the job id is missing or malformed (:func:`requeue_job_id`).
    """
    job_id = requeue_job_id(environ)
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return f"scontrol is not on PATH: requeue job {job_id} yourself (scontrol requeue {job_id})"
    done = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return f"scontrol requeue {job_id} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}"
    return f"requeued SLURM job {job_id} (scontrol requeue {job_id})"
