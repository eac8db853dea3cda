"""The elastic run's store: a TCPStore served by a process of its own, and an event queue over it.

No worker's death takes the store down: it lives in the quorum service's
process (:mod:`gradsync.elastic.service`), not in rank 0, and listens on
loopback only (or, on the emulated hosts, on the switch namespace's address).

The event queue is append-only: a writer takes the next number with the
store's atomic ``add`` and writes ``ev/<n>``; the one reader (the quorum
service) reads ``ev/1``, ``ev/2`` ... in order, so no event is lost or read
twice whatever the writers' interleaving.

>>> import torch.distributed as dist
>>> store = dist.HashStore()
>>> post(store, "join", slot=2, incarnation=0)
1
>>> reader = EventReader(store)
>>> reader.next(timeout_s=1.0)["kind"], reader.next(timeout_s=0.01)
('join', None)
"""

from __future__ import annotations

import datetime
import json
import time

import torch.distributed as dist

from gradsync.rendezvous import bounded, is_loopback, listening_socket

EVENT_COUNT_KEY = "ev/count"
POLL_S = 0.002  # how often a waiting reader looks again


def serve(host: str, port: int = 0) -> dist.TCPStore:
    """A TCPStore server listening on ``host:port`` only (port 0: a free one; ``store.port`` says which)."""
    sock = listening_socket("127.0.0.1" if host.lower() == "localhost" else host, port)
    port = sock.getsockname()[1]
    try:
        return dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False,
                             master_listen_fd=sock.detach(), use_libuv=True)
    except BaseException:
        sock.close()
        raise


def connect(host: str, port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    """A client of the run's store.

    Raises:
        TimeoutError: the store did not answer within ``timeout_s`` (its process is gone or stopped).
    """
    make = lambda: dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))  # noqa: E731
    return bounded(make, timeout_s, f"the elastic run's store at {host}:{port}")


def post(store, kind: str, **fields) -> int:
    """Append the event ``{"kind": kind, **fields, "time": wall clock}``; returns its number (from 1)."""
    number = store.add(EVENT_COUNT_KEY, 1)
    store.set(f"ev/{number}", json.dumps({"kind": kind, "time": time.time(), **fields}))
    return number


class EventReader:
    """Reads the queue in order, each event once (one reader per run: the quorum service)."""

    def __init__(self, store):
        self.store = store
        self.next_number = 1

    def next(self, timeout_s: float) -> dict | None:
        """The next event, or None if none was posted within ``timeout_s``.

        Polls (a store ``wait`` that times out logs a warning in torch's C++ client): the count first,
        then the event, which a writer between its ``add`` and its ``set`` is about to write.
        """
        deadline = time.monotonic() + timeout_s
        while int(self.store.add(EVENT_COUNT_KEY, 0)) < self.next_number:
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)
        key = f"ev/{self.next_number}"
        while not self.store.check([key]):
            time.sleep(POLL_S)
        self.next_number += 1
        return json.loads(self.store.get(key))


def get_json(store, key: str) -> dict | None:
    """The JSON value of ``key``, or None if it is not set."""
    if not store.check([key]):
        return None
    return json.loads(store.get(key))


def wait_key(store, key: str, timeout_s: float, poll_s: float = 0.005) -> bool:
    """Wait until ``key`` is set (True) or ``timeout_s`` passed (False), by polling ``check``."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def wait_json(store, key: str, timeout_s: float) -> dict:
    """Wait for ``key`` and return its JSON value.

    Raises:
        TimeoutError: not set within ``timeout_s``.
    """
    if not wait_key(store, key, timeout_s):
        raise TimeoutError(f"the elastic run's store did not get {key!r} within {timeout_s:g} s")
    return json.loads(store.get(key))


__all__ = ["serve", "connect", "post", "EventReader", "get_json", "wait_key", "wait_json", "is_loopback"]
