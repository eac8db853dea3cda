"""The options of ``gradsync bench allreduce``, checked before any process starts: sizes, row names, pretend nodes.

Every bad option is one ``ValueError`` naming it. With ``--collective
reduce_scatter|all_gather`` the installed gradsync is asked which algorithms
carry the collective (:func:`gradsync.bench.sweep_collectives.refusals`): a
name given in ``--algorithms`` that it refuses is an error; of the default
list and the always-added ``native`` row, refused ones are left out and named
in a note printed above the table (native's in the table's own header).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from gradsync.bench.mpi import MPI_COLUMN
from gradsync.bench.spread import check_repeat
from gradsync.bench.sweep_collectives import ALL_REDUCE, check_collective, refusals
from gradsync.collectives import ops

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30}
MIN_NBYTES, MAX_NBYTES = 4, 2**30
DEFAULT_ALGORITHMS = "ring,tree,double_binary_tree,halving_doubling,hierarchical,shm,shm_zero_copy,native"
HOSTS_ALGORITHMS = "ring,tree,double_binary_tree,halving_doubling,hierarchical,native,auto"  # shm cannot cross hosts
ZERO_COPY = "shm_zero_copy"  # shm on a buffer that already lies in shared memory (ops.shared_buffer)
ONE_HOST_ONLY = ("shm", ZERO_COPY)
ALL_REDUCE_ONLY = ("tree", "double_binary_tree", ZERO_COPY)  # left out of the default list of the other collectives (issue 38)


@dataclass
class SweepOptions:
    """Checked options: ``sizes`` (bytes), ``names`` (rows, native last unless given or refused),
    ``ranks_per_node`` (None across hosts), ``notes`` (lines printed above the table: rows left out, why)."""

    sizes: list[int]
    names: list[str]
    ranks_per_node: int | None
    notes: list[str] = field(default_factory=list)


def parse_nbytes(text: str) -> int:
    """Parse "4K", "64KiB", "1M", "123" into bytes (powers of 1024).

    >>> parse_nbytes("4K"), parse_nbytes("1M"), parse_nbytes("100")
    (4096, 1048576, 100)
    """
    stripped = text.strip().upper()
    digits = stripped.rstrip("KMGIB")
    unit = stripped[len(digits):]
    if not digits.isdigit() or unit not in _UNITS:
        raise ValueError(f"bad size {text!r} in --sizes: use a number of bytes with an optional K, M or G "
                         f"suffix, separated by commas")
    return int(digits) * _UNITS[unit]


def cell_bytes(text: str, hosts: int | None) -> int:
    """One size of ``--shm-cells`` in bytes (>= 64). Raises ValueError naming the option."""
    if hosts and hosts > 1:
        raise ValueError(f"--shm-cells: shm runs on one host only, not across --hosts {hosts}")
    try:
        nbytes = parse_nbytes(text)
    except ValueError:
        nbytes = -1
    if nbytes < 64:
        raise ValueError(f"--shm-cells: {text.strip()!r} is not a cell size of at least 64 bytes "
                         f"(a number with an optional K or M suffix)")
    return nbytes


def cell_name(nbytes: int) -> str:
    """The row name of ``shm`` with cells of ``nbytes`` (``--shm-cells``): "shm@1M"."""
    for unit, suffix in ((2**20, "M"), (2**10, "K")):
        if nbytes % unit == 0:
            return f"shm@{nbytes // unit}{suffix}"
    return f"shm@{nbytes}"


def _sizes(text: str) -> list[int]:
    size_list = [parse_nbytes(part) for part in text.split(",")]
    for nbytes in size_list:
        if not MIN_NBYTES <= nbytes <= MAX_NBYTES:
            raise ValueError(f"--sizes: {nbytes} bytes is outside [{MIN_NBYTES}, {MAX_NBYTES}] "
                             f"(one float32 to 1 GiB per message)")
    _refuse_repeats("--sizes", size_list)
    return size_list


def _default_names(collective: str, hosts: int | None, mpi_available: Callable[[], bool]) -> list[str]:
    text = HOSTS_ALGORITHMS if hosts else DEFAULT_ALGORITHMS + (f",{MPI_COLUMN}" if mpi_available() else "")
    names = text.split(",")
    return names if collective == ALL_REDUCE else [name for name in names if name not in ALL_REDUCE_ONLY]


def _check_name(name: str, hosts: int | None, mpi_available: Callable[[], bool]) -> None:
    """Raises ValueError naming ``--algorithms`` when ``name`` cannot be a row of this sweep."""
    if name == MPI_COLUMN and hosts:
        raise ValueError("--algorithms mpi does not run across --hosts (mpiexec starts the processes)")
    if name == MPI_COLUMN and not mpi_available():
        raise ValueError("--algorithms mpi needs mpi4py and mpiexec: pip install -e '.[mpi]' in the "
                         "clone, or 'gradsync[mpi]'")
    if name.startswith("shm@"):
        cell_bytes(name[4:], hosts)
        return
    if name not in ops.ALGORITHMS + (MPI_COLUMN, ZERO_COPY):
        raise ValueError(f"unknown algorithm {name!r} in --algorithms; choose from "
                         f"{', '.join(ops.ALGORITHMS + (ZERO_COPY, MPI_COLUMN))}")
    if name in ONE_HOST_ONLY and hosts and hosts > 1:
        raise ValueError(f"--algorithms {name}: shared memory cannot cross hosts (--hosts {hosts}); "
                         f"use hierarchical (shm inside each host)")


def _drop_refused(collective: str, names: list[str], given: set[str]) -> tuple[list[str], list[str]]:
    """``names`` less those the installed gradsync refuses for ``collective``, and the notes saying so.

    Raises:
        ValueError: a name the user gave (in ``given``: ``--algorithms``, ``--shm-cells``) is refused.
    """
    if collective == ALL_REDUCE:
        return names, []
    if ZERO_COPY in given:
        raise ValueError(f"--algorithms {ZERO_COPY}: an AllReduce on the shared arena, not a {collective} "
                         f"(--collective {collective}); use shm")
    asked = {name: "shm" if name.startswith("shm@") else name for name in names if name != MPI_COLUMN}
    refused = refusals(collective, sorted(set(asked.values())))
    dropped = [name for name in names if asked.get(name) in refused]
    for name in dropped:
        if name in given:
            raise ValueError(f"--algorithms {name}: this gradsync refuses --collective {collective} with it "
                             f"({refused[asked[name]]})")
    notes = [f"# not measured: {name}, which this gradsync refuses for {collective}" for name in dropped
             if name != "native"]  # a missing native row is said above the table (allreduce.collective_header)
    return [name for name in names if name not in dropped], notes


def parse_options(nproc: int, sizes: str, algorithms: str | None, repeat: int, ranks_per_node: int | None,
                  segment_bytes: int | None, hosts: int | None = None, shm_cells: str | None = None,
                  collective: str = ALL_REDUCE, mpi_available: Callable[[], bool] = lambda: False) -> SweepOptions:
    """Checked sizes, row names (native added), ranks per pretend node (None across hosts) and notes.

    ``mpi_available``: whether the ``mpi`` row can run here (asked only when it matters).

    Raises:
        ValueError: a bad option, named; with ``hosts`` > 1, shm/shm_zero_copy (cannot cross hosts);
        with ``hosts``, mpi or --ranks-per-node (hierarchical groups by real host); with ``collective``
        other than all_reduce, a given algorithm the installed gradsync refuses for it.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    check_repeat(repeat)
    check_collective(collective)
    size_list = _sizes(sizes)
    names = ([name.strip() for name in algorithms.split(",")] if algorithms is not None
             else _default_names(collective, hosts, mpi_available))
    names += [cell_name(cell_bytes(text, hosts)) for text in shm_cells.split(",")] if shm_cells else []
    given = set(names) if algorithms is not None else {name for name in names if name.startswith("shm@")}
    _refuse_repeats("--algorithms/--shm-cells", names)
    for name in names:
        _check_name(name, hosts, mpi_available)
    if "native" not in names:
        names.append("native")
    names, notes = _drop_refused(collective, names, given)
    if segment_bytes is not None and segment_bytes < 1:
        raise ValueError(f"--segment-bytes must be >= 1, got {segment_bytes}")
    if hosts:
        if ranks_per_node is not None:
            raise ValueError("--ranks-per-node pretends nodes on one machine; with --hosts, hierarchical "
                             "groups the ranks by their real host")
        return SweepOptions(size_list, names, None, notes)
    if ranks_per_node is None:
        ranks_per_node = 2 if nproc >= 4 and nproc % 2 == 0 else nproc
    if ranks_per_node < 1 or nproc % ranks_per_node:
        raise ValueError(f"--ranks-per-node {ranks_per_node} must be >= 1 and divide --nproc {nproc}")
    return SweepOptions(size_list, names, ranks_per_node, notes)


def _refuse_repeats(option: str, values: list) -> None:
    """Raises ValueError naming ``option`` when a value appears twice (a row would be measured twice)."""
    twice = sorted({str(value) for value in values if values.count(value) > 1})
    if twice:
        raise ValueError(f"{option}: {', '.join(twice)} given more than once")
