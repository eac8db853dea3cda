"""The torchft peer row's processes: the replicas (relaunched when they exit) and the tail of their logs.

Every process is started here and ended by PID in :meth:`Replicas.close`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gradsync
from gradsync.errors import GradsyncError

CRASH_LOOP = 3


class ReplicaCrashLoop(GradsyncError):
    """A replica process keeps ending before it starts training (bad environment, import error)."""


class Replicas:
    """The replica processes, each relaunched when it exits; every one ended by PID in :meth:`close`.

    ``launcher`` "forkserver": forked from gradsync's forkserver with torch and torchft imported (as
    ``gradsync train`` starts its workers); "exec": a fresh ``python -m`` that imports them itself.
    """

    def __init__(self, nproc: int, out_dir: Path, worker_args: list[str], launcher: str = "forkserver"):
        self.nproc, self.out_dir, self.worker_args, self.launcher = nproc, out_dir, worker_args, launcher
        self.procs: dict[int, object] = {}  # replica -> subprocess.Popen or multiprocessing.Process
        self.launches: list[dict] = []
        self.log_sizes: dict[int, int] = {}  # replica -> its log's size at its latest launch
        self.early_exits: dict[int, int] = {}  # replica -> exits in a row before it wrote to its log
        self.stopping = False
        src = str(Path(gradsync.__file__).resolve().parents[1])
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
                    "RUST_LOG": os.environ.get("RUST_LOG", "warn")}

    def log_path(self, replica: int) -> Path:
        return self.out_dir / f"replica{replica}.jsonl"

    def launch(self, replica: int) -> None:
        argv = ["--replica", str(replica), "--log", str(self.log_path(replica)),
                "--final", str(self.out_dir / f"final{replica}.pt"), *self.worker_args]
        output = self.out_dir / f"replica{replica}.out"
        if self.launcher == "forkserver":
            from gradsync.bench import torchft_worker

            proc = multiprocessing.get_context("forkserver").Process(target=torchft_worker.serve,
                                                                     args=(argv, str(output)), daemon=True)
            proc.start()
        else:
            with open(output, "a") as file:
                proc = subprocess.Popen([sys.executable, "-m", "gradsync.bench.torchft_worker", *argv], env=self.env,
                                        stdout=file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[replica] = proc
        path = self.log_path(replica)
        self.log_sizes[replica] = path.stat().st_size if path.exists() else 0
        self.launches.append({"replica": replica, "pid": proc.pid, "time": time.time()})

    @staticmethod
    def exited(proc) -> bool:
        return (proc.poll() if isinstance(proc, subprocess.Popen) else proc.exitcode) is not None

    def relaunch_exited(self) -> None:
        """The relauncher: start again every replica whose process ended (not once stopping).

        Raises:
            ReplicaCrashLoop: a replica ended :data:`CRASH_LOOP` times in a row before writing its log
            (it cannot start: the message quotes its output).
        """
        for replica, proc in list(self.procs.items()):
            if self.exited(proc) and not self.stopping:
                path = self.log_path(replica)
                started = path.exists() and path.stat().st_size > self.log_sizes.get(replica, 0)
                self.early_exits[replica] = 0 if started else self.early_exits.get(replica, 0) + 1
                if self.early_exits[replica] >= CRASH_LOOP:
                    out = self.out_dir / f"replica{replica}.out"
                    output = out.read_text(errors="replace")[-2000:] if out.exists() else "(nothing: it never ran)"
                    raise ReplicaCrashLoop(f"torchft replica {replica} ended {CRASH_LOOP} times before it started; "
                                           f"its output ends:\n{output}")
                self.launch(replica)

    def kill(self, replica: int) -> dict:
        proc = self.procs[replica]
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it had just ended by itself: the relauncher starts it again
            pass
        return {"victim": replica, "pid": proc.pid, "time": time.time()}

    def all_exited(self) -> bool:
        return all(self.exited(proc) for proc in self.procs.values())

    def close(self) -> None:
        for proc in self.procs.values():
            if not self.exited(proc):
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10) if isinstance(proc, subprocess.Popen) else proc.join(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def start_forkserver() -> None:
    """gradsync's forkserver, with the torchft worker (torch, torchft) imported once."""
    from gradsync.bench import torchft_worker
    from gradsync.launch import start_forkserver as start

    start(torchft_worker.serve)


class Progress:
    """Tails the replicas' logs: each replica's last committed step and whether it committed since launch."""

    def __init__(self, replicas: Replicas):
        self.replicas = replicas
        self.offsets = {}
        self.last = {}  # replica -> last record

    def poll(self) -> None:
        for replica in range(self.replicas.nproc):
            path = self.replicas.log_path(replica)
            if not path.exists():
                continue
            with open(path, encoding="ascii", errors="replace") as file:  # json.dumps writes ASCII
                file.seek(self.offsets.get(replica, 0))
                text = file.read()
            cut = text.rfind("\n") + 1
            self.offsets[replica] = self.offsets.get(replica, 0) + cut
            for line in text[:cut].splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line a SIGKILL cut, then the relaunched replica's first line
                    continue
                if record.get("committed") and record.get("participating") or record.get("event") == "started":
                    self.last[replica] = record

    def healthy(self, replica: int) -> bool:
        """In the quorum since its latest launch (its last record is a committed step, not 'started')."""
        return "step" in self.last.get(replica, {})

    def max_step(self) -> int:
        return max((r["step"] for r in self.last.values() if "step" in r), default=0)

    def all_in(self) -> bool:
        return all(self.healthy(replica) for replica in range(self.replicas.nproc))
