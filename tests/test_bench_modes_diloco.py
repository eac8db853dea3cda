"""``bench modes``' DiLoCo rows: settings, the one bytes definition, the goal lines; torchft's row (slow).

The fast tests use synthetic runs (no processes); the slow one trains
gradsync's DiLoCo and torchft's on the same tiny job, whose fp32 results
must agree (same model, samples, schedule and outer step).
"""

from __future__ import annotations

import pytest

from gradsync.bench import modes, modes_diloco


def test_diloco_specs_become_local_sgd_settings_with_the_outer_step():
    """``H[:COMPRESSION[:F]]`` -> local-sgd + nesterov rows; torchft once per H of an fp32 one-fragment row."""
    settings = modes_diloco.parse_diloco("64, 64:int8, 16:fp32:4", 0.7, 0.5, torchft=True)
    outer = {"mode": "local-sgd", "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.5}
    assert settings == [
        {**outer, "sync_every": 64, "outer_compression": "fp32", "outer_fragments": 1},
        {**outer, "sync_every": 64, "outer_compression": "int8", "outer_fragments": 1},
        {**outer, "sync_every": 16, "outer_compression": "fp32", "outer_fragments": 4},
        {"mode": modes_diloco.TORCHFT, "sync_every": 64, "outer_optimizer": "nesterov", "outer_lr": 0.7,
         "outer_momentum": 0.5}]
    assert [modes.label(s) for s in settings] == ["diloco H=64", "diloco H=64 int8", "diloco H=16 F=4",
                                                   "torchft diloco H=64"]
    assert modes_diloco.train_config(settings[3], nproc=4).outer_optimizer == "nesterov"
    assert modes_diloco.parse_diloco("") == []


@pytest.mark.parametrize("specs, torchft, message", [
    ("64:int4", False, "--diloco: '64:int4': compression must be one of fp32, bf16, fp16, int8"),
    ("0", False, "--diloco: '0': H and F must be integers >= 1"),
    ("64:fp32:1:2", False, "--diloco: '64:fp32:1:2' is not H[:COMPRESSION[:F]]"),
    ("64,64", False, "--diloco repeats a row: 64,64"),
    ("64:int8", True, "--torchft-diloco needs an fp32 one-fragment row in --diloco"),
])
def test_bad_diloco_specs_raise_one_line(specs, torchft, message):
    with pytest.raises(ValueError) as caught:
        modes_diloco.parse_diloco(specs, torchft=torchft)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_bytes_per_rank_is_one_definition_for_every_mode():
    """AllReduce payload n counts 2(p-1)/p n (sync: every step's buckets; local SGD: its rounds), a push n."""
    buckets = [{"bucket_nbytes": 1000, "algorithm": "shm"}, {"bucket_nbytes": 500, "algorithm": "ring"}]
    sync = {"mode": "sync", "num_workers": 4, "steps": 10, "algorithms": buckets}
    local = {"mode": "local-sgd", "num_workers": 4, "steps": 10, "algorithms": buckets,
             "local_sgd": {"sync_payload_nbytes": 3000}}
    pushed = {"mode": "async", "num_workers": 4, "steps": 10, "gradients_pushed_per_worker": [3, 5],
              "algorithms": [{"bucket_nbytes": 1500, "algorithm": "parameter_server"}]}
    assert modes_diloco.bytes_per_rank(sync) == 10 * 1500 * 1.5
    assert modes_diloco.bytes_per_rank(local) == 3000 * 1.5
    assert modes_diloco.bytes_per_rank(pushed) == 4 * 1500


def _run(accuracy: float, speed: float, nbytes: float) -> dict:
    return {"num_workers": 4, "samples_per_s": speed, "seconds_to_target": None, "test_accuracy": accuracy,
            "best_test_accuracy": accuracy, "staleness_mean": 0.0, "staleness_max": 0, "wall_s": 1.0, "steps": 3,
            "samples": 10, "accuracy_curve": [[1.0, accuracy]], "run_folder": "r", "bytes_per_rank": nbytes}


def test_goal_lines_pair_repetitions_and_judge_each_goal():
    """Accuracy gaps are paired by repetition (pp), bytes and speed as ratios; each goal gets a verdict."""
    outer = {"mode": "local-sgd", "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9,
             "outer_fragments": 1}
    settings = [{"mode": "sync"}, {**outer, "sync_every": 64, "outer_compression": "fp32"},
                {**outer, "sync_every": 64, "outer_compression": "int8"},
                {"mode": modes_diloco.TORCHFT, "sync_every": 64, "outer_optimizer": "nesterov"}]
    runs = [[_run(0.90, 100.0, 6400.0), _run(0.92, 110.0, 6400.0)],
            [_run(0.896, 150.0, 100.0), _run(0.905, 160.0, 100.0)],   # -0.4 and -1.5 pp; 64x fewer
            [_run(0.893, 150.0, 25.0), _run(0.902, 150.0, 25.0)],     # int8 vs fp32: -0.3, -0.3 pp
            [_run(0.895, 100.0, 100.0), _run(0.90, 200.0, 100.0)]]    # ours vs torchft: +0.1, +0.5 pp; 1.5x, 0.8x
    rows = [modes.setting_row(setting, 1.0, run, runs[0], 0.85) for setting, run in zip(settings, runs)]
    goals = modes_diloco.goal_lines(rows)
    assert goals[0] == ("diloco H=64: accuracy vs sync -0.95 pp (-1.50--0.40) (goal >= -1 pp: met, straddles); "
                        "bytes 64x (64-64) fewer (goal >= 50x: met)")
    assert goals[1] == ("diloco H=64 int8: accuracy vs sync -1.25 pp (-1.80--0.70) (goal >= -1 pp: missed, "
                        "straddles); bytes 256x (256-256) fewer (goal >= 50x: met)")
    assert goals[2] == "diloco H=64 int8 vs diloco H=64: accuracy -0.30 pp (-0.30--0.30) (goal >= -0.5 pp: met)"
    assert goals[3] == ("diloco H=64 vs torchft diloco H=64 (bytes 1.00x theirs): accuracy +0.30 pp (+0.10-+0.50) "
                        "(goal >= 0: met); samples/s 1.15x (0.80-1.50) (goal >= 1x: met, straddles)")
    straggling = [modes.setting_row(setting, 3.0, run, runs[0], 0.85) for setting, run in zip(settings, runs)]
    assert [line.split(":")[0] for line in modes_diloco.goal_lines(rows + straggling)[4:]] == [
        "diloco H=64 with a 3x straggler", "diloco H=64 int8 with a 3x straggler",
        "torchft diloco H=64 with a 3x straggler"]  # samples/s against sync's, for the DiLoCo rows only
    other_h = [modes.setting_row({**settings[1], "sync_every": 16}, 1.0, runs[1], runs[0], 0.85), rows[0]]
    assert modes_diloco.goal_lines(other_h) == []  # the sync goal is H = 64's: another H is reported, not judged
    table = modes.format_table(rows)
    assert "0.006 (0.006-0.006)" in table and "64x (64-64)" in table and "int8" in table


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchft_diloco_row_matches_gradsync_diloco_on_the_same_job(tmp_path):
    """fp32, H = 8, 2 workers, 1 epoch: torchft's DiLoCo and gradsync's reach the same accuracy and bytes."""
    pytest.importorskip("torchft")
    options = {"nproc": 2, "epochs": 1, "num_samples": 2000, "data_dir": str(tmp_path / "data")}
    gradsync_setting, torchft_setting = modes_diloco.parse_diloco("8", 0.7, 0.9, torchft=True)
    ours = modes.run_setting(gradsync_setting, 1.0, tmp_path, options, 0.85)
    theirs = modes.run_setting(torchft_setting, 1.0, tmp_path, options, 0.85)
    assert ours["steps"] == theirs["steps"] and ours["samples"] == theirs["samples"]
    assert ours["bytes_per_rank"] == theirs["bytes_per_rank"]
    assert ours["test_accuracy"] == pytest.approx(theirs["test_accuracy"], abs=0.01)
