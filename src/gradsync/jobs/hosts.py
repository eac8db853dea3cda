"""``gradsync train --hosts H --nproc L``: the job across H test hosts, one torchrun per host.

The options are checked here first (a bad one costs no namespace), the run
folder gets an absolute path every host writes to (the hosts share this
machine's file system; only ``/dev/shm`` and ``/proc`` are private), and each
host runs ``torchrun ... -m gradsync train <the same options>``
(:mod:`gradsync.hosts.torchrun`). ``--max-restarts`` goes to torchrun (its agents
restart the workers, which resume from ``<run folder>/checkpoints``);
``--cut-link-at`` / ``--kill-host-at`` are carried out by the harness when
rank 0's ``metrics.jsonl`` reaches the step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from gradsync.fault.injection import KILL_HOST_ENV
from gradsync.hosts.torchrun import Fault, run_on_hosts
from gradsync.train.config import TrainConfig
from gradsync.train.metrics import METRICS_FILE, SUMMARY_FILE

_HARNESS_FIELDS = {"hosts", "inter_host_gbit", "join_timeout", "cut_link_at", "kill_host_at", "nproc",
                   "max_restarts", "out", "checkpoint_dir"}
RESTORE_GRACE_S = 5.0  # a cut link comes back this long after the collectives' timeout has expired


def worker_argv(config: TrainConfig, out_dir: Path) -> list[str]:
    """``train`` plus every option that differs from its default, for the workers under torchrun."""
    defaults = TrainConfig()
    argv = ["train", "--out", str(out_dir)]
    for item in dataclasses.fields(TrainConfig):
        name, value = item.name, getattr(config, item.name)
        if name in _HARNESS_FIELDS or value == getattr(defaults, name):
            continue
        option = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(option if value else f"--no-{name.replace('_', '-')}")
        else:
            argv += [option, str(value)]
    if config.max_restarts:
        argv += ["--checkpoint-dir", str(config.checkpoint_dir or out_dir / "checkpoints")]
    return argv


def reached_step(out_dir: Path, step: int):
    """A trigger: true once ``metrics.jsonl`` holds a step record with ``step`` >= ``step``."""
    def trigger() -> bool:
        try:
            lines = (out_dir / METRICS_FILE).read_text(encoding="utf-8").splitlines()
        except OSError:
            return False
        for line in reversed(lines):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("kind") == "step":
                return record.get("step", 0) >= step
        return False
    return trigger


def run_on_test_hosts(config: TrainConfig, out_dir: Path) -> dict:
    """Run the job on ``config.hosts`` test hosts; returns rank 0's summary (with ``hosts``).

    Raises:
        HostsFailedError: rendezvous or a worker failed (the message names the host and the error).
    """
    faults = []
    cut, kill = config.host_fault("cut_link_at"), config.host_fault("kill_host_at")
    if cut is not None:
        faults.append(Fault("cut", cut[0], reached_step(out_dir, cut[1]),
                            restore_after_s=config.timeout + RESTORE_GRACE_S))
    if kill is not None:  # fired by the host's own worker at the exact step (fault.injection)
        faults.append(Fault("kill", kill[0], None, first_env={KILL_HOST_ENV: str(kill[1])}))
    run_on_hosts(config.hosts, config.nproc, worker_argv(config, out_dir), inter_host_gbit=config.inter_host_gbit,
                 join_timeout_s=config.join_timeout, max_restarts=config.max_restarts, faults=faults,
                 log_dir=out_dir / "hosts")
    summary = json.loads((out_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
    summary.setdefault("hosts", config.hosts)
    return summary
