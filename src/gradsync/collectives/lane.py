"""One communicator's collectives in issue order: a single communication thread, a "lane".

DataParallel reduces gradient buckets on a communication thread while
backward runs. A collective issued meanwhile from the training thread (an
autograd Function whose backward all-gathers, as SimCLR's GatherLayer does)
would race the buckets on the same transport, so that ranks could pair one
rank's bucket with another's gather. While some owner *holds* the lane (a
DataParallel backward in flight), every public collective on the
communicator is therefore run on the lane's thread, after the buckets
already handed to it: in issue order, on every rank
(:func:`~gradsync.collectives.recording.public_collective` routes them).

Before such a collective is queued, each holder's ``check`` runs on the
calling thread; it may raise (a held round whose backward died, see the
reducer) instead of letting the collective pair with a peer's bucket.

>>> lane = Lane()
>>> lane.held
False
>>> token = lane.hold(lambda: None)
>>> lane.run(lambda: 1 + 1)          # from another thread than the lane's: queued, then awaited
2
>>> lane.release(token); lane.close()
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

R = TypeVar("R")


class Lane:
    """A single-thread executor shared by everything that communicates on one communicator."""

    def __init__(self):
        self._executor: ThreadPoolExecutor | None = None
        self._thread_ident: int | None = None
        self._holders: dict[int, Callable[[], None]] = {}
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., R], *args) -> Future:
        """Queue ``fn(*args)`` behind everything queued before; return its future."""
        with self._lock:
            if not self._closed:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradsync-comm",
                                                        initializer=self._note_thread)
                return self._executor.submit(fn, *args)
        future: Future = Future()  # the group is shut down: run here, so that its error reaches the caller
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)
        return future

    def _note_thread(self) -> None:
        self._thread_ident = threading.get_ident()

    def on_lane(self) -> bool:
        """Whether the calling thread is the lane's thread."""
        return threading.get_ident() == self._thread_ident

    @property
    def held(self) -> bool:
        return bool(self._holders)

    def hold(self, check: Callable[[], None]) -> int:
        """Route collectives through the lane until :meth:`release`; ``check`` runs before each one."""
        token = next(self._tokens)
        self._holders[token] = check
        return token

    def release(self, token: int | None) -> None:
        self._holders.pop(token, None)

    def run(self, fn: Callable[[], R]) -> R:
        """Run ``fn`` in issue order: directly when the lane is free or this is its thread, else queued."""
        if not self._holders or self.on_lane():
            return fn()
        for check in list(self._holders.values()):
            check()
        return self.submit(fn).result()

    def close(self) -> None:
        """Stop the thread once the work already queued is done."""
        with self._lock:
            executor, self._executor, self._closed = self._executor, None, True
        if executor is not None:
            executor.shutdown(wait=False)

