"""The elastic bench's per-failure figures: one scenario logged as gradsync and as torchft log it, the same numbers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from gradsync.bench import elastic_table
from gradsync.bench.elastic_metrics import RunEvents, all_failures, failure_figures, pooled
from gradsync.bench.faults_elastic import epochs_for, fault_row, reference_row, run_events, training_samples_per_s
from gradsync.bench.torchft_metrics import summarize
from gradsync.bench.torchft_rows import build_rows

# The scenario, 3 workers (slots / replicas 0, 1, 2); step index i = steps committed before it.
# Steps 0..6 commit at 3 + i. Kill A at 10.0 (victim 1) while step 7 is in flight: the survivors' step 7
# fails at 10.4; step 7 commits at 12.0 (8 at 13.0, 9 at 14.0); the relaunched 1 commits first at 15.0
# (step 10). Steps 10..24 commit at 5 + i. Kill B at 30.0 (victim 2) while step 25 is in flight: the
# survivors' step 25 fails at 30.5 and, tried again, at 31.0; it commits at 33.0; the relaunched 2
# commits first at 34.0 (step 26).
KILLS = [{"victim": 1, "time": 10.0}, {"victim": 2, "time": 30.0}]
EXPECTED = [{"detect_s": 0.4, "recover_s": 2.0, "steps_redone": 1, "joiner_s": 5.0},
            {"detect_s": 0.5, "recover_s": 3.0, "steps_redone": 2, "joiner_s": 4.0}]
COMMITS = {**{i: 3.0 + i for i in range(7)}, 7: 12.0, 8: 13.0, 9: 14.0, **{i: 5.0 + i for i in range(10, 25)},
           25: 33.0, 26: 34.0}
TIMEOUT = "CollectiveTimeoutError: all_reduce (algorithm=ring): peer rank 1 connection closed"
CHANGED = "MembershipChanged: the quorum closed this membership"


def _gradsync_folder(folder):
    """events.jsonl and metrics.jsonl as `gradsync train --elastic` writes them (rank 0's step records)."""
    def trained(epoch, time, step, joined=()):
        return {"event": "resumed_training", "epoch": epoch, "world_size": 3, "step": step, "joined": list(joined),
                "replicas_equal": True, "time": time}

    def left(slot, epoch, step, error, time):
        return {"event": "left", "slot": slot, "incarnation": 0, "epoch": epoch, "step": step, "error": error,
                "time": time}

    events = [trained(1, 2.5, 0, (0, 1, 2)),
              left(0, 1, 7, TIMEOUT, 10.4), left(2, 1, 7, TIMEOUT, 10.45), trained(2, 11.5, 7),
              left(0, 2, 10, CHANGED, 14.2), left(2, 2, 10, CHANGED, 14.2), trained(3, 14.5, 10, (1,)),
              left(0, 3, 25, TIMEOUT, 30.5), left(1, 3, 25, TIMEOUT, 30.55), trained(4, 30.8, 25),
              left(0, 4, 25, TIMEOUT, 31.0), left(1, 4, 25, TIMEOUT, 31.02), trained(5, 32.5, 25),
              left(0, 5, 26, CHANGED, 33.1), left(1, 5, 26, CHANGED, 33.1), trained(6, 33.2, 26, (2,))]
    steps = [{"kind": "step", "epoch": 0, "step": index + 1, "loss": 1.0, "time": time}
             for index, time in sorted(COMMITS.items())]
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    return folder


def _torchft_records():
    """The replicas' step records as gradsync.bench.torchft_worker writes them."""
    def record(replica, step, t_backward, committed=True, quorum=1, members=(0, 1, 2), participating=True):
        return {"replica": replica, "step": step, "committed": committed, "participants": len(members),
                "participating": participating, "errored": not committed, "quorum_id": quorum,
                "piece": members.index(replica), "pieces": len(members), "t_start": t_backward - 0.2,
                "t_backward": t_backward, "t_end": t_backward + (0.05 if committed else 0.1)}

    def commit(step, members, quorum, healing=()):
        t_end = COMMITS[step]
        return [dict(record(r, step, t_end - 0.05, quorum=quorum, members=members, participating=r not in healing))
                for r in members]

    records = [r for step in range(7) for r in commit(step, (0, 1, 2), 1)]
    records += [record(0, 7, 10.4, committed=False), record(2, 7, 10.45, committed=False)]
    records += [r for step in (7, 8, 9) for r in commit(step, (0, 2), 2)]
    records += commit(10, (0, 1, 2), 3, healing=(1,))
    records += [r for step in range(11, 25) for r in commit(step, (0, 1, 2), 3)]
    records += [record(r, 25, t, committed=False, quorum=3) for r, t in ((0, 30.5), (1, 30.55), (0, 31.0), (1, 31.02))]
    records += commit(25, (0, 1), 4) + commit(26, (0, 1, 2), 5, healing=(2,))
    return sorted(records, key=lambda r: r["t_end"])


def _figures(failure):
    return {name: failure[name] for name in ("detect_s", "recover_s", "steps_redone", "joiner_s")}


def test_both_libraries_logs_of_one_scenario_give_the_hand_computed_figures(tmp_path):
    gradsync = all_failures(run_events(_gradsync_folder(tmp_path)), KILLS)
    torchft = summarize(KILLS, _torchft_records(), lambda step: torch.arange(6 * step, 6 * step + 6),
                        start=3.0, end=35.0)["per_failure"]
    for failures in (gradsync, torchft):
        assert [f["victim"] for f in failures] == [1, 2]
        for failure, expected in zip(failures, EXPECTED):
            assert _figures(failure) == pytest.approx(expected)
    assert pooled(gradsync) == pytest.approx(pooled(torchft))
    row = pooled(gradsync)
    assert row["failures"] == 2
    assert (row["detect_s"], row["detect_s_min"], row["detect_s_max"]) == pytest.approx((0.45, 0.4, 0.5))
    assert (row["recover_s"], row["recover_s_max"]) == pytest.approx((2.5, 3.0))
    assert (row["steps_redone"], row["steps_redone_max"]) == pytest.approx((1.5, 2))  # the in-flight step counts
    assert (row["joiner_s"], row["joiner_s_max"]) == pytest.approx((4.5, 5.0))


def test_a_step_past_its_allreduce_at_the_kill_is_not_the_recovery():
    # step 7 commits at 10.2 although the kill came at 10.0; step 8 fails at 10.5, commits at 11.0
    events = RunEvents(commits=[(9.0, 6), (10.2, 7), (11.0, 8)], failed=[(10.5, 0, 8)])
    figures = failure_figures(events, 10.0, victim=1)
    assert figures["detect_s"] == pytest.approx(0.5) and figures["recover_s"] == pytest.approx(1.0)
    assert figures["steps_redone"] == 1 and figures["joiner_s"] is None


def test_a_kill_between_steps_seen_as_a_changed_membership_redoes_nothing_and_a_lost_commit_counts():
    between = RunEvents(commits=[(9.0, 6), (11.0, 7)], changed=[(10.3, 0)])
    assert failure_figures(between, 10.0, victim=1)["steps_redone"] == 0
    # the victim (rank 0) logged step 7 at 9.9, the survivors' try at it failed: step 7 runs again once
    lost = RunEvents(commits=[(9.0, 6), (9.9, 7), (12.0, 7)], failed=[(10.1, 0, 7)])
    assert failure_figures(lost, 9.95, victim=1)["steps_redone"] == 1
    seen = RunEvents(commits=lost.commits, changed=[(10.1, 0)])
    assert failure_figures(seen, 9.95, victim=1)["steps_redone"] == 1


def _run(samples_per_s, failures=(), folder=None):
    return SimpleNamespace(folder=folder, summary={"final_test_accuracy": 0.9, "wall_s": 10.0}, failures=list(failures),
                           samples={"samples_lost": 0, "samples_duplicated": 0}, replicas_equal=True,
                           samples_per_s=samples_per_s)


def _model(folder, value):
    folder.mkdir()
    torch.save({"w": torch.full((3,), value)}, folder / "model.pt")
    return folder


def test_throughput_kept_is_paired_within_each_repetition_for_both_libraries(tmp_path):
    calm_speeds, chaos_speeds = [100.0, 60.0, 200.0], [90.0, 57.0, 150.0]  # kept 0.90, 0.95, 0.75
    calm = [_run(s, folder=_model(tmp_path / f"calm{k}", 1.0)) for k, s in enumerate(calm_speeds)]
    chaos = [_run(s, [dict(EXPECTED[k % 2], victim=1, kill_time=0.0)], _model(tmp_path / f"chaos{k}", 1.0))
             for k, s in enumerate(chaos_speeds)]
    gradsync = fault_row("chaos", chaos, calm, nproc=3)
    runs = [{"samples_per_s": s, "repetition": k, "per_failure": [], "kills": [], "relaunches": 0, "final_step": 1,
             "steps_replicas_unequal": 0, "steps_replicas_compared": 1, "replicas_equal": True, "samples_lost": 0,
             "samples_duplicated": 0, "final_test_accuracy": 0.9, "committed_steps": 1, "attempts_uncommitted": 0,
             "load_average": {}, "run_folder": ""} for k, s in enumerate(chaos_speeds + calm_speeds)]
    torchft = build_rows(runs[:3], runs[3:], nproc=3, duration_s=60, kill_every_s=15, settings={})[1]
    for row in (gradsync, torchft):
        assert (row["throughput_kept"], row["throughput_kept_min"], row["throughput_kept_max"]) == pytest.approx(
            (0.90, 0.75, 0.95))
        assert row["fault_free_samples_per_s_median"] == pytest.approx(100.0)
    assert gradsync["failures"] == 3 and gradsync["steps_redone_max"] == 2
    assert gradsync["bitwise_equal_to_fault_free"] is True
    other = fault_row("kill", [chaos[0]], [_run(1.0, folder=_model(tmp_path / "other", 2.0))], nproc=3)
    assert other["bitwise_equal_to_fault_free"] is False and "throughput_kept" not in other


def test_fault_free_references_carry_no_comparison_and_show_dashes():
    gradsync = reference_row("chaos-none", [_run(100.0), _run(80.0)], nproc=3)
    torchft = build_rows([], [{"samples_per_s": 50.0, "replicas_equal": True, "samples_lost": 0,
                               "samples_duplicated": 0, "final_test_accuracy": 0.9, "final_step": 5,
                               "committed_steps": 5, "attempts_uncommitted": 0, "load_average": {},
                               "run_folder": ""}], nproc=3, duration_s=60, kill_every_s=15, settings={})[0]
    for row in (gradsync, torchft):
        assert row["reference"] is True and row["failures"] == 0
        for name in ("throughput_kept", "bitwise_equal_to_fault_free", "detect_s", "recover_s", "steps_redone",
                     "joiner_s"):
            assert row[name] is None, name
    assert (gradsync["samples_per_s"], gradsync["samples_per_s_min"]) == (90.0, 80.0)
    text = elastic_table.format_table([gradsync, torchft])
    lines = [line.split() for line in text.splitlines()]
    assert lines[2][:3] == ["gradsync", "chaos-none", "2"] and lines[2][5:] == ["-"] * 4
    throughput = lines[lines.index([]) + 3]
    assert throughput[:5] == ["gradsync", "chaos-none", "2", "90", "(80-100)"] and throughput[5] == "-"


def test_rows_recorded_before_the_common_definitions_render_dashes_not_their_old_figures():
    old = {"system": "torchft", "fault": "chaos", "nproc": 4, "failures": 9, "detect_s": 0.027, "recover_s": 0.39,
           "steps_lost_per_fault": 1, "throughput_kept": 0.983, "samples_per_s": 6428.2, "replicas_equal": True,
           "bitwise_equal_to_fault_free": None, "final_test_accuracy": 0.9657, "samples_lost": 0,
           "samples_duplicated": 0}
    lines = [line.split() for line in elastic_table.format_table([old]).splitlines()]
    assert lines[2] == ["torchft", "chaos", "1", "4", "9", "-", "-", "-", "-"]
    assert lines[6][3:5] == ["6428", "0.983"]


def test_chaos_runs_last_about_chaos_s_and_throughput_leaves_out_the_start_up(tmp_path):
    # 2 epochs of 11 steps, one every 0.5 s (5.5 s of training) in a run of 9.5 s wall: 4 s start-up
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"kind": "step", "step": i + 1, "time": 100.0 + 0.5 * i})
                                                    + "\n" for i in range(11)))
    run = SimpleNamespace(folder=tmp_path, summary={"wall_s": 9.5})
    assert epochs_for(run, epochs=2, seconds=60.0) == 20  # (60 - 4) / 2.75 = 20.4
    assert epochs_for(run, epochs=2, seconds=1.0) == 1
    assert training_samples_per_s(tmp_path, global_batch_size=128) == pytest.approx(10 * 128 / 5.0)
