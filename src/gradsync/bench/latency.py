"""Where the microseconds of a 4-byte shm AllReduce go: ``python -m gradsync.bench.latency [--nproc 2]``.

Times, on every rank at once, each layer of a small ``all_reduce(algorithm="shm")``
(:mod:`gradsync.collectives.shm_lean`) next to two yardsticks of this
machine: an empty Python function call and a bare one-element ``torch.add``.
Rows (median of 5 repetitions of 2000 calls, rank 0, microseconds per call):
the yardsticks; one shared-memory barrier; ``Communicator.new_call`` (the
call's deadline and flight record); the plan lookup (the layout key and its
dict); the lean round itself (copy in, check word, barrier, sum: a plan's
``run`` on a prebuilt call); and the whole call, on an explicit
communicator and through ``gradsync.all_reduce`` (the default group). The
whole call minus the rows above it is the decorators' share (issue order,
flight record, autograd off).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradsync
from gradsync.collectives import ops, shm_lean
from gradsync.collectives.shm_setup import ShmState, barrier

CALLS, REPETITIONS = 2000, 5


def _empty() -> None:
    return None


def _per_call_us(comm, fn) -> float:
    times = []
    for _ in range(REPETITIONS):
        ops.all_reduce(torch.zeros(1), comm, algorithm="native", verify=False)  # line the ranks up
        started = time.perf_counter()
        for _ in range(CALLS):
            fn()
        times.append((time.perf_counter() - started) / CALLS * 1e6)
    return statistics.median(times)


def profile_rows() -> list[tuple[str, float]]:
    """(what, microseconds per call) on this rank; collective (every rank runs the same rows)."""
    torch.set_num_threads(1)
    comm = gradsync.init()
    try:
        tensor, other = torch.zeros(1), torch.zeros(1)
        for _ in range(3):  # the segment, then the plan
            ops.all_reduce(tensor, comm, algorithm="shm")
        plan = next(iter(comm.plans.values()))
        segment = comm.options(ShmState).segment
        call = comm.new_call("all_reduce", "shm")
        return [
            ("empty Python function call", _per_call_us(comm, _empty)),
            ("torch.add of one float32 (out=)", _per_call_us(comm, lambda: torch.add(tensor, other, out=other))),
            ("shm barrier alone", _per_call_us(comm, lambda: barrier(segment, call, "latency"))),
            ("Communicator.new_call", _per_call_us(comm, lambda: comm.new_call("all_reduce", "shm"))),
            ("plan lookup (layout key + dict)", _per_call_us(comm, lambda: comm.plans.get(
                shm_lean.plan_key(tensor, "sum", "shm", None)))),
            ("lean round (plan.run: copy in, word, barrier, sum)", _per_call_us(comm, lambda: plan.run(tensor, call))),
            ("collectives.all_reduce(tensor, comm, algorithm='shm')", _per_call_us(
                comm, lambda: ops.all_reduce(tensor, comm, algorithm="shm"))),
            ("gradsync.all_reduce(tensor, algorithm='shm'), 4 bytes", _per_call_us(
                comm, lambda: gradsync.all_reduce(tensor, algorithm="shm"))),
        ]
    finally:
        gradsync.shutdown()


def format_rows(rows: list[tuple[str, float]]) -> str:
    width = max(len(what) for what, _ in rows)
    lines = [f"{'what':<{width}} {'us/call':>9}", "-" * (width + 10)]
    lines += [f"{what:<{width}} {us:>9.2f}" for what, us in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks on this machine (default %(default)s)")
    options = parser.parse_args()
    if options.nproc < 2:
        parser.error(f"--nproc must be >= 2 (a collective needs peers), got {options.nproc}")
    from gradsync.launch import launch_local

    rows = launch_local(options.nproc, profile_rows)[0]
    print(f"# 4-byte shm AllReduce at world size {options.nproc}, rank 0, median of {REPETITIONS} x {CALLS} calls")
    print(format_rows(rows))


if __name__ == "__main__":
    main()
