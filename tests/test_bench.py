"""``gradsync bench allreduce``: bad options fail fast; a small sweep writes consistent rows."""

from __future__ import annotations

import json
import subprocess

import pytest

from gradsync.bench.allreduce import format_table, parse_nbytes
from gradsync.cli import main


def _main(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)


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
    (["--repetitions", "0"], "--repetitions"),
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
def test_bench_small_sweep_writes_rows_with_nccl_tests_definitions(tmp_path, capsys):
    """Two ranks, two sizes: one row per (size, algorithm), busbw = algbw·2(p-1)/p, native ratio 1."""
    out = tmp_path / "rows.json"
    result = _main(["bench", "allreduce", "--nproc", "2", "--sizes", "4K,64K", "--algorithms", "ring,tree",
                    "--repetitions", "2", "--json", str(out)], capsys)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    assert [(r["nbytes"], r["algorithm"]) for r in rows] == [
        (4096, "ring"), (4096, "tree"), (4096, "native"), (65536, "ring"), (65536, "tree"), (65536, "native")]
    for row in rows:
        assert row["world_size"] == 2 and row["time_us"] > 0
        assert row["algbw_gbps"] == pytest.approx(row["nbytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (2 - 1) / 2)
    native = [row for row in rows if row["algorithm"] == "native"]
    assert all(row["ratio_to_native"] == pytest.approx(1.0) for row in native)
    ring = [row for row in rows if row["algorithm"] == "ring"]
    assert all(row["bytes_sent_per_call"] == row["nbytes"] for row in ring)  # 2(p-1)/p·N at p = 2
    assert format_table(rows).splitlines()[0] in result.stdout
