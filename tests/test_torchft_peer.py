"""The torchft peer row: its arithmetic on hand-made step records, and a live run with one kill (needs torchft)."""

from __future__ import annotations

import pytest
import torch

from gradsync.bench.torchft_metrics import summarize
from gradsync.train.models import build_model


def _record(replica, step, t_end, committed=True, participants=2, participating=True, errored=False, piece=None):
    return {"replica": replica, "step": step, "committed": committed, "participants": participants,
            "participating": participating, "errored": errored, "quorum_id": 1, "piece": replica if piece is None
            else piece, "pieces": 2, "t_start": t_end - 0.05, "t_backward": t_end - 0.01, "t_end": t_end}


def test_summarize_measures_a_kill_by_hand():
    # global batch s = ids 4s..4s+3; replica r trains piece r (2 ids). Replica 1 is killed at t=10.
    steps = [_record(r, s, 9.0 + 0.1 * s) for s in range(3) for r in (0, 1)]
    steps += [_record(0, 3, 10.06, committed=False, errored=True),  # its AllReduce failed: detected at 10.05
              _record(0, 3, 11.2, participants=1),  # the quorum without replica 1: training again at 11.2
              _record(0, 4, 16.0), _record(1, 4, 16.0, participating=False),  # replica 1 heals: its piece lost
              _record(0, 5, 16.5), _record(1, 5, 16.5)]  # replica 1 trains again
    steps += [_record(0, 6, 17.0, participants=2)]  # replica 1 died after the AllReduce, before its log line
    row = summarize([{"victim": 1, "pid": 7, "time": 10.0}], sorted(steps, key=lambda r: r["t_end"]),
                    lambda step: torch.arange(4 * step, 4 * step + 4), start=9.0, end=20.0)
    failure = row["per_failure"][0]
    assert failure["detect_s"] == pytest.approx(0.05)
    assert failure["recover_s"] == pytest.approx(1.2)
    assert failure["steps_redone"] == 1  # step 3, in flight at the kill, tried again
    assert failure["joiner_s"] == pytest.approx(6.0)  # its healing commit: in step with replica 0
    assert failure["samples_lost"] == 2 + 2  # step 3 and step 4 lost replica 1's piece of 2 ids
    assert row["samples_lost"] == 4 and row["samples_duplicated"] == 0
    assert row["committed_steps"] == 7  # step 6's 2 participants trained both pieces, one logged
    assert row["samples_per_s"] == pytest.approx((7 * 4 - 4) / 11.0)


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_killed_replica_rejoins_from_its_peer_with_equal_parameters(tmp_path):
    pytest.importorskip("torchft")
    from gradsync.bench.torchft_peer import run_torchft_chaos

    [row] = run_torchft_chaos(nproc=2, duration_s=1.0, kill_every_s=0.5, seed=3, global_batch_size=32,
                              out_dir=tmp_path, fault_free=False, num_samples=400, data_dir=str(tmp_path / "data"))
    assert row["failures"] == 1 and row["relaunches"] == 1 and row["throughput_kept"] is None
    failure = row["failures_detail"][0]
    assert failure["recover_s"] is not None and failure["recover_s"] < 10  # the survivor trained on alone
    # the relaunched replica trained again: shown below by its new pid and its final step and parameters equal to
    # the survivor's (``joiner_s``, its first commit inside the 1 s window, is a measurement, None under load)
    finals = [torch.load(tmp_path / "chaos-0" / f"final{r}.pt", weights_only=True) for r in (0, 1)]
    killed = failure["victim"]
    assert finals[killed]["pid"] != [k for k in row["kills"][0] if k["victim"] == killed][0]["pid"]
    assert finals[0]["step"] == finals[1]["step"] == row["final_steps"][0] > 0
    for name, tensor in finals[0]["model"].items():
        assert torch.equal(tensor, finals[1]["model"][name]), name
    assert row["replicas_equal"] is True
    torch.manual_seed(3)  # the replicas' initial parameters (seed 3)
    fresh = build_model("cnn").state_dict()
    assert any(not torch.equal(fresh[name], finals[0]["model"][name]) for name in fresh)  # it trained


def test_summarize_detects_a_kill_between_steps_by_the_quorum_change():
    # replica 1 dies between steps; replica 0's next quorum (id 2) holds its healed replacement: no error, no shrink
    steps = [_record(r, 0, 9.0) for r in (0, 1)]
    steps += [dict(_record(0, 1, 11.1), quorum_id=2), dict(_record(1, 1, 11.1, participating=False), quorum_id=2)]
    row = summarize([{"victim": 1, "pid": 7, "time": 10.0}], steps, lambda step: torch.arange(4 * step, 4 * step + 4),
                    start=9.0, end=12.0)
    failure = row["per_failure"][0]
    assert failure["detect_s"] == pytest.approx(1.09) and failure["recover_s"] == pytest.approx(1.1)
    assert failure["steps_redone"] == 0 and failure["samples_lost"] == 2  # the healing replica's piece of step 1


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_a_replica_that_cannot_start_is_named_not_relaunched_forever(tmp_path):
    pytest.importorskip("torchft")
    import time

    from gradsync.bench.torchft_replicas import CRASH_LOOP, ReplicaCrashLoop, Replicas, start_forkserver

    start_forkserver()
    replicas = Replicas(1, tmp_path, ["--nproc", "1", "--lighthouse", "http://127.0.0.1:1", "--data",
                                      str(tmp_path / "missing.npz"), "--stop-file", str(tmp_path / "stop")])
    try:
        replicas.launch(0)
        deadline = time.monotonic() + 30
        with pytest.raises(ReplicaCrashLoop, match="(?s)replica 0 ended 3 times.*FileNotFoundError.*missing.npz"):
            while time.monotonic() < deadline:
                replicas.relaunch_exited()
                time.sleep(0.05)
        assert len(replicas.launches) == CRASH_LOOP == 3
    finally:
        replicas.close()
    assert replicas.all_exited()
