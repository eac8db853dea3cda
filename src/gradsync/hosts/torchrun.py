"""Run a gradsync command across test hosts, one ``torchrun`` per host, as a user would on H machines.

:func:`run_on_hosts` makes :class:`~gradsync.hosts.netns.TestHosts`, starts
the rendezvous store in the switch, and inside every host runs::

    torchrun --nnodes=H --nproc-per-node=L --rdzv-backend=c10d \\
        --rdzv-endpoint=198.18.0.254:PORT --rdzv-id=RUN --local-addr=198.18.0.(h+1) \\
        --rdzv-conf=join_timeout=S --max-restarts=R -m gradsync <command...>

with ``GLOO_SOCKET_IFNAME=eth0`` (each host's one interface) and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torch 2.13 otherwise hands the
workers a store hosted by node 0's agent and keeps its address across
rounds, so a replaced host (or a replaced host 0) would look for a store
that is gone; without sharing, each round's rank 0 publishes a fresh one.
Host 0's output is relayed to this terminal; every host's goes to
``<log_dir>/host<h>.log``. A fault plan (:class:`Fault`) cuts a host's link or
kills a host when a trigger fires; with ``max_restarts`` > 0 the harness
brings it back (link up again, or a new agent in the host).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gradsync.errors import GradsyncError
from gradsync.hosts.netns import HOST_DEVICE, SWITCH_ADDR, TestHosts, host_addr

STORE_PORT = 29400
DEFAULT_JOIN_TIMEOUT_S = 30.0
STORE_START_S = 60.0
# once a host's agent has given up (the job cannot finish with fewer than H hosts), how long the others get
# to end by themselves before the harness stops them: an agent never learns that another host gave up, so
# one whose worker is frozen would wait forever
STOP_OTHERS_AFTER_S = 10.0


class HostsFailedError(GradsyncError):
    """The job across test hosts failed; the message names the host (and rank, when known) and the error."""


@dataclass
class Fault:
    """Cut host ``host``'s link ("cut") or kill every process on it ("kill") once ``trigger()`` is true."""

    kind: str
    host: int
    trigger: Callable[[], bool] | None  # None: the host's own workers fire it (``first_env``)
    first_env: dict = field(default_factory=dict)  # extra environment of the host's first agent
    restore_after_s: float = 0.0  # "cut": seconds until the link comes up again (with restarts)
    fired_at: float | None = None
    restored: bool = False


@dataclass
class HostJob:
    """What :func:`run_on_hosts` ran and saw."""

    hosts: int
    nproc_per_host: int
    commands: list[list[str]] = field(default_factory=list)
    exit_codes: dict[int, int] = field(default_factory=dict)
    relaunches: int = 0
    # host -> (the host whose failure made the harness stop it, seconds it waited)
    stopped: dict[int, tuple[int, float]] = field(default_factory=dict)
    log_dir: str = ""


def torchrun_command(hosts: int, nproc: int, index: int, port: int, run_id: str, join_timeout_s: float,
                     max_restarts: int, argv: list[str]) -> list[str]:
    """The torchrun command line host ``index`` runs (what a user types on that machine)."""
    launcher = Path(sys.executable).with_name("torchrun")
    head = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return head + [f"--nnodes={hosts}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={SWITCH_ADDR}:{port}", f"--rdzv-id={run_id}",
                   f"--local-addr={host_addr(index)}", f"--rdzv-conf=join_timeout={math.ceil(join_timeout_s)}",
                   f"--max-restarts={max_restarts}", "--monitor-interval=0.5", "-m", "gradsync", *argv]


def host_environment() -> dict:
    env = dict(os.environ, GLOO_SOCKET_IFNAME=HOST_DEVICE, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    src = str(Path(__file__).resolve().parents[2])  # gradsync's own source, as this process imports it
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _relay(stream, log_path: Path, echo) -> threading.Thread:
    def pump() -> None:
        with open(log_path, "ab") as log:
            for chunk in iter(lambda: stream.read1(65536), b""):
                log.write(chunk)
                log.flush()
                if echo is not None:
                    echo.write(chunk)
                    echo.flush()
    thread = threading.Thread(target=pump, daemon=True, name=f"relay-{log_path.name}")
    thread.start()
    return thread


class _Runner:
    def __init__(self, testhosts: TestHosts, nproc: int, argv: list[str], join_timeout_s: float,
                 max_restarts: int, log_dir: Path, echo_host0: bool,
                 stop_others_after_s: float = STOP_OTHERS_AFTER_S):
        self.testhosts, self.nproc, self.argv = testhosts, nproc, argv
        self.join_timeout_s, self.max_restarts, self.log_dir = join_timeout_s, max_restarts, log_dir
        self.echo = sys.stdout.buffer if echo_host0 else None
        self.run_id = f"gs{uuid.uuid4().hex[:10]}"
        self.report = log_dir / "rendezvous.json"
        self.processes: dict[int, subprocess.Popen] = {}
        self.relays: list[threading.Thread] = []
        self.job = HostJob(testhosts.count, nproc, log_dir=str(log_dir))
        self._failed_since: tuple[float, int] | None = None  # (when, host) the first agent gave up
        self.stop_others_after_s = stop_others_after_s

    def start_store(self) -> None:
        store = self.testhosts.popen(None, [sys.executable, "-m", "gradsync.hosts.store", SWITCH_ADDR,
                                            str(STORE_PORT), self.run_id, str(self.report)],
                                     env=host_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        ready: list[bytes] = []
        reader = threading.Thread(target=lambda: ready.append(store.stdout.readline()), daemon=True)
        reader.start()
        reader.join(STORE_START_S)
        if not ready or ready[0].strip() != b"ready":
            raise HostsFailedError(f"the rendezvous store in the switch did not start: "
                                   f"{store.stderr.read1(4096).decode(errors='replace') if store.poll() else 'no answer'}")

    def launch(self, index: int, extra_env: dict | None = None) -> None:
        command = torchrun_command(self.testhosts.count, self.nproc, index, STORE_PORT, self.run_id,
                                   self.join_timeout_s, self.max_restarts, self.argv)
        self.job.commands.append(command)
        process = self.testhosts.popen(index, command, env=dict(host_environment(), **(extra_env or {})), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.relays.append(_relay(process.stdout, self.log_dir / f"host{index}.log",
                                  self.echo if index == 0 else None))
        self.processes[index] = process

    def apply(self, fault: Fault) -> None:
        now = time.monotonic()
        if fault.trigger is None:
            if fault.fired_at is None and self.processes[fault.host].poll() is not None:
                fault.fired_at = now  # the host's workers killed it
            return
        if fault.fired_at is None and fault.trigger():
            fault.fired_at = now
            if fault.kind == "cut":
                self.testhosts.set_link(fault.host, up=False)
            else:
                self.testhosts.kill_host(fault.host)
        elif (fault.kind == "cut" and fault.fired_at is not None and not fault.restored and self.max_restarts
              and now - fault.fired_at >= fault.restore_after_s):
            self.testhosts.set_link(fault.host, up=True)
            fault.restored = True

    def wait(self, faults: list[Fault], deadline_s: float | None) -> None:
        started = time.monotonic()
        relaunched: set[int] = set()
        while True:
            for fault in faults:
                self.apply(fault)
            running = [index for index, process in self.processes.items() if process.poll() is None]
            for fault in faults:
                # a killed host's agent is gone: start a new one while restarts remain (the others wait for it)
                if (fault.kind == "kill" and fault.fired_at is not None and fault.host not in running
                        and fault.host not in relaunched and self.max_restarts):
                    relaunched.add(fault.host)
                    self.job.relaunches += 1
                    self.launch(fault.host)
                    running.append(fault.host)
            if not running:
                break
            self._stop_after_a_failure(running)
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                raise HostsFailedError(f"the job across {self.testhosts.count} hosts did not end within "
                                       f"{deadline_s:g} s")
            time.sleep(0.1)
        for relay in self.relays:
            relay.join(5)
        self.job.exit_codes = {index: process.returncode for index, process in self.processes.items()}

    def _stop_after_a_failure(self, running: list[int]) -> None:
        """Stop the running hosts ``stop_others_after_s`` after the first host whose agent exited with an
        error (one being replaced by a relaunch is running again by now)."""
        gave_up = [index for index, process in self.processes.items() if process.poll() not in (None, 0)]
        if not gave_up:
            return
        if self._failed_since is None:
            self._failed_since = (time.monotonic(), gave_up[0])
        since, first = self._failed_since
        if time.monotonic() - since < self.stop_others_after_s:
            return
        for index in running:
            self.job.stopped[index] = (first, self.stop_others_after_s)
            self.testhosts.kill_host(index)


def run_on_hosts(hosts: int, nproc: int, argv: list[str], *, inter_host_gbit: float | None = None,
                 join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S, max_restarts: int = 0,
                 faults: list[Fault] | None = None, absent_hosts: tuple[int, ...] = (),
                 log_dir: str | Path | None = None, echo_host0: bool = True,
                 deadline_s: float | None = None, testhosts: TestHosts | None = None,
                 stop_others_after_s: float = STOP_OTHERS_AFTER_S) -> HostJob:
    """Run ``gradsync <argv>`` on ``hosts`` test hosts of ``nproc`` ranks each; returns when every host ends.

    Args:
        argv: the gradsync command and its options (e.g. ``["train", "--epochs", "1"]``).
        absent_hosts: hosts whose torchrun is never started (a machine that never arrives).
        testhosts: hosts already made (a shared test fixture); by default made and removed here.
        deadline_s: give up (and stop everything) after this many seconds; None: no limit.
        stop_others_after_s: once a host's agent has exited with an error, stop the hosts still running
            this many seconds later (an agent never learns that another host gave up).

    Raises:
        ValueError: bad counts. HostsFailedError: a host failed: rendezvous (naming how many
        hosts arrived within the join timeout) or a worker (naming the host and its error).
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be an integer >= 1, got {nproc!r}")
    if not join_timeout_s > 0:
        raise ValueError(f"the join timeout must be > 0 s, got {join_timeout_s}")
    own = testhosts is None
    testhosts = testhosts or TestHosts(hosts, inter_host_gbit)
    folder = Path(log_dir) if log_dir else Path(tempfile_dir())
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if own:
            testhosts.start()
        runner = _Runner(testhosts, nproc, argv, join_timeout_s, max_restarts, folder, echo_host0,
                         stop_others_after_s)
        runner.start_store()
        first_env = {fault.host: fault.first_env for fault in faults or [] if fault.first_env}
        for index in range(testhosts.count):
            if index not in absent_hosts:
                runner.launch(index, first_env.get(index))
        runner.wait(list(faults or []), deadline_s)
    finally:
        for process in testhosts.started:
            if process.poll() is None:
                process.kill()
        testhosts.kill_all()  # the store and any worker nsenter's children left behind
        if own:
            testhosts.close()
        else:
            testhosts.started.clear()
    job = runner.job
    failed = {index: code for index, code in job.exit_codes.items() if code != 0}
    if failed or absent_hosts:
        raise HostsFailedError(diagnose(job, runner.report, join_timeout_s, failed))
    return job


def tempfile_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="gradsync-hosts-")


_ERROR_LINE = re.compile(r"^gradsync [a-z ]+: error: (.*)$", re.M)
_GRADSYNC_LINE = re.compile(r"^(gradsync: .*)$", re.M)  # e.g. an injected fault's notice


def diagnose(job: HostJob, report: Path, join_timeout_s: float, failed: dict[int, int]) -> str:
    """One message for a failed job: the rendezvous's arrivals, or the first worker error per host."""
    arrived = _arrived(report)
    if len(arrived) < job.hosts:
        never = [index for index in range(job.hosts) if index not in arrived]
        return (f"rendezvous failed: {len(arrived)} of {job.hosts} hosts arrived within the "
                f"{join_timeout_s:g} s join timeout (host{'s' if len(never) > 1 else ''} "
                f"{', '.join(map(str, never))} never joined; logs in {job.log_dir})")
    lines = []
    for index in sorted(failed):
        if index in job.stopped:
            first, after_s = job.stopped[index]
            lines.append(f"host {index} ({host_addr(index)}) stopped by the harness: still running "
                         f"{after_s:g} s after host {first} gave up (a frozen worker?)")
            continue
        text = _log_text(job, index)
        errors = _ERROR_LINE.findall(text) or _GRADSYNC_LINE.findall(text)[-1:]
        detail = errors[0] if errors else _last_line(text) or f"exit code {failed[index]}"
        lines.append(f"host {index} ({host_addr(index)}) failed: {detail}")
    return "; ".join(lines) + f" (logs in {job.log_dir})"


def _arrived(report: Path) -> set[int]:
    try:
        nodes = json.loads(report.read_text(encoding="utf-8"))["nodes"]
    except (OSError, ValueError, KeyError):
        return set()
    return {int(addr.rsplit(".", 1)[1]) - 1 for addr in nodes if addr.startswith(SWITCH_ADDR.rsplit(".", 1)[0])}


def _log_text(job: HostJob, index: int) -> str:
    try:
        return (Path(job.log_dir) / f"host{index}.log").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines()
             if line.strip().strip("=-") and not line.startswith(("[", "W", "I"))]
    return lines[-1] if lines else ""


def remove_log_dir(job: HostJob) -> None:
    shutil.rmtree(job.log_dir, ignore_errors=True)
