"""``gradsync train`` survives a killed or hung worker and a corrupt checkpoint, end to end (real processes).

Every job is a ``python -m gradsync train`` subprocess in its own process
group, killed as a whole if it outlives its deadline. Runs are small
(2000 MNIST-1D samples, 2 workers, two epochs of 25 steps, batch 32) and
most of their time is process start-up, so jobs that measure no time are
started together and overlap on the cores (:class:`_Job`): the first wave
(:data:`FIRST_WAVE`) at the module's first test, the corrupt-checkpoint
resumes once the baseline's checkpoints exist. The hang test, whose 2-s
collective timeout must not compete for the cores, runs alone, last. Each
recovered job is compared with the uninterrupted baseline of the same
options: the final ``model.pt`` bitwise, and ``metrics.jsonl`` step by step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradsync.debug.analyze import render
from gradsync.fault.events import read_events
from gradsync.fault.injection import ATTEMPTS_ENV, INJECTED_EXIT_CODE
from gradsync.train import data
from test_cli import _assert_one_line_error, _main

pytestmark = pytest.mark.dist

NUM_SAMPLES, EPOCHS, BATCH_SIZE = 2000, 2, 32
CHECKPOINT_EVERY = 10  # K: optimizer steps between checkpoints
JOB_TIMEOUT_S = 150  # deadline of one subprocess job (a healthy one takes 15-30 s on 2 cores)


def _train_args(nproc: int = 2, *extra: str) -> list[str]:
    # the default algorithm (auto: shm on one machine, which sees a killed peer's process die at once)
    return ["--nproc", str(nproc), "--num-samples", str(NUM_SAMPLES), "--epochs", str(EPOCHS),
            "--batch-size", str(BATCH_SIZE), "--no-progress", *extra]


def _total_steps(nproc: int) -> int:
    """Optimizer steps of the job: DistributedSampler pads the 80% training split to equal shares."""
    per_rank = -(-(NUM_SAMPLES * 8 // 10) // nproc)
    return per_rank // BATCH_SIZE * EPOCHS


# ---------------------------------------------------------------- jobs as subprocesses

_STARTED: list["_Job"] = []


def _own_group(niceness: int) -> None:
    """In the child before exec: a process group of its own (killable as a whole) and a lower priority.

    Not a new session: with the kernel's autogroup scheduling a session is
    scheduled as one unit, and nice values would then not count across jobs.
    """
    os.setpgid(0, 0)
    if niceness:
        os.nice(niceness)


class _Job:
    """One ``gradsync train`` subprocess, started now and waited for later (so several can overlap).

    Output goes to files, not pipes, so a job never blocks on a full pipe
    while the test waits for another one. A job with ``niceness`` > 0 (its
    workers inherit it) yields the cores to the jobs that others wait for.
    """

    def __init__(self, folder: Path, args: list[str], env: dict, timeout_s: float = JOB_TIMEOUT_S,
                 niceness: int = 0):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.args, self.timeout_s = folder, args, timeout_s
        self.out = folder / "run"
        self._stdout, self._stderr = open(folder / "stdout.txt", "w"), open(folder / "stderr.txt", "w")
        self.process = subprocess.Popen([sys.executable, "-m", "gradsync", "train", *args, "--out", str(self.out)],
                                        stdout=self._stdout, stderr=self._stderr, env=env, text=True,
                                        preexec_fn=lambda: _own_group(niceness))
        self.deadline = time.monotonic() + timeout_s
        self.result: subprocess.CompletedProcess | None = None
        _STARTED.append(self)

    def wait(self) -> subprocess.CompletedProcess:
        if self.result is None:
            try:
                code = self.process.wait(max(self.deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self.kill()
                code = None
            self._stdout.close(), self._stderr.close()
            self.result = subprocess.CompletedProcess(self.args, code, (self.folder / "stdout.txt").read_text(),
                                                      (self.folder / "stderr.txt").read_text())
            if code is None:
                pytest.fail(f"gradsync train {' '.join(self.args)} did not finish within {self.timeout_s} s; "
                            f"stderr:\n{self.result.stderr}")
        return self.result

    def succeeded(self) -> subprocess.CompletedProcess:
        result = self.wait()
        assert result.returncode == 0, f"gradsync train {' '.join(self.args)} exited {result.returncode}:\n" \
                                       f"{result.stderr}"
        return result

    def kill(self) -> None:
        """Stop the job and its workers (only this job's process group)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(10)


@pytest.fixture(scope="module", autouse=True)
def _stop_leftover_jobs():
    """A job still running when the module ends (a test failed before waiting for it) is killed."""
    yield
    for job in _STARTED:
        job.kill()


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """Environment of every job: one MNIST-1D cache for the module, generated once before any job starts."""
    data_dir = tmp_path_factory.mktemp("mnist1d")
    data.prepare(data_dir, NUM_SAMPLES)
    environment = {**os.environ, "GRADSYNC_DATA_DIR": str(data_dir)}
    environment.pop(ATTEMPTS_ENV, None)
    return environment


# ---------------------------------------------------------------- reading a run folder


def _model(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


def _assert_same_model(got: Path, want: Path) -> None:
    """Bitwise equal final parameters and buffers."""
    a, b = _model(got), _model(want)
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{got} differs from the uninterrupted run in {different}"


def _records(out: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if r["kind"] == "step"], [r for r in records if r["kind"] == "epoch"]


def _assert_same_trajectory(got: Path, want: Path, total_steps: int) -> None:
    """metrics.jsonl: every step exactly once, 1..N in order, with the uninterrupted run's losses and lrs."""
    steps, epochs = _records(got)
    want_steps, want_epochs = _records(want)
    assert [r["step"] for r in steps] == list(range(1, total_steps + 1))
    assert [r["step"] for r in want_steps] == list(range(1, total_steps + 1))
    assert [(r["loss"], r["lr"], r["epoch"]) for r in steps] == \
           [(r["loss"], r["lr"], r["epoch"]) for r in want_steps]
    assert [r["epoch"] for r in epochs] == list(range(EPOCHS))
    keys = ("epoch", "train_loss", "test_loss", "test_accuracy")
    assert [[r[k] for k in keys] for r in epochs] == [[r[k] for k in keys] for r in want_epochs]


def _one(events: list[dict], **match) -> dict:
    found = [e for e in events if all(e.get(k) == v for k, v in match.items())]
    assert len(found) == 1, f"expected one event {match}, got {found}; all events: {events}"
    return found[0]


def _checkpoint_steps(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in folder.iterdir() if p.name.startswith("step-"))


# ---------------------------------------------------------------- the first wave of jobs

FAULT_RANK, KILL_STEP, FAIL_STEP = 1, 28, 3
CHECKPOINTS = ["--checkpoint-every", str(CHECKPOINT_EVERY)]

# name -> (options, GRADSYNC_FAULT_ATTEMPTS or None). These jobs measure no time, so they run at once;
# all but the baseline run at a lower CPU priority, so that the baseline (which the corrupt-checkpoint
# resumes start from) finishes first and the second wave overlaps with the rest of the first.
BACKGROUND_NICENESS = 10
FIRST_WAVE = {
    # the uninterrupted reference (its checkpoints are also the corrupt test's and the world-size test's input)
    "baseline": (_train_args(2, *CHECKPOINTS, "--max-restarts", "1"), None),
    # rank 1 dies before step 28, the 3rd of the second epoch (25 steps each): the job resumes from the
    # checkpoint of step 20, in the first epoch, so the replayed steps cross an epoch boundary
    "kill": (_train_args(2, *CHECKPOINTS, "--max-restarts", "1", "--fail-at", f"{FAULT_RANK}:{KILL_STEP}"), None),
    # rank 1 dies on every attempt the job is allowed
    "exhausted-0": (_train_args(2, "--max-restarts", "0", "--fail-at", f"{FAULT_RANK}:{FAIL_STEP}"), 1),
    "exhausted-1": (_train_args(2, *CHECKPOINTS, "--max-restarts", "1", "--fail-at", f"{FAULT_RANK}:{FAIL_STEP}"), 2),
}


def _first_wave_jobs_of(item: pytest.Item) -> list[str]:
    """The :data:`FIRST_WAVE` jobs a test of this module waits for (the baseline: those that compare with it)."""
    names = ["baseline"] if "baseline" in item.fixturenames else []
    if item.originalname == "test_killed_worker_resumes_and_ends_bitwise_equal_to_an_uninterrupted_run":
        names.append("kill")
    if item.originalname == "test_more_failures_than_max_restarts_fail_the_job_naming_rank_and_restarts":
        names.append(f"exhausted-{item.callspec.params['max_restarts']}")
    return names


@pytest.fixture(scope="module")
def jobs(request, env, tmp_path_factory) -> dict[str, _Job]:
    """The jobs of :data:`FIRST_WAVE` that the selected tests (``-m``, ``-k``) wait for, started together once
    for the module."""
    wanted = {name for item in request.session.items if item.module is request.module
              for name in _first_wave_jobs_of(item)}
    started = {}
    for name, (args, fault_attempts) in FIRST_WAVE.items():
        if name not in wanted:
            continue
        job_env = env if fault_attempts is None else {**env, ATTEMPTS_ENV: str(fault_attempts)}
        started[name] = _Job(tmp_path_factory.mktemp(name), args, job_env,
                             niceness=0 if name == "baseline" else BACKGROUND_NICENESS)
    return started


@pytest.fixture(scope="module")
def baseline(jobs) -> _Job:
    """The finished uninterrupted run (a failure here fails every test that compares with it)."""
    jobs["baseline"].succeeded()
    return jobs["baseline"]


# ---------------------------------------------------------------- a corrupt newest checkpoint


def _damage(path: Path, how: str) -> None:
    content = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(content[:len(content) // 2]))
    else:
        content[len(content) // 2] ^= 0x01
        path.write_bytes(bytes(content))


DAMAGES = {"truncate": "rank-00001.pt", "flip": "shared.pt"}  # how -> the file of the newest checkpoint


@pytest.fixture(scope="module")
def corrupt_resumes(baseline, env, tmp_path_factory) -> dict[str, tuple[_Job, Path, int]]:
    """Per damage: a job resuming from a copy of the baseline's checkpoints whose newest one was damaged.

    Both jobs run at once. Returns ``{how: (job, damaged file, step of the checkpoint before the newest)}``.
    """
    source = baseline.out / "checkpoints"
    steps = _checkpoint_steps(source)
    assert len(steps) >= 2, f"the baseline kept {steps}"
    jobs = {}
    for how, name in DAMAGES.items():
        folder = tmp_path_factory.mktemp(f"corrupt-{how}")
        checkpoints = folder / "checkpoints"
        shutil.copytree(source, checkpoints)
        damaged = checkpoints / f"step-{steps[-1]:09d}" / name
        _damage(damaged, how)
        jobs[how] = (_Job(folder, _train_args(2, *CHECKPOINTS,
                                              "--checkpoint-dir", str(checkpoints)), env),
                     damaged, steps[-2])
    return jobs


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("how", sorted(DAMAGES))
def test_corrupt_newest_checkpoint_is_skipped_and_the_previous_one_resumed(corrupt_resumes, baseline, how):
    """A damaged newest checkpoint is skipped with a CheckpointWarning naming the file; the one before is resumed."""
    job, damaged, previous_step = corrupt_resumes[how]
    result = job.succeeded()
    assert "CheckpointWarning" in result.stderr and str(damaged) in result.stderr, result.stderr
    assert f"skipping checkpoint {damaged.parent.name}" in result.stderr, result.stderr
    resumed = _one(read_events(job.out), event="resumed")
    assert resumed["from_step"] == previous_step and resumed["attempt"] == 0
    assert resumed["checkpoint"] == str(damaged.parent.parent / f"step-{previous_step:09d}")
    _assert_same_model(job.out, baseline.out)
    _assert_same_trajectory(job.out, baseline.out, _total_steps(2))


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_checkpoint_size_does_not_grow_with_the_step(baseline):
    """Before (issue 16): every checkpoint embedded metrics.jsonl so far (~350 bytes a step here, writes growing
    with the square of the run length). Now the two kept checkpoints, 10 steps apart, are the same size up to
    one epoch record and the zip format's alignment."""
    steps = _checkpoint_steps(baseline.out / "checkpoints")
    sizes = [(baseline.out / "checkpoints" / f"step-{step:09d}" / "shared.pt").stat().st_size for step in steps]
    assert len(sizes) == 2 and abs(sizes[1] - sizes[0]) < 600, (steps, sizes)


# ---------------------------------------------------------------- resuming at another world size


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_checkpoint_of_another_world_size_and_lr_is_refused_naming_the_lr_only(baseline, env, tmp_path, capsys,
                                                                               monkeypatch):
    """Checkpoints written by 2 workers, resumed with --nproc 3 and another --lr: one line naming the lr (another
    world size alone resumes, see test_resume_world_size), exit 2, nothing trained."""
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(baseline.out / "checkpoints", checkpoints)
    before = {p.relative_to(checkpoints): p.read_bytes() for p in checkpoints.rglob("*") if p.is_file()}
    monkeypatch.setenv("GRADSYNC_DATA_DIR", env["GRADSYNC_DATA_DIR"])
    out = tmp_path / "run"
    result = _main(["train", *_train_args(3, "--checkpoint-every", str(CHECKPOINT_EVERY), "--checkpoint-dir",
                                          str(checkpoints), "--max-restarts", "1", "--lr", "0.02"), "--out", str(out)],
                   capsys)
    assert result.returncode == 2, result.stderr
    _assert_one_line_error(result, "belongs to another job", "--lr 0.01 there, 0.02 here")
    assert "workers" not in result.stderr
    assert not out.exists(), "nothing may be trained or written"
    after = {p.relative_to(checkpoints): p.read_bytes() for p in checkpoints.rglob("*") if p.is_file()}
    assert after == before, "the checkpoints must be left as they were"


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_checkpoint_of_2_workers_resumes_with_3_and_says_so_first(baseline, env, tmp_path):
    """Step 40 of 2 workers (sample 960 of epoch 1) resumed with --nproc 3: the first line names the change,
    and the 640 samples left make 6 steps of 96; every step is logged once."""
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(baseline.out / "checkpoints", checkpoints)
    shutil.rmtree(checkpoints / "step-000000050")
    job = _Job(tmp_path, _train_args(3, *CHECKPOINTS, "--checkpoint-dir", str(checkpoints)), env)
    first = job.succeeded().stderr.splitlines()[0]
    assert first.startswith(f"gradsync: attempt 1: resuming from {checkpoints / 'step-000000040'} (step 40 of 46) "
                            "written by 2 workers, now 3: data position kept (sample 960 of 1600 in epoch 1, "
                            "6 steps left in it); global batch now 96 samples, was 64"), first
    steps, epochs = _records(job.out)
    assert [r["step"] for r in steps] == list(range(1, 47)) and [r["epoch"] for r in epochs] == [0, 1]


# ---------------------------------------------------------------- a killed worker


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_killed_worker_resumes_and_ends_bitwise_equal_to_an_uninterrupted_run(jobs, baseline):
    """Rank 1 dies mid-epoch: the restarted job resumes from the last checkpoint and ends exactly as if it had not."""
    job, total = jobs["kill"], _total_steps(2)
    assert CHECKPOINT_EVERY < KILL_STEP < total and (KILL_STEP - 1) % (total // EPOCHS) != 0  # mid-epoch
    result = job.succeeded()
    assert f"injected failure (--fail-at {FAULT_RANK}:{KILL_STEP})" in result.stderr, result.stderr
    _assert_same_model(job.out, baseline.out)
    _assert_same_trajectory(job.out, baseline.out, total)

    events = read_events(job.out)
    fault = _one(events, event="fault")
    assert (fault["fault"], fault["rank"], fault["step"], fault["attempt"]) == ("kill", FAULT_RANK, KILL_STEP, 0)
    resumed = _one(events, event="resumed")
    assert resumed["attempt"] == 1 and resumed["time"] > fault["time"]
    assert KILL_STEP - CHECKPOINT_EVERY <= resumed["from_step"] < KILL_STEP
    recomputed = (KILL_STEP - 1) - resumed["from_step"]  # steps done before the kill that were lost
    assert 0 <= recomputed <= CHECKPOINT_EVERY
    # the checkpoint it resumed from was written by the first attempt before the fault
    written = _one(events, event="checkpoint", step=resumed["from_step"], attempt=0)
    assert written["time"] < fault["time"]
    assert Path(resumed["checkpoint"]).name == f"step-{resumed['from_step']:09d}"
    summary = json.loads((job.out / "summary.json").read_text())
    assert (summary["restarts"], summary["resumed_from_step"], summary["steps"]) == (1, resumed["from_step"], total)


# ---------------------------------------------------------------- more failures than restarts


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("max_restarts", [0, 1])
def test_more_failures_than_max_restarts_fail_the_job_naming_rank_and_restarts(jobs, max_restarts):
    """When every allowed attempt fails, the job exits non-zero naming the failing rank and the restarts used."""
    job = jobs[f"exhausted-{max_restarts}"]
    result = job.wait()
    assert result.returncode not in (0, None), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("gradsync train: error:")]
    assert len(error) == 1, result.stderr
    assert f"worker rank {FAULT_RANK} failed" in error[0], error[0]
    assert f"exit code {INJECTED_EXIT_CODE} (injected by --fail-at)" in error[0], error[0]
    assert f"--max-restarts {max_restarts}" in error[0], error[0]
    if max_restarts == 1:
        assert "1 restart" in error[0] and "1 restarts" not in error[0], error[0]
    else:
        assert "no restart" in error[0], error[0]
    faults = [e for e in read_events(job.out) if e["event"] == "fault"]
    assert [(e["rank"], e["step"], e["attempt"]) for e in faults] == \
           [(FAULT_RANK, FAIL_STEP, attempt) for attempt in range(max_restarts + 1)]
    assert not (job.out / "model.pt").exists()


# ---------------------------------------------------------------- a hung worker

HANG_TIMEOUT_S, HANG_STEP = 2.0, 15


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_hung_worker_is_named_by_the_others_and_the_job_recovers(baseline, env, tmp_path):
    """Rank 1 hangs: rank 0 names it within the timeout (+5 s), and the restarted job ends bitwise as the baseline."""
    for other in _STARTED:  # alone: the 2-s timeout must not compete with other jobs for the cores
        other.wait()
    job = _Job(tmp_path, _train_args(2, *CHECKPOINTS, "--max-restarts", "1", "--timeout", str(HANG_TIMEOUT_S),
                                     "--hang-at", f"{FAULT_RANK}:{HANG_STEP}"), env)
    result = job.succeeded()
    assert f"injected hang (--hang-at {FAULT_RANK}:{HANG_STEP})" in result.stderr, result.stderr
    named = [line for line in result.stderr.splitlines() if "CollectiveTimeoutError" in line]
    assert named and all(f"peer rank {FAULT_RANK} stopped responding" in line for line in named), result.stderr
    events = read_events(job.out)
    fault = _one(events, event="fault")
    assert (fault["fault"], fault["rank"], fault["step"], fault["attempt"]) == ("hang", FAULT_RANK, HANG_STEP, 0)
    detected = {e["rank"]: e for e in events if e["event"] == "detected"}
    assert set(detected) == {0}, events  # every rank but the hung one
    for rank, event in detected.items():
        assert event["peer"] == FAULT_RANK, f"rank {rank} blamed rank {event['peer']}: {event['error']}"
        assert event["timed_out"] and event["attempt"] == 0, event
        # the hang detector's wording: the rank was found silent, not merely the peer waited for
        assert f"peer rank {FAULT_RANK} stopped responding" in event["error"], event["error"]
        assert HANG_TIMEOUT_S - 0.5 <= event["time"] - fault["time"] <= HANG_TIMEOUT_S + 5, (event, fault)
    resumed = _one(events, event="resumed")
    assert resumed["attempt"] == 1 and HANG_STEP - CHECKPOINT_EVERY <= resumed["from_step"] < HANG_STEP
    # the first attempt's rank 0 wrote its flight record; gradsync debug places the hung rank from it
    report = render(job.out)
    assert f"rank {FAULT_RANK} wrote no dump (frozen, killed, or its folder is not this one): rank 0 was " \
           f"waiting on it in all_reduce #" in report, report
    _assert_same_model(job.out, baseline.out)
    _assert_same_trajectory(job.out, baseline.out, _total_steps(2))


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_hang_under_the_native_algorithm_ends_the_job_soon_after_detection(env, tmp_path):
    """Gloo's own all_reduce must give up with --timeout: it used to hold the workers ~60 s after detection."""
    for other in _STARTED:  # alone, like the other timed test
        other.wait()
    started = time.monotonic()
    job = _Job(tmp_path, _train_args(2, "--algorithm", "native", "--timeout", str(HANG_TIMEOUT_S),
                                     "--hang-at", f"{FAULT_RANK}:5"), env)
    result = job.wait()
    elapsed_s = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("gradsync train: error")]
    assert len(error) == 1 and f"worker rank {FAULT_RANK} failed: it stopped responding" in error[0], result.stderr
    assert "rank -1" not in error[0], error[0]
    assert elapsed_s < 45, f"the job took {elapsed_s:.0f} s (start-up ~10 s, detection {HANG_TIMEOUT_S + 1.5} s)"
