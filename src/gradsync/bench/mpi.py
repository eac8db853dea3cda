"""The ``mpi`` column of ``gradsync bench allreduce``: MPI_Allreduce measured in the same processes.

When ``mpi4py`` is importable and an ``mpiexec`` is found (the optional extra
``pip install gradsync[mpi]`` brings both: mpi4py and MPICH), the sweep is
launched by ``mpiexec`` instead of torch's elastic agent. Every process then
joins MPI_COMM_WORLD *and* a gradsync group over Gloo (rank and world size
from MPI, the rendezvous port chosen by rank 0 and broadcast over MPI), so
MPI_Allreduce(MPI_IN_PLACE, SUM) on the tensor's memory is timed interleaved
with every gradsync algorithm, on the same buffers and in the same processes.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

MPI_COLUMN = "mpi"


def mpiexec_path() -> str | None:
    """``mpiexec`` next to this interpreter (a venv with the extra), else on PATH, else None."""
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def mpi_available() -> bool:
    """Whether the ``mpi`` column can be measured: mpi4py importable and an mpiexec found."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return mpiexec_path() is not None


class MpiAllReduce:
    """Times ``MPI_Allreduce(MPI_IN_PLACE, tensor, MPI_SUM)`` on a float32 CPU tensor's memory."""

    def __init__(self):
        from mpi4py import MPI
        self._mpi = MPI
        self._comm = MPI.COMM_WORLD

    def __call__(self, tensor) -> None:
        self._comm.Allreduce(self._mpi.IN_PLACE, tensor.numpy(), op=self._mpi.SUM)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_with_mpiexec(nproc: int, options: dict, timeout_s: float = 3600) -> list[dict]:
    """Run the sweep in ``nproc`` processes started by mpiexec; return rank 0's rows.

    Raises:
        RuntimeError: the processes failed (their output is included).
    """
    with tempfile.TemporaryDirectory(prefix="gradsync-mpi-") as folder:
        options_path, rows_path = Path(folder) / "options.json", Path(folder) / "rows.json"
        options_path.write_text(json.dumps(options))
        command = [mpiexec_path(), "-n", str(nproc), sys.executable, "-m", "gradsync.bench.allreduce",
                   str(options_path), str(rows_path)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0 or not rows_path.exists():
            raise RuntimeError(f"mpiexec -n {nproc} failed (exit {result.returncode}):\n"
                               f"{result.stdout[-2000:]}{result.stderr[-4000:]}")
        return json.loads(rows_path.read_text())
