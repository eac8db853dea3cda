"""Run any function elastically on this machine: the library's ``gradsync train --elastic``.

>>> # def worker(slot, incarnation, host, port):            # a top-level function
>>> #     member = ElasticMember(connect(host, port), slot, incarnation, timeout_s=30)
>>> #     member.join()
>>> #     ...                                               # the loop in gradsync.elastic.member
>>> # launch_elastic(4, worker)                             # {slot: [exit codes]}

The target is forked from a forkserver (``preload``: modules it imports
once, e.g. your training module), started again when it dies (up to
``max_relaunches``; not after it died three times within 2 s of its start),
and must exit 0 when the run is over. As with any multiprocessing start
method but fork, the calling script needs ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Callable

from gradsync.elastic.launcher import Launcher
from gradsync.elastic.service import QuorumService, ServiceSettings
from gradsync.elastic.run_store import connect
from gradsync.errors import GradsyncError

POLL_S = 0.05


class ElasticRunError(GradsyncError):
    """The quorum gave up or the run did not end in time (the message says which)."""


def launch_elastic(nproc: int, target: Callable, *args, min_nproc: int = 1, max_nproc: int | None = None,
                   timeout_s: float = 300.0, max_relaunches: int = 100, out_dir=None,
                   preload: tuple[str, ...] = (), deadline_s: float | None = None) -> dict[int, list[int]]:
    """Run ``target(slot, incarnation, store_host, store_port, *args)`` on ``nproc`` slots, elastically.

    Returns:
        ``{slot: exit codes of its processes, in order}`` once the run is done (rank 0 of the last
        membership called :meth:`ElasticMember.finish`) or every launcher ended.

    Raises:
        ValueError: bad counts. ElasticRunError: the quorum gave up, or ``deadline_s`` passed.
    """
    if not callable(target):
        raise TypeError(f"target must be a top-level function, got {type(target).__name__}")
    for name, value in (("nproc", nproc), ("min_nproc", min_nproc), ("max_nproc", max_nproc)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{name} must be an int, got {value!r}")
    max_nproc = nproc if max_nproc is None else max_nproc
    if not 1 <= min_nproc <= nproc <= max_nproc:
        raise ValueError(f"need 1 <= min_nproc ({min_nproc}) <= nproc ({nproc}) <= max_nproc ({max_nproc})")
    multiprocessing.set_forkserver_preload(["torch", "gradsync", target.__module__, *preload])
    service = QuorumService(ServiceSettings(nproc, min_nproc, max_nproc, timeout_s), out_dir=out_dir)
    store = connect(service.host, service.port)
    launchers = [Launcher(slot, target, (service.host, service.port, *args),
                          lambda: connect(service.host, service.port), max_relaunches) for slot in range(nproc)]
    started = time.monotonic()
    try:
        for launcher in launchers:
            launcher.start()
        while any(launcher.is_alive() for launcher in launchers):
            if store.check(["q/failed"]):
                raise ElasticRunError(f"the elastic run failed: {store.get('q/failed').decode()}")
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                raise ElasticRunError(f"the elastic run did not end within {deadline_s:g} s")
            time.sleep(POLL_S)
        if store.check(["q/failed"]):
            raise ElasticRunError(f"the elastic run failed: {store.get('q/failed').decode()}")
        if not store.check(["q/done"]):
            raise ElasticRunError(f"every worker ended before the run was done (rank 0 never called finish()): "
                                  f"exit codes by slot { {l.slot: l.exitcodes for l in launchers} }")
    finally:
        for launcher in launchers:
            launcher.stop()
        for launcher in launchers:
            launcher.join(10)
        service.stop()
    return {launcher.slot: launcher.exitcodes for launcher in launchers}
