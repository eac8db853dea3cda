"""``python -m gradsync.bench.flight_cost``: what the always-on flight recorder costs per collective call.

Three measurements, each the median over rounds of the mean µs per call:

- ``all_reduce``: a 4-byte (one float32) ``gradsync.all_reduce`` at world
  size 2 over Gloo on this machine, with the layout check (``verify=True``,
  the public call) and without it (``verify=False``, as DataParallel's
  buckets): the whole per-call cost a user sees, network included;
- ``framework``: the same call on a one-rank communicator (it returns after
  the checks, so no message moves): gradsync's own per-call work, where the
  recorder's share is largest;
- ``recorder``: the recorder's own work for one call, each part (the end
  of the call, entering the ring, the start times, dtype and shape, a wait
  on a peer) timed alone against the same code without it, in CPU time
  (finding the communicator among the arguments is not counted: the issue
  order needed it before the recorder, and does it faster now).

Run it on two checkouts (before and after a change) and compare; the
machines are noisy, so each figure is the median (and, for whole calls, the
minimum) over rounds, and verify on and off alternate.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import time

import torch

NUMEL = 1  # 4 bytes of float32


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _timed_calls(call, calls: int, clock=time.perf_counter) -> float:
    """Mean µs of ``calls`` runs of ``call()`` on ``clock``."""
    started = clock()
    for _ in range(calls):
        call()
    return (clock() - started) / calls * 1e6


def _cpu_samples(call, calls: int, rounds: int) -> list[float]:
    """The mean CPU µs (this thread's) per ``call()`` of each of ``rounds`` rounds: other processes' load on a
    shared machine counts less than in wall-clock time."""
    _timed_calls(call, calls // 4, time.thread_time)
    return [_timed_calls(call, calls, time.thread_time) for _ in range(rounds)]


def _cpu_us(call, calls: int, rounds: int) -> float:
    """The median of :func:`_cpu_samples`."""
    return statistics.median(_cpu_samples(call, calls, rounds))


def _rank_all_reduce(rank: int, port: int, calls: int, rounds: int, results) -> None:
    """One rank of the world-size-2 measurement: alternate verify on/off for ``rounds`` rounds."""
    import gradsync
    from gradsync.collectives import ops
    from gradsync.process_group import default_communicator

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    gradsync.init(backend="gloo", timeout=60.0)
    comm = default_communicator()
    tensor = torch.ones(NUMEL)
    checked = lambda: ops.all_reduce(tensor, comm)  # noqa: E731
    unchecked = lambda: ops.all_reduce(tensor, comm, verify=False)  # noqa: E731
    _timed_calls(checked, calls // 4)  # warm-up: connections, buffers
    samples: dict[str, list[float]] = {"verify": [], "no verify": []}
    for _ in range(rounds):
        samples["verify"].append(_timed_calls(checked, calls))
        samples["no verify"].append(_timed_calls(unchecked, calls))
    if rank == 0:
        results.put(samples)
    gradsync.shutdown()


def all_reduce_cost(calls: int, rounds: int) -> dict[str, list[float]]:
    """µs per 4-byte all_reduce at world size 2 (Gloo, this machine) per round, verify on and off."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank_all_reduce, args=(rank, port, calls, rounds, results), daemon=True)
                 for rank in range(2)]
    for process in processes:
        process.start()
    samples = results.get(timeout=600)
    for process in processes:
        process.join(60)
    return samples


def framework_cost(calls: int, rounds: int) -> list[float]:
    """CPU µs per all_reduce on a one-rank communicator per round (checks and bookkeeping only, no message)."""
    from gradsync.collectives import Communicator, ops
    from gradsync.transport.thread import ThreadWorld

    comm = Communicator(ThreadWorld(1).transport(0), 60.0)
    tensor = torch.ones(NUMEL)
    return _cpu_samples(lambda: ops.all_reduce(tensor, comm), calls, rounds)


def recorder_costs(calls: int, rounds: int) -> list[tuple[str, float]] | None:
    """(part, median CPU µs) of the recorder's work for one call, each part timed alone against the same
    code without it (None: this checkout has no recorder)."""
    try:
        from gradsync.collectives.recording import run_recorded
    except ImportError:
        return None
    from gradsync.collectives import Communicator
    from gradsync.debug.flight import FlightEntry
    from gradsync.transport.thread import ThreadWorld

    comm = Communicator(ThreadWorld(1).transport(0), 60.0)
    call = comm.new_call("all_reduce", "ring")
    for ordinal in range(comm.flight.capacity):  # a full ring, as after a while
        entry = FlightEntry()
        entry.ordinal = ordinal
        comm.flight.enter(entry)
    tensor = torch.ones(NUMEL)

    def bare(tensor, comm):
        comm.calls_started += 1  # as new_call does (the ring's entries stand for its calls)

    def start_times():  # what CollectiveCall.__init__ adds: the wall clock, four stores
        call.started_mono = 0.0
        call.started_wall = time.time()
        call.entry = None
        call._group_ranks = None

    def dtype_and_shape():  # what start_call adds
        call.dtype, call.shape = tensor.dtype, tensor.shape

    def one_wait():  # what CollectiveCall.wait adds
        if call.entry is None:
            call.waiting_on = 0

    nothing = lambda: None  # noqa: E731
    parts = [("end of call (run_recorded)", lambda: run_recorded(comm, bare, tensor, comm), lambda: bare(tensor, comm)),
             ("enter the ring", lambda: comm.flight.enter(call), nothing),
             ("start times", start_times, nothing),
             ("dtype and shape", dtype_and_shape, nothing),
             ("one wait on a peer", one_wait, nothing)]
    costs = [(name, max(_cpu_us(measured, calls, rounds) - _cpu_us(baseline, calls, rounds), 0.0))
             for name, measured, baseline in parts]
    return costs + [("recorder total (4 waits)", sum(cost for _, cost in costs) + 3 * costs[-1][1])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gradsync.bench.flight_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per round (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the median is shown (default %(default)s)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [(f"recorder: {name}", [cost]) for name, cost in recorder_costs(args.calls * 50, args.rounds) or []]
    rows.append(("all_reduce 4 B, ws=1 (checks only, CPU)", framework_cost(args.calls * 5, args.rounds)))
    wide = all_reduce_cost(args.calls, args.rounds)
    rows += [(f"all_reduce 4 B, ws=2 Gloo, {mode} (wall)", values) for mode, values in wide.items()]
    print(f"{'measurement':<48} {'median µs':>10} {'min µs':>10}")
    for name, values in rows:
        low = f"{min(values):.2f}" if len(values) > 1 else ""
        print(f"{name:<48} {statistics.median(values):>10.2f} {low:>10}")

if __name__ == "__main__":
    main()
