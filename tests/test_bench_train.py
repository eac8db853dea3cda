"""``bench train``'s rows from synthetic per-repetition times: ratios paired per repetition, DDP's peer, the goal.

Every figure below is worked out by hand from the synthetic times (10 steps,
a batch of 64 on 2 ranks: 128 samples per step).
"""

from __future__ import annotations

import pytest

from gradsync.bench.train_rows import (COMPUTE_ONLY, add_goal, ddp_peer, format_table, goal_lines, measured_keys,
                                       throughput_rows)
from gradsync.cli import main

STEPS, SAMPLES_PER_STEP = 10, 128
BASE = {"model": "mlp", "world_size": 2, "batch_per_rank": 64, "steps": STEPS, "threads_per_rank": 1}
COMPUTE, AUTO = (COMPUTE_ONLY, "none", False), ("gradsync", "auto", False)
ZERO_COPY, DDP, DDP_VIEW = ("gradsync", "shm_zero_copy", True), ("ddp", "native", False), ("ddp", "native", True)


def _runs(elapsed, cpu=None, comm=None, exposed=None):
    """One measurement per repetition: seconds over the STEPS timed steps."""
    runs = [{"elapsed_s": seconds, "comm_s": 0.0, "exposed_comm_s": 0.0} for seconds in elapsed]
    for name, values in (("cpu_s", cpu), ("comm_s", comm), ("exposed_comm_s", exposed)):
        for run, value in zip(runs, values or ()):
            run[name] = value
    return runs


def _rows():
    results = {COMPUTE: _runs([1.5, 2.0, 1.5], cpu=[0.5, 0.5, 0.5]),
               AUTO: _runs([1.5, 2.2, 2.1], cpu=[0.6, 0.55, 0.7], comm=[0.2, 0.4, 0.3], exposed=[0.1, 0.1, 0.3]),
               ZERO_COPY: _runs([1.0, 1.0, 1.0], cpu=[0.5, 0.5, 0.5], comm=[0.1, 0.1, 0.1], exposed=[0, 0, 0]),
               DDP: _runs([1.0, 2.0, 2.0], cpu=[0.5, 0.5, 0.5]),
               DDP_VIEW: _runs([0.5, 1.0, 1.0], cpu=[0.5, 0.5, 0.5])}
    settings = {view: {"backend": "gloo", "gradient_as_bucket_view": view} for view in (False, True)}
    rows = throughput_rows(results, STEPS, SAMPLES_PER_STEP, BASE, settings)
    return {(row["impl"], row["algorithm"], row["gradient_as_bucket_view"]): row for row in rows}


def test_step_vs_compute_only_is_the_median_of_per_repetition_ratios():
    """auto/compute-only per repetition: 1.0, 1.1, 1.4 -> 1.1 (1.0-1.4); the ratio of the medians would be
    2.1/1.5 = 1.4. Times and samples/s carry their spread; compute-only is not compared with itself."""
    rows = _rows()
    auto = rows[AUTO]
    assert (auto["step_vs_compute_only"], auto["step_vs_compute_only_min"],
            auto["step_vs_compute_only_max"]) == pytest.approx((1.1, 1.0, 1.4))
    assert auto["step_vs_compute_only_median"] == auto["step_vs_compute_only"]
    assert (auto["step_s"], auto["step_s_min"], auto["step_s_max"]) == pytest.approx((0.21, 0.15, 0.22))
    assert (auto["samples_per_s"], auto["samples_per_s_min"], auto["samples_per_s_max"]) == pytest.approx(
        (128 / 0.21, 128 / 0.22, 128 / 0.15))
    assert auto["compute_only_step_s"] == pytest.approx(0.15) and auto["repeat"] == 3
    assert (auto["cpu_vs_compute_only"], auto["cpu_vs_compute_only_min"],
            auto["cpu_vs_compute_only_max"]) == pytest.approx((1.2, 1.1, 1.4))
    # gradsync's own communication per step, and the exposed share paired per repetition: 0.5, 0.25, 1.0
    assert (auto["comm_s_per_step"], auto["exposed_comm_s_per_step"]) == pytest.approx((0.03, 0.01))
    assert (auto["exposed_comm_fraction"], auto["exposed_comm_fraction_min"],
            auto["exposed_comm_fraction_max"]) == pytest.approx((0.5, 0.25, 1.0))
    compute = rows[COMPUTE]
    assert compute["step_vs_compute_only"] is None and compute["cpu_vs_compute_only"] is None
    assert compute["comm_s_per_step"] is None


def test_zero_copy_row_is_compared_with_ddp_given_bucket_views():
    """shm_zero_copy against DDP with gradient_as_bucket_view, per repetition: 0.5, 1, 1 -> 1.0 (0.5-1.0)
    (against plain DDP it would read 2.0); auto and compute-only against plain DDP; DDP rows not with
    themselves, and they carry their settings."""
    rows = _rows()
    zero_copy = rows[ZERO_COPY]
    assert (zero_copy["ratio_to_ddp"], zero_copy["ratio_to_ddp_min"], zero_copy["ratio_to_ddp_max"]) == \
        pytest.approx((1.0, 0.5, 1.0))
    assert zero_copy["ddp_peer"] == "ddp, gradient_as_bucket_view=True"
    auto = rows[AUTO]  # DDP 1.0, 2.0, 2.0 over auto 1.5, 2.2, 2.1
    assert auto["ratio_to_ddp"] == pytest.approx(2.0 / 2.2) and auto["ratio_to_ddp_min"] == pytest.approx(1 / 1.5)
    assert rows[COMPUTE]["ratio_to_ddp"] == pytest.approx(1.0)  # DDP 1.0, 2.0, 2.0 over 1.5, 2.0, 1.5
    for key in (DDP, DDP_VIEW):
        assert rows[key]["ratio_to_ddp"] is None and rows[key]["ddp_peer"] is None
        assert rows[key]["ddp_settings"] == {"backend": "gloo", "gradient_as_bucket_view": key[2]}
    assert rows[DDP_VIEW]["step_vs_compute_only"] == pytest.approx(0.5)  # 1/3, 0.5, 2/3


def test_ddp_with_bucket_views_is_measured_only_beside_a_zero_copy_row():
    """measured_keys adds DDP(gradient_as_bucket_view=True) exactly when a gradsync row uses bucket views."""
    assert measured_keys(["auto", "ring"]) == [COMPUTE, AUTO, ("gradsync", "ring", False), DDP]
    assert measured_keys(["shm_zero_copy"]) == [COMPUTE, ZERO_COPY, DDP, DDP_VIEW]
    assert ddp_peer(ZERO_COPY, [COMPUTE, ZERO_COPY, DDP]) == DDP  # no view row measured: plain DDP
    assert ddp_peer(DDP_VIEW, [DDP_VIEW]) is None


def test_rows_need_compute_only_and_equal_repetitions():
    """No compute-only measurement, or repetitions that cannot be paired: ValueError, not a wrong ratio."""
    with pytest.raises(ValueError, match="compute-only"):
        throughput_rows({AUTO: _runs([1.0]), DDP: _runs([1.0])}, STEPS, SAMPLES_PER_STEP, BASE)
    with pytest.raises(ValueError, match="repetition"):
        throughput_rows({COMPUTE: _runs([1.0, 1.0]), AUTO: _runs([1.0]), DDP: _runs([1.0, 1.0])},
                        STEPS, SAMPLES_PER_STEP, BASE)


@pytest.mark.parametrize("median, low, high, verdict", [
    (1.12, 1.05, 1.20, "met, straddles"), (1.10, 1.02, 1.14, "met"), (1.20, 1.16, 1.30, "missed"),
    (1.16, 1.10, 1.25, "missed, straddles")])
def test_goal_verdict_on_auto_mlp_ws2(median, low, high, verdict):
    """auto <= 1.15x compute-only by the median; a min-max range containing 1.15 says so."""
    row = {"impl": "gradsync", "algorithm": "auto", "model": "mlp", "world_size": 2, "hosts": 1,
           "step_vs_compute_only": median, "step_vs_compute_only_min": low, "step_vs_compute_only_max": high}
    other = {**row, "hosts": 2}  # across test hosts: not the goal's setting
    rows = [row, other, {**row, "algorithm": "shm"}, {**row, "model": "cnn"}]
    add_goal(rows)
    assert row["goal_verdict"] == verdict and all("goal_verdict" not in r for r in rows[1:])
    assert goal_lines(rows) == [f"# goal: auto's step <= 1.15x compute-only's (median) on the MLP at world size 2: "
                                f"{median:.2f}x ({low:.2f}-{high:.2f}): {verdict}"]


OLD_ROW = {"kind": "throughput", "model": "mlp", "world_size": 2, "impl": "gradsync", "algorithm": "auto",
           "samples_per_s": 527.62, "ratio_to_ddp": 1.156, "step_s": 0.24260, "local_step_s": 0.19928,
           "step_overhead_fraction": 0.1786, "comm_s_per_step": 0.03423, "exposed_comm_s_per_step": 0.02410,
           "exposed_comm_fraction": 0.704, "rounds": 3, "hosts": 1, "nproc_per_host": 2}


def test_format_table_renders_old_rows_without_spread():
    """A row recorded before --repeat: bare values, step/compute-only from local_step_s, its footnote."""
    table = format_table([OLD_ROW])
    line = table.splitlines()[2].split()
    assert line[:6] == ["mlp", "2", "gradsync", "auto", "-", "528"]
    assert line[6:9] == ["242.60", "1.22x", "-"] and line[9] == "1.16x"
    assert "# local compute-only step (mlp, world_size 2): 199.28 ms" in table and "goal" not in table


def test_format_table_renders_new_rows_with_spread_settings_and_goal():
    """New rows: median (min-max) cells, the view column, DDP's settings and the goal's verdict."""
    rows = list(_rows().values())
    add_goal(rows)
    lines = format_table(rows).splitlines()
    auto = next(line for line in lines if " auto " in line)
    assert "210.00 (150.00-220.00)" in auto and "1.10x (1.00-1.40)" in auto and "1.20x (1.10-1.40)" in auto
    zero_copy = next(line for line in lines if "shm_zero_copy" in line)
    assert " yes " in zero_copy and "1.00x (0.50-1.00)" in zero_copy
    assert "# ddp: torch DistributedDataParallel, backend gloo, gradient_as_bucket_view False/True (column view)" \
        in lines
    assert lines[-1].endswith("1.10x (1.00-1.40): met, straddles")


@pytest.mark.parametrize("args, needle", [(["--repeat", "0"], "--repeat"), (["--repeat", "-2"], "--repeat"),
                                          (["--rounds", "3"], "--rounds")])
def test_bench_train_repeat_is_checked_and_rounds_is_gone(args, needle, capsys):
    """--repeat below 1 fails before any process starts, naming it; --rounds is no longer an option."""
    try:
        code = main(["bench", "train", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert needle in lines[-1]
