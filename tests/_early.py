"""Early jobs: ``python -m gradsync ...`` commands that start at the beginning of the test session.

A test module registers a command with :func:`early_job` and marks the test
that checks it with ``@pytest.mark.early_job(name)``; when such tests are
collected, ``conftest.py`` runs their commands as subprocesses from the
beginning of the session, one at a time in the order the tests come, so that
their seconds of process start-up overlap with the thread-rank tests (which
mostly use one core, the GIL's) instead of adding to the run. The test asks
for the ``early`` fixture and waits for the result with :meth:`EarlyJob.wait`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

EARLY_NICENESS = 5  # the tests running meanwhile (some of them timed) get the cores first
_EARLY_COMMANDS: dict[str, tuple[list[str], dict[str, str], dict[str, str]]] = {}


def early_job(name: str, args: list[str], env: dict[str, str] | None = None,
              files: dict[str, str] | None = None) -> str:
    """Register ``python -m gradsync ARGS`` under ``name``; ``{folder}`` in ARGS and env values is the job's folder.

    ``files`` (name -> text) are written into the folder before the command starts.
    """
    _EARLY_COMMANDS[name] = (list(args), dict(env or {}), dict(files or {}))
    return name


def _background_group() -> None:
    """In the child before exec: its own process group (killable as a whole) and a lower priority."""
    os.setpgid(0, 0)
    os.nice(EARLY_NICENESS)


class EarlyJob:
    """A registered command, run as a subprocess (own process group, output in files) once started."""

    def __init__(self, name: str, folder: Path):
        args, env, self.files = _EARLY_COMMANDS[name]
        self.name, self.folder = name, folder
        self.args = [arg.replace("{folder}", str(folder)) for arg in args]
        self.env = {**os.environ, **{key: value.replace("{folder}", str(folder)) for key, value in env.items()}}
        self.process: subprocess.Popen | None = None
        self.started_at = 0.0
        self._lock = threading.Lock()
        self._started = threading.Event()

    def start(self) -> None:
        """Start the command (once; later calls do nothing)."""
        with self._lock:
            if self.process is None:
                for file_name, text in self.files.items():
                    (self.folder / file_name).write_text(text)
                with open(self.folder / "stdout.txt", "w") as out, open(self.folder / "stderr.txt", "w") as err:
                    self.process = subprocess.Popen([sys.executable, "-m", "gradsync", *self.args], stdout=out,
                                                    stderr=err, env=self.env, text=True,
                                                    preexec_fn=_background_group)
                self.started_at = time.monotonic()
                self._started.set()

    def wait(self, timeout_s: float) -> subprocess.CompletedProcess:
        """The finished command's exit code and output; fails the test ``timeout_s`` after the command started.

        A job whose turn has not come yet is started now.
        """
        self.start()
        try:
            code = self.process.wait(max(self.started_at + timeout_s - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"gradsync {' '.join(self.args)} did not finish within {timeout_s} s of its start; "
                        f"stderr:\n{(self.folder / 'stderr.txt').read_text()}")
        return subprocess.CompletedProcess(self.args, code, (self.folder / "stdout.txt").read_text(),
                                           (self.folder / "stderr.txt").read_text())

    def kill(self) -> None:
        with self._lock:
            process = self.process
            self._started.set()
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(10)


class EarlyRunner:
    """Runs the jobs one after the other on a daemon thread; :meth:`stop` kills whatever still runs."""

    def __init__(self, jobs: list[EarlyJob]):
        self.jobs = {job.name: job for job in jobs}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(jobs,), name="early-jobs", daemon=True)
        self._thread.start()

    def _run(self, jobs: list[EarlyJob]) -> None:
        for job in jobs:
            if self._stopping.is_set():
                return
            job.start()
            job.process.wait()

    def stop(self) -> None:
        self._stopping.set()
        for job in self.jobs.values():
            job.kill()
