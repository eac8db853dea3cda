"""The elastic parameter server: no update lost or applied twice when the server or a worker is killed.

* a killed server (SIGKILL, after a checkpoint, with pushes applied since)
  restarts from its checkpoint, the workers replay what it does not hold and
  the one-hot run still ends at exactly -1 everywhere (0: a lost update, -2: a
  duplicate);
* a killed worker is replaced while the same server process keeps serving;
* a duplicate ``(slot, seq)`` is dropped; the checkpoint round-trips the
  whole state, staleness record included;
* ``run_elastic_async`` (``gradsync train --mode async --elastic``) survives
  its server's death and counts every update once in its summary.

Process tests run the quorum service and one launcher per slot
(``_ps_elastic.py``); every wait is bounded and every process is ended by PID.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from _ps_elastic import Plan, run, run_slots, train_slot_main
from _ps_helpers import Vector, one_hot
from gradsync.elastic.ps_server import ElasticParameterServer
from gradsync.parallel.ps_ledger import Ledger, incarnation_seq
from gradsync.parallel.ps_protocol import PUSH, REPLAY
from gradsync.train import data, elastic_async
from gradsync.train.config import TrainConfig
from gradsync.train.validation import validate


def _push(numel: int, step: int, loss: float | None = None) -> torch.Tensor:
    """A push payload for the Vector model: the one-hot gradient of ``step``, then the loss."""
    return torch.cat([one_hot(numel, step), torch.tensor([float(step) if loss is None else loss])])


def _header(kind: int, version_read: int, step: int, seq: int) -> torch.Tensor:
    return torch.tensor([kind, version_read, step, seq], dtype=torch.int64)


def _server(tmp_path, numel: int = 8, momentum: float = 0.0, **kwargs) -> ElasticParameterServer:
    model = Vector(numel)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=momentum)
    kwargs.setdefault("checkpoint_every", 100)
    return ElasticParameterServer(model, optimizer, numel, tmp_path / "ckpt", **kwargs)


# --------------------------------------------------------------------------------------------------
# Units: dedupe, the ledger, checkpoint contents
# --------------------------------------------------------------------------------------------------

def test_duplicate_slot_seq_is_dropped(tmp_path):
    """The same (slot, seq) twice is applied once; the same seq from another slot is a different push."""
    server = _server(tmp_path)
    for step in range(3):
        server.ledger.take(slot=0)
    assert server.apply(0, _header(PUSH, 0, 0, 1), _push(8, 0))
    assert not server.apply(0, _header(REPLAY, 0, 0, 1), _push(8, 0))  # the replay of an applied push
    assert server.apply(0, _header(REPLAY, 0, 1, 2), _push(8, 1))      # a replay it had not applied
    assert not server.apply(0, _header(REPLAY, 0, 1, 2), _push(8, 1))
    assert server.version == 2 and server.ledger.duplicates == 2 and server.applied_per_slot == {0: 2}
    assert server.module.weight.detach().tolist() == [-1, -1, 0, 0, 0, 0, 0, 0]
    # an older seq than the slot's highest is a duplicate too (pushes of a slot are applied in order)
    assert not server.apply(0, _header(REPLAY, 0, 2, 1), _push(8, 2))
    assert server.apply(1, _header(PUSH, 0, 2, 1), _push(8, 2))        # slot 1's seq 1: new
    assert server.module.weight.detach().tolist() == [-1, -1, -1, 0, 0, 0, 0, 0] and server.ledger.duplicates == 3
    assert server.ledger.applied_seq == {0: 2, 1: 1}


def test_a_step_is_never_applied_twice_even_under_a_new_seq(tmp_path):
    """A second push of an applied step (only a double failure could make one) is dropped, not applied."""
    server = _server(tmp_path)
    server.ledger.take(slot=0)
    assert server.apply(0, _header(PUSH, 0, 0, 1), _push(8, 0))
    assert not server.apply(1, _header(PUSH, 1, 0, 1), _push(8, 0))
    assert not server.apply(1, _header(PUSH, 1, 99, 2), _push(8, 0))  # outside the run
    assert server.version == 1 and server.ledger.duplicates == 2 and server.module.weight.detach()[0] == -1


def test_ledger_requeues_lost_steps_and_skips_replayed_ones():
    """Assigned steps whose worker died go out again first; steps a replay applied are never handed out."""
    ledger = Ledger(total_steps=6)
    assert [ledger.take(slot) for slot in (0, 1, 2)] == [0, 1, 2]
    ledger.complete(0, slot=0, seq=incarnation_seq(0, 1))
    assert ledger.requeue_assigned() == [1, 2] and ledger.assigned == {}
    assert ledger.take(slot=0) == 1
    ledger.complete(4, slot=1, seq=incarnation_seq(1, 1))  # a replay of a step handed out after a checkpoint
    assert [ledger.take(0), ledger.take(0), ledger.take(0), ledger.take(0)] == [2, 3, 5, None]
    assert ledger.applied_seq == {0: 1, 1: (1 << 32) + 1}
    with pytest.raises(ValueError, match="total_steps"):
        Ledger(-1)


def test_checkpoint_round_trips_the_whole_state(tmp_path):
    """Parameters, momentum, scheduler, version, ledger, staleness histogram, per-slot counts, losses and
    the caller's state come back equal in a fresh server; replies then report the checkpoint durable."""
    server = _server(tmp_path, momentum=0.9, max_staleness=3)
    server.scheduler = torch.optim.lr_scheduler.StepLR(server.optimizer, step_size=2, gamma=0.5)
    server.user_state = {"epochs": [{"epoch": 0, "test_accuracy": 0.25}], "eval_s": 1.5}
    for slot in (0, 1, 2, 0):
        server.ledger.take(slot)
    # version_read 0 each time: staleness 0, 1, 2, then a replay from a "newer" version: clamped to 0
    for step, (slot, seq, version_read) in enumerate([(0, 1, 0), (1, 1, 0), (2, 1, 0), (0, 2, 9)]):
        assert server.apply(slot, _header(PUSH, version_read, step, seq), _push(8, step, loss=step / 2))
    server.ledger.take(1)
    server.ledger.requeue_assigned()
    assert server.staleness.histogram == [2, 1, 1]
    folder = server.checkpoint()
    assert folder.name == "step-000000004" and server.durable_seq == {0: 2, 1: 1, 2: 1}

    fresh = _server(tmp_path, momentum=0.9, max_staleness=3)
    fresh.scheduler = torch.optim.lr_scheduler.StepLR(fresh.optimizer, step_size=2, gamma=0.5)
    assert fresh.restore() and fresh.restored_from == folder
    assert torch.equal(fresh.module.weight.detach(), server.module.weight.detach())
    momentum = [fresh.optimizer.state[p]["momentum_buffer"] for p in fresh.params]
    assert all(torch.equal(a, server.optimizer.state[p]["momentum_buffer"]) for a, p in zip(momentum, server.params))
    assert fresh.scheduler.state_dict() == server.scheduler.state_dict()
    assert fresh.optimizer.param_groups[0]["lr"] == server.optimizer.param_groups[0]["lr"] == 0.25
    assert fresh.version == 4 and fresh.checkpointed_version == 4
    assert fresh.ledger.state_dict() == server.ledger.state_dict()
    assert fresh.ledger.requeue == [4] and fresh.ledger.next_step == 5
    assert fresh.staleness.histogram == [2, 1, 1] and fresh.staleness.max == 2
    assert fresh.applied_per_slot == {0: 2, 1: 1, 2: 1} and fresh.losses == [0.0, 0.5, 1.0, 1.5]
    assert fresh.user_state == server.user_state and fresh.durable_seq == {0: 2, 1: 1, 2: 1}
    # the flat buffer the workers are sent is still the module's storage
    fresh.module.weight.data.add_(1.0)
    assert torch.equal(fresh.flat[:8], fresh.module.weight.detach())


def test_no_checkpoint_means_a_fresh_start_and_bad_arguments_are_named(tmp_path):
    server = _server(tmp_path)
    assert not server.restore() and server.version == 0 and server.restored_from is None
    with pytest.raises(ValueError, match="checkpoint_every"):
        _server(tmp_path, checkpoint_every=0)
    with pytest.raises(ValueError, match="timeout"):
        _server(tmp_path, timeout=math.inf)
    with pytest.raises(ValueError, match="not a parameter-server checkpoint"):
        server.load_state_dict({"kind": "something else"})


def test_a_checkpoint_of_another_job_is_refused_before_and_at_restore(tmp_path):
    """check_resumable names the option that differs; the server's own restore refuses it too, before
    loading anything; --nproc may differ (step k is the same batch whoever computes it)."""
    config = TrainConfig(mode="async", elastic=True, nproc=2, lr=0.05, checkpoint_dir=str(tmp_path / "ckpt"))
    elastic_async.check_resumable(config, tmp_path)  # no checkpoint yet: nothing to refuse
    server = _server(tmp_path)
    server.user_state = {"job": elastic_async._job_fields(config)}
    server.checkpoint()
    elastic_async.check_resumable(replace(config, nproc=5), tmp_path)
    other = replace(config, lr=0.1, max_staleness=2)
    with pytest.raises(ValueError, match=r"belongs to another job: --lr 0.05 there, 0.1 here; --max-staleness None"):
        elastic_async.check_resumable(other, tmp_path)
    fresh = _server(tmp_path)
    with pytest.raises(ValueError, match="--lr 0.05 there"):
        fresh.restore(check=lambda saved, folder: elastic_async.check_compatible(other, saved, folder))
    assert fresh.version == 0 and fresh.restored_from is None
    server.user_state = {}
    server.apply(0, _header(PUSH, 0, server.ledger.take(0), 1), _push(8, 0))
    server.checkpoint()
    with pytest.raises(ValueError, match="does not say which job wrote it"):
        elastic_async.check_resumable(config, tmp_path)


def test_elastic_async_accepts_checkpoint_options_plain_async_does_not(tmp_path):
    validate(TrainConfig(mode="async", elastic=True, checkpoint_dir=str(tmp_path), checkpoint_every=7))
    assert TrainConfig(mode="async", elastic=True).checkpointing()
    with pytest.raises(ValueError, match="--checkpoint-dir applies to --mode sync"):
        validate(TrainConfig(mode="async", checkpoint_dir=str(tmp_path)))


# --------------------------------------------------------------------------------------------------
# Processes: a killed server, a killed worker (one-hot gradients)
# --------------------------------------------------------------------------------------------------

def _assert_every_update_once(reports: dict, server_key: tuple, total_steps: int) -> None:
    server = reports[server_key]
    assert torch.equal(server["params"], torch.full((total_steps,), -1.0)), server["params"]
    assert server["version"] == total_steps == sum(server["applied_per_slot"].values())
    for key, report in reports.items():
        if key[0] != server_key[0]:  # every worker ends with the final parameters and nothing kept
            assert torch.equal(report["params"], server["params"]) and report["kept"] == 0, key


@pytest.mark.timeout(60)
def test_killed_server_restarts_from_its_checkpoint_and_workers_replay(tmp_path):
    total, every, dies_at = 60, 5, 17
    out = run(Plan(nproc=3, total_steps=total, checkpoint_every=every, folder=str(tmp_path), server_dies_at=dies_at))
    assert out["exitcodes"] == {0: [0], 1: [0], 2: [0], 3: [-9, 0]}
    reports = out["reports"]
    assert set(reports) == {(0, 0), (1, 0), (2, 0), (3, 1)}  # the first server died before reporting
    server = reports[(3, 1)]
    # it came back from the newest checkpoint before the kill: updates 16 and 17 were applied, not durable
    assert server["restored"] and server["restored_version"] == dies_at // every * every
    _assert_every_update_once(reports, (3, 1), total)
    workers = [reports[(slot, 0)] for slot in range(3)]
    assert sum(w["replayed"] for w in workers) >= dies_at - server["restored_version"]
    # every step was computed exactly once: a replayed push is not recomputed, nor handed out again
    assert sorted(s for w in workers for s in w["steps"]) == list(range(total))
    assert sum(w["pushes"] for w in workers) == total
    assert server["durable_seq"] == {slot: workers[slot]["pushes"] for slot in range(3)}


@pytest.mark.timeout(60)
def test_killed_worker_is_replaced_while_the_server_keeps_serving(tmp_path):
    total = 60
    out = run(Plan(nproc=2, total_steps=total, checkpoint_every=50, folder=str(tmp_path), worker_dies=(1, 3)))
    assert out["exitcodes"] == {0: [0], 1: [-9, 0], 2: [0]}
    reports = out["reports"]
    assert set(reports) == {(0, 0), (1, 1), (2, 0)}
    server = reports[(2, 0)]
    assert len(out["pids"][2]) == 1 and server["pid"] == out["pids"][2][0] and not server["restored"]
    assert server["memberships"] >= 2  # the same process served the membership after the death
    _assert_every_update_once(reports, (2, 0), total)
    # the dead worker's 2 pushes were applied, its 3rd step went to another worker; the replacement pushed
    replacement = reports[(1, 1)]
    assert replacement["pushes"] > 0 and replacement["replayed"] == 0
    assert server["applied_per_slot"][1] == 2 + replacement["pushes"]
    assert sorted(step for _, step in server["applied"]) == list(range(total))


@pytest.mark.timeout(60)
def test_hung_server_is_evicted_and_restarts_from_its_checkpoint(tmp_path):
    """A server that stops answering (SIGSTOP) is named by the workers' timeouts, evicted (its launcher
    kills it) and relaunched from its checkpoint: still every update exactly once."""
    total, every, hangs_at = 30, 4, 10
    out = run(Plan(nproc=2, total_steps=total, checkpoint_every=every, folder=str(tmp_path), server_dies_at=hangs_at,
                   hang=True, timeout_s=1.5))
    assert out["exitcodes"] == {0: [0], 1: [0], 2: [-9, 0]}  # SIGKILLed by its launcher on eviction
    server = out["reports"][(2, 1)]
    assert server["restored"] and server["restored_version"] == 8
    _assert_every_update_once(out["reports"], (2, 1), total)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["slot"], e["why"].split(":")[0]) for e in events if e["event"] == "evict"] == [(2, "evicted")]


# --------------------------------------------------------------------------------------------------
# gradsync train --mode async --elastic (run_elastic_async)
# --------------------------------------------------------------------------------------------------

def _train(tmp_path, name: str, config: TrainConfig, server_dies_at: int | None) -> tuple[dict, dict, list]:
    """One elastic async run through run_elastic_async: (launch outcome, server summary, metrics records)."""
    out_dir = tmp_path / name
    out_dir.mkdir()
    config = replace(config, out=str(out_dir))
    out = run_slots(config.nproc, train_slot_main, (config, str(data.prepare(tmp_path / "data", 400)), str(out_dir),
                                                    server_dies_at), str(out_dir))
    saved = torch.load(out_dir / "summary.pt", weights_only=False)
    assert saved["pid"] == out["pids"][config.nproc][-1]
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return out, saved["summary"], records


@pytest.mark.timeout(90)
def test_run_elastic_async_survives_its_server_and_keeps_the_trajectory(tmp_path):
    """gradsync train --mode async --elastic: the server killed after update 15 (checkpoint at 12) comes
    back, counts every update once, and under --max-staleness 0 (serial) the run is bitwise the
    fault-free one: same per-step losses, same final test loss."""
    config = TrainConfig(mode="async", elastic=True, nproc=2, epochs=2, batch_size=16, num_samples=400,
                         checkpoint_every=6, timeout=5.0, progress=False, max_staleness=0)
    validate(config)
    total = 2 * (320 // 16)
    clean_out, clean, clean_records = _train(tmp_path, "clean", config, None)
    out, summary, records = _train(tmp_path, "killed", config, 15)
    assert clean_out["exitcodes"] == {0: [0], 1: [0], 2: [0]} and clean["restored_from"] is None
    assert out["exitcodes"] == {0: [0], 1: [0], 2: [-9, 0]}
    assert summary["elastic"] and summary["updates_applied"] == summary["steps"] == total
    assert sum(summary["updates_applied_per_worker"]) == total == sum(summary["staleness_histogram"])
    assert summary["restored_from"].endswith("step-000000012")
    restarts = [r for r in records if r["kind"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["version"] == 12
    assert {r["epoch"] for r in records if r["kind"] == "epoch"} == {0, 1}
    assert (tmp_path / "killed" / "checkpoints" / f"step-{total:09d}" / "MANIFEST.json").is_file()
    # the trajectory: the losses of steps 1..total (the last record of each: a restart may log one twice)
    def losses(rows):
        return {r["step"]: r["loss"] for r in rows if r["kind"] == "step"}
    assert sorted(losses(records)) == list(range(1, total + 1))
    assert losses(records) == losses(clean_records)
    final, clean_final = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("killed", "clean"))
    assert final.keys() == clean_final.keys() and all(torch.equal(final[k], clean_final[k]) for k in final)
    for key in ("final_test_loss", "final_test_accuracy", "final_train_loss", "staleness_histogram"):
        assert summary[key] == clean[key], key
