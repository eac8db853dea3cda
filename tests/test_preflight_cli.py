"""gradsync train's memory preflight, refused under a memory limit the test sets in a child cgroup of its own.

The test makes a child of its own memory cgroup with a limit below what the
run needs (:class:`~gradsync.hosts.memory_children.ChildCgroups`), starts
``gradsync train`` inside it (the launcher moves itself in before it execs,
so its workers are born there) and expects the preflight's one line before
any step: the part that is too large and a setting that would fit. Skipped
where this user cannot make memory cgroups.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from gradsync.hosts import memory_children

LIMIT_MIB = 800  # the launcher, its forkserver and one worker start in ~500 MiB; the run needs ~1 GiB


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.skipif(memory_children.unavailable_reason() is not None,
                    reason=memory_children.unavailable_reason() or "")
def test_train_is_refused_before_step_1_under_a_cgroup_limit(tmp_path):
    """The gpt at width 512 (6.5M parameters) scores the whole test split in one forward at --nproc 1 (~0.9 GiB
    of activations): refused in one line naming activations and a larger world size, nothing trained."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "gradsync", "train", "--model", "gpt", "--gpt-width", "512", "--gpt-depth", "2",
            "--batch-size", "2", "--nproc", "1", "--epochs", "1", "--out", str(out), "--no-progress",
            "--timeout", "60"]
    with memory_children.ChildCgroups(1, LIMIT_MIB * 2**20) as cgroups:
        directory = cgroups.rank_directory(0)
        result = subprocess.run(argv, capture_output=True, text=True, timeout=110,
                                preexec_fn=lambda: memory_children.join(directory))
        oom_kills = memory_children.oom_kills(directory)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and oom_kills == 0, result.stderr
    assert len(lines) == 1, result.stderr
    assert "MemoryPreflightError: gradsync preflight: one rank needs" in lines[0]
    assert "the largest part is activations" in lines[0]
    assert "--nproc " in lines[0].split("; ")[-1] and "would need" in lines[0], lines[0]
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()
