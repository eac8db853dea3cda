"""``gradsync train`` under SLURM's ``srun``: this process is one task, and each task is one worker.

The world size, rank and rendezvous come from SLURM (:mod:`gradsync.slurm`);
``--nproc``, when given, must equal ``SLURM_NTASKS``. The run folder defaults
to ``runs/slurm-<SLURM_JOB_ID>`` (a requeued job keeps its id, so it finds
the folder again) with checkpoints in ``<run folder>/checkpoints``, and every
start resumes from the newest complete one. On SLURM's preemption signal
(SIGUSR1 from ``--signal=USR1@90``, or SIGTERM) every rank stops at one step
boundary with a checkpoint (:mod:`~gradsync.train.preemption`), task 0 runs
``scontrol requeue`` when ``scontrol`` is on PATH (as Lightning does) and
says "preempted at step S: checkpoint saved, requeue to resume", and every
task exits with :data:`~gradsync.train.preemption.PREEMPTED_EXIT_CODE`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gradsync import slurm
from gradsync.jobs.worker import run_worker
from gradsync.train import task as train_task
from gradsync.train.config import TrainConfig
from gradsync.train.preemption import PREEMPTED_EXIT_CODE, Preempted, Preemption, interval_from_env


def srun_refusal(config: TrainConfig, where: str, given=frozenset()) -> str | None:
    """``--nproc N`` given under srun with N != SLURM_NTASKS: the one-line refusal (an equal one is accepted
    and has no effect); None otherwise.

    Raises:
        ValueError: SLURM's variables are incomplete or malformed (checked only when ``--nproc`` is given).
    """
    if where != "slurm" or "nproc" not in given:
        return None
    tasks = slurm.read().world_size
    if config.nproc == tasks:
        return None
    return (f"--nproc {config.nproc} disagrees with SLURM_NTASKS={tasks}: under srun each task is one worker "
            f"and SLURM sets the world size (leave --nproc out, or start {config.nproc} tasks with srun)")


def out_dir(job_id: str) -> str:
    """The default run folder of SLURM job ``job_id``: ``runs/slurm-<job id>``."""
    return str(Path("runs") / f"slurm-{job_id}")


def fill_defaults(config: TrainConfig) -> None:
    """Read this task (every SLURM variable checked) and fill in srun's defaults, before the options are
    checked (so ``--checkpoint-every`` counts the default checkpoint folder).

    Sets ``--out`` (``runs/slurm-<job id>``) and ``--checkpoint-dir`` (``<out>/checkpoints``) when not
    given, on every task alike (not in a combination srun refuses: ``--mode async``, ``--elastic``).

    Raises:
        ValueError: one line naming the missing or malformed variables (a job id that is not digits).
    """
    found = slurm.read()
    if config.mode == "async" or config.elastic:
        return  # refused under srun by the option rules, with their own line
    if config.out is None:
        config.out = out_dir(found.job_id)
    if config.checkpoint_dir is None:
        config.checkpoint_dir = str(Path(config.out) / "checkpoints")


def prepare(config: TrainConfig) -> int:
    """Read this task, fill in the SLURM defaults (:func:`fill_defaults`); returns the world size.

    Also sets ``nproc`` to the world size, on every task alike.

    Raises:
        ValueError: one line naming the missing or malformed variables, or the rendezvous node that does
        not resolve.
    """
    fill_defaults(config)
    found = slurm.read()
    slurm.check_resolves(found)  # before any data is made: a wrong node list costs nothing
    config.nproc = found.world_size
    interval_from_env()  # a bad $GRADSYNC_PREEMPTION_CHECK_S is refused before training
    return found.world_size


def launch_srun(config: TrainConfig, world_size: int, in_run_folder) -> dict | None:
    """Train as this task's rank; the main rank claims (or takes over) the run folder.

    ``in_run_folder(config, reuse, launch)``: the job's folder claim (:func:`gradsync.jobs.job._in_run_folder`).

    Raises:
        SystemExit: with :data:`PREEMPTED_EXIT_CODE` after a preemption (checkpoint saved, job requeued).
    """
    found = slurm.read()
    main = found.rank == config.main_rank(world_size)
    with Preemption(interval_s=interval_from_env()) as preemption:
        try:
            if not main:
                data_path = train_task.prepare_data(config)
                return run_worker(config, str(data_path), str(config.out), preemption=preemption)
            return in_run_folder(config, True, lambda data_path, folder: run_worker(
                config, str(data_path), str(folder), preemption=preemption))
        except Preempted as stopped:
            _report(stopped, main)
    raise SystemExit(PREEMPTED_EXIT_CODE)


def _report(stopped: Preempted, main: bool) -> None:
    """The main rank says where the job stopped, then requeues it (``scontrol requeue``)."""
    if not main:
        return
    print(f"gradsync train: {stopped}", file=sys.stderr, flush=True)
    try:
        line = slurm.requeue()
    except (ValueError, OSError, subprocess.SubprocessError) as exc:
        line = f"not requeued: {exc}"
    print(f"gradsync train: {line}", file=sys.stderr, flush=True)
