"""``gradsync bench allreduce|train --hosts H``: options checked before anything starts; one real 2-host sweep.

The sweep runs on test hosts (network namespaces, :mod:`gradsync.hosts.netns`) and is
skipped, with the reason, where they cannot be made (not root).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.bench import across_hosts as bench_hosts
from gradsync.bench.allreduce import _worker_argv, format_table
from gradsync.cli import main
from gradsync.hosts import netns

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.parametrize("bench, args, needle", [
    ("allreduce", ["--hosts", "2", "--algorithms", "ring,shm"], "shm"),
    ("allreduce", ["--hosts", "2", "--algorithms", "shm_zero_copy"], "shm_zero_copy"),
    ("allreduce", ["--hosts", "2", "--ranks-per-node", "1"], "--ranks-per-node"),
    ("allreduce", ["--hosts", "0"], "--hosts"),
    ("allreduce", ["--hosts", "2", "--inter-host-gbit", "0"], "--inter-host-gbit"),
    ("allreduce", ["--inter-host-gbit", "1"], "--hosts"),
    ("allreduce", ["--hosts", "2", "--join-timeout", "0"], "--join-timeout"),
    ("allreduce", ["--hosts", "2", "--join-timeout", "inf"], "--join-timeout"),
    ("allreduce", ["--hosts", "2", "--join-timeout", "1e12"], "--join-timeout"),
    ("allreduce", ["--hosts", "2", "--inter-host-gbit", "1e-9"], "--inter-host-gbit must be in [0.001, 1000]"),
    ("train", ["--hosts", "2", "--inter-host-gbit", "inf"], "--inter-host-gbit"),
    ("allreduce", ["--hosts", "2", "--algorithms", "bogus"], "bogus"),
    ("train", ["--hosts", "2", "--algorithms", "shm"], "shm"),
    ("train", ["--hosts", "2", "--nproc", "1,2"], "one integer"),
    ("train", ["--hosts", "-1"], "--hosts"),
])
def test_bench_hosts_bad_options_fail_before_any_host_starts(bench, args, needle, capsys, monkeypatch):
    """Exit 2 and one error line naming the option; no test host is made (run_on_hosts is not reached)."""
    import gradsync.hosts.torchrun as launch

    monkeypatch.setattr(launch, "run_on_hosts", lambda *a, **k: pytest.fail("a host was started"))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert main(["bench", bench, *args]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], lines


def test_bench_hosts_worker_argv_leaves_out_the_launch_options():
    """The workers' command has no --hosts/--join-timeout and no --nproc (torchrun's parser: ambiguous prefix)."""
    argv = _worker_argv("4K,1M", ["ring", "native"], 3, None, 1.0)
    assert argv == ["bench", "allreduce", "--sizes", "4K,1M", "--algorithms", "ring,native",
                    "--repeat", "3", "--inter-host-gbit", "1"]


def test_bench_hosts_tx_bytes_reads_field_9_of_the_device(tmp_path, monkeypatch):
    """/proc/net/dev: receive bytes, packets, errs, drop, fifo, frame, compressed, multicast, then tx bytes."""
    dev = tmp_path / "dev"
    dev.write_text("Inter-|   Receive\n face |bytes packets\n"
                   "    lo: 100 1 0 0 0 0 0 0 200 2 0 0 0 0 0 0\n"
                   "  eth0: 5000 7 0 0 0 0 0 0 123456 9 0 0 0 0 0 0\n")
    monkeypatch.setattr(bench_hosts, "NET_DEV", str(dev))
    assert bench_hosts.tx_bytes() == 123456 and bench_hosts.tx_bytes("lo") == 200
    assert bench_hosts.tx_bytes("eth9") is None


def test_bench_hosts_table_has_hosts_and_link_columns():
    """A 2x2 shaped row shows "2x2", its link Gbit/s and the percent of the shaped rate."""
    row = dict(algorithm="ring", world_size=4, nbytes=1024, time_us=10.0, algbw_gbps=0.1, busbw_gbps=0.15,
               ratio_to_native=1.0, bytes_sent_per_call=1536.0, repeat=1, iterations=1, hosts=2,
               nproc_per_host=2, link_gbps=0.8, link_fraction=0.8)
    header, _, line = format_table([row]).splitlines()
    assert "hosts" in header and "link [Gb/s]" in header and "link %" in header
    assert line.split()[0] == "2x2" and line.split()[-2:] == ["0.800", "80.0"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(150)
def test_bench_allreduce_across_two_test_hosts(tmp_path):
    """2 hosts x 1 rank: rows say so, and host 0's link carried at least the payload rank 0 sent."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-m", "gradsync", "bench", "allreduce", "--hosts", "2", "--nproc", "1",
                             "--sizes", "4K,64K", "--algorithms", "ring,hierarchical", "--repeat", "1",
                             "--json", str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted((row["nbytes"], row["algorithm"]) for row in rows) == sorted(
        (n, a) for n in (4096, 65536) for a in ("ring", "hierarchical", "native"))
    for row in rows:
        assert (row["hosts"], row["nproc_per_host"], row["world_size"]) == (2, 1, 2), row
        assert row["busbw_gbps"] > 0 and row["link_fraction"] is None, row
        # tx counts headers too, and rank 0's timed seconds are at most the slowest rank's (1 repetition)
        payload_gbps = row["bytes_sent_per_call"] * 8 / (row["time_us"] * 1e-6) / 1e9
        assert row["link_gbps"] > 0 and row["link_gbps"] >= 0.9 * payload_gbps, row
    assert "2x1" in result.stdout


@pytest.mark.parametrize("args,needle", [
    (["--nproc", "2", "--kill-host-at", "1:5"], "need --hosts"),
    (["--nproc", "2", "--cut-link-at", "1:5"], "need --hosts"),
    (["--nproc", "2", "--join-timeout", "5"], "--join-timeout applies to --hosts"),
    (["--hosts", "2", "--nproc", "2", "--algorithm", "shm"], "--algorithm shm needs every rank on one host"),
    (["--hosts", "2", "--nproc", "1", "--inter-host-gbit", "1e-9"], "--inter-host-gbit must be in [0.001"),
    (["--hosts", "2", "--nproc", "1", "--join-timeout", "1e12"], "--join-timeout must be in (0,"),
    (["--hosts", "2", "--nproc", "1", "--epochs", "1", "--num-samples", "2000", "--kill-host-at", "0:99999"],
     "--kill-host-at step 99999 is after the job's last step 25"),
    (["--hosts", "2", "--nproc", "1", "--epochs", "1", "--num-samples", "2000", "--cut-link-at", "1:26"],
     "--cut-link-at step 26 is after the job's last step 25"),
])
def test_train_hosts_bad_options_fail_before_any_host_starts(args, needle, capsys, monkeypatch):
    """gradsync train: options that act on test hosts without --hosts, shm across hosts, a link rate tc cannot
    set, fault steps after the run: exit 2 and one line naming the option, before any host starts."""
    import gradsync.hosts.torchrun as launch

    monkeypatch.setattr(launch, "run_on_hosts", lambda *a, **k: pytest.fail("a host was started"))
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    assert main(["train", *args]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], lines


def test_train_hosts_under_torchrun_is_refused_not_ignored(capsys, monkeypatch):
    """RANK/WORLD_SIZE set (a worker of the user's own torchrun): --hosts would be ignored, so it is refused."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(name, value)
    assert main(["train", "--hosts", "2", "--nproc", "1"]) == 2
    assert "under torchrun (RANK and WORLD_SIZE are set) leave it out" in capsys.readouterr().err


def test_diagnose_names_a_hosts_own_notice_not_a_separator_line(tmp_path):
    """A host whose log has no "gradsync ...: error:" line (an injected fault, then torchrun's report): the
    message quotes gradsync's own last notice, never the "=====" of torchrun's failure report."""
    from gradsync.hosts.torchrun import HostJob, diagnose

    report = tmp_path / "rendezvous.json"
    report.write_text(json.dumps({"nodes": ["198.18.0.1", "198.18.0.2"]}))
    (tmp_path / "host1.log").write_text("gradsync: rank 1, step 5: injected failure (--fail-at 1:5): exiting\n"
                                        "Root Cause (first observed failure):\n" + "=" * 60 + "\n")
    (tmp_path / "host0.log").write_text("torch failed\n" + "-" * 60 + "\n")
    message = diagnose(HostJob(2, 1, log_dir=str(tmp_path)), report, 30, {0: 1, 1: 1})
    assert "host 1 (198.18.0.2) failed: gradsync: rank 1, step 5: injected failure" in message, message
    assert "host 0 (198.18.0.1) failed: torch failed" in message and "===" not in message, message
