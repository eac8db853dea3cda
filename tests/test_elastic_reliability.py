"""Reliability of an elastic run's pieces on their own (issue 36, item 7), in this process.

A corrupt newest elastic checkpoint is reported (a :class:`CheckpointWarning`
naming the file and what is wrong with it) before the one before it is
resumed. A member's heartbeat outlives a store error that passes, so the
quorum does not evict a healthy member, and ends, saying so, only when told
to or when the store stays gone longer than the member's timeout.
"""

from __future__ import annotations

import datetime
import threading
import warnings

import pytest
import torch
import torch.distributed as dist

from gradsync.elastic.member import ElasticMember, start_heartbeat
from gradsync.elastic.quorum import HEARTBEAT_STALE_S, Quorum
from gradsync.elastic.run_store import EventReader
from gradsync.fault.checkpoint import CheckpointWarning
from gradsync.elastic import run_checkpoint as elastic_checkpoint
from gradsync.train.config import TrainConfig


# ---------------------------------------------------------------- checkpoints


def _save(config: TrainConfig, step: int):
    state = {"model": {"w": torch.full((4,), float(step))}, "optimizer": {}, "scheduler": {},
             "progress": {"step": step}, "global_batch": 32}
    return elastic_checkpoint.save(_root(config), state, 2, config.keep_checkpoints, {})


def _root(config: TrainConfig):
    return elastic_checkpoint.folder(config.checkpoint_dir)


@pytest.mark.parametrize("damage", ["truncate", "empty", "not_a_checkpoint"])
def test_a_corrupt_newest_elastic_checkpoint_is_reported_then_the_one_before_resumes(tmp_path, damage):
    """The skipped file is named in a CheckpointWarning with its problem; the older complete one is returned."""
    config = TrainConfig(checkpoint_dir=str(tmp_path), keep_checkpoints=3)
    _save(config, 10)
    newest = _save(config, 20)
    if damage == "truncate":
        newest.write_bytes(newest.read_bytes()[:200])
    elif damage == "empty":
        newest.write_bytes(b"")
    else:  # a readable file that is no elastic checkpoint (another program's, a half-migrated one)
        torch.save({"weights": torch.ones(2)}, newest)
    with pytest.warns(CheckpointWarning) as caught:
        path, state = elastic_checkpoint.latest(_root(config))
    assert path.name == "step-00000010.pt" and state["progress"]["step"] == 10
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and str(newest) in messages[0], messages
    assert ("cannot be read" if damage != "not_a_checkpoint" else "lacks") in messages[0], messages


def test_the_skipped_checkpoints_are_returned_for_the_run_to_record(tmp_path):
    """scan() gives the run the same lines the warning shows, and warns nothing itself."""
    config = TrainConfig(checkpoint_dir=str(tmp_path))
    _save(config, 10)
    newest = _save(config, 20)
    newest.write_bytes(b"garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found, skipped = elastic_checkpoint.scan(_root(config))
    assert found[0].name == "step-00000010.pt"
    assert len(skipped) == 1 and str(newest) in skipped[0]


def test_every_elastic_checkpoint_corrupt_is_reported_and_none_resumes(tmp_path):
    config = TrainConfig(checkpoint_dir=str(tmp_path))
    only = _save(config, 10)
    only.write_bytes(b"")
    with pytest.warns(CheckpointWarning, match=str(only)):
        assert elastic_checkpoint.latest(_root(config)) is None


# ---------------------------------------------------------------- heartbeats


class _FlakyStore:
    """The run's store as a member sees it: the heartbeat's first ``failures`` adds raise (a store that
    hiccups: a reset connection, a slow answer), later ones land and are counted (``wait_landed``)."""

    def __init__(self, store, failures: int):
        self.store, self.failures, self.landed = store, failures, 0
        self.changed = threading.Condition()

    def add(self, key, amount):
        if not key.startswith("hb/"):
            return self.store.add(key, amount)
        with self.changed:
            if self.failures:
                self.failures -= 1
                raise RuntimeError("injected: Connection reset by peer")
        value = self.store.add(key, amount)
        with self.changed:
            self.landed += 1
            self.changed.notify_all()
        return value

    def wait_landed(self, count: int, timeout_s: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.landed >= count, timeout_s)

    def set(self, key, value):
        self.store.set(key, value)

    def get(self, key):
        return self.store.get(key)

    def check(self, keys):
        return self.store.check(keys)


def test_a_transient_store_error_does_not_stop_the_heartbeat_nor_evict_a_healthy_member(caplog):
    """Three failed beats, then the store answers again: the member beats on and the quorum keeps it."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=2))
    clock = [0.0]
    quorum = Quorum(store, 1, 1, 2, timeout_s=60.0, clock=lambda: clock[0])
    flaky = _FlakyStore(store, failures=3)
    member = ElasticMember(flaky, slot=0, incarnation=0, timeout_s=30.0)
    member.join()
    reader = EventReader(store)
    quorum.handle(reader.next(timeout_s=5.0))
    quorum.tick()
    assert store.check(["q/members/1"])
    quorum.handle({"kind": "join", "slot": 1, "incarnation": 0, "step": -1})  # closes epoch 1: slot 0 must answer
    try:
        quorum.tick()  # the quorum reads slot 0's heartbeat counter now ...
        landed = flaky.landed
        assert flaky.wait_landed(landed + 1, timeout_s=30.0), "the heartbeat stopped after a store error"
        clock[0] = HEARTBEAT_STALE_S + 1.0
        quorum.tick()  # ... and again later: it moved, so slot 0 is alive
        assert not store.check(["q/evict/0/0"]), store.get("q/evict/0/0")
        assert "Connection reset by peer" in caplog.text  # the failure was told, not swallowed
    finally:
        member.stop_heartbeat()


class _GoneStore:
    def add(self, key, amount):
        raise RuntimeError("injected: Connection refused")


def test_the_heartbeat_ends_and_says_so_when_the_store_stays_gone_past_the_timeout(caplog):
    thread = start_heartbeat(_GoneStore(), 3, 1, timeout_s=0.5, stop=threading.Event())
    thread.join(timeout=30.0)
    assert not thread.is_alive()
    assert "slot 3" in caplog.text and "0.5 s" in caplog.text and "Connection refused" in caplog.text


def test_the_heartbeat_ends_when_stopped():
    stop = threading.Event()
    flaky = _FlakyStore(dist.HashStore(), failures=0)
    thread = start_heartbeat(flaky, 0, 0, timeout_s=30.0, stop=stop)
    assert flaky.wait_landed(1, timeout_s=30.0)
    stop.set()
    thread.join(timeout=30.0)
    assert not thread.is_alive()
