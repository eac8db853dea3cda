"""Memory cgroups: this process's read back from the files themselves; per-rank children whose limit the kernel
enforces, removed after a run, after a SIGTERM and (by the next run's sweep) after a SIGKILL; ``--memory-limit-mib``
refused in one line before any process starts; a small ``gradsync train`` run whose ranks ran in the children.

The tests that make cgroups make them below this test process's own cgroup (never the machine's) and skip
where no writable memory controller exists (not root, or no controller).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _cli import run_cli
from _early import early_job
from gradsync.hosts import memory_cgroup, memory_children
from gradsync.hosts.memory_cgroup import MemoryController, find_controller
from gradsync.hosts.memory_children import ChildCgroups, sweep_stale

MIB = 2**20
SRC = str(Path(memory_cgroup.__file__).resolve().parents[2])
WRITABLE = memory_children.unavailable_reason()
needs_cgroups = pytest.mark.skipif(WRITABLE is not None, reason=f"no writable memory cgroup here: {WRITABLE}")

# a child Python that imports only gradsync.hosts (a stand-in package: no torch, ~50 ms instead of ~1.7 s)
_PRELUDE = (f"import sys, types, time; pkg = types.ModuleType('gradsync'); pkg.__path__ = [{SRC!r} + '/gradsync']; "
            "sys.modules['gradsync'] = pkg; from gradsync.hosts import memory_cgroup, memory_children\n")
_ALLOCATE = _PRELUDE + """
memory_children.join(sys.argv[1])
print(memory_cgroup.own_limit_bytes(), memory_cgroup.controller().directory, flush=True)
block = bytearray(int(sys.argv[2]) * 2**20)
block[::4096] = b"x" * len(block[::4096])  # every page touched
print("allocated", flush=True)
"""
_LAUNCHER = _PRELUDE + """
with memory_children.ChildCgroups(2, 64 * 2**20) as cgroups:
    print(cgroups.directory, flush=True)
    time.sleep(60)
"""


def _python(code: str, *args: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout_s)


def _own_memory_dir_from_files() -> tuple[int, str] | None:
    """(version, directory) of this process's memory cgroup, read from /proc directly (mount root "/" assumed)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    mounts = [line.split(" - ")[0].split()[3:5] + line.split(" - ")[1].split()
              for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for line in lines:
        _, names, path = line.split(":", 2)
        if "memory" in names.split(","):
            point = next(m[1] for m in mounts if m[2] == "cgroup" and "memory" in m[4].split(","))
            return 1, point + path.rstrip("/")
    return None


@pytest.mark.skipif(memory_cgroup.controller() is None, reason="no memory cgroup controller on this machine")
def test_reading_api_reads_this_process_cgroup_files():
    """controller(), own_limit_bytes(), own_usage_bytes(), own_peak_bytes() against the files read here."""
    ctl = memory_cgroup.controller()
    expected = _own_memory_dir_from_files()
    if expected is not None:
        assert (ctl.version, ctl.directory) == expected
    limit_file = Path(ctl.file("limit")).read_text().strip()
    own = None if limit_file == "max" or int(limit_file) >= 2**62 else int(limit_file)
    limit = memory_cgroup.own_limit_bytes()
    assert limit == own or (limit is not None and (own is None or limit < own))  # an ancestor may be tighter
    usage = memory_cgroup.own_usage_bytes()
    peak = memory_cgroup.own_peak_bytes()
    assert usage > 0
    if peak is not None:  # a running maximum, read after the usage
        assert peak >= usage


def test_find_controller_v1_namespaced_v2_and_none():
    """The cgroup path is joined under the right mount: v1 (also a mount whose root is the cgroup itself, as in
    a container), v2 when cgroup.controllers lists memory, None when no hierarchy offers memory."""
    v1 = "4:memory:/a/b\n0::/\n"
    mount_v1 = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    assert find_controller(v1, mount_v1, exists=lambda path: True) == MemoryController(
        1, "/sys/fs/cgroup/memory", "/sys/fs/cgroup/memory/a/b")
    mount_ns = "35 31 0:32 /a /sys/fs/cgroup/mem\\040x rw - cgroup cgroup rw,memory\n"
    assert find_controller(v1, mount_ns, exists=lambda path: True).directory == "/sys/fs/cgroup/mem x/b"
    v2 = "0::/user.slice/run.scope\n"
    mount_v2 = "30 23 0:26 / /sys/fs/cgroup rw shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
    found = find_controller(v2, mount_v2, exists=lambda path: True, read=lambda path: "cpu io memory pids\n")
    assert found == MemoryController(2, "/sys/fs/cgroup", "/sys/fs/cgroup/user.slice/run.scope")
    assert found.file("limit") == "/sys/fs/cgroup/user.slice/run.scope/memory.max"
    assert find_controller(v2, mount_v2, exists=lambda path: True, read=lambda path: "cpu io\n") is None
    assert find_controller(v1, "", exists=lambda path: True) is None


@needs_cgroups
@pytest.mark.timeout(60)
def test_child_cgroup_limit_kills_an_allocation_beyond_it_and_is_removed():
    """64 MiB children: a process in one that touches 200 MiB is OOM-killed, one that touches 16 MiB runs
    and reads its limit back; the folders are gone after the context."""
    with ChildCgroups(2, 64 * MIB) as cgroups:
        assert sorted(n for n in os.listdir(cgroups.directory) if n.startswith("rank-")) == ["rank-0", "rank-1"]
        assert Path(cgroups.directory).parent == Path(memory_cgroup.controller().directory)
        small = _python(_ALLOCATE, cgroups.rank_directory(0), "16")
        assert small.returncode == 0, small.stderr
        assert small.stdout.split()[:2] == [str(64 * MIB), cgroups.rank_directory(0)]
        big = _python(_ALLOCATE, cgroups.rank_directory(1), "200")
        assert big.returncode == -signal.SIGKILL and "allocated" not in big.stdout, big.stdout + big.stderr
        assert memory_children.oom_kills(cgroups.rank_directory(1)) >= 1
        assert memory_children.oom_kills(cgroups.rank_directory(0)) == 0
    assert not os.path.exists(cgroups.directory)


@needs_cgroups
def test_join_refuses_a_cgroup_outside_its_own():
    """A process only moves into a child of its own cgroup: its parent's is refused, in one line."""
    parent = os.path.dirname(memory_cgroup.controller().directory)
    with pytest.raises(ValueError, match="not below this process's own"):
        memory_children.join(parent)


def _launcher_stopped_by(sig: int) -> str:
    """Start a launcher stand-in that makes 2 children, stop it with ``sig``; returns its run folder."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True)
    try:
        folder = launcher.stdout.readline().strip()
        assert os.path.isdir(os.path.join(folder, "rank-1"))
        launcher.send_signal(sig)
        assert launcher.wait(20) == (128 + signal.SIGTERM if sig == signal.SIGTERM else -signal.SIGKILL)
    finally:
        launcher.kill()
        launcher.wait()
    return folder


@needs_cgroups
@pytest.mark.timeout(60)
def test_sigterm_removes_the_cgroups_and_sigkill_leaves_them_to_the_next_sweep():
    """A launcher stopped by SIGTERM removes its cgroups itself; one SIGKILLed leaves them; the sweep removes
    them (the launcher's pid is dead) and not a live run's, and the next run's start sweeps."""
    assert not os.path.exists(_launcher_stopped_by(signal.SIGTERM))
    with ChildCgroups(1, 64 * MIB) as live:
        killed = _launcher_stopped_by(signal.SIGKILL)
        assert os.path.isdir(killed)
        assert killed in sweep_stale(memory_cgroup.controller())  # (another run here may have left one too)
        assert os.path.isdir(live.rank_directory(0))
    killed = _launcher_stopped_by(signal.SIGKILL)
    with ChildCgroups(1, 64 * MIB) as next_run:
        assert not os.path.exists(killed)
    assert not os.path.exists(live.directory) and not os.path.exists(next_run.directory)


@pytest.mark.parametrize("value, needle", [
    ("-5", "must be an int >= 1"),
    ("0", "must be an int >= 1"),
    ("abc", "invalid int value"),
    ("10000000000", "physical memory"),
])
@pytest.mark.timeout(60)
def test_bad_memory_limit_is_refused_in_one_line(value, needle, tmp_path, capsys, monkeypatch):
    """A bad --memory-limit-mib: one line naming it, before any process starts or any data is made."""
    monkeypatch.setenv("GRADSYNC_DATA_DIR", str(tmp_path / "data"))
    result = run_cli(["train", "--memory-limit-mib", value, "--out", str(tmp_path / "run")], capsys)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode not in (0, None) and len(lines) == 1, result.stderr
    assert "--memory-limit-mib" in lines[0] and needle in lines[0], lines[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()


@needs_cgroups
@pytest.mark.parametrize("shard, limit, line", [
    ("none", "50", "--memory-limit-mib 50 is below the gpt model's parameters alone: 96.8 MiB per rank at --shard "
                   "none and --nproc 4; --shard parameters keeps 1/4 of them per rank"),
    ("parameters", "20", "--memory-limit-mib 20 is below the gpt model's parameters alone: 24.2 MiB per rank at "
                         "--shard parameters and --nproc 4"),
])
def test_a_limit_below_the_parameters_alone_is_refused_before_any_process(shard, limit, line, tmp_path, capsys):
    """The 25.4M-parameter gpt (4 bytes each: 96.8 MiB; a quarter per rank at ZeRO-3 and 4 ranks), counted on the
    meta device, against the limit: one line, nothing started."""
    result = run_cli(["train", "--model", "gpt", "--gpt-width", "512", "--gpt-depth", "8", "--gpt-heads", "8",
                      "--nproc", "4", "--shard", shard, "--memory-limit-mib", limit, "--out", str(tmp_path / "run")],
                     capsys)
    lines = [text for text in result.stderr.splitlines() if text.strip()]
    assert result.returncode not in (0, None) and lines == [f"gradsync train: error: {line}"], result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, needle", [
    (["--hosts", "2"], "with --hosts"),
    (["--elastic"], "--elastic"),
])
def test_memory_limit_is_refused_where_the_ranks_are_not_gradsync_s_to_place(extra, needle, tmp_path, capsys):
    """Test hosts and elastic runs start their ranks elsewhere: the option is refused there, one line."""
    result = run_cli(["train", "--memory-limit-mib", "512", *extra, "--out", str(tmp_path / "run")], capsys)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode not in (0, None) and len(lines) == 1, result.stderr
    assert "--memory-limit-mib is not honoured" in lines[0] and needle in lines[0], lines[0]


LIMITED_RUN = early_job("memory-limited-run", [
    "train", "--nproc", "2", "--model", "logreg", "--epochs", "1", "--num-samples", "200", "--batch-size", "16",
    "--memory-limit-mib", "2000", "--out", "{folder}/run", "--no-progress"],
    env={"GRADSYNC_DATA_DIR": "{folder}"})


@needs_cgroups
@pytest.mark.dist
@pytest.mark.early_job(LIMITED_RUN)
@pytest.mark.timeout(120)
def test_train_runs_each_rank_in_its_own_limited_cgroup_and_removes_it(early):
    """gradsync train --nproc 2 --memory-limit-mib 2000: rank 0 reports the child it ran in (below this test's
    own cgroup, named for the launcher), the 2000 MiB it ran under and a peak within it; all gone after."""
    result = early.wait(110)
    assert result.returncode == 0, result.stderr
    summary = json.loads((early.folder / "run" / "summary.json").read_text())
    record = summary["memory_cgroup"]
    own = re.escape(memory_cgroup.controller().directory)
    launcher = early.process.pid  # the python -m gradsync process made them
    assert re.fullmatch(own + rf"/gradsync-{launcher}-[0-9a-f]+/rank-0", record["directory"]), record
    assert record["limit_mib"] == 2000 and 0 < record["peak_mib"] <= 2000
    assert summary["config"]["memory_limit_mib"] == 2000
    assert not os.path.exists(os.path.dirname(record["directory"]))


OOM_RUN = early_job("memory-oom-run", [
    "train", "--nproc", "2", "--model", "logreg", "--epochs", "1", "--num-samples", "200", "--batch-size", "16",
    "--memory-limit-mib", "8", "--no-preflight", "--out", "{folder}/run", "--no-progress"],
    env={"GRADSYNC_DATA_DIR": "{folder}"})


@needs_cgroups
@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.early_job(OOM_RUN)
@pytest.mark.timeout(120)
def test_train_rank_over_its_limit_is_oom_killed_and_the_error_says_so(early):
    """--memory-limit-mib 8 --no-preflight (the preflight refuses it in the launcher, test_zero3_user.py) is below
    what a rank allocates (torch's buffers alone): the kernel kills it, the job
    fails naming the limit, and no gradsync-* cgroup of the run is left."""
    result = early.wait(110)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the kernel's OOM killer killed it: the rank needed more than --memory-limit-mib 8" in result.stderr
    own = memory_cgroup.controller().directory
    assert not [name for name in os.listdir(own) if name.startswith(f"gradsync-{early.process.pid}-")]


_COPY_ON_WRITE = """
import os, sys
from gradsync.hosts import memory_children
from gradsync.train import process_memory
block = bytearray(64 * 2**20)
block[::4096] = b"a" * len(block[::4096])  # the parent's pages, charged to the parent's cgroup
pid = os.fork()
if pid == 0:
    memory_children.join(sys.argv[1])
    before = process_memory.snapshot()
    fresh = bytearray(32 * 2**20)
    fresh[::4096] = b"b" * len(fresh[::4096])  # its own growth: in its resident set and its cgroup alike
    print(process_memory.copied_bytes(before), process_memory.own_growth(before, process_memory.snapshot()))
    block[::4096] = b"c" * len(block[::4096])  # every shared page copied: charged here, the resident set unchanged
    print(process_memory.copied_bytes(before), process_memory.own_growth(before, process_memory.snapshot()),
          flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@needs_cgroups
@pytest.mark.timeout(60)
def test_copy_on_write_pages_charged_to_a_forked_rank_cgroup_are_counted_apart_from_its_own_growth():
    """A process forked into its own cgroup: 32 MiB it allocates are its own growth (nothing copied); then
    writing the 64 MiB it shares with its parent copies them, charged to its cgroup while its resident set
    stays: ``copied_bytes`` (what the preflight adds under ``--memory-limit-mib``) sees them."""
    with ChildCgroups(1, 512 * MIB) as cgroups:
        done = _python(_COPY_ON_WRITE, cgroups.rank_directory(0), timeout_s=50)
    assert done.returncode == 0, done.stderr
    (copied_fresh, own_fresh), (copied, own) = [map(int, line.split()) for line in done.stdout.split("\n")[:2]]
    assert copied_fresh < 8 * MIB and 30 * MIB <= own_fresh < 40 * MIB
    assert 60 * MIB <= copied < 72 * MIB and 30 * MIB <= own < 40 * MIB
