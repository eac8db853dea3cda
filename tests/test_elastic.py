"""``gradsync train --elastic``: survivors re-form without a restart, replacements join from a live peer.

The quorum's decisions are checked on their own (a ``HashStore``, events by
hand). The jobs run in this process (``run_job``: the quorum service and the
workers are processes of their own, forked from the forkserver) on 2000
MNIST-1D samples (25 steps of 64 per epoch) and are compared with a
fault-free run: ``--deterministic`` makes the final model bitwise independent
of the world size, so every recovery must leave it exactly as the fault-free
run at another world size leaves it. Samples are counted per id from the
members' own records.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradsync.elastic.quorum import Quorum
from gradsync.elastic.run_store import EventReader, post
from gradsync.fault.events import read_events
from gradsync.train import data
from gradsync.train.config import TrainConfig
from gradsync.elastic.samples import count_samples
from gradsync.train.global_batch import global_batches
from gradsync.jobs.job import run_job
from gradsync.train.metrics import MODEL_FILE
from test_cli import _assert_one_line_error, _main

NUM_SAMPLES, GLOBAL_BATCH = 2000, 64
NUM_TRAIN = data.num_train_samples(NUM_SAMPLES)


# ---------------------------------------------------------------- the quorum alone


def _quorum(nproc=3, low=1, high=3, timeout_s=5.0):
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=2))  # a get of a key never set fails instead of waiting
    clock = [0.0]
    quorum = Quorum(store, nproc, low, high, timeout_s, startup_s=10.0, rejoin_s=10.0, clock=lambda: clock[0])
    return store, quorum, clock


def _members(store, epoch):
    record = json.loads(store.get(f"q/members/{epoch}"))
    return [(m["slot"], m["incarnation"]) for m in record["members"]], record


def _start(quorum, nproc=3):
    for slot in range(nproc):
        quorum.handle({"kind": "join", "slot": slot, "incarnation": 0, "step": -1})
    quorum.tick()


def test_quorum_forms_then_drops_a_dead_member_and_picks_the_most_advanced_source():
    store, quorum, _ = _quorum()
    _start(quorum)
    assert _members(store, 1)[0] == [(0, 0), (1, 0), (2, 0)]
    quorum.handle({"kind": "died", "slot": 0, "incarnation": 0, "exitcode": -9})
    assert store.check(["q/next/1"])  # every member stops at its next boundary or failed collective
    quorum.handle({"kind": "ready", "slot": 1, "incarnation": 0, "epoch": 1, "step": 7})
    quorum.tick()
    assert not store.check(["q/members/2"])  # slot 2 has not answered yet
    quorum.handle({"kind": "ready", "slot": 2, "incarnation": 0, "epoch": 1, "step": 8})  # it committed one more
    quorum.tick()
    members, record = _members(store, 2)
    assert members == [(2, 0), (1, 0)] and record["source"] == 2 and record["step"] == 8
    assert record["left"] == [{"slot": 0, "why": "died (exit code -9)"}]


def test_quorum_evicts_a_suspect_that_does_not_answer_and_grows_back_with_its_replacement():
    store, quorum, clock = _quorum()
    _start(quorum)
    quorum.handle({"kind": "ready", "slot": 0, "incarnation": 0, "epoch": 1, "step": 4, "suspect": 2})
    quorum.handle({"kind": "ready", "slot": 1, "incarnation": 0, "epoch": 1, "step": 4, "suspect": 2})
    quorum.tick()
    assert store.check(["q/evict/2/0"])  # its launcher kills it
    assert _members(store, 2)[0] == [(0, 0), (1, 0)]
    quorum.handle({"kind": "died", "slot": 2, "incarnation": 0, "exitcode": -9})  # the kill: nothing changes
    assert not store.check(["q/next/2"])
    quorum.handle({"kind": "join", "slot": 2, "incarnation": 1, "step": -1})
    assert store.check(["q/next/2"])
    for slot in (0, 1):
        quorum.handle({"kind": "ready", "slot": slot, "incarnation": 0, "epoch": 2, "step": 6})
    quorum.tick()
    assert _members(store, 3)[0] == [(0, 0), (1, 0), (2, 1)]


def test_quorum_evicts_a_member_silent_past_the_timeout_and_fails_below_min_nproc():
    store, quorum, clock = _quorum(nproc=2, low=2, high=2, timeout_s=5.0)
    _start(quorum, 2)
    quorum.handle({"kind": "ready", "slot": 0, "incarnation": 0, "epoch": 1, "step": 3})
    clock[0] += 5.1
    quorum.tick()
    assert store.check(["q/evict/1/0"]) and not store.check(["q/members/2"])  # 1 left, --min-nproc 2
    clock[0] += 10.1
    quorum.tick()
    assert "fewer than --min-nproc 2" in json.loads(store.get("q/failed"))["reason"]


def test_quorum_holds_joiners_beyond_max_nproc_and_ends_when_rank0_finishes():
    store, quorum, _ = _quorum(nproc=2, low=1, high=2)
    _start(quorum, 2)
    quorum.handle({"kind": "join", "slot": 5, "incarnation": 0, "step": -1})
    assert not store.check(["q/next/1"])  # full: it waits
    quorum.handle({"kind": "finished", "slot": 1, "incarnation": 0, "epoch": 1})
    assert quorum.outcome is None  # rank 1 is not the one that writes the run folder
    quorum.handle({"kind": "finished", "slot": 0, "incarnation": 0, "epoch": 1})
    assert quorum.outcome == "done" and store.check(["q/done"])


def test_a_fatal_error_ends_the_run_with_its_reason():
    store, quorum, _ = _quorum()
    _start(quorum)
    quorum.handle({"kind": "fatal", "slot": 1, "incarnation": 0, "error": "CollectiveMismatchError: shapes differ"})
    assert quorum.outcome == "failed"
    assert json.loads(store.get("q/failed"))["reason"] == "slot 1: CollectiveMismatchError: shapes differ"


def test_event_queue_reads_every_event_once_in_order():
    store = dist.HashStore()
    for number in range(5):
        post(store, "ready", slot=number)
    reader = EventReader(store)
    assert [reader.next(0.1)["slot"] for _ in range(5)] == list(range(5))
    assert reader.next(0.01) is None


# ---------------------------------------------------------------- jobs


def _config(tmp_path: Path, name: str, nproc: int, **options) -> TrainConfig:
    base = dict(nproc=nproc, elastic=True, deterministic=True, global_batch_size=GLOBAL_BATCH,
                num_samples=NUM_SAMPLES, epochs=1, progress=False, timeout=20.0, out=str(tmp_path / name))
    base.update(options)
    return TrainConfig(**base)


def _batches(num_train: int, global_batch: int):
    return lambda epoch: global_batches(num_train, global_batch, 0, epoch)


def _model(run: Path) -> dict:
    return torch.load(run / MODEL_FILE, weights_only=True)


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _samples(run: Path, summary: dict, epochs: int = 1) -> dict:
    return count_samples(run, _batches(NUM_TRAIN, GLOBAL_BATCH), steps_done=summary["steps"])


def _memberships(run: Path) -> list[dict]:
    return [e for e in read_events(run) if e["event"] == "membership"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free deterministic run at world size 2: what every recovery must reproduce bit for bit."""
    tmp = tmp_path_factory.mktemp("elastic-reference")
    summary = run_job(_config(tmp, "ref", 2, epochs=2))
    return tmp / "ref", summary


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_two_failures_in_a_row_lose_no_sample_and_leave_the_model_bitwise_equal(tmp_path, reference):
    """ws 3: slot 1 dies inside its backward (the others wait in the exchange), then slot 2 dies before a
    step; both come back."""
    ref_run, ref_summary = reference
    config = _config(tmp_path, "run", 3, epochs=2, elastic_fault="1:allreduce:8", fail_at="2:12")
    summary = run_job(config)
    run = Path(config.out)
    assert summary["steps"] == ref_summary["steps"] == 2 * (NUM_TRAIN // GLOBAL_BATCH)
    assert _bitwise_equal(_model(run), _model(ref_run))
    assert summary["replicas_equal"] is True
    counts = _samples(run, summary)
    assert counts["samples_lost"] == 0 and counts["samples_duplicated"] == 0
    assert counts["samples_used"] == summary["steps"] * GLOBAL_BATCH
    sizes = [len(m["members"]) for m in _memberships(run)]
    shrinks = sum(after < before for before, after in zip(sizes, sizes[1:]))
    # shrank at each failure; whether a replacement is back before the next failure or the end is the
    # machine's timing (3 -> 2 -> 3 -> 2 -> 3, or 3 -> 2 -> 1 -> ... under load), not the contract
    assert sizes[0] == 3 and shrinks == 2 and max(sizes) == 3
    faults = [e for e in read_events(run) if e["event"] == "fault"]
    assert len(faults) == 2


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(120)
def test_rank0_dies_during_the_state_handover_to_a_joiner(tmp_path, reference):
    """Slot 2 dies; when it rejoins, rank 0 (slot 0) dies between the state's length and its payload."""
    ref_run, _ = reference
    config = _config(tmp_path, "run", 3, epochs=2, fail_at="2:5", elastic_fault="0:broadcast:5")
    summary = run_job(config)
    run = Path(config.out)
    assert _bitwise_equal(_model(run), _model(ref_run))
    counts = _samples(run, summary)
    assert (counts["samples_lost"], counts["samples_duplicated"]) == (0, 0)
    memberships = _memberships(run)
    after = next(m for m in memberships if any(left["slot"] == 0 for left in m["left"]))
    assert after["members"][0]["slot"] == 1  # the survivor with the steps became rank 0 and the source


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_hung_worker_is_evicted_within_the_timeout_and_replaced(tmp_path):
    timeout_s = 2.0
    config = _config(tmp_path, "run", 2, hang_at="1:6", timeout=timeout_s, algorithm="ring")
    summary = run_job(config)
    run = Path(config.out)
    events = read_events(run)
    fault = next(e for e in events if e["event"] == "fault")
    evicted = next(e for e in events if e["event"] == "evict")
    assert evicted["slot"] == 1 and "hanging" in evicted["why"]
    assert evicted["time"] - fault["time"] <= timeout_s + 2.0
    back = [e for e in events if e["event"] == "resumed_training" and e["time"] > evicted["time"]]
    assert back and back[0]["time"] - evicted["time"] < 1.0  # training again within a second
    assert back[0]["members"] == [0]  # the survivor alone: it did not wait for the replacement
    relaunched = [e for e in events if e["event"] == "launched" and e["slot"] == 1]
    assert [e["incarnation"] for e in relaunched] == [0, 1]  # its launcher killed it and started it again
    assert summary["steps"] == NUM_TRAIN // GLOBAL_BATCH
    counts = _samples(run, summary)
    assert (counts["samples_lost"], counts["samples_duplicated"]) == (0, 0)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_death_inside_a_bucket_allreduce_then_a_joiner_grows_the_world_to_max_nproc(tmp_path):
    from gradsync.jobs.elastic import ElasticJob

    # the global batch stays 2 x 16 = 32 at 3 workers (uneven shares); slot 0 dies inside a bucket's
    # AllReduce (several 4-KB buckets: the peer is inside one), while it is rank 0; from step 30 on, a
    # membership of fewer than 3 holds until a joiner asks in (3:hold:30), so the survivor cannot finish
    # the run alone before the joiner and slot 0's relaunch have started, however loaded the machine
    config = _config(tmp_path, "run", 2, max_nproc=3, epochs=1, deterministic=False, global_batch_size=None,
                     batch_size=16, bucket_cap_mb=0.004, elastic_fault="0:allreduce:30,3:hold:30",
                     algorithm="ring")
    run = Path(config.out)
    run.mkdir()
    job = ElasticJob(config, data.prepare(None, NUM_SAMPLES), run)
    try:
        deadline = time.monotonic() + 60
        while not _memberships(run) and time.monotonic() < deadline:
            time.sleep(0.05)
        job.add_worker()  # what `gradsync train --join RUN` does from another shell
        summary = job.wait(timeout_s=90)
    finally:
        job.close()
    assert [len(m["members"]) for m in _memberships(run)][-1] == 3
    left = [e for e in read_events(run) if e["event"] == "left" and e["slot"] == 1]
    assert any("all_reduce" in e["error"] and "connection closed" in e["error"] for e in left)
    assert summary["replicas_equal"] is True and summary["steps"] == NUM_TRAIN // 32
    assert summary["world_size"] == 3 and summary["global_batch_size"] == 32
    counts = count_samples(run, _batches(NUM_TRAIN, 32), steps_done=summary["steps"])
    assert (counts["samples_lost"], counts["samples_duplicated"]) == (0, 0)
    assert not (run / "elastic.json").exists()
    assert all(not launcher.is_alive() for launcher in job.launchers.values())


@pytest.mark.parametrize("args, message", [
    (["--elastic", "--nproc", "4", "--min-nproc", "5"], "--min-nproc 5 <= --nproc 4"),
    (["--elastic", "--max-restarts", "1"], "--elastic replaces --max-restarts"),
    (["--max-nproc", "3"], "--max-nproc needs --elastic"),
    (["--elastic", "--elastic-fault", "1:nowhere:3"], "--elastic-fault"),
    (["--elastic", "--join", "/nonexistent-run"], "no running elastic job there"),
    (["--elastic", "--nproc", "2", "--num-samples", "2000", "--epochs", "1", "--elastic-fault", "5:allreduce:3"],
     "--elastic-fault slot 5 is not a worker slot: slots are 0..1"),
    (["--elastic", "--nproc", "2", "--num-samples", "2000", "--epochs", "1", "--elastic-fault", "1:allreduce:999"],
     "--elastic-fault step 999 is after the job's last step 25"),
    (["--max-relaunches", "3"], "--max-relaunches needs --elastic"),
])
def test_bad_elastic_options_are_one_line_errors(args, message, capsys):
    _assert_one_line_error(_main(["train", *args], capsys), message)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_whole_job_failure_resumes_from_the_checkpoint_at_another_world_size(tmp_path, reference):
    from gradsync.jobs.elastic import ElasticJob

    ref_run, ref_summary = reference
    checkpoints = tmp_path / "checkpoints"
    first = _config(tmp_path, "first", 3, epochs=2, checkpoint_dir=str(checkpoints), checkpoint_every=10)
    Path(first.out).mkdir()
    job = ElasticJob(first, data.prepare(None, NUM_SAMPLES), Path(first.out))
    try:
        deadline = time.monotonic() + 60
        while not list((checkpoints / "elastic").glob("step-*.pt")) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        job.close()  # every worker and the quorum service killed: the whole job is gone
    saved = sorted((checkpoints / "elastic").glob("step-*.pt"))
    assert saved, "no checkpoint was written"
    second = _config(tmp_path, "second", 2, epochs=2, checkpoint_dir=str(checkpoints), checkpoint_every=10)
    summary = run_job(second)
    resumed = [e for e in read_events(Path(second.out)) if e["event"] == "resumed"]
    assert len(resumed) == 1 and "written by 3 workers, now 2" in resumed[0]["line"]  # what it printed first
    assert summary["steps"] == ref_summary["steps"]
    assert _bitwise_equal(_model(Path(second.out)), _model(ref_run))


def test_samples_of_a_member_killed_after_its_step_count_when_a_peer_committed_it(tmp_path):
    """Counting: ids computed in membership m count iff some member committed that step in m."""
    folder = tmp_path / "elastic"
    folder.mkdir()
    batches = [batch.tolist() for batch in __import__("gradsync.train.global_batch", fromlist=["x"])
               .global_batches(8, 4, 0, 0)]
    lines = {"samples-0.0.jsonl": [{"m": 1, "step": 0, "epoch": 0, "ids": batches[0][:2]}, {"m": 1, "commit": 0},
                                   {"m": 1, "step": 1, "epoch": 0, "ids": batches[1][:2]},  # aborted: redone in m 2
                                   {"m": 2, "step": 1, "epoch": 0, "ids": batches[1]}, {"m": 2, "commit": 1}],
             "samples-1.0.jsonl": [{"m": 1, "step": 0, "epoch": 0, "ids": batches[0][2:]}]}  # killed before its commit
    for name, records in lines.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records) + '{"m": 1, "st')  # torn last line
    counts = count_samples(tmp_path, _batches(8, 4), steps_done=2)
    assert counts == {"samples_used": 8, "samples_lost": 0, "samples_duplicated": 0, "steps": 2}
    (folder / "samples-1.0.jsonl").write_text(json.dumps({"m": 1, "step": 0, "epoch": 0, "ids": batches[0][:1]}))
    counts = count_samples(tmp_path, _batches(8, 4), steps_done=2)
    assert (counts["samples_lost"], counts["samples_duplicated"]) == (2, 1)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.skipif(__import__("gradsync.hosts.netns", fromlist=["x"]).unavailable_reason() is not None,
                    reason="test hosts need root and network namespaces")
def test_a_lost_host_is_evicted_at_once_and_its_return_grows_the_world_back(tmp_path, reference):
    """2 test hosts x 2 ranks; host 1 is killed whole (both ranks and their launcher) at step 5.
    --min-nproc 4 makes the quorum wait for the host's return, so the grow is certain to happen."""
    ref_run, ref_summary = reference
    config = _config(tmp_path, "run", 2, hosts=2, epochs=2, kill_host_at="1:5", min_nproc=4)
    summary = run_job(config)
    run = Path(config.out)
    events = read_events(run)
    evicted = [e for e in events if e["event"] == "evict"]
    assert sorted(e["slot"] for e in evicted) == [2, 3]  # host 1's slots
    assert max(e["time"] for e in evicted) - min(e["time"] for e in evicted) <= 2.0 + 1.0  # heartbeat, not timeout
    memberships = _memberships(run)
    assert [len(m["members"]) for m in memberships] == [4, 4]
    assert {m["incarnation"] for m in memberships[-1]["members"] if m["slot"] in (2, 3)} == {1}
    assert len({m["host"] for m in memberships[-1]["members"]}) == 2
    assert summary["steps"] == ref_summary["steps"]
    assert _bitwise_equal(_model(run), _model(ref_run))
    counts = _samples(run, summary)
    assert (counts["samples_lost"], counts["samples_duplicated"]) == (0, 0)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_the_library_runs_any_step_function_elastically(tmp_path):
    from _elastic_worker import run
    from gradsync.elastic.run import launch_elastic

    out = tmp_path / "result.json"
    codes = launch_elastic(3, run, 60, 1, 20, str(out), timeout_s=20.0, deadline_s=50, preload=("_elastic_worker",))
    assert codes[1] == [17, 0] and codes[0] == [0] and codes[2] == [0]  # slot 1 died once, came back
    result = json.loads(out.read_text())
    assert result["steps"] == 60 and result["world_size"] == 3 and result["memberships"] >= 3


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_a_worker_that_fails_at_start_is_not_relaunched_forever():
    from _elastic_worker import fail_at_start
    from gradsync.elastic.run import ElasticRunError, launch_elastic

    started = time.monotonic()
    with pytest.raises(ElasticRunError, match="fails at start"):
        launch_elastic(2, fail_at_start, deadline_s=50, preload=("_elastic_worker",))
    assert time.monotonic() - started < 30
    with pytest.raises(TypeError, match="nproc must be an int"):
        launch_elastic("2", fail_at_start)
