"""gradsync train's memory preflight, refused under a memory limit the test sets in a child cgroup of its own.

The run is an early job (``_early.py``: started with the session, so that
its process start-up overlaps the other tests). Its ``sitecustomize.py``
runs first in the launcher: it makes a child of the test process's memory
cgroup with a limit below what the run needs and moves the launcher in, so
that its forkserver and worker are born there (a process is only ever moved
into a child of its own cgroup); the test removes the child once the run
has exited. The preflight must then stop the run before step 1 with one
line naming the part that is too large and a setting that would fit.
Skipped where this user cannot make memory cgroups.
"""

from __future__ import annotations

import os
import time

import pytest

from _early import early_job
from gradsync.hosts import memory_children
from gradsync.hosts.memory_cgroup import controller

LIMIT_MIB = 800  # the launcher, its forkserver and one worker start in ~500 MiB; the run needs ~1 GiB
CHILD = "preflight-test-{pid}"  # not gradsync-<pid>-<hex>: gradsync's own sweep must leave it alone

_JOIN_A_LIMITED_CHILD = f"""
import os
if "GRADSYNC_TEST_CGROUP" not in os.environ:  # the launcher; its children are born in its cgroup
    from gradsync.hosts.memory_cgroup import controller
    from gradsync.hosts.memory_children import join
    ctl = controller()
    child = os.path.join(ctl.directory, "{CHILD}".format(pid=os.environ["GRADSYNC_TEST_PARENT"]))
    os.mkdir(child)
    with open(ctl.file("limit", child), "w") as handle:
        handle.write(str({LIMIT_MIB} * 2**20))
    os.environ["GRADSYNC_TEST_CGROUP"] = join(child)
"""

REFUSED = early_job(
    "preflight-refused-under-a-cgroup-limit",
    ["train", "--model", "gpt", "--gpt-width", "512", "--gpt-depth", "2", "--batch-size", "2", "--nproc", "1",
     "--epochs", "1", "--out", "{folder}/run", "--no-progress", "--timeout", "60"],
    env={"PYTHONPATH": os.pathsep.join(filter(None, ["{folder}", os.environ.get("PYTHONPATH")])),
         "GRADSYNC_TEST_PARENT": str(os.getpid())},
    files={"sitecustomize.py": _JOIN_A_LIMITED_CHILD})


def _remove_child(timeout_s: float = 10.0) -> int:
    """Remove the run's child cgroup once the kernel has let its exited processes go (a cgroup with tasks
    cannot be removed); its OOM kills, counted before. -1 when it was never made."""
    ctl = controller()
    child = os.path.join(ctl.directory, CHILD.format(pid=os.getpid()))
    if not os.path.isdir(child):
        return -1
    kills = memory_children.oom_kills(child)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(child)
            return kills
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.dist
@pytest.mark.early_job(REFUSED)
@pytest.mark.timeout(150)
@pytest.mark.skipif(memory_children.unavailable_reason() is not None,
                    reason=memory_children.unavailable_reason() or "")
def test_train_is_refused_before_step_1_under_a_cgroup_limit(early):
    """The gpt at width 512 (6.5M parameters) scores the whole test split in one forward at --nproc 1 (~0.9 GiB
    of activations): refused in one line naming activations and a larger world size, nothing trained."""
    try:
        result = early.wait(140)
    finally:
        oom_kills = _remove_child()
    assert oom_kills == 0, result.stderr  # the cgroup existed, and its limit killed nothing
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "MemoryPreflightError: gradsync preflight: one rank needs" in lines[0]
    assert "the largest part is activations" in lines[0]
    assert "--nproc " in lines[0].split("; ")[-1] and "would need" in lines[0], lines[0]
    metrics = early.folder / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()
