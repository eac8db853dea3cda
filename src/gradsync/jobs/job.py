"""One ``gradsync train`` job: validate, prepare data, claim the run folder, launch, clean up.

Everything that can be checked before a worker starts is checked here, so a
bad option costs no process start-up and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from pathlib import Path

from gradsync.train.memory_report import limit_below_parameters
from gradsync import slurm
from gradsync.fault import checkpoint
from gradsync.fault.injection import attempt, check_environment
from gradsync.hosts import memory_children
from gradsync.launch import WorkerFailedError, launch_local
from gradsync.train import resume, task
from gradsync.train.config import TrainConfig
from gradsync.train.validation import validate, validate_against_data, writable_folder
from gradsync.jobs.option_rules import refusal
from gradsync.jobs.srun import fill_defaults as fill_srun_defaults, launch_srun, prepare as prepare_srun, srun_refusal
from gradsync.jobs.worker import run_worker
from gradsync.train.metrics import METRICS_FILE, private_files
from gradsync.train.tensorboard_events import check_log_dir


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) started this process as one worker."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def default_out_dir() -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, suffix = Path("runs") / stamp, 1
    while path.exists():
        suffix += 1
        path = Path("runs") / f"{stamp}-{suffix}"
    return path


def torchrun_out_dir() -> str | None:
    """The default run folder under torchrun: named after the job's run id, so a restart finds it again.

    None (a timestamped folder) when the run id is torchrun's placeholder "none".
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id in ("", "none") or not all(c.isalnum() or c in "-_." for c in run_id):
        return None
    return str(Path("runs") / f"torchrun-{run_id}")


def claim_out_dir(out: str | None, reuse: bool = False) -> tuple[Path, bool]:
    """Create the run folder and claim it by creating ``metrics.jsonl`` exclusively.

    With ``reuse`` (a restarted attempt of the same job) a folder that
    already holds the run is taken over instead.

    Returns:
        The folder and whether this call created it.

    Raises:
        ValueError: the folder cannot be written, or already holds a run
        (also when another job claims it at the same moment).
    """
    path = Path(out) if out else default_out_dir()
    created = not path.exists()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / METRICS_FILE).touch(exist_ok=reuse)
    except FileExistsError:
        raise ValueError(f"--out {path} already holds a run ({METRICS_FILE}); choose another folder") from None
    except OSError as exc:
        raise ValueError(f"--out {path} is not a writable folder: {exc.strerror or exc}") from None
    return path, created


def release_out_dir(path: Path, created: bool) -> None:
    """Undo :func:`claim_out_dir` when the job wrote nothing (so failures leave no empty folders)."""
    metrics = path / METRICS_FILE
    if metrics.exists() and metrics.stat().st_size == 0:
        metrics.unlink()
        if created and not any(path.iterdir()):
            shutil.rmtree(path, ignore_errors=True)


def check_trace_path(trace: str) -> Path:
    """Return the absolute trace path, or raise ValueError if it cannot be written."""
    if not trace.strip():
        raise ValueError("--trace needs a file name, got an empty string")
    path = Path(trace).expanduser().resolve()
    if path.is_dir():
        raise ValueError(f"--trace {trace} is a folder; give a file name such as trace.json")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise ValueError(f"--trace {trace}: folder {path.parent} does not exist or is not writable")
    existed = path.exists()
    try:  # prove it now, not after training (os.access says yes to root, and /proc refuses new files)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"--trace {trace} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()
    return path


def check_checkpoint_dir(folder: str | Path) -> Path:
    """Create the checkpoint folder if needed and prove it writable; returns its absolute path.

    Raises:
        ValueError: it cannot be created or written (the message names it).
    """
    return writable_folder(folder, "--checkpoint-dir")


def check_resumable(config: TrainConfig, world_size: int) -> None:
    """Refuse, before any worker starts, a checkpoint folder holding another job's (another world size is fine)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.CheckpointWarning)  # rank 0 reports them when it resumes
        found = checkpoint.latest(config.checkpoint_dir)
    if found is not None:
        saved = found.load_shared()
        resume.check_compatible(saved.get("config", {}), config, world_size, found.world_size, found.folder)


def run_job(config: TrainConfig, given: set[str] | frozenset = frozenset()) -> dict | None:
    """Run the whole job; returns rank 0's summary (None on other torchrun ranks).

    ``given``: the fields the user named (the command line's options), checked against the option
    rules even where their value is the default.

    The folders and files it creates are private to the user (0700 / 0600, see ``private_files``).

    Raises:
        ValueError: a bad option (one line, before any worker starts).
        WorkerFailedError: a worker failed.
    """
    with private_files():
        return _run_job(config, given)


def placement(config: TrainConfig) -> str:
    """Where the job's workers run: ``local`` processes, one ``torchrun`` rank (this process), ``test hosts``,
    one ``slurm`` task (this process, under srun; torchrun's variables win)."""
    if under_torchrun():
        return "torchrun"
    if slurm.under_srun():
        return "slurm"
    return "test hosts" if config.hosts is not None else "local"


def check_options(config: TrainConfig, where: str, given=frozenset()) -> None:
    """Every option's value (:func:`~gradsync.train.validation.validate`) and its rule in ``where``'s
    combination (:mod:`~gradsync.jobs.option_rules`; ``given``: fields named even at their default):
    ValueError with one line naming the option."""
    validate(config)
    problem = _torchrun_refusal(config, where) or refusal(config, where, given) or srun_refusal(config, where, given)
    if problem:
        raise ValueError(problem)


def _run_job(config: TrainConfig, given) -> dict | None:
    where, membership = placement(config), "elastic" if config.elastic else "static"
    if where == "slurm":
        fill_srun_defaults(config)  # first: its --checkpoint-dir counts for --checkpoint-every
    check_options(config, where, given)
    check_environment()
    if config.memory_limit_mib is not None:
        problem = memory_children.limit_problem(config.memory_limit_mib) or limit_below_parameters(config) or (
            config.preflight and memory_children.floor_problem(config.memory_limit_mib))
        if problem:
            raise ValueError(problem)
    if config.join is not None:
        from gradsync.jobs.elastic import join_run

        outcome = join_run(config.join)
        print(f"gradsync: the worker of slot {outcome['slot']} left the run (exit codes {outcome['exitcodes']})")
        return None
    world_size = int(os.environ["WORLD_SIZE"]) if where == "torchrun" else config.world_size()
    if where == "slurm":
        world_size = prepare_srun(config)
    validate_against_data(config, world_size, task.num_train(config))
    if config.trace is not None:
        config.trace = str(check_trace_path(config.trace))
    if config.tensorboard is not None:  # the extra and the folder, before any process starts
        config.tensorboard = str(check_log_dir(config.tensorboard))
    if config.checkpoint_dir is not None:
        config.checkpoint_dir = str(check_checkpoint_dir(config.checkpoint_dir))
        check_resumable(config, world_size)
    return LAUNCHERS[(where, membership)](config, world_size)


def _torchrun_refusal(config: TrainConfig, where: str) -> str | None:
    if where != "torchrun":
        return None
    if config.hosts is not None:
        return ("--hosts starts one torchrun per test host itself; under torchrun (RANK and WORLD_SIZE are set) "
                "leave it out")
    if config.max_restarts:
        return ("under torchrun, give --max-restarts to torchrun (its agent restarts the workers) and "
                "--checkpoint-dir to gradsync train (each worker resumes from it)")
    return None


def _launch_torchrun(config: TrainConfig, world_size: int) -> dict | None:
    """This process is one torchrun rank: the main rank claims the run folder, the others only train."""
    if config.out is None:
        config.out = torchrun_out_dir()
    if int(os.environ.get("RANK", "0")) != config.main_rank(world_size):
        data_path = task.prepare_data(config)
        return run_worker(config, str(data_path), str(config.out or "runs/unused"))
    # torchrun restarts this whole function: a restarted rank 0 continues the folder it claimed
    # (a replaced host's new agent counts its attempts from 0: a resumable job may always take its folder over)
    reuse = attempt() > 0 or config.checkpoint_dir is not None
    return _in_run_folder(config, reuse, lambda data_path, out_dir: run_worker(config, str(data_path), str(out_dir)))


def _launch_slurm(config: TrainConfig, world_size: int) -> dict | None:
    """This process is one SLURM task (:mod:`gradsync.jobs.srun`): the main rank takes its folder over."""
    return launch_srun(config, world_size, _in_run_folder)


def _launch_local(config: TrainConfig, world_size: int) -> dict | None:
    def launch(data_path: Path, out_dir: Path) -> dict | None:
        with _memory_cgroups(config, world_size) as cgroups:
            try:
                results = launch_local(world_size, run_worker, config, str(data_path), str(out_dir),
                                       cgroups and cgroups.directory, max_restarts=config.max_restarts)
            except WorkerFailedError as failure:
                raise _with_restarts(_with_oom_kill(failure, cgroups, config), config.max_restarts) from None
        return results[config.main_rank(world_size)]
    return _in_run_folder(config, False, launch)


def _memory_cgroups(config: TrainConfig, world_size: int):
    """``--memory-limit-mib``: one child memory cgroup per rank, removed when the job ends (a context)."""
    if config.memory_limit_mib is None:
        return contextlib.nullcontext()
    return memory_children.ChildCgroups(world_size, config.memory_limit_mib * 2**20)


def _with_oom_kill(failure: WorkerFailedError, cgroups, config: TrainConfig) -> WorkerFailedError:
    """Say so when the kernel's OOM killer killed the failed rank in its ``--memory-limit-mib`` cgroup."""
    if cgroups is None or not memory_children.oom_kills(cgroups.rank_directory(failure.rank)):
        return failure
    return WorkerFailedError(failure.rank, f"{failure.message} [the kernel's OOM killer killed it: the rank "
                                           f"needed more than --memory-limit-mib {config.memory_limit_mib}]")


def _launch_local_elastic(config: TrainConfig, world_size: int) -> dict:
    from gradsync.jobs.elastic import run_elastic

    return _in_run_folder(config, False, lambda data_path, out_dir: run_elastic(config, data_path, out_dir))


def _in_run_folder(config: TrainConfig, reuse: bool, launch) -> dict | None:
    """Claim the run folder, prepare the data, run ``launch(data_path, out_dir)``; an empty folder goes."""
    out_dir, created = claim_out_dir(config.out, reuse=reuse)
    config.out = str(out_dir)
    try:
        data_path = task.prepare_data(config)  # after --out: a bad folder costs nothing
        if config.checkpointing() and config.checkpoint_dir is None:
            config.checkpoint_dir = str(check_checkpoint_dir(out_dir / "checkpoints"))
        return launch(data_path, out_dir)
    finally:
        release_out_dir(out_dir, created)


def _hosts_out_dir(config: TrainConfig) -> Path:
    from gradsync.hosts.netns import unavailable_reason

    for name in ("cut_link_at", "kill_host_at"):
        config.host_fault(name)
    reason = unavailable_reason()
    if reason:
        raise ValueError(f"--hosts: {reason}")
    out_dir = (Path(config.out) if config.out else default_out_dir()).resolve()
    if (out_dir / METRICS_FILE).exists():
        raise ValueError(f"--out {out_dir} already holds a run ({METRICS_FILE}); choose another folder")
    return out_dir


def _launch_hosts(config: TrainConfig, world_size: int) -> dict:
    """The job across ``config.hosts`` test hosts (:mod:`gradsync.jobs.hosts`)."""
    from gradsync.jobs.hosts import run_on_test_hosts

    out_dir = _hosts_out_dir(config)
    task.prepare_data(config)  # once here, not on every host at the same time
    return run_on_test_hosts(config, out_dir)  # HostsFailedError names the host and its error


def _launch_hosts_elastic(config: TrainConfig, world_size: int) -> dict:
    from gradsync.jobs.elastic_hosts import run_elastic_on_hosts

    return run_elastic_on_hosts(config, _hosts_out_dir(config))


# {placement} x {membership} -> launcher (torchrun x elastic is refused by options.REFUSED_COMBINATIONS)
LAUNCHERS = {
    ("local", "static"): _launch_local,
    ("local", "elastic"): _launch_local_elastic,
    ("torchrun", "static"): _launch_torchrun,
    ("slurm", "static"): _launch_slurm,
    ("test hosts", "static"): _launch_hosts,
    ("test hosts", "elastic"): _launch_hosts_elastic,
}


def _with_restarts(failure: WorkerFailedError, max_restarts: int) -> WorkerFailedError:
    """The agent gives up only when every restart is used: say how many that was."""
    if max_restarts == 0:
        used = "with no restart allowed (--max-restarts 0)"
    else:
        used = f"after {max_restarts} restart{'s' if max_restarts > 1 else ''} (all of --max-restarts {max_restarts})"
    error = WorkerFailedError(failure.rank, f"{failure.message} [the job stopped {used}]")
    error.restarts = max_restarts
    return error
