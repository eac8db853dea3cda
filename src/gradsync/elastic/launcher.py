"""One launcher per worker slot: start the worker, report its death at once, start it again.

That is all a launcher does (membership is the quorum's). A worker is forked
from the job's forkserver (torch already imported there), so a replacement
is training again within about a second instead of paying a fresh import.
The launcher also carries out the quorum's evictions (``q/evict/<slot>/<inc>``:
a hung worker cannot stop itself) by killing its own process, by PID.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import wait
from typing import Callable

from gradsync.elastic.run_store import post

EVICT_POLL_S = 0.05
SUCCESS = 0
CRASH_LOOP_S = 2.0      # a process that dies this soon after its start ...
CRASH_LOOP_TIMES = 3    # ... this many times in a row is not started again (and the run fails)


class Launcher(threading.Thread):
    """Runs ``target(slot, incarnation, *args)`` in a process, again after each death, up to ``max_relaunches``.

    ``store_factory()`` makes this launcher's own store client. The launcher stops relaunching once
    the run is over (``q/done`` / ``q/failed``), after a clean exit, or when :meth:`stop` is called.
    """

    def __init__(self, slot: int, target: Callable, args: tuple, store_factory: Callable, max_relaunches: int,
                 log=None):
        super().__init__(daemon=True, name=f"gradsync-launcher-{slot}")
        self.slot, self.target, self.args = slot, target, args
        self.store_factory, self.max_relaunches = store_factory, max_relaunches
        self.incarnation = -1  # taken from the store's count at each launch
        self.log = log or (lambda record: None)
        self.process: multiprocessing.Process | None = None
        self.exitcodes: list[int] = []
        self._halt = threading.Event()

    @property
    def pid(self) -> int | None:
        process = self.process
        return process.pid if process is not None and process.is_alive() else None

    def run(self) -> None:
        store = self.store_factory()
        context = multiprocessing.get_context("forkserver")
        relaunches = quick = 0
        while not self._halt.is_set():
            # the run's count for this slot, so that a host's new launcher never reuses an incarnation
            self.incarnation = int(store.add(f"q/incarnation/{self.slot}", 1)) - 1
            self.process = context.Process(target=self.target, args=(self.slot, self.incarnation, *self.args),
                                           name=f"gradsync-worker-{self.slot}.{self.incarnation}")
            self.process.start()
            self.log({"event": "launched", "slot": self.slot, "incarnation": self.incarnation,
                      "pid": self.process.pid})
            started = time.monotonic()
            code = self._watch(store)
            self.exitcodes.append(code)
            quick = quick + 1 if code != SUCCESS and time.monotonic() - started < CRASH_LOOP_S else 0
            if code == SUCCESS or self._halt.is_set():
                return
            post(store, "died", slot=self.slot, incarnation=self.incarnation, exitcode=code)
            self.log({"event": "died", "slot": self.slot, "incarnation": self.incarnation, "exitcode": code})
            if store.check(["q/done"]) or store.check(["q/failed"]):
                return
            if quick >= CRASH_LOOP_TIMES:  # it fails at start: starting it again would only repeat that
                os.write(2, f"gradsync: slot {self.slot} died {quick} times within {CRASH_LOOP_S:g} s of its start "
                            f"(exit code {code}); not starting it again\n".encode())
                post(store, "fatal", slot=self.slot, incarnation=self.incarnation,
                     error=f"the worker of slot {self.slot} fails at start (exit code {code}, {quick} times)")
                return
            if relaunches >= self.max_relaunches:
                os.write(2, f"gradsync: slot {self.slot} died (exit code {code}) and is not started again "
                            f"(--max-relaunches {self.max_relaunches})\n".encode())
                return
            relaunches += 1

    def _watch(self, store) -> int:
        """Wait for the process to end (killing it if the quorum evicts it); returns its exit code."""
        evict_key = f"q/evict/{self.slot}/{self.incarnation}"
        process = self.process
        while not wait([process.sentinel], timeout=EVICT_POLL_S):
            if self._halt.is_set() or store.check([evict_key]):
                _kill(process)
        process.join()
        return process.exitcode

    def stop(self) -> None:
        """Stop relaunching and kill the current process (by its PID)."""
        self._halt.set()
        if self.process is not None:
            _kill(self.process)


def _kill(process: multiprocessing.Process) -> None:
    if process.pid is not None and process.is_alive():
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
