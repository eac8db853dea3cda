"""The one entry of every public collective: run it in issue order, then end its flight record.

:func:`public_collective` decorates each public collective (``ops``,
``validate.reject_call``). While some owner holds the communicator's lane
(a DataParallel backward in flight, :mod:`~gradsync.collectives.lane`), the
call runs on the lane's thread, after the buckets already queued; otherwise
here. Either way, on the thread that ran it, the calls it started
(``Communicator.new_call``, usually one: the ordinals between the
communicator's count before and after) are marked done, or failed, in the
communicator's :class:`~gradsync.debug.flight.FlightRecorder`, which writes
its dump on a timeout or mismatch. :func:`recorded` does the second part only
(collectives that never queue on the lane); calls started outside a public
collective (``gradsync.init``'s host identity exchange) use :func:`run_recorded`.

Cost: one lookup of the communicator among the arguments and one clock read
per call (``python -m gradsync.bench.flight_cost``).
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
    if first == comm.calls_started:  # one call, the last one entered: the usual case
        comm.flight.finish_last(first)
    else:
        recorded_end(comm.flight, first, comm.calls_started)
    return result


def _communicator(args: tuple, kwargs: dict) -> Communicator | None:
    """The collective's ``comm`` argument (a keyword, or the first Communicator among the positional ones)."""
    comm = kwargs.get("comm")
    if comm is None:
        for arg in args:
            if isinstance(arg, Communicator):
                return arg
    return comm


def public_collective(collective: Callable[..., R]) -> Callable[..., R]:
    """Decorate a public collective whose arguments include its Communicator: issue order, then the record."""

    @functools.wraps(collective)
    def run(*args, **kwargs):
        comm = _communicator(args, kwargs)
        if comm is None:  # no communicator: let the collective raise its own error
            return collective(*args, **kwargs)
        lane = comm.lane
        if lane.held:
            return lane.run(lambda: run_recorded(comm, collective, *args, **kwargs))
        return run_recorded(comm, collective, *args, **kwargs)

    return run


def recorded(collective: Callable[..., R]) -> Callable[..., R]:
    """Decorate a collective whose arguments include its Communicator: end its calls' records (no lane)."""

    @functools.wraps(collective)
    def run(*args, **kwargs):
        comm = _communicator(args, kwargs)
        if comm is None:
            return collective(*args, **kwargs)
        return run_recorded(comm, collective, *args, **kwargs)

    return run
