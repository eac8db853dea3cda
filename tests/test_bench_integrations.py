"""``gradsync bench train --integrations``: which jobs run, the ratios within each repetition, the goal, bad input."""

import pytest

from gradsync.bench.integration_jobs import step_seconds, window_sizes
from gradsync.bench.train_integrations import (format_integration_table, goal_lines, impls_for, integration_rows,
                                               plain_peer, run_integrations)


def test_impls_for_names_the_plain_loops_and_each_integrations_pair():
    assert impls_for(["ray"]) == ["gradsync", "ddp", "ray-gradsync", "ray-ddp"]
    assert impls_for(["ray", "lightning"]) == ["gradsync", "ddp", "lightning-gradsync", "lightning-ddp",
                                               "ray-gradsync", "ray-ddp"]
    assert [plain_peer(impl) for impl in ("lightning-ddp", "ray-gradsync", "gradsync")] == ["ddp", "gradsync",
                                                                                          "gradsync"]


def test_rows_pair_each_repetition_with_the_plain_loops_of_the_same_repetition():
    # steps of 1280 samples; repetition k's seconds per step per implementation
    times = {"gradsync": [1.0, 2.0, 1.0], "ddp": [1.0, 1.0, 1.0], "lightning-gradsync": [1.02, 2.0, 1.1],
             "lightning-ddp": [2.0, 1.0, 1.0]}
    rows = {row["impl"]: row for row in integration_rows(times, {"model": "mlp", "world_size": 2,
                                                                  "algorithm": "auto"}, 1280)}
    lightning = rows["lightning-gradsync"]
    expected = sorted([1.0 / 1.02, 2.0 / 2.0, 1.0 / 1.1])  # samples/s ratio = inverse seconds ratio
    assert lightning["vs_gradsync"] == pytest.approx(expected[1])
    assert (lightning["vs_gradsync_min"], lightning["vs_gradsync_max"]) == pytest.approx((expected[0], expected[2]))
    assert lightning["samples_per_s"] == pytest.approx(1280 / 1.1)  # median of 1280/1.02, 640, 1280/1.1
    assert lightning["goal_verdict"] == "met, straddles"  # median 1/1.02 = 0.980 >= 0.97; min 1/1.1 below
    assert rows["lightning-ddp"]["vs_plain"] == pytest.approx(1.0)  # against ddp: 0.5, 1, 1
    assert rows["lightning-ddp"]["plain_peer"] == "ddp" and "goal" not in rows["lightning-ddp"]
    assert rows["lightning-ddp"]["algorithm"] == "native" and rows["gradsync"]["algorithm"] == "auto"
    assert "lightning-gradsync" in format_integration_table(list(rows.values()))
    assert goal_lines(list(rows.values()))[0].startswith("# goal: lightning-gradsync within 3%")


def test_bad_integration_name_and_several_algorithms_are_refused_before_any_job():
    with pytest.raises(ValueError, match="unknown 'horovod' in --integrations"):
        run_integrations(integrations="horovod", nproc="2", models="mlp", algorithms="auto", steps=5, warmup=1,
                         repeat=1, json_path=None)
    with pytest.raises(ValueError, match="one gradsync algorithm"):
        run_integrations(integrations="ray", nproc="2", models="mlp", algorithms="auto,ring", steps=5, warmup=1,
                         repeat=1, json_path=None)


def test_a_job_reports_its_median_window_per_step():
    sizes = window_sizes(20)
    assert sizes == [4] * 5 and sum(window_sizes(23)) == 23 and max(window_sizes(23)) - min(window_sizes(23)) == 1
    # one window slowed by other load (40 s) does not move the figure; per step: 1, 1.25, 10, 0.75, 1
    assert step_seconds([4.0, 5.0, 40.0, 3.0, 4.0], sizes) == 1.0
