"""How a collective's flight record ends: done when the public call returns, failed when it raises.

The calls a public collective starts (``Communicator.new_call``, usually one)
are the ordinals between the communicator's count before and after it; the
:func:`recorded` decorator marks them in the communicator's
:class:`~gradsync.debug.flight.FlightRecorder`, which writes its dump on a
timeout or mismatch. Calls started outside a public collective (the host
identity exchange of ``gradsync.init``) use :func:`run_recorded`.

Decorators stack as ``@in_issue_order`` (outermost) then ``@recorded``, so the
record ends on the thread that ran the call.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

from gradsync.collectives.communicator import Communicator
from gradsync.debug.flight import FlightRecorder

R = TypeVar("R")


def recorded_end(flight: FlightRecorder, first: int, last: int, error: BaseException | None = None) -> None:
    """End the records of calls ``first..last``: done, or failed with ``error`` (dumped if a timeout or mismatch)."""
    if first > last:  # no call started (e.g. a closed group)
        return
    if error is None:
        flight.finish(first, last)
    else:
        flight.fail(first, last, error)


def run_recorded(comm: Communicator, fn: Callable[..., R], *args, **kwargs) -> R:
    """``fn(*args, **kwargs)``, ending the records of the calls it starts on ``comm``."""
    first = comm.calls_started + 1
    try:
        result = fn(*args, **kwargs)
    except BaseException as error:
        recorded_end(comm.flight, first, comm.calls_started, error)
        raise
    recorded_end(comm.flight, first, comm.calls_started)
    return result


def recorded(collective: Callable[..., R]) -> Callable[..., R]:
    """Decorate a public collective whose arguments include its Communicator (``comm``)."""

    @functools.wraps(collective)
    def run(*args, **kwargs):  # run_recorded, inlined: this runs on every call
        comm = kwargs.get("comm")
        if comm is None:
            for comm in args:
                if isinstance(comm, Communicator):
                    break
        first = comm.calls_started + 1
        try:
            result = collective(*args, **kwargs)
        except BaseException as error:
            recorded_end(comm.flight, first, comm.calls_started, error)
            raise
        if first == comm.calls_started:  # one call, the last one entered
            comm.flight.finish_last(first)
        else:
            recorded_end(comm.flight, first, comm.calls_started)
        return result

    return run
