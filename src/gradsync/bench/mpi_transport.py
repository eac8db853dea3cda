"""What an MPI library says it runs on: its version, transport and read settings, parsed from its own output.

The ``mpi`` column of ``gradsync bench allreduce`` names the transport each
MPI used, as the library itself reports it during the very run that is timed:

* MPICH (ch4 device): ``MPIR_CVAR_DEBUG_SUMMARY=2`` makes every rank print, at
  ``MPI_Init``, the netmod in use (``==== UCX netmod Capability ====``, or
  ``libfabric provider: <name>`` for ofi) and, when its POSIX shared-memory
  module serves the ranks of this node, a ``POSIX Topo Dist`` block with one
  ``Rank: r, Local_rank: l`` line per local rank. ``mpivars`` (shipped with
  MPICH) lists the control variables with the values MPICH read from the
  environment.
* Open MPI: ``OMPI_MCA_{pml,btl,smsc}_base_verbose=10`` print the selected PML
  (``select: component ob1 selected``), the BTL used towards each peer
  (``mca: bml: Using sm btl for send to [[job,1],r]``) and the single-copy
  mechanism (``selected shared-memory single-copy component: cma``);
  ``OMPI_MCA_mpi_show_mca_params=enviro`` echoes the parameters read from the
  environment.
"""

from __future__ import annotations

import re


def short_library(version: str) -> str:
    """``MPI_Get_library_version()``'s text as "MPICH 5.0.2" / "Open MPI 5.0.11" (else its first line).

    >>> short_library("MPICH Version:      5.0.2\\nMPICH Release date: ...")
    'MPICH 5.0.2'
    >>> short_library("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11")
    'Open MPI 5.0.11'
    """
    mpich = re.search(r"MPICH Version:\s*(\S+)", version)
    if mpich:
        return f"MPICH {mpich.group(1)}"
    openmpi = re.search(r"Open MPI v(\S+?),", version)
    if openmpi:
        return f"Open MPI {openmpi.group(1)}"
    lines = version.strip().splitlines()
    return lines[0].strip() if lines else "unknown MPI"


def mpich_transport(output: str, world_size: int) -> str:
    """MPICH's transport from its ``MPIR_CVAR_DEBUG_SUMMARY=2`` output: "ch4:ucx, posix shm (2 of 2 ranks)".

    The netmod is the one whose capability block was printed; the shm part
    counts the distinct ranks listed in the ``POSIX Topo Dist`` block ("no posix
    shm" when absent: every message then goes through the netmod).

    Raises:
        ValueError: the output has no summary (MPIR_CVAR_DEBUG_SUMMARY was not read).
    """
    if "==== UCX netmod Capability ====" in output:
        netmod = "ch4:ucx"
    elif (provider := re.search(r"libfabric provider:\s*(\S+)", output)) is not None:
        netmod = f"ch4:ofi ({provider.group(1)})"
    elif "collective selection" in output:
        netmod = "ch4"
    else:
        raise ValueError("no MPICH debug summary in the output of the run (MPIR_CVAR_DEBUG_SUMMARY=2 not read?)")
    if "POSIX Topo Dist" not in output:
        return f"{netmod}, no posix shm"
    local = {int(rank) for rank in re.findall(r"Rank: (\d+), Local_rank: \d+", output)}
    return f"{netmod}, posix shm ({len(local)} of {world_size} ranks)"


def openmpi_transport(output: str) -> str:
    """Open MPI's transport from its verbose output: "pml ob1, btl sm, smsc cma".

    The BTLs are those used towards other ranks (``self`` is a rank's own loopback).

    Raises:
        ValueError: no PML selection in the output (the verbose parameters were not read).
    """
    pml = re.search(r"select: component (\w+) selected", output)
    if pml is None:
        raise ValueError("no PML selection in the output of the run (OMPI_MCA_pml_base_verbose not read?)")
    btls = sorted(set(re.findall(r"Using (\w+) btl for send to", output)) - {"self"})
    smsc = re.search(r"selected shared-memory single-copy component: (\w+)", output)
    parts = [f"pml {pml.group(1)}"]
    if btls:
        parts.append("btl " + "+".join(btls))
    if smsc:
        parts.append(f"smsc {smsc.group(1)}")
    return ", ".join(parts)


def mpich_cvars(mpivars_output: str) -> dict[str, str]:
    """The control variables ``mpivars`` lists, with the value MPICH read: {"MPIR_CVAR_X": "1", ...}.

    >>> mpich_cvars("\\tMPIR_CVAR_CH4_PROGRESS_THROTTLE =1\\tSCOPE_LOCAL\\tNo-object\\tMPI_INT")
    {'MPIR_CVAR_CH4_PROGRESS_THROTTLE': '1'}
    """
    return {name: value for name, value in
            re.findall(r"^\s*(MPIR_CVAR_\w+)\s*=([^\t\n]*)", mpivars_output, re.MULTILINE)}


def openmpi_params(output: str) -> dict[str, str]:
    """The MCA parameters Open MPI says it read from the environment (``mpi_show_mca_params=enviro``).

    >>> openmpi_params("[vm:14499] mpi_yield_when_idle=true (environment)")
    {'mpi_yield_when_idle': 'true'}
    """
    return dict(re.findall(r"\] (\w+)=(\S*) \(environment\)", output))
