"""The flight recorder and ``gradsync debug``: the ring, the records, the dumps, and the analysis of
a real hang, a real mismatch and a skipped collective (Gloo processes), plus hand-made dumps, damaged ones included.

Sequence numbers are computed from each scenario: every rank reports the
communicator's call count before its calls, and the expected ``#seq`` in the
analyzer's text follows from it.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from torch import nn

import gradsync
from _dist import run_threads, run_world
from gradsync.cli import main
from gradsync.collectives import Communicator, ops
from gradsync.debug import analyze
from gradsync.debug.dumps import load_folder
from gradsync.debug.flight import ENTRIES_ENV, FOLDER_ENV, FlightEntry, FlightRecorder, entries_from_env
from gradsync.errors import CollectiveMismatchError, CollectiveTimeoutError
from gradsync.process_group import default_communicator
from gradsync.transport.thread import ThreadWorld

# ---------------------------------------------------------------- the ring


def _entry(seq: int, op: str = "all_reduce", **fields) -> FlightEntry:
    entry = FlightEntry()
    entry.ordinal, entry.op_name, entry.algorithm = seq, op, fields.pop("algorithm", "ring")
    entry.started_wall, entry.started_mono = 1000.0 + seq, float(seq)
    for name, value in fields.items():
        setattr(entry, name, value)
    return entry


@pytest.mark.parametrize("capacity, calls", [(5, 12), (5, 5), (5, 3), (1, 4)])
def test_ring_keeps_the_last_capacity_calls_oldest_first(capacity, calls):
    """After ``calls`` calls a ring of ``capacity`` holds calls max(1, calls-capacity+1)..calls, in order."""
    recorder = FlightRecorder(0, 1, capacity=capacity)
    for seq in range(1, calls + 1):
        recorder.enter(_entry(seq))
        recorder.finish(seq, seq)
    records = recorder.records()
    assert [record["seq"] for record in records] == list(range(max(1, calls - capacity + 1), calls + 1))
    assert all(record["state"] == "done" for record in records)


def test_communicator_ring_size_comes_from_the_environment_and_records_each_call(monkeypatch):
    """GRADSYNC_FLIGHT_ENTRIES=3: the last 3 calls, with op, dtype, shape and bytes (numel * itemsize)."""
    monkeypatch.setenv(ENTRIES_ENV, "3")
    comm = Communicator(ThreadWorld(1).transport(0), 10.0)
    for _ in range(4):
        ops.all_reduce(torch.ones(2, 3, dtype=torch.float64), comm)
    ops.broadcast(torch.zeros(5, dtype=torch.int16), comm)
    records = comm.flight.records()
    assert [(r["seq"], r["op"], r["dtype"], r["shape"], r["nbytes"], r["state"]) for r in records] == [
        (3, "all_reduce", "float64", [2, 3], 2 * 3 * 8, "done"), (4, "all_reduce", "float64", [2, 3], 48, "done"),
        (5, "broadcast", "int16", [5], 5 * 2, "done")]
    assert all(r["start_wall"] <= r["end_wall"] and r["start_monotonic"] <= r["end_monotonic"] for r in records)


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_bad_ring_size_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(ENTRIES_ENV, value)
    with pytest.raises(ValueError, match=ENTRIES_ENV):
        entries_from_env()


# ---------------------------------------------------------------- records of real calls (thread ranks)


def test_a_timeout_is_recorded_waiting_on_the_silent_peer_and_dumped(monkeypatch, tmp_path):
    """Rank 1 never calls: rank 0's record fails waiting on peer 1, its dump is written and named by the error."""
    monkeypatch.setenv(FOLDER_ENV, str(tmp_path))

    def rank_fn(comm):
        if comm.rank == 1:
            return None
        error = None
        try:
            ops.all_reduce(torch.ones(3), comm, timeout=0.3)
        except CollectiveTimeoutError as exc:
            error = exc
        return error, comm.flight.records()[-1]

    error, record = run_threads(2, rank_fn)[0]
    assert isinstance(error, CollectiveTimeoutError)
    assert (record["seq"], record["state"], record["peer"]) == (1, "failed", 1)
    assert record["error"].startswith("CollectiveTimeoutError: ")
    assert error.flight_dump == tmp_path / "rank-0.json"
    dumped = json.loads(error.flight_dump.read_text())
    assert (dumped["rank"], dumped["world_size"], dumped["pid"]) == (0, 2, os.getpid())
    assert dumped["error"]["type"] == "CollectiveTimeoutError" and dumped["records"][-1]["peer"] == 1


def test_without_a_folder_nothing_is_written_but_the_records_stay_readable(monkeypatch, tmp_path):
    monkeypatch.delenv(FOLDER_ENV, raising=False)
    monkeypatch.chdir(tmp_path)

    def rank_fn(comm):
        try:
            ops.all_reduce(torch.ones(2 + comm.rank), comm)
        except CollectiveMismatchError as exc:
            return getattr(exc, "flight_dump", None), comm.flight.records()[-1]["state"]

    assert run_threads(2, rank_fn) == [(None, "failed")] * 2
    assert list(tmp_path.iterdir()) == []


def test_data_parallel_labels_its_bucket_all_reduces():
    """Every bucket's AllReduce carries "bucket i", for i over the reducer's buckets."""
    def rank_fn(comm):
        torch.manual_seed(0)
        model = gradsync.DataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)), bucket_cap_mb=0.01,
                                      group=comm)
        model(torch.ones(2, 64)).sum().backward()
        labels = [r["label"] for r in comm.flight.records() if r["label"]]
        return labels, len(model._reducer.buckets)

    for labels, buckets in run_threads(2, rank_fn):
        assert buckets > 1 and sorted(labels) == sorted(f"bucket {i}" for i in range(buckets))


# ---------------------------------------------------------------- the analyzer on hand-made dumps


def _write_dump(folder, rank, world_size, entries, error):
    recorder = FlightRecorder(rank, world_size, capacity=100, folder=folder)
    for entry in entries:
        recorder.enter(entry)
    return recorder.dump(error)


def _stuck_world(folder):
    """World size 4: calls 1-5 done everywhere; #6: ranks 0, 1 in broadcast waiting on rank 3,
    rank 2 in all_reduce bucket 3 waiting on rank 0; rank 3 wrote no dump."""
    for rank in range(3):
        entries = [_entry(seq, ended_mono=seq + 0.5) for seq in range(1, 6)]
        if rank == 2:
            entries.append(_entry(6, label="bucket 3", waiting_on=0, error="CollectiveTimeoutError: ..."))
        else:
            entries.append(_entry(6, "broadcast", algorithm="tree", waiting_on=3, blamed=3,
                                  error="CollectiveTimeoutError: ..."))
        _write_dump(folder, rank, 4, entries, CollectiveTimeoutError(f"timeout on rank {rank}"))


def test_analyzer_names_where_each_rank_is_and_places_the_rank_without_a_dump(tmp_path):
    _stuck_world(tmp_path)
    text = analyze.render(tmp_path)
    assert "3 of 4 ranks dumped" in text
    assert "rank 2 is in all_reduce #6 bucket 3; ranks 0, 1 are in broadcast #6; rank 3 wrote no dump" in text
    assert "disagreement at #6: rank 2 is in all_reduce #6 bucket 3; ranks 0, 1 are in broadcast #6" in text
    assert ("ranks 0, 1 were waiting on it in broadcast #6, so it never reached broadcast #6 or froze inside it; "
            "the last call every rank that dumped finished is all_reduce #5") in text
    assert "timeout on rank 0" in text and len(text.splitlines()) <= 24  # one screen


def test_analyzer_carries_on_past_garbage_empty_and_damaged_files(tmp_path):
    """A garbage rank-3.json makes rank 3 'unreadable' yet placed by its peers; bad files are named, not raised."""
    _stuck_world(tmp_path)
    (tmp_path / "rank-3.json").write_bytes(b"\x00\xff{garbage")
    (tmp_path / "rank-9.json").write_text("")
    (tmp_path / "rank-7.json").write_text('{"format": "gradsync-fl')  # cut inside the header
    (tmp_path / "rank-8.json").write_text('[' * 100_000)  # too deep for the json module
    (tmp_path / "notes.txt").write_text("not a dump")
    (tmp_path / "rank-5.json").write_text('{"rank": 1000000000000, "world_size": 4, "records": []}')
    (tmp_path / "rank-6.json").write_text('{"rank": 6, "world_size": 4, "records": [{"seq": 1, "op": "' + "x" * 5000
                                          + '"}]}')
    document = json.loads((tmp_path / "rank-0.json").read_text())
    document["records"][:0] = [{"seq": "x", "op": "all_reduce"}, {"seq": 4, "op": 7}, "noise"]
    document["records"][-1]["shape"] = "not a shape"
    (tmp_path / "rank-0.json").write_text(json.dumps(document))
    text = analyze.render(tmp_path)
    assert "rank 3 wrote no dump (its dump is unreadable): ranks 0, 1 were waiting on it in broadcast #6" in text
    for name in ("rank-3.json", "rank-5.json", "rank-6.json", "rank-7.json", "rank-8.json", "rank-9.json"):
        assert f"unreadable: {name}: " in text, name
    assert "note: rank-0.json: 3 unreadable records skipped" in text
    assert "notes.txt" not in text


def test_analyzer_reads_the_records_of_a_dump_cut_short(tmp_path):
    entries = [_entry(seq, ended_mono=seq + 0.5) for seq in range(1, 10)] + [_entry(10, waiting_on=1)]
    _write_dump(tmp_path, 0, 2, entries, CollectiveTimeoutError("rank 0 timed out"))
    path = _write_dump(tmp_path, 1, 2, entries, CollectiveTimeoutError("rank 1 timed out"))
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:6]) + "\n" + lines[6][:20])  # the header, 5 records, part of the 6th
    text = analyze.render(tmp_path)
    assert "note: rank-1.json: cut short or damaged at line 7: read its first 5 records" in text
    assert "rank 0 is in all_reduce #10; rank 1 finished all_reduce #5 and started no call after it" in text
    assert "disagreement at #6: rank 0 reached all_reduce #6; rank 1 did not (last call: all_reduce #5)" in text


def test_debug_command_exit_codes(tmp_path, capsys):
    """0 and the report when DIR (or DIR/flight) holds dumps; 1 and why when it holds none; 2 for no folder."""
    _stuck_world(tmp_path / "run" / "flight")
    assert main(["debug", str(tmp_path / "run")]) == 0
    assert "ranks 0, 1 are in broadcast #6" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["debug", str(tmp_path / "empty")]) == 1
    assert "no readable flight record in" in capsys.readouterr().err
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "rank-0.json").write_text('{"a":')
    assert main(["debug", str(tmp_path / "garbage")]) == 1  # every dump damaged: each named with why
    assert "unreadable: rank-0.json: not valid JSON" in capsys.readouterr().err
    assert main(["debug", str(tmp_path / "absent")]) == 2


# ---------------------------------------------------------------- real failures over Gloo

WORLD_SIZE, ODD_RANK = 3, 1
HANG_TIMEOUT_S, HANG_GRACE_S = 1.0, 0.5


def _rank_flight_scenarios(root):
    """Three scenarios, each dumping into its own folder; returns ({scenario: seq of its failing call},
    this rank's (seq, op, state) from gradsync.flight_records()).

    mismatch: rank 1 all-reduces 5 elements, the others 4. skip: rank 1 skips an all_reduce and calls the
    next broadcast. hang: rank 1 stops calling (alive, silent) while the others all_reduce.
    """
    rank, comm = gradsync.rank(), default_communicator()
    comm.hang_detector.grace_s = HANG_GRACE_S  # the diagnosis after a timeout, shortened for the test
    seqs = {}
    os.environ[FOLDER_ENV] = os.path.join(root, "mismatch")
    gradsync.all_reduce(torch.ones(4))
    seqs["mismatch"] = comm.calls_started + 1
    with pytest.raises(CollectiveMismatchError):
        gradsync.all_reduce(torch.ones(5 if rank == ODD_RANK else 4))
    os.environ[FOLDER_ENV] = os.path.join(root, "skip")
    seqs["skip"] = comm.calls_started + 1
    with pytest.raises(CollectiveMismatchError):
        if rank == ODD_RANK:
            gradsync.broadcast(torch.ones(3))  # its all_reduce skipped
        else:
            gradsync.all_reduce(torch.ones(3))
    os.environ[FOLDER_ENV] = os.path.join(root, "hang")
    gradsync.broadcast(torch.ones(2))
    seqs["hang"] = comm.calls_started + 1
    if rank == ODD_RANK:  # alive and silent until the others have timed out and dumped
        others = [os.path.join(root, "hang", f"rank-{peer}.json") for peer in range(WORLD_SIZE) if peer != rank]
        deadline = time.monotonic() + HANG_TIMEOUT_S + 20
        while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        with pytest.raises(CollectiveTimeoutError):
            gradsync.all_reduce(torch.ones(2), timeout=HANG_TIMEOUT_S)
    return seqs, [(record["seq"], record["op"], record["state"]) for record in gradsync.flight_records()]


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    root = tmp_path_factory.mktemp("flight")
    per_rank = run_world(WORLD_SIZE, _rank_flight_scenarios, str(root), timeout_s=40)
    assert all(seqs == per_rank[0][0] for seqs, _ in per_rank), per_rank
    return root, per_rank[0][0], [records for _, records in per_rank]


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_real_mismatch_is_named_at_its_collective(scenarios):
    root, seqs, _ = scenarios
    text = analyze.render(root / "mismatch")
    k = seqs["mismatch"]
    assert "3 of 3 ranks dumped" in text
    assert f"ranks 0, 1, 2 are in all_reduce #{k}" in text
    assert f"disagreement at all_reduce #{k}: shape: rank 1 has (5,); ranks 0, 2 have (4,)" in text


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_real_skipped_collective_shows_the_ranks_in_different_collectives(scenarios):
    root, seqs, _ = scenarios
    k = seqs["skip"]
    text = analyze.render(root / "skip")
    assert f"rank 1 is in broadcast #{k}; ranks 0, 2 are in all_reduce #{k}" in text
    assert f"disagreement at #{k}: rank 1 is in broadcast #{k}; ranks 0, 2 are in all_reduce #{k}" in text


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_real_hang_names_the_silent_rank_from_its_peers_records(scenarios, capsys):
    root, seqs, _ = scenarios
    k = seqs["hang"]
    assert main(["debug", str(root / "hang")]) == 0
    text = capsys.readouterr().out
    assert not (root / "hang" / "rank-1.json").exists()
    assert "2 of 3 ranks dumped" in text
    assert f"ranks 0, 2 are in all_reduce #{k}; rank 1 wrote no dump" in text
    assert (f"rank 1 wrote no dump (frozen, killed, or its folder is not this one): ranks 0, 2 were waiting on it "
            f"in all_reduce #{k}, so it never reached all_reduce #{k} or froze inside it; the last call every rank "
            f"that dumped finished is broadcast #{k - 1}") in text
    assert "failed waiting on peer 1" in text and "stopped responding" in text
    records = load_folder(root / "hang").dumps[0].records
    assert records[k]["blamed"] == 1 and records[k]["start_wall"] >= records[k - 1]["end_wall"]


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_flight_records_returns_this_ranks_calls_in_order(scenarios):
    """gradsync.flight_records() on each rank: init, then each scenario's calls with their ops and states."""
    _, seqs, per_rank = scenarios
    m, s, h = seqs["mismatch"], seqs["skip"], seqs["hang"]
    for rank, records in enumerate(per_rank):
        skipped = "broadcast" if rank == ODD_RANK else "all_reduce"
        expected = [(1, "init", "done")] + [(seq, "all_reduce", "done") for seq in range(2, m)]
        expected += [(m, "all_reduce", "failed"), (s, skipped, "failed")]
        expected += [(seq, "broadcast", "done") for seq in range(s + 1, h)]
        if rank != ODD_RANK:
            expected.append((h, "all_reduce", "failed"))
        assert records == expected, (rank, records)
