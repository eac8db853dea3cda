"""Run a function on every rank of a group: real processes over Gloo, or threads in-process.

``run_world(n, fn, *args)`` starts ``n`` processes (see :func:`start_context`;
127.0.0.1 and a free port), each joining the group with
``gradsync.init`` and calling ``fn(*args)``; it returns the per-rank results,
index = rank. ``run_threads(n, fn)`` runs ``fn(comm)`` on ``n`` threads over
:class:`gradsync.transport.thread.ThreadWorld` (optionally with a small
``segment_bytes`` or pretend nodes of ``ranks_per_node`` ranks). Both re-raise
a rank's exception in the caller naming the rank, and both have a deadline
after which the ranks still running are reported by rank (and, for
processes, terminated).

Functions run inside ranks must be top-level (picklable) and named ``_rank_<what>``.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable

import torch

import gradsync
from gradsync.collectives import Communicator, HierarchicalOptions, SegmentOptions
from gradsync.transport.thread import ThreadWorld

DEFAULT_COLLECTIVE_TIMEOUT_S = 20.0
# Imported once by the fork server, so that rank processes start without importing torch.
# torch._dynamo: the first torch.optim optimizer imports it (~4 s of CPU per rank here); it starts no thread.
PRELOADED_MODULES = ["torch", "torch._dynamo", "gradsync", "_dist", "_reference"]
_TEARDOWN_GRACE_S = 10.0  # a rank that reported its result may take this long to leave the group


class RankError(RuntimeError):
    """A rank raised: carries the rank, the exception's type name and the rank's traceback text."""

    def __init__(self, rank: int, exc_type: str, message: str, traceback_text: str, others: str = ""):
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n"
                         f"--- traceback from rank {rank} ---\n{traceback_text}{others}")
        self.rank = rank
        self.exc_type = exc_type
        self.traceback_text = traceback_text


class RankHangError(TimeoutError):
    """Some ranks did not finish before the deadline; ``ranks`` lists them."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


def capture_error(call: Callable[[], object]) -> Exception | None:
    """Run ``call()``; return the exception it raised (None if none), for tests that inspect it."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_context():
    """The multiprocessing context rank processes start from.

    "forkserver" with ``PRELOADED_MODULES``: a clean single-threaded server
    process imports torch and gradsync once and forks every rank from there,
    so a rank starts in milliseconds. With "spawn" each rank imports torch
    afresh, about 2 s of CPU, and a world of 4 on 2 cores takes ~9 s to start.
    The server never touches torch.distributed or threads, so its children are
    as clean as spawned ones. "spawn" where there is no fork server (Windows).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED_MODULES)
    return context


def _worker(rank: int, world_size: int, port: int, collective_timeout_s: float,
            fn: Callable, args: tuple, results) -> None:
    """Body of one rank process: join the group, run ``fn``, report, leave the group."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.set_num_threads(1)
        gradsync.init(backend="gloo", timeout=collective_timeout_s)
        # Plain pickle (not torch's shared-memory reductions): the bytes stay valid after we exit.
        payload = pickle.dumps((True, fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent
        payload = pickle.dumps((False, (type(exc).__qualname__, str(exc), traceback.format_exc())))
    try:
        results.put((rank, payload))
    finally:
        gradsync.shutdown()


def _raise_first_error(errors: dict[int, tuple[str, str, str]], hang_message: str) -> None:
    if not errors:
        return
    first = min(errors)
    others = "".join(f"\n(also rank {rank}: {exc_type}: {message})"
                     for rank, (exc_type, message, _) in sorted(errors.items()) if rank != first)
    if hang_message:
        others += f"\n(also: {hang_message})"
    raise RankError(first, *errors[first], others=others)


def run_world(world_size: int, fn: Callable, *args, timeout_s: float = 60,
              collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
              may_exit: Iterable[int] = ()) -> list:
    """Run ``fn(*args)`` on ``world_size`` processes joined by ``gradsync.init``.

    Args:
        world_size: number of ranks (processes).
        fn: a top-level function; its return value must be picklable.
        timeout_s: deadline in seconds for the whole world, process start included.
        collective_timeout_s: ``gradsync.init(timeout=...)`` on every rank.
        may_exit: ranks allowed to end without reporting (fault tests); their result is None.

    Returns:
        ``fn``'s results, index = rank.

    Raises:
        RankError: a rank raised (the lowest such rank, with its traceback text).
        RankHangError: ranks did not finish before the deadline (they were terminated).
    """
    context = start_context()
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker, name=f"gradsync-test-rank{rank}", daemon=True,
                                 args=(rank, world_size, port, collective_timeout_s, fn, args, results))
                 for rank in range(world_size)]
    may_exit = set(may_exit)
    deadline = time.monotonic() + timeout_s
    payloads: dict[int, bytes] = {}
    try:
        for process in processes:
            process.start()
        _collect(processes, results, payloads, may_exit, deadline)
        hang_message, hung = _join_or_report(processes, payloads, may_exit, deadline)
    finally:
        for process in processes:  # only the processes this call started
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
        results.close()
    outcomes = {rank: pickle.loads(payload) for rank, payload in payloads.items()}
    # An exception is usually the cause of the other ranks' hang, so it is reported first.
    _raise_first_error({rank: detail for rank, (ok, detail) in outcomes.items() if not ok}, hang_message)
    if hung:
        raise RankHangError(hang_message, hung)
    return [outcomes[rank][1] if rank in outcomes else None for rank in range(world_size)]


def _collect(processes, results, payloads: dict, may_exit: set, deadline: float) -> None:
    """Read results until every rank reported, died, or the deadline passed."""
    exited_at: dict[int, float] = {}
    while len(payloads) < len(processes) and time.monotonic() < deadline:
        try:
            rank, payload = results.get(timeout=0.2)
            payloads[rank] = payload
            continue
        except queue.Empty:
            pass
        for rank, process in enumerate(processes):
            if rank not in payloads and not process.is_alive():
                exited_at.setdefault(rank, time.monotonic())
        # A rank that exited has flushed its result long before this grace period ends.
        dead = [rank for rank, when in exited_at.items()
                if rank not in payloads and time.monotonic() - when > 1.0]
        unexpected = [rank for rank in dead if rank not in may_exit]
        if unexpected:
            codes = ", ".join(f"rank {rank} (pid {processes[rank].pid}) exit code {processes[rank].exitcode}"
                              for rank in unexpected)
            raise RankError(unexpected[0], "ProcessDied", f"exited without a result: {codes}", "")
        if len(payloads) + len(dead) == len(processes):
            return


def _join_or_report(processes, payloads: dict, may_exit: set, deadline: float) -> tuple[str, list[int]]:
    """Join every process; return a message naming the ranks that hung (no result, or stuck leaving)."""
    silent = [rank for rank in range(len(processes)) if rank not in payloads and rank not in may_exit
              and processes[rank].is_alive()]
    if silent:
        pids = ", ".join(f"rank {rank} pid {processes[rank].pid}" for rank in silent)
        return (f"ranks {silent} did not finish within the deadline and were terminated ({pids})",
                silent)
    teardown_deadline = min(deadline, time.monotonic() + _TEARDOWN_GRACE_S)
    for process in processes:
        process.join(max(teardown_deadline - time.monotonic(), 0.0))
    stuck = [rank for rank, process in enumerate(processes)
             if process.is_alive() and rank not in may_exit]
    if stuck:
        return f"ranks {stuck} reported a result but hung in gradsync.shutdown() and were terminated", stuck
    return "", []


def communicator_options(*, segment_bytes: int | None = None, ranks_per_node: int | None = None,
                         inter_node_algorithm: str = "ring", intra_node_algorithm: str = "ring") -> list:
    """The ``Communicator(options=...)`` list for the old keyword settings (None: the default)."""
    options = [HierarchicalOptions(ranks_per_node=ranks_per_node, inter_node_algorithm=inter_node_algorithm,
                                   intra_node_algorithm=intra_node_algorithm)]
    return options + ([SegmentOptions(segment_bytes=segment_bytes)] if segment_bytes is not None else [])


def run_threads(world_size: int, fn: Callable, timeout_s: float = 20,
                collective_timeout_s: float | None = None, *, segment_bytes: int | None = None,
                ranks_per_node: int | None = None, world=None, intra_node_algorithm: str = "ring") -> list:
    """Run ``fn(comm)`` for every rank of a :class:`ThreadWorld` on its own thread.

    Args:
        world_size: number of thread-ranks.
        fn: called as ``fn(comm)`` with that rank's
            :class:`gradsync.collectives.Communicator`.
        timeout_s: join deadline in seconds.
        collective_timeout_s: the communicators' default collective timeout
            (half of ``timeout_s`` when None, so a hang surfaces as a collective error first).
        segment_bytes: the communicators' pipelining unit (None: Communicator's default).
        ranks_per_node: ranks per pretend node for ``hierarchical`` (None: one node).
        intra_node_algorithm: ``hierarchical`` inside a node: "ring" or "shm".
        world: makes each rank's transport with ``world.transport(rank)``
            (None: a new ``ThreadWorld(world_size)``).

    Returns:
        ``fn``'s results, index = rank.

    Raises:
        RankError: a rank raised (chained to the original exception).
        RankHangError: ranks still running at the deadline.
    """
    world = ThreadWorld(world_size) if world is None else world
    if collective_timeout_s is None:
        collective_timeout_s = timeout_s / 2
    options = communicator_options(segment_bytes=segment_bytes, ranks_per_node=ranks_per_node,
                                   intra_node_algorithm=intra_node_algorithm)
    comms = [Communicator(world.transport(rank), timeout_s=collective_timeout_s, options=options)
             for rank in range(world_size)]
    results: list = [None] * world_size
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            results[rank] = fn(comms[rank])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller with the rank
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(rank,), name=f"rank{rank}", daemon=True)
               for rank in range(world_size)]
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if hung:
        raise RankHangError(f"thread ranks {hung} still running after {timeout_s} s", hung)
    if errors:
        first = min(errors)
        exc = errors[first]
        text = "".join(traceback.format_exception(exc))
        others = "".join(f"\n(also rank {rank}: {type(other).__name__}: {other})"
                         for rank, other in sorted(errors.items()) if rank != first)
        raise RankError(first, type(exc).__qualname__, str(exc), text, others) from exc
    return results


def capture(call):
    """Run ``call``; return ``(exception or None, seconds taken)``."""
    started = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc, time.monotonic() - started
    return None, time.monotonic() - started
