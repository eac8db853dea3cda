"""Reliability of an elastic run's pieces on their own (issue 36, item 7), in this process.

A corrupt newest elastic checkpoint is reported (a :class:`CheckpointWarning`
naming the file and what is wrong with it) before the one before it is
resumed. A member's heartbeat outlives a store error that passes, so the
quorum does not evict a healthy member, and ends, saying so, only when told
to or when the store stays gone longer than the member's timeout.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from gradsync.fault.checkpoint import CheckpointWarning
from gradsync.train import elastic_checkpoint
from gradsync.train.config import TrainConfig


# ---------------------------------------------------------------- checkpoints


def _save(config: TrainConfig, step: int):
    state = {"model": {"w": torch.full((4,), float(step))}, "optimizer": {}, "scheduler": {},
             "progress": {"step": step}, "global_batch": 32}
    return elastic_checkpoint.save(config, state, world_size=2)


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
        path, state = elastic_checkpoint.latest(config)
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
        found, skipped = elastic_checkpoint.scan(config)
    assert found[0].name == "step-00000010.pt"
    assert len(skipped) == 1 and str(newest) in skipped[0]


def test_every_elastic_checkpoint_corrupt_is_reported_and_none_resumes(tmp_path):
    config = TrainConfig(checkpoint_dir=str(tmp_path))
    only = _save(config, 10)
    only.write_bytes(b"")
    with pytest.warns(CheckpointWarning, match=str(only)):
        assert elastic_checkpoint.latest(config) is None
