"""An elastic hand-over that leaves the replicas different raises, on every member (issue 36, item 7).

After each membership's state hand-over the trainer compares the members'
replicas; it used to record only ``replicas_equal: false`` in
``events.jsonl`` and train on from different weights. Expected
(docs/elastic.md): :class:`gradsync.ReplicaDivergenceError` on every member,
naming the tensor, the ranks on each side and the step handed over.

Two real processes run one hand-over of the sync elastic trainer with a
stand-in member (no quorum); rank 1 nudges one weight right after building
its replica from rank 0's bytes, as a bad restore or a bit flip would.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gradsync
from _dist import run_world
from gradsync.elastic.member import Membership
from gradsync.train import data
from gradsync.train.config import TrainConfig

STEP = 7  # committed steps rank 0 hands over


def _rank_handover_with_a_divergent_replica(data_path: str, out_dir: str):
    from gradsync.elastic.membership import ElasticMembership, View
    from gradsync.train import loop
    from gradsync.train.models import build_model

    rank = gradsync.rank()
    members = [{"slot": r, "incarnation": 0, "step": STEP if r == 0 else -1, "host": "h"} for r in range(2)]
    membership = Membership(2, rank, 2, members, "slot 1 joins", {"epoch": 2, "step": STEP, "joined": [1]})
    member = SimpleNamespace(slot=rank, incarnation=0, membership=membership)
    config = TrainConfig(nproc=2, elastic=True, deterministic=False, global_batch_size=64, num_samples=2000,
                         epochs=1, progress=False, out=out_dir)
    trainer = loop.Trainer(config, Path(data_path), Path(out_dir), ElasticMembership(member, Path(out_dir)))
    trainer.state.step = STEP
    if rank == 1:
        build = loop.build_replica

        def build_then_nudge(*args, **kwargs):
            model = build(*args, **kwargs)
            with torch.no_grad():
                first = next(model.module.parameters())
                first.view(-1)[0] = torch.nextafter(first.view(-1)[0], torch.tensor(9.0))
            return model

        loop.build_replica = build_then_nudge
    first = next(name for name, _ in build_model(config.model).named_parameters())
    try:
        trainer._start(View(rank, 2, 2, membership))
    except gradsync.ReplicaDivergenceError as error:
        return {"message": str(error), "tensor": error.tensor, "groups": error.groups, "step": error.step,
                "first": first}
    return {"message": None, "first": first}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_divergent_replica_after_a_handover_raises_naming_tensor_ranks_and_step(tmp_path):
    data_path = data.prepare(None, 2000)
    (tmp_path / "run").mkdir()
    results = run_world(2, _rank_handover_with_a_divergent_replica, str(data_path), str(tmp_path / "run"),
                        timeout_s=90)
    for rank, result in enumerate(results):
        assert result["message"] is not None, (f"rank {rank}: the hand-over left the replicas different and "
                                               f"nothing was raised")
        assert result["tensor"] == f"parameter '{result['first']}'", result
        assert result["groups"] == [[0], [1]] and result["step"] == STEP, result
        assert f"step {STEP}" in result["message"] and "rank 1" in result["message"], result
