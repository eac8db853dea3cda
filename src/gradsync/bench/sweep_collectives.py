"""The collectives ``gradsync bench allreduce --collective`` times: message bytes, busbw factor, the call.

Sizes and bus bandwidths follow nccl-tests (doc/PERFORMANCE.md): for a
message of S bytes taking t seconds, algbw = S / t and busbw = algbw · f with

* ``all_reduce``: S = the tensor every rank reduces, f = 2(p−1)/p;
* ``reduce_scatter``: S = the whole tensor every rank puts in (its input
  bytes; each rank gets S/p back), f = (p−1)/p;
* ``all_gather``: S = the gathered output, p × each rank's part, f = (p−1)/p.

For the two new collectives S is rounded down to a multiple of p float32s
(at least one per rank): every rank's part is equal, as nccl-tests' count per
rank and ``MPI_Reduce_scatter_block`` / ``MPI_Allgather`` need. gradsync's
own calls are ``ops.reduce_scatter`` (this rank's chunk of the flattened
tensor) and ``ops.all_gather`` (every rank's tensor), with ``verify=False``
as in the AllReduce rows.

Which algorithms carry which collective is the installed gradsync's business:
:func:`refusals` asks it, on a one-rank group in the calling process, before
any worker starts, so that a refused name is one line, not a traceback.
"""

from __future__ import annotations

import torch

from gradsync.collectives import ops
from gradsync.collectives.communicator import Communicator

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = "all_reduce", "reduce_scatter", "all_gather"
COLLECTIVES = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER)
SIZE_MEANING = {
    ALL_REDUCE: "size = the tensor each rank reduces",
    REDUCE_SCATTER: "size = the whole tensor each rank puts in (input bytes; each rank gets size/p back)",
    ALL_GATHER: "size = the gathered output, p x each rank's part (output bytes)",
}


def check_collective(collective: str) -> str:
    """``collective`` if it is one of :data:`COLLECTIVES`. Raises ValueError naming ``--collective``."""
    if collective not in COLLECTIVES:
        raise ValueError(f"--collective: {collective!r} is not one of {', '.join(COLLECTIVES)}")
    return collective


def busbw_factor(collective: str, world_size: int) -> float:
    """busbw / algbw (nccl-tests): 2(p−1)/p for all_reduce, (p−1)/p for reduce_scatter and all_gather.

    >>> busbw_factor("all_reduce", 4), busbw_factor("reduce_scatter", 4), busbw_factor("all_gather", 2)
    (1.5, 0.75, 0.5)
    """
    share = (world_size - 1) / world_size
    return 2 * share if check_collective(collective) == ALL_REDUCE else share


def message_numel(collective: str, nbytes: int, world_size: int) -> int:
    """float32 elements of the message S for ``nbytes`` of ``--sizes`` (see the module docstring).

    >>> message_numel("all_reduce", 4098, 4), message_numel("reduce_scatter", 4098, 4), message_numel("all_gather", 4, 4)
    (1024, 1024, 4)
    """
    numel = max(nbytes // 4, 1)
    if check_collective(collective) == ALL_REDUCE:
        return numel
    return max(numel // world_size, 1) * world_size


def input_numel(collective: str, numel: int, world_size: int) -> int:
    """Elements each rank passes in for a message of ``numel``: its part for all_gather, all of it else."""
    return numel // world_size if collective == ALL_GATHER else numel


def run_call(collective: str, tensor: torch.Tensor, comm: Communicator, algorithm: str) -> None:
    """One gradsync call of ``collective`` on ``tensor`` (its result is dropped; all_reduce works in place)."""
    if collective == REDUCE_SCATTER:
        ops.reduce_scatter(tensor, comm, algorithm=algorithm, verify=False)
    elif collective == ALL_GATHER:
        ops.all_gather(tensor, comm, algorithm=algorithm, verify=False)
    else:
        ops.all_reduce(tensor, comm, algorithm=algorithm, verify=False)


def refusal(collective: str, algorithm: str) -> str | None:
    """Why the installed gradsync refuses ``collective`` with ``algorithm`` (its own one-line message), or None.

    Asked of a one-rank group in this process (a thread transport, nothing started): the algorithm
    names each collective accepts are checked before anything else, at every world size.
    """
    from gradsync.transport.thread import ThreadWorld

    comm = Communicator(ThreadWorld(1).transport(0), 10.0)
    try:
        run_call(collective, torch.zeros(1), comm, algorithm)
    except (ValueError, TypeError) as exc:
        return str(exc)
    finally:
        comm.close()
    return None


def refusals(collective: str, algorithms: list[str]) -> dict[str, str]:
    """``{name: the installed gradsync's reason}`` for each of ``algorithms`` it refuses for ``collective``
    (all_reduce: none asked, the names are checked against ``ops.ALGORITHMS`` already)."""
    if collective == ALL_REDUCE:
        return {}
    reasons = {name: refusal(collective, name) for name in algorithms}
    return {name: reason for name, reason in reasons.items() if reason is not None}
