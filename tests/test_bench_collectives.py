"""``gradsync bench allreduce --collective reduce_scatter|all_gather``: nccl-tests' sizes and busbw, the rows of
small real runs (MPI's calls among them), auto judged against the candidates that carry the collective, and a
refused algorithm in one line."""

from __future__ import annotations

import json

import pytest

from _cli import run_cli
from _early import early_job
from gradsync.bench.allreduce import collective_header, tables_text
from gradsync.bench.allreduce_rows import row_figures
from gradsync.bench.auto_rows import auto_candidates, auto_rows
from gradsync.bench.mpi_collectives import result_error
from gradsync.bench.mpi_libraries import MPICH, installed_libraries
from gradsync.bench.sweep_collectives import input_numel, message_numel, refusal

US = 1e-6


@pytest.mark.parametrize("collective, factor", [("all_reduce", 2 * 3 / 4), ("reduce_scatter", 3 / 4),
                                                ("all_gather", 3 / 4)])
def test_busbw_is_algbw_times_the_nccl_tests_factor(collective, factor):
    """4000 B in 10 us = 0.4 GB/s at world size 4: busbw x 2(p-1)/p for all_reduce, x (p-1)/p for the others."""
    figures = row_figures({"ring": [10 * US, 20 * US, 8 * US]}, nbytes=4000, world_size=4, collective=collective)
    ring = figures["ring"]
    assert ring["algbw_gbps"] == pytest.approx(0.4)
    assert (ring["busbw_gbps"], ring["busbw_gbps_min"], ring["busbw_gbps_max"]) == \
        pytest.approx((0.4 * factor, 0.2 * factor, 0.5 * factor))


def test_message_is_whole_input_for_reduce_scatter_and_whole_output_for_all_gather():
    """S in float32s, a multiple of p for the new collectives (at least one per rank); all_gather's ranks put
    in S/p each, reduce_scatter's all of S; all_reduce as before (bytes // 4, at least one)."""
    assert message_numel("all_reduce", 4098, 4) == 1024 and message_numel("all_reduce", 4, 4) == 1
    assert message_numel("reduce_scatter", 4096 + 12, 4) == 1024  # 1027 floats -> 1024, 256 each
    assert message_numel("reduce_scatter", 4, 4) == message_numel("all_gather", 12, 4) == 4  # one float each
    assert message_numel("all_gather", 64 * 2**20, 4) == 16 * 2**20
    assert input_numel("all_gather", 1024, 4) == 256 and input_numel("reduce_scatter", 1024, 4) == 1024
    assert input_numel("all_reduce", 1024, 4) == 1024


def test_mpi_result_check_catches_a_wrong_block_or_gather():
    """The closed forms of the check run under mpiexec, against two ranks simulated here: exact results give 0,
    a call that returns its own input instead gives the missing peer's share."""
    import torch

    def reduce_scatter_rank0(tensor):  # rank 0 of 2 gets the first half of its data plus rank 1's
        index = torch.arange(tensor.numel(), dtype=torch.float32)
        return (tensor + index * 2 + 1)[:tensor.numel() // 2].numpy()

    def all_gather_rank0(part):  # rank 0's part, then rank 1's (i * 2 + 1)
        index = torch.arange(part.numel(), dtype=torch.float32)
        return torch.cat([part, index * 2 + 1]).numpy()

    assert result_error(reduce_scatter_rank0, "reduce_scatter", rank=0, world_size=2, numel=100_000) == 0.0
    assert result_error(all_gather_rank0, "all_gather", rank=0, world_size=2, numel=100_000) == 0.0
    # rank 1's x_1 = 1*2 + 1 missing from the block's second sum
    assert result_error(lambda t: t[:2].numpy(), "reduce_scatter", rank=0, world_size=2, numel=4) == 3
    # rank 0's part [0, 1] where rank 1's [1, 3] belongs
    assert result_error(lambda t: torch.cat([t, t]).numpy(), "all_gather", rank=0, world_size=2, numel=4) == 2


def _row(algorithm, reps_us, collective):
    return {"algorithm": algorithm, "nbytes": 4096, "world_size": 4, "hosts": 1, "collective": collective,
            "time_us": sorted(reps_us)[len(reps_us) // 2], "time_us_reps": reps_us}


def test_auto_of_reduce_scatter_is_judged_without_tree():
    """tree refuses reduce_scatter and all_gather: it is no candidate (even when fastest), and its absence does
    not make the verdict incomplete; the all_reduce rows of the same size are not mixed in."""
    assert "tree" not in auto_candidates(1, "reduce_scatter") and "tree" in auto_candidates(1)
    assert auto_candidates(2, "all_gather") == ("ring", "halving_doubling", "hierarchical")
    rows = [_row("ring", [100.0, 100.0, 100.0], "reduce_scatter"), _row("shm", [200.0] * 3, "reduce_scatter"),
            _row("halving_doubling", [300.0] * 3, "reduce_scatter"), _row("tree", [1.0] * 3, "reduce_scatter"),
            _row("shm", [1.0] * 3, "all_reduce"), _row("auto", [105.0, 104.0, 120.0], "reduce_scatter")]
    (judged,) = auto_rows(rows)
    assert (judged["fastest"], judged["missing"], judged["verdict"]) == ("ring", [], "met, straddles")


def test_table_of_a_new_collective_says_what_size_and_busbw_mean():
    """reduce_scatter rows: a line on the size (input bytes) and busbw's factor, and one for the missing native
    row; all_reduce rows: no header, as before."""
    figures = row_figures({"ring": [10 * US, 12 * US]}, 4096, 2, "reduce_scatter")["ring"]
    rows = [{"algorithm": "ring", "world_size": 2, "nbytes": 4096, "bytes_sent_per_call": 2048.0, "repeat": 2,
             "iterations": 1, "hosts": 1, "collective": "reduce_scatter", **figures}]
    text = tables_text(rows)
    assert text.startswith("# reduce_scatter: size = the whole tensor each rank puts in (input bytes")
    assert "busbw = algbw x (p-1)/p" in text and "# no native row" in text
    assert collective_header([{**rows[0], "collective": "all_reduce"}]) == ""
    assert "output bytes" in collective_header([{**rows[0], "algorithm": "native", "collective": "all_gather"}])


@pytest.mark.parametrize("args, needle", [
    (["--collective", "reduce_scatter", "--algorithms", "ring,tree"], "--algorithms tree: this gradsync refuses"),
    (["--collective", "all_gather", "--algorithms", "shm_zero_copy"], "--algorithms shm_zero_copy"),
    (["--collective", "scatter"], "--collective"),
])
def test_a_refused_algorithm_or_collective_is_one_line(args, needle, capsys):
    """Exit 2 and one line naming the option, before any process starts."""
    result = run_cli(["bench", "allreduce", "--nproc", "2", "--sizes", "4K", *args], capsys)
    assert result.returncode == 2, result
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# Small real runs (ws 2, --repeat 2), started with the session (tests/_early.py). Each launch costs seconds, so
# one of them has the mpi row (MPI_Allgather, under MPICH where it is installed: its receive buffer is p times its
# input); MPI_Reduce_scatter_block shares its code but for the call, and its closed form is checked above.
_MPI = {"reduce_scatter": False, "all_gather": MPICH in installed_libraries()}
_RUNS = {collective: early_job(f"bench-{collective}", [
    "bench", "allreduce", "--nproc", "2", "--collective", collective, "--sizes", "12,4K",
    "--algorithms", "ring,shm" + (",mpi" if mpi else ""), *(["--mpi", MPICH] if mpi else []), "--repeat", "2",
    "--json", "{folder}/rows.json"]) for collective, mpi in _MPI.items()}


def _check_rows(rows: list[dict], collective: str, stdout: str) -> None:
    native, mpi = refusal(collective, "native") is None, _MPI[collective]  # native: does this gradsync run it
    names = ["ring", "shm"] + (["mpi"] if mpi else []) + (["native"] if native else [])
    # 12 bytes = 3 floats -> 2 (one per rank); 4K -> 1024 floats
    assert [(row["nbytes"], row["algorithm"]) for row in rows] == [(n, a) for n in (8, 4096) for a in names]
    for row in rows:
        assert row["collective"] == collective and row["world_size"] == 2 and len(row["time_us_reps"]) == 2
        assert row["algbw_gbps"] == pytest.approx(row["nbytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * (2 - 1) / 2)
        assert (row["ratio_to_native"] is None) == (not native)
        if row["algorithm"] == "ring":  # each rank sends (p-1)/p of the message once: half of it at p = 2
            assert row["bytes_sent_per_call"] == row["nbytes"] / 2
        if mpi and row["algorithm"] != "mpi":
            versus = next(r for r in rows if r["algorithm"] == "mpi" and r["nbytes"] == row["nbytes"])
            ratios = sorted(m / t for m, t in zip(versus["time_us_reps"], row["time_us_reps"]))
            assert [row["ratio_to_mpi_min"], row["ratio_to_mpi_max"]] == pytest.approx(ratios)
    if mpi:
        mpi_row = next(row for row in rows if row["algorithm"] == "mpi")
        assert mpi_row["mpi_sum_error"] == 0.0 and mpi_row["mpi_library"].startswith("MPICH")
    assert f"# {collective}: size = " in stdout and ("# no native row" in stdout) == (not native)


@pytest.mark.dist
@pytest.mark.early_job(_RUNS["reduce_scatter"])
@pytest.mark.timeout(180)
def test_reduce_scatter_sweep_rows(early):
    """Every (size, row) timed, the size the whole input (12 bytes: one float per rank); busbw = algbw (p-1)/p;
    ring sends half the input."""
    result = early.wait(170)
    assert result.returncode == 0, result.stderr[-3000:]
    _check_rows(json.loads((early.folder / "rows.json").read_text()), "reduce_scatter", result.stdout)


@pytest.mark.dist
@pytest.mark.early_job(_RUNS["all_gather"])
@pytest.mark.timeout(180)
def test_all_gather_sweep_rows(early):
    """As for reduce_scatter, with the gathered output as the size; MPI_Allgather's results exact, its ratios
    paired per repetition."""
    result = early.wait(170)
    assert result.returncode == 0, result.stderr[-3000:]
    _check_rows(json.loads((early.folder / "rows.json").read_text()), "all_gather", result.stdout)
