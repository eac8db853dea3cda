"""``gradsync bench allreduce`` and ``bench train``: bad options fail fast; small runs write consistent rows."""

from __future__ import annotations

import json

import pytest

from _cli import run_cli
from _early import early_job
from gradsync.bench import train as train_bench
from gradsync.bench.allreduce import format_table, parse_nbytes
from gradsync.bench.memory_bound import bound_fraction, bytes_per_payload_byte


def _main(argv, capsys):
    return run_cli(argv, capsys)


@pytest.mark.parametrize("args, needle", [
    (["--nproc", "0"], "--nproc"),
    (["--sizes", ""], "--sizes"),
    (["--sizes", "4K,,8K"], "--sizes"),
    (["--sizes", "4X"], "4X"),
    (["--sizes", "0"], "0 bytes"),
    (["--sizes", "2G"], "outside"),
    (["--algorithms", "ring,,tree"], "''"),
    (["--algorithms", "bogus"], "bogus"),
    (["--ranks-per-node", "0"], "--ranks-per-node 0"),
    (["--ranks-per-node", "3"], "--ranks-per-node 3"),
    (["--segment-bytes", "0"], "--segment-bytes"),
    (["--repeat", "0"], "--repeat must be an integer >= 1"),
    (["--repeat", "-2"], "--repeat must be an integer >= 1"),
    (["--repeat", "two"], "--repeat"),
    (["--repeat", "1.5"], "--repeat"),
    (["--repetitions", "3"], "--repetitions"),  # the option --repeat replaced
    (["--shm-cells", "0"], "--shm-cells: '0'"),
    (["--shm-cells", "1Q"], "--shm-cells: '1Q'"),
    (["--shm-cells", "-5"], "--shm-cells: '-5'"),
])
def test_bench_rejects_bad_options_with_one_line(args, needle, capsys):
    """Each bad option: exit 2 and one error line naming it, before any process starts."""
    result = _main(["bench", "allreduce", *args], capsys)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_bench_parse_nbytes_uses_powers_of_1024():
    """4K is 4096 bytes, 1M is 2**20, plain numbers are bytes."""
    assert [parse_nbytes(text) for text in ("4K", "64KiB", "1M", "2G", "100")] == [4096, 65536, 2**20, 2**31, 100]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_bench_mpi_column_without_mpi4py_names_the_extra(capsys, monkeypatch):
    from gradsync.bench import allreduce
    monkeypatch.setattr(allreduce, "mpi_available", lambda: False)
    result = _main(["bench", "allreduce", "--algorithms", "ring,mpi"], capsys)
    assert result.returncode == 2 and "gradsync[mpi]" in result.stderr, result.stderr


# Runs of the benches: early jobs (``_early.py``), started with the session and waited for by their tests.
SHM_ROWS = early_job("bench-shm-rows", ["bench", "allreduce", "--nproc", "2", "--sizes", "4K,256K", "--algorithms",
                                        "shm,shm_zero_copy", "--shm-cells", "64K", "--repeat", "1",
                                        "--json", "{folder}/rows.json"])
SMALL_SWEEP = early_job("bench-small-sweep", ["bench", "allreduce", "--nproc", "2", "--sizes", "4K,64K",
                                              "--algorithms", "ring,tree,double_binary_tree,halving_doubling,shm,auto",
                                              "--repeat", "2",
                                              "--json", "{folder}/rows.json"])
TRAIN_RUN = early_job("bench-train", ["bench", "train", "--nproc", "2", "--model", "cnn", "--algorithms", "ring",
                                      "--steps", "2", "--warmup", "1", "--repeat", "1", "--no-memory",
                                      "--json", "{folder}/rows.json"])


@pytest.mark.dist
@pytest.mark.early_job(SHM_ROWS)
@pytest.mark.timeout(120)
def test_bench_shm_rows_including_zero_copy(early):
    """shm and shm_zero_copy (data already in the shared arena) each get a row at every size."""
    result = early.wait(110)
    out = early.folder / "rows.json"
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    assert [(r["nbytes"], r["algorithm"]) for r in rows] == [
        (4096, "shm"), (4096, "shm_zero_copy"), (4096, "shm@64K"), (4096, "native"),
        (262144, "shm"), (262144, "shm_zero_copy"), (262144, "shm@64K"), (262144, "native")]
    assert all(r["time_us"] > 0 and r["bytes_sent_per_call"] == 0 for r in rows if r["algorithm"] != "native")
    for row in rows:  # of bound = model bytes x ranks x size / measured rate / measured time
        per_byte = bytes_per_payload_byte(row["algorithm"], 2)
        if per_byte is None:
            assert row["bound_fraction"] is None, row
            continue
        expected = per_byte * 2 * row["nbytes"] / (row["memory_gbps"] * 1e9) / (row["time_us"] * 1e-6)
        assert row["bound_fraction"] == pytest.approx(expected, rel=1e-6), row
    assert "of bound" in result.stdout


def test_memory_bound_models():
    """Bytes per payload byte and rank: 3 for shm (and its cell rows), 1 + 2/p + 3(p-1)/p zero-copy, none else."""
    assert bytes_per_payload_byte("shm", 4) == bytes_per_payload_byte("shm@1M", 2) == 3.0
    assert bytes_per_payload_byte("shm_zero_copy", 2) == pytest.approx(3.5)
    assert bytes_per_payload_byte("shm_zero_copy", 4) == pytest.approx(1 + 0.5 + 2.25)
    assert bytes_per_payload_byte("ring", 2) is None and bound_fraction("ring", 2, 100, 1.0, 1e9) is None
    assert bound_fraction("shm", 2, 10**6, 1e-3, 6e9) == pytest.approx(3 * 2 * 10**6 / 6e9 / 1e-3)


@pytest.mark.slow
@pytest.mark.early_job(SMALL_SWEEP)
def test_bench_small_sweep_writes_rows_with_nccl_tests_definitions(early):
    """Two ranks, two sizes: one row per (size, algorithm), busbw = algbw·2(p-1)/p, native ratio 1; each
    repetition's time kept, the ratios paired per repetition; auto set against the fastest of its candidates."""
    result = early.wait(110)
    out = early.folder / "rows.json"
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    assert [(r["nbytes"], r["algorithm"]) for r in rows] == [
        (n, a) for n in (4096, 65536)
        for a in ("ring", "tree", "double_binary_tree", "halving_doubling", "shm", "auto", "native")]
    native = {row["nbytes"]: row["time_us_reps"] for row in rows if row["algorithm"] == "native"}
    for row in rows:
        assert row["world_size"] == 2 and row["time_us"] > 0 and row["repeat"] == 2 and len(row["time_us_reps"]) == 2
        assert row["time_us_min"] == min(row["time_us_reps"]) and row["time_us_max"] == max(row["time_us_reps"])
        ratios = sorted(n / t for n, t in zip(native[row["nbytes"]], row["time_us_reps"]))
        assert [row["ratio_to_native_min"], row["ratio_to_native_max"]] == pytest.approx(ratios)
        assert row["algbw_gbps"] == pytest.approx(row["nbytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (2 - 1) / 2)
    assert all(row["ratio_to_native"] == pytest.approx(1.0) for row in rows if row["algorithm"] == "native")
    for auto in (row for row in rows if row["algorithm"] == "auto"):
        rivals = [row for row in rows if row["nbytes"] == auto["nbytes"] and row["algorithm"] in
                  ("ring", "tree", "double_binary_tree", "halving_doubling", "shm")]
        assert auto["fastest"] == min(rivals, key=lambda row: row["time_us"])["algorithm"]
    assert "auto / the fastest" in result.stdout and "incomplete" not in result.stdout
    ring = [row for row in rows if row["algorithm"] == "ring"]
    assert all(row["bytes_sent_per_call"] == row["nbytes"] for row in ring)  # 2(p-1)/p·N at p = 2
    assert format_table(rows).splitlines()[0] in result.stdout


@pytest.mark.parametrize("args, needle", [
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "2,x"], "--nproc"),
    (["--model", "bogus"], "--model"),
    (["--model", "cnn,,mlp"], "--model"),
    (["--algorithms", "bogus"], "bogus"),
    (["--steps", "0"], "--steps"),
    (["--warmup", "-1"], "--warmup"),
    (["--repeat", "0"], "--repeat"),
])
def test_bench_train_rejects_bad_options_with_one_line(args, needle, capsys):
    """Each bad option of bench train: exit 2 and one error line naming it, before any process starts."""
    result = _main(["bench", "train", *args], capsys)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_bench_train_mlp_is_comm_heavy():
    """The bench MLP is 1024-4096-4096-1024-10 with about 25.2M parameters; mlp runs steps // 5."""
    numel = sum(param.numel() for param in train_bench.build_bench_model("mlp").parameters())
    assert numel == 1024 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 1024 + 1024 + 1024 * 10 + 10
    assert round(numel / 1e6, 1) == 25.2
    steps = [train_bench.steps_for(model, steps) for model, steps in (("cnn", 100), ("mlp", 100), ("mlp", 2))]
    assert steps == [100, 20, 1]


@pytest.mark.dist
@pytest.mark.early_job(TRAIN_RUN)
@pytest.mark.timeout(90)
def test_bench_train_small_run_writes_rows_with_ratio_to_ddp(early):
    """Two ranks, cnn, one repetition: compute-only, gradsync ring and ddp rows; ratio_to_ddp is the samples/s
    ratio (none for ddp itself), step_vs_compute_only the step time ratio."""
    result = early.wait(85)
    out = early.folder / "rows.json"
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    by_impl = {(row["impl"], row["algorithm"]): row for row in rows}
    assert sorted(by_impl) == [("compute-only", "none"), ("ddp", "native"), ("gradsync", "ring")]
    for row in rows:
        assert {"model", "world_size", "impl", "algorithm", "samples_per_s", "samples_per_s_min", "ratio_to_ddp",
                "step_vs_compute_only", "exposed_comm_fraction"} <= set(row), row
        assert row["model"] == "cnn" and row["world_size"] == 2 and row["samples_per_s"] > 0 and row["repeat"] == 1
    ddp, ring, compute = by_impl[("ddp", "native")], by_impl[("gradsync", "ring")], by_impl[("compute-only", "none")]
    assert ddp["ratio_to_ddp"] is None and ddp["exposed_comm_fraction"] is None
    assert ddp["ddp_settings"]["gradient_as_bucket_view"] is False and ddp["ddp_settings"]["backend"] == "gloo"
    assert ring["ratio_to_ddp"] == pytest.approx(ring["samples_per_s"] / ddp["samples_per_s"])
    assert ring["step_vs_compute_only"] == pytest.approx(ring["step_s"] / compute["step_s"])
    assert ring["comm_s_per_step"] > 0 and ring["exposed_comm_fraction"] is not None
    assert train_bench.format_table(rows).splitlines()[0] in result.stdout
