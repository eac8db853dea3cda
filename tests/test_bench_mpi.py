"""The ``mpi`` column of ``gradsync bench allreduce``: transports parsed from each MPI's own output, settings
chosen by ranks against cores, and real runs under every installed MPI (MPICH from the mpi extra, Open MPI
under <venv>/openmpi)."""

from __future__ import annotations

import json

import pytest

from _early import early_job
from gradsync.bench.mpi import check_mpi_options, mpi_tables, placement_text, settings_text, sum_check_error
from gradsync.bench.mpi_libraries import (MPICH, MPICH_OVERSUBSCRIBED, OPENMPI, Launch, choose_settings,
                                          installed_libraries, parse_mpi_option)
from gradsync.bench.mpi_transport import (mpich_cvars, mpich_transport, openmpi_params, openmpi_transport,
                                          short_library)

# What MPICH 5.0.2 (the mpich wheel) prints with MPIR_CVAR_DEBUG_SUMMARY=2, two ranks' output interleaved.
MPICH_SUMMARY = """\
==== UCX netmod Capability ====
MPIDI_UCX_CONTEXT_ID_BITS: 16
tag_bits: 30
===============================
==== collective selection ====
MPID/shm: MPIDI_POSIX_coll_generic_json
====== POSIX Topo Dist ======
Rank: 0, Local_rank: 0 [ 0, 0 ]
=============================
threadcomm        : enabledRank: 1, Local_rank: 1 [ 0, 0 ]
"""
# The same with MPIR_CVAR_NOLOCAL=1 and the ofi netmod: no POSIX block, every message through libfabric.
MPICH_OFI_NOLOCAL = """\
==== Capability set configuration ====
libfabric provider: sockets - 192.0.2.0/24
==== collective selection ====
MPID/shm: MPIDI_POSIX_coll_generic_json
"""
# Open MPI 5.0.11 with OMPI_MCA_{pml,btl,smsc}_base_verbose=10 and mpi_show_mca_params=enviro (excerpt).
OPENMPI_VERBOSE = """\
[vm:17246] select: init returned failure for component ucx
[vm:17246] select: component ob1 selected
[vm:17246] mca: bml: Using self btl for send to [[38200,1],0] on node vm
[vm:17246] mca: bml: Using sm btl for send to [[38200,1],1] on node vm
[vm:17246] mca_smsc_base_select: selected shared-memory single-copy component: cma
[vm:14499] mpi_yield_when_idle=true (environment)
"""


def test_mpich_transport_names_the_netmod_and_the_ranks_its_posix_shm_serves():
    """UCX netmod plus both ranks listed by the POSIX module (one line run into another rank's output);
    no POSIX block: no shared memory; no summary at all: an error, not a guess."""
    assert mpich_transport(MPICH_SUMMARY, 2) == "ch4:ucx, posix shm (2 of 2 ranks)"
    assert mpich_transport(MPICH_SUMMARY, 4) == "ch4:ucx, posix shm (2 of 4 ranks)"
    assert mpich_transport(MPICH_OFI_NOLOCAL, 2) == "ch4:ofi (sockets), no posix shm"
    with pytest.raises(ValueError, match="DEBUG_SUMMARY"):
        mpich_transport("16MiB ms 10.2\n", 2)


def test_openmpi_transport_names_pml_the_btls_towards_peers_and_single_copy():
    """ob1 over sm (self is a rank's own loopback, not a transport to a peer) with CMA; tcp when so reported."""
    assert openmpi_transport(OPENMPI_VERBOSE) == "pml ob1, btl sm, smsc cma"
    tcp = "select: component ob1 selected\nmca: bml: Using tcp btl for send to [[1,1],1] on node b\n"
    assert openmpi_transport(tcp) == "pml ob1, btl tcp"
    with pytest.raises(ValueError, match="PML"):
        openmpi_transport("mca: bml: Using sm btl for send to [[1,1],1]")


def test_library_versions_and_read_back_settings_are_parsed():
    """Version texts of both MPIs shortened; mpivars' listed values and Open MPI's echoed parameters read."""
    assert short_library("MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25") == "MPICH 5.0.2"
    assert short_library("Open MPI v5.0.11, package: Open MPI user@localhost Distribution") == "Open MPI 5.0.11"
    assert short_library("Some MPI 1.0\nmore") == "Some MPI 1.0"
    listed = "\tMPIR_CVAR_POLLS_BEFORE_YIELD    =1\tSCOPE_ALL_EQ\n\tMPIR_CVAR_CH4_NETMOD            =\tSCOPE_ALL_EQ\n"
    assert mpich_cvars(listed) == {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_CH4_NETMOD": ""}
    assert openmpi_params(OPENMPI_VERBOSE) == {"mpi_yield_when_idle": "true"}


def test_settings_yield_only_when_ranks_outnumber_cores():
    """MPICH: its CI's yield/throttle CVARs at 4 ranks on 2 cores, nothing at 2 on 2 or with "defaults";
    Open MPI: run-as-root always as root, oversubscription + yield_when_idle at 4 on 2."""
    assert choose_settings(MPICH, 4, 2) == (MPICH_OVERSUBSCRIBED, "4 ranks on 2 cores")
    assert choose_settings(MPICH, 2, 2) == ({}, "2 ranks on 2 cores")
    assert choose_settings(MPICH, 4, 2, mode="defaults")[0] == {}
    over, _ = choose_settings(OPENMPI, 4, 2, as_root=True)
    assert over == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMPI_MCA_mpi_yield_when_idle": "1"}
    assert choose_settings(OPENMPI, 2, 4) == ({}, "2 ranks on 4 cores")
    assert "OMPI_MCA_mpi_yield_when_idle" not in choose_settings(OPENMPI, 4, 2, mode="defaults")[0]
    with pytest.raises(ValueError, match="--mpi-settings"):
        choose_settings(MPICH, 4, 2, mode="fast")


def test_settings_text_says_whether_the_library_read_each_setting():
    """A value mpivars lists back is "read"; one it lists differently is named; Open MPI's echo counts too."""
    start = Launch(MPICH, ["mpiexec"], {}, {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
                                           "MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}, "4 ranks on 2 cores")
    both = "\tMPIR_CVAR_CH4_PROGRESS_THROTTLE =1\tX\n\tMPIR_CVAR_POLLS_BEFORE_YIELD    =1\tX\n"
    assert settings_text(start, "", mpivars=lambda env: both) == (
        "mpiexec, MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 MPIR_CVAR_POLLS_BEFORE_YIELD=1 (4 ranks on 2 cores; read)")
    one = "\tMPIR_CVAR_CH4_PROGRESS_THROTTLE =0\tX\n\tMPIR_CVAR_POLLS_BEFORE_YIELD    =1\tX\n"
    assert settings_text(start, "", mpivars=lambda env: one).endswith("NOT read: MPIR_CVAR_CH4_PROGRESS_THROTTLE)")
    ompi = Launch(OPENMPI, ["mpiexec"], {}, {"OMPI_MCA_mpi_yield_when_idle": "1"}, "4 ranks on 2 cores")
    assert settings_text(ompi, OPENMPI_VERBOSE).endswith("; read)")
    assert "NOT read" in settings_text(ompi, "")
    gforker = Launch(MPICH, ["/venv/bin/mpiexec.gforker"], {}, {}, "2 ranks on 2 cores")
    assert settings_text(gforker, "") == "mpiexec.gforker, library defaults (2 ranks on 2 cores)"
    bound = [{"cores": 1, "session": 40}, {"cores": 1, "session": 40}]
    assert placement_text(bound, cores=2) == "ranks bound to 1 core each, in one session"
    hydra = [{"cores": 2, "session": 50 + rank} for rank in range(4)]  # hydra: setsid() for every rank
    assert placement_text(hydra, cores=2) == "ranks not bound (2 cores each), in 4 sessions"


def test_mpi_options_are_checked_by_name():
    """--mpi: an unknown name, a repeated one, or --mpi without the mpi column; --mpi-settings: a bad mode.
    Each a ValueError naming the option."""
    with pytest.raises(ValueError, match="--mpi: unknown MPI library 'lam'"):
        parse_mpi_option("mpich,lam")
    with pytest.raises(ValueError, match="add mpi to --algorithms"):
        check_mpi_options("mpich", "auto", measured=False)
    with pytest.raises(ValueError, match="--mpi-settings"):
        check_mpi_options(None, "busy", measured=True)
    assert check_mpi_options(None, "auto", measured=False) == []
    with pytest.raises(ValueError, match="twice"):
        parse_mpi_option("mpich,mpich")


def test_bench_command_rejects_a_bad_mpi_option_in_one_line(capsys):
    """`gradsync bench allreduce --mpi lam`: exit 2 and one line naming --mpi, before any process starts."""
    from gradsync.cli import main

    try:
        code = main(["bench", "allreduce", "--nproc", "2", "--sizes", "4K", "--mpi", "lam"])
    except SystemExit as exc:
        code = exc.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "--mpi" in lines[0], lines


def test_mpi_tables_put_each_run_under_its_own_line():
    """Rows of two MPI runs: two tables, each headed by its MPI, transport and settings; old rows: one table."""
    def rows(run, library):
        return [{"algorithm": "shm", "mpi_run": run, "nbytes": 4},
                {"algorithm": "mpi", "mpi_run": run, "nbytes": 4, "mpi_library": library,
                 "mpi_transport": f"{run} shm", "mpi_settings": "library defaults"}]
    tables = mpi_tables(rows("mpich", "MPICH 5.0.2") + rows("openmpi", "Open MPI 5.0.11"),
                        lambda group: ",".join(row["algorithm"] for row in group))
    assert tables == ["# mpi = MPICH 5.0.2 over mpich shm; settings: library defaults\nshm,mpi",
                      "# mpi = Open MPI 5.0.11 over openmpi shm; settings: library defaults\nshm,mpi"]
    assert mpi_tables([{"algorithm": "mpi", "nbytes": 4}], lambda group: "table") == ["table"]


def test_sum_check_catches_a_reduction_that_is_not_the_sum():
    """The check the bench runs under mpiexec before timing: zero for the true sum over two ranks (simulated
    here from each rank's closed-form data), the missing peer's share for a call that reduces nothing."""
    import torch

    def true_sum(tensor):  # what MPI_Allreduce must leave on rank 0 of 2: its data plus rank 1's
        index = torch.arange(tensor.numel(), dtype=torch.float32)
        tensor.add_(index * 2 + 1)

    assert sum_check_error(true_sum, rank=0, world_size=2, numel=100_000) == 0.0
    assert sum_check_error(lambda tensor: None, rank=0, world_size=2, numel=5) == 2 * 4 + 1  # rank 1's x_4
    assert sum_check_error(lambda tensor: None, rank=0, world_size=1, numel=5) == 0.0


# A tiny sweep (ws 2, 4 KiB, one repetition) under every installed MPI, started with the session (tests/_early.py).
MPI_SWEEP = early_job("bench-mpi-sweep", ["bench", "allreduce", "--nproc", "2", "--sizes", "4K", "--algorithms",
                                          "shm,mpi", "--repeat", "1", "--json", "{folder}/rows.json"])


@pytest.mark.dist
@pytest.mark.early_job(MPI_SWEEP)
@pytest.mark.timeout(180)
def test_sweep_runs_under_every_installed_mpi(early):
    """One run and table per installed MPI, every row timed, each MPI row naming its library and the
    shared-memory transport that library reported, and MPI's sums of rank-dependent data (3 and 100000
    floats) equal to the closed form in the real processes."""
    libraries = installed_libraries()
    result = early.wait(170)
    if not libraries:
        pytest.skip("no MPI installed (pip install -e '.[mpi]')")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((early.folder / "rows.json").read_text())
    assert [row["mpi_run"] for row in rows] == [library for library in libraries for _ in range(3)]
    for library in libraries:
        run = [row for row in rows if row["mpi_run"] == library]
        assert [row["algorithm"] for row in run] == ["shm", "mpi", "native"]
        assert all(row["time_us"] > 0 and row["algbw_gbps"] > 0 and row["world_size"] == 2 for row in run)
        mpi_row = run[1]
        expected = {MPICH: ("MPICH ", "posix shm (2 of 2 ranks)"), OPENMPI: ("Open MPI ", "btl sm")}[library]
        assert mpi_row["mpi_library"].startswith(expected[0]) and expected[1] in mpi_row["mpi_transport"], mpi_row
        assert "(2 ranks on" in mpi_row["mpi_settings"] and "in one session" in mpi_row["mpi_settings"], mpi_row
        assert mpi_row["mpi_sum_error"] == 0.0, mpi_row
        assert f"# mpi = {mpi_row['mpi_library']} over {mpi_row['mpi_transport']}" in result.stdout
