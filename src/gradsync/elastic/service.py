"""The quorum service: the run's store and its :class:`~gradsync.elastic.quorum.Quorum`, in a process of their own.

No worker hosts anything the others need: rank 0 may die like any other.
The process is started by the job (``gradsync train --elastic``; on the
emulated hosts, in the switch namespace), dies with it
(``PR_SET_PDEATHSIG``), and writes the quorum's decisions to the run
folder's ``events.jsonl``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from gradsync.elastic.quorum import Quorum
from gradsync.elastic.run_store import EventReader, serve
from gradsync.fault.events import EventLog

POLL_S = 0.005        # the longest the quorum waits for an event before it looks at the clock
LINGER_S = 2.0        # the store stays up this long after the run ends, so every worker reads the outcome


@dataclass
class ServiceSettings:
    nproc: int
    min_nproc: int
    max_nproc: int
    timeout_s: float
    startup_s: float = 120.0
    rejoin_s: float = 60.0
    host: str = "127.0.0.1"
    port: int = 0


def run_service(settings: ServiceSettings, out_dir: str | None, ready_pipe) -> None:
    """The service process's target: serve the store, read events, decide; the port goes to ``ready_pipe``."""
    from gradsync.launch import die_with_launcher

    die_with_launcher()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the job stops the service itself

    def report(port: int) -> None:
        ready_pipe.send(port)
        ready_pipe.close()

    serve_quorum(settings, out_dir, report)


def serve_quorum(settings: ServiceSettings, out_dir: str | None, report) -> None:
    """Serve the store, call ``report(port)``, then read events and decide until the run is over."""
    server = serve(settings.host, settings.port)
    report(server.port)
    events = EventLog(out_dir) if out_dir else None
    quorum = Quorum(server, settings.nproc, settings.min_nproc, settings.max_nproc, settings.timeout_s,
                    settings.startup_s, settings.rejoin_s, log=events.write if events else None)
    reader = EventReader(server)
    while quorum.outcome is None:
        event = reader.next(timeout_s=POLL_S)
        while event is not None:
            quorum.handle(event)
            event = reader.next(timeout_s=0)
        quorum.tick()
    time.sleep(LINGER_S)


class QuorumService:
    """Handle on the service process: ``host``, ``port``, ``pid``; :meth:`stop` ends it.

    Raises (from the constructor):
        RuntimeError: the service did not start within ``startup_s`` (its error is in stderr).
    """

    def __init__(self, settings: ServiceSettings, out_dir: str | Path | None = None, startup_s: float = 60.0):
        context = multiprocessing.get_context("forkserver")
        receiver, sender = context.Pipe(duplex=False)
        self.process = context.Process(target=run_service, args=(settings, str(out_dir) if out_dir else None,
                                                                 sender), daemon=True, name="gradsync-quorum")
        self.process.start()
        sender.close()
        if not receiver.poll(startup_s):
            self.stop()
            raise RuntimeError(f"the elastic quorum service did not start within {startup_s:g} s")
        self.host, self.port, self.pid = settings.host, receiver.recv(), self.process.pid
        receiver.close()

    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self) -> None:
        """End the process (by its PID) and reap it."""
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)


def main(argv: list[str] | None = None) -> None:
    """``python -m gradsync.elastic.service HOST PORT NPROC MIN MAX TIMEOUT OUT``: the service in this
    process (on the emulated hosts, started in the switch namespace); prints ``ready PORT`` once it listens."""
    import sys

    host, port, nproc, low, high, timeout_s, out_dir = (argv or sys.argv[1:])[:7]
    settings = ServiceSettings(int(nproc), int(low), int(high), float(timeout_s), host=host, port=int(port))
    serve_quorum(settings, out_dir, lambda bound: print(f"ready {bound}", flush=True))


if __name__ == "__main__":
    main()
