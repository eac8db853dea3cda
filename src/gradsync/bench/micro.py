"""Micro-benchmarks the simulator's profile is calibrated from (``gradsync calibrate``).

Every function here is collective over a :class:`~gradsync.collectives.communicator.Communicator`:
every rank calls it with the same arguments (the ranks outside the pair or host measured
only line up), and every rank makes the same calls (``comm.new_call``), so that the
message tags of Gloo stay in step. Messages go through gradsync's own path
(``CollectiveCall.isend``/``irecv``/``wait_on`` over the group's transport, the
``TorchP2PTransport`` on Gloo), so the Python cost per message that the algorithms
pay is part of what is measured.

What each one measures (all times in seconds, the median of ``repeats`` batches: the
statistic of the sweep the profile is validated against, so that both see the machine
as it is, other processes included; the least batch would be the machine's own cost,
but a profile of it then predicts a loaded machine's sweep systematically low):

* :func:`ping_pong`: one-way time of an ``nbytes`` message between two ranks (half a
  round trip; the reply's receive is posted before the ping is sent, as the
  algorithms post receives first).
* :func:`exchange`: both ranks send ``nbytes`` to each other at once (a ring step
  at two ranks); the time of one exchange.
* :func:`hop_chain`: ``hops`` dependent exchanges of ``nbytes`` between two ranks in one call, as a
  ring's steps at two ranks run them (receive posted, send posted, both waited; the next hop starts
  when this one ended); the time of one chain. Its slope over the hops is the cost of a hop inside a
  multi-hop schedule, which the one-way ping-pong underestimates.
* :func:`fixed_cost_batches`: chains of several hop counts and small all_reduce calls of several
  algorithms, interleaved batch by batch (the fixed costs drift with the machine's load: figures
  that are subtracted from each other are measured side by side).
* :func:`compute_per_byte`: ``acc += other`` (float32) and ``dst.copy_(src)`` piece by
  piece over large buffers, one rank per core at once, per output byte.
* :func:`cache_per_byte`: the same on buffers of a shm cell's size, passed over again and again
  (in cache).
* :func:`memory_bandwidth`: ranks 0 and 1 copy a large buffer at once; the DRAM bytes of
  both (3 per byte copied: the read, the destination's read for ownership, the write-back)
  over the slower rank's time.
* :func:`shm_barrier`: one barrier of ranks 0 and 1 on their shared-memory segment, on
  a core each, or both pinned to one core (ranks that outnumber the cores).
* :func:`shm_cell`: one cell of the pipelined shm AllReduce
  (:mod:`gradsync.collectives.shm_pipeline`) of two floats on ranks 0 and 1, its barriers included.
* :func:`tiny_all_reduce`: one ``all_reduce`` of a few float32 (``verify=False``,
  as the sweep calls it) over the whole group.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from gradsync.collectives import ops
from gradsync.collectives import shm_pipeline
from gradsync.collectives.communicator import Communicator
from gradsync.collectives.cost.shm_formulas import COPY_MEMORY_BYTES
from gradsync.collectives.shm_setup import ShmState, group_segment

_FLOAT = 4


def line_up(comm: Communicator) -> None:
    """Every rank waits for every other (a one-float native all_reduce, as the sweep lines up)."""
    ops.all_reduce(torch.zeros(1), comm, algorithm="native", verify=False)


def _batches(repeats: int, once) -> float:
    """The median of ``repeats`` values of ``once()`` (seconds, one value per batch)."""
    return statistics.median(once() for _ in range(max(repeats, 1)))


def _slowest(comm: Communicator, seconds: float) -> float:
    return max(float(t) for t in ops.all_gather(torch.tensor([seconds], dtype=torch.float64), comm,
                                                verify=False))


def ping_pong(comm: Communicator, pair: tuple[int, int], nbytes: int, iterations: int, repeats: int) -> float:
    """One-way seconds of an ``nbytes`` message from ``pair[0]`` to ``pair[1]`` and back (half a round
    trip); every rank returns the value measured on ``pair[0]``."""
    first, second = pair
    tensor = torch.zeros(max(nbytes // _FLOAT, 1))
    reply = torch.zeros_like(tensor)
    results = []
    for batch in range(repeats + 1):  # batch 0 warms the connection and buffers
        call = comm.new_call("calibrate ping-pong", "p2p")
        line_up(comm)
        started = time.perf_counter()
        if comm.rank == first:
            for _ in range(iterations):
                pending = call.irecv(reply, second, "pong")
                call.send(tensor, second, "ping")
                call.wait_on(pending, "pong")
        elif comm.rank == second:
            for _ in range(iterations):
                call.recv(reply, first, "ping")
                call.send(tensor, first, "pong")
        if batch:
            results.append((time.perf_counter() - started) / iterations / 2)
    return _from(comm, first, statistics.median(results) if comm.rank == first else 0.0)


def exchange(comm: Communicator, pair: tuple[int, int], nbytes: int, iterations: int, repeats: int) -> float:
    """Seconds of one simultaneous exchange of ``nbytes`` each way between the ranks of ``pair``."""
    tensor = torch.zeros(max(nbytes // _FLOAT, 1))
    inbox = torch.zeros_like(tensor)
    results = []
    for batch in range(repeats + 1):
        call = comm.new_call("calibrate exchange", "p2p")
        line_up(comm)
        started = time.perf_counter()
        if comm.rank in pair:
            peer = pair[1] if comm.rank == pair[0] else pair[0]
            for _ in range(iterations):
                call.send_recv(tensor, peer, inbox, peer, "exchange")
        if batch:
            results.append((time.perf_counter() - started) / iterations)
    return _from(comm, pair[0], statistics.median(results) if comm.rank == pair[0] else 0.0)


def hop_chain(comm: Communicator, pairs: list[tuple[int, int]], nbytes: int, hops: int, iterations: int,
              one_way: bool = False) -> float:
    """Seconds of one chain of ``hops`` dependent exchanges of ``nbytes`` each way between the ranks of
    each of ``pairs`` (disjoint; all at once: ranks that outnumber the cores), ``CollectiveCall.send_recv``
    (the receive posted first, as the ring's hops), a new call per chain, the mean of ``iterations``
    chains on this rank (0.0 off the pairs; every rank calls it). ``one_way``: a relay instead, ``hops``
    one-way messages, each sent once the previous one arrived (the pair's first rank sends the even
    ones, its second the odd ones: a tree's edges, one by one)."""
    tensor = torch.zeros(max(nbytes // _FLOAT, 1))
    inbox = torch.zeros_like(tensor)
    if not pairs:  # a ring of every rank: hop h's message goes from rank h mod p to its right neighbour
        return _ring_chain(comm, tensor, inbox, hops, iterations, one_way)
    mine = next((pair for pair in pairs if comm.rank in pair), None)
    peer = None if mine is None else (mine[1] if comm.rank == mine[0] else mine[0])
    line_up(comm)
    started = time.perf_counter()
    for _ in range(iterations):
        call = comm.new_call("calibrate hop chain", "p2p")  # on every rank: the tags stay in step
        if peer is not None and one_way:
            first = comm.rank == mine[0]
            for hop in range(hops):
                if (hop % 2 == 0) == first:
                    call.send(tensor, peer, "relay")
                else:
                    call.recv(inbox, peer, "relay")
        elif peer is not None:
            for _hop in range(hops):
                call.send_recv(tensor, peer, inbox, peer, "hop")
    return (time.perf_counter() - started) / iterations if peer is not None else 0.0


def _ring_chain(comm: Communicator, tensor, inbox, hops: int, iterations: int, one_way: bool) -> float:
    """:func:`hop_chain` over a ring of all ranks: ``hops`` ring steps (each rank sends right and receives
    from the left at once), or (``one_way``) a relay of ``hops`` messages around the ring."""
    rank, p = comm.rank, comm.world_size
    right, left = (rank + 1) % p, (rank - 1) % p
    line_up(comm)
    started = time.perf_counter()
    for _ in range(iterations):
        call = comm.new_call("calibrate ring chain", "p2p")
        for hop in range(hops):
            if not one_way:
                call.send_recv(tensor, right, inbox, left, "hop")
            elif hop % p == rank:
                call.send(tensor, right, "relay")
            elif (hop + 1) % p == rank:
                call.recv(inbox, left, "relay")
    return (time.perf_counter() - started) / iterations


def fixed_cost_batches(comm: Communicator, pairs: list[tuple[int, int]], nbytes: int, hop_counts: tuple[int, ...],
                       chains: int, calls: dict[str, tuple[str, int]], call_count: int,
                       repeats: int) -> dict[object, list[float]]:
    """Per batch, interleaved so that every figure sees the machine as the others do: a chain of each of
    ``hop_counts`` hops of ``nbytes`` between the ranks of each of ``pairs`` at once (:func:`hop_chain`,
    ``chains`` of each, keys the hop counts; relays of as many one-way messages, keys ("one-way", hops)), and ``call_count`` all_reduce calls (``verify=False``) of each
    ``calls[label] = (algorithm, numel)`` over the whole group (keys the labels). Returns every
    key's seconds per batch (the slowest rank's), ``repeats`` batches after one to warm up."""
    relays = [("one-way", hops) for hops in hop_counts]
    batches: dict[object, list[float]] = {key: [] for key in (*hop_counts, *relays, *calls)}
    tensors = {label: torch.zeros(numel) for label, (_, numel) in calls.items()}
    for batch in range(repeats + 1):
        for key in (*hop_counts, *relays):
            hops, one_way = (key[1], True) if isinstance(key, tuple) else (key, False)
            seconds = _slowest(comm, hop_chain(comm, pairs, nbytes, hops, chains, one_way))
            if batch:
                batches[key].append(seconds)
        for label, (algorithm, _) in calls.items():
            line_up(comm)
            started = time.perf_counter()
            for _ in range(call_count):
                ops.all_reduce(tensors[label], comm, algorithm=algorithm, verify=False)
            seconds = _slowest(comm, (time.perf_counter() - started) / call_count)
            if batch:
                batches[label].append(seconds)
    return batches


def _from(comm: Communicator, rank: int, value: float) -> float:
    """``rank``'s ``value`` on every rank."""
    return float(ops.all_gather(torch.tensor([value], dtype=torch.float64), comm, verify=False)[rank])


def compute_per_byte(comm: Communicator, piece_bytes: int, total_bytes: int, repeats: int,
                     workers: int = 2) -> tuple[float, float]:
    """(add, copy) seconds per output byte of float32 ``acc += other`` and ``dst.copy_(src)`` in
    pieces of ``piece_bytes`` over ``total_bytes`` buffers (the data comes from memory), on ranks
    0 .. ``workers``-1 at once (one per core: the simulator's oversubscription adds the wait for a
    core), the slower rank's median."""
    numel = max(total_bytes // _FLOAT, 1)
    piece = max(min(piece_bytes, total_bytes) // _FLOAT, 1)
    busy = comm.rank < workers
    acc, other = (torch.ones(numel), torch.ones(numel)) if busy else (None, None)
    bounds = [(a, min(a + piece, numel)) for a in range(0, numel, piece)]

    def timed(work) -> float:
        line_up(comm)
        started = time.perf_counter()
        if busy:
            for a, b in bounds:
                work(a, b)
        return _slowest(comm, time.perf_counter() - started)

    def add(a, b):
        acc[a:b].add_(other[a:b])

    def copy(a, b):
        acc[a:b].copy_(other[a:b])

    timed(add), timed(copy)  # warm: first touch of the pages
    add_s = _batches(repeats, lambda: timed(add))
    copy_s = _batches(repeats, lambda: timed(copy))
    return add_s / (numel * _FLOAT), copy_s / (numel * _FLOAT)


def cache_per_byte(comm: Communicator, nbytes: int, passes: int, repeats: int, workers: int = 2) -> tuple[float, float]:
    """(add, copy) seconds per output byte of float32 ``acc += other`` and ``dst.copy_(src)`` on
    ``nbytes`` buffers that stay in cache (``passes`` passes over the same buffers per batch, after a
    warm pass), on ranks 0 .. ``workers``-1 at once, the slower rank's median."""
    numel = max(nbytes // _FLOAT, 1)
    busy = comm.rank < workers
    acc, other = (torch.ones(numel), torch.ones(numel)) if busy else (None, None)

    def timed(work) -> float:
        line_up(comm)
        if busy:
            work()
        started = time.perf_counter()
        if busy:
            for _ in range(passes):
                work()
        return _slowest(comm, (time.perf_counter() - started) / passes)

    add_s = _batches(repeats, lambda: timed(lambda: acc.add_(other)))
    copy_s = _batches(repeats, lambda: timed(lambda: acc.copy_(other)))
    return add_s / (numel * _FLOAT), copy_s / (numel * _FLOAT)


def memory_bandwidth(comm: Communicator, nbytes: int, repeats: int, workers: int = 2) -> float:
    """Bytes per second the host's memory moves when ranks 0 .. ``workers``-1 each copy ``nbytes`` at
    once (3 bytes moved per byte copied: the read, the destination's read for ownership and its
    write-back, as :mod:`gradsync.collectives.cost.shm_formulas` counts them)."""
    numel = max(nbytes // _FLOAT, 1)
    busy = comm.rank < workers
    source, target = (torch.ones(numel), torch.zeros(numel)) if busy else (None, None)

    def timed() -> float:
        line_up(comm)
        started = time.perf_counter()
        if busy:
            target.copy_(source)
        return _slowest(comm, time.perf_counter() - started)

    timed()
    seconds = _batches(repeats, timed)
    return min(workers, comm.world_size) * COPY_MEMORY_BYTES * numel * _FLOAT / seconds


def shm_barrier(comm: Communicator, barriers: int, repeats: int, one_core: bool = False) -> float | None:
    """Seconds of one barrier of ranks 0 and 1 through their shared-memory segment (None: those two
    ranks share no memory). ``one_core``: both ranks pinned to one core for the measurement (their
    affinity is restored after), the barrier of ranks that outnumber the cores; on a segment of its
    own, whose first wait happens pinned, so that it waits as such a group's does (yielding at once,
    not spinning first: ``shm_segment``'s spin is decided at a segment's first wait)."""
    results = []
    for batch in range(repeats + 1):
        call = comm.new_call("calibrate shm barrier", "shm")
        line_up(comm)
        if comm.rank >= 2:
            continue
        sub = call.sub([0, 1], "shm", options=[_STATE.setdefault((id(comm), one_core), ShmState())])
        try:
            segment = group_segment(sub)
        except ValueError:
            return None
        cores = os.sched_getaffinity(0)
        if one_core:
            os.sched_setaffinity(0, {min(cores)})
        try:
            segment.barrier(sub.deadline)
            started = time.perf_counter()
            for _ in range(barriers):
                segment.barrier(sub.deadline)
            seconds = (time.perf_counter() - started) / barriers
        finally:
            if one_core:
                os.sched_setaffinity(0, cores)
        if batch:
            results.append(seconds)
    return statistics.median(results) if comm.rank == 0 and results else 0.0


def shm_cell(comm: Communicator, cells: int, repeats: int) -> float:
    """Seconds of one cell of the pipelined shm AllReduce (``shm_pipeline.all_reduce`` with cells of
    two floats, one per rank, ``cells`` of them per call) on ranks 0 and 1, its barriers included
    (0.0 on the other ranks). Call after :func:`shm_barrier` found shared memory (its segment)."""
    results = []
    for batch in range(repeats + 1):
        call = comm.new_call("calibrate shm cells", "shm")
        line_up(comm)
        if comm.rank >= 2:
            continue
        sub = call.sub([0, 1], "shm", options=[_STATE.setdefault((id(comm), False), ShmState())])
        segment = group_segment(sub)
        flat = torch.zeros(2 * cells)
        started = time.perf_counter()
        shm_pipeline.all_reduce(flat, sub, segment, 2 * _FLOAT)
        if batch:
            results.append((time.perf_counter() - started) / cells)
    return statistics.median(results) if comm.rank == 0 and results else 0.0


_STATE: dict[tuple[int, bool], ShmState] = {}  # the calibration's own segments per (communicator, one core)


def close_shm(comm: Communicator) -> None:
    for one_core in (False, True):
        state = _STATE.pop((id(comm), one_core), None)
        if state is not None:
            state.close()


def tiny_all_reduce(comm: Communicator, calls: int, repeats: int, algorithm: str = "ring", numel: int = 1) -> float:
    """Seconds of one ``all_reduce`` of ``numel`` float32 (``verify=False``), the slowest rank's median."""
    tensor = torch.zeros(numel)

    def timed() -> float:
        line_up(comm)
        started = time.perf_counter()
        for _ in range(calls):
            ops.all_reduce(tensor, comm, algorithm=algorithm, verify=False)
        return _slowest(comm, (time.perf_counter() - started) / calls)

    timed()
    return _batches(repeats, timed)
