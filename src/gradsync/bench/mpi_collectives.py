"""The ``mpi`` row of ``gradsync bench allreduce --collective reduce_scatter|all_gather``, and its check.

``MPI_Reduce_scatter_block(send, recv, recvcount, MPI_FLOAT, MPI_SUM)``: every
rank puts in the whole float32 tensor and gets its block of the sum (equal
blocks, hence the sweep's sizes in multiples of p floats);
``MPI_Allgather(send, recv)``: every rank puts in its part and gets all of
them, rank by rank. Both through mpi4py's buffer interface on the tensors'
memory, into receive buffers allocated once per size (the timing sees the
call, not an allocation). Before timing, the run checks MPI's results on
rank-dependent data against their closed form, as the AllReduce run checks
its sums (:func:`gradsync.bench.mpi.check_mpi_sums`).
"""

from __future__ import annotations

from typing import Callable

from gradsync.bench.mpi import SUM_CHECK_SIZES, MpiAllReduce, check_mpi_sums
from gradsync.bench.sweep_collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, check_collective


class MpiCollective:
    """``MPI_Reduce_scatter_block`` (``collective`` "reduce_scatter") or ``MPI_Allgather`` ("all_gather") on a
    contiguous float32 CPU tensor; a call returns the receive buffer (numpy, float32): this rank's block of the
    sum, or every rank's part in rank order."""

    def __init__(self, collective: str):
        from mpi4py import MPI

        if check_collective(collective) == ALL_REDUCE:
            raise ValueError("MpiCollective times reduce_scatter and all_gather; MpiAllReduce times all_reduce")
        self._mpi, self._comm, self._collective = MPI, MPI.COMM_WORLD, collective
        self._received = {}  # input numel -> its receive buffer

    def _receive_buffer(self, numel: int):
        import numpy

        buffer = self._received.get(numel)
        if buffer is None:
            world_size = self._comm.Get_size()
            count = numel // world_size if self._collective == REDUCE_SCATTER else numel * world_size
            buffer = self._received[numel] = numpy.empty(count, dtype=numpy.float32)
        return buffer

    def __call__(self, tensor):
        send, received = tensor.numpy(), self._receive_buffer(tensor.numel())
        if self._collective == REDUCE_SCATTER:
            self._comm.Reduce_scatter_block(send, received, op=self._mpi.SUM)
        else:
            self._comm.Allgather(send, received)
        return received


def mpi_call(collective: str) -> Callable:
    """The MPI call of the ``mpi`` row for ``collective`` (MPI_Allreduce in place for all_reduce)."""
    return MpiAllReduce() if check_collective(collective) == ALL_REDUCE else MpiCollective(collective)


def result_error(call: Callable, collective: str, rank: int, world_size: int, numel: int) -> float:
    """The largest deviation of ``call``'s result from the closed form, for a message of ``numel`` floats
    (a multiple of ``world_size``). Collective: every rank calls it.

    Rank r holds x_i = i·(r+1) + r: for reduce_scatter the whole message, whose sum over p ranks is
    i·p(p+1)/2 + p(p−1)/2 (rank r gets indices [r·k, (r+1)·k), k = numel/p); for all_gather its part of k
    elements, gathered so that rank q's part sits at [q·k, (q+1)·k). Exact in float32 below 2**24.
    """
    import torch

    part = numel // world_size
    if collective == ALL_GATHER:
        received = torch.from_numpy(call(torch.arange(part, dtype=torch.float32) * (rank + 1) + rank))
        index = torch.arange(part, dtype=torch.float32).repeat(world_size)
        owner = torch.arange(world_size, dtype=torch.float32).repeat_interleave(part)
        expected = index * (owner + 1) + owner
    else:
        received = torch.from_numpy(call(torch.arange(numel, dtype=torch.float32) * (rank + 1) + rank))
        index = torch.arange(rank * part, (rank + 1) * part, dtype=torch.float32)
        expected = index * (world_size * (world_size + 1) // 2) + world_size * (world_size - 1) // 2
    return float((received - expected).abs().max())


def check_mpi_results(collective: str) -> float:
    """Under mpiexec, before timing: MPI's ``collective`` on :data:`~gradsync.bench.mpi.SUM_CHECK_SIZES` floats
    (rounded up to a multiple of the world size) against the closed form; returns the largest deviation, the
    same on every rank (0.0: exact).

    Raises:
        RuntimeError: on every rank, when MPI's results are not exact.
    """
    if check_collective(collective) == ALL_REDUCE:
        return check_mpi_sums()
    from mpi4py import MPI

    comm, call = MPI.COMM_WORLD, MpiCollective(collective)
    world_size = comm.Get_size()
    error = max(result_error(call, collective, comm.Get_rank(), world_size, -(-numel // world_size) * world_size)
                for numel in SUM_CHECK_SIZES)
    error = comm.allreduce(error, op=MPI.MAX)
    if error != 0.0:
        raise RuntimeError(f"MPI's {collective} differs from the closed form by up to {error}: the mpi column "
                           f"would time a wrong result")
    return error
