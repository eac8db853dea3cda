"""``bench modes --model/--batch-size`` and its goal lines: options refused before any run, verdicts from medians."""

from __future__ import annotations

import pytest

from gradsync.bench.modes import run_bench
from gradsync.bench.modes_compute import describe, diloco_rows, goal_lines, model_options
from gradsync.train.config import GPT_LR


def _row(label, mode, straggler, speed, ratio, accuracy, **extra):
    return {"label": label, "mode": mode, "straggler": straggler, "samples_per_s": speed,
            "samples_per_s_vs_sync": ratio, "samples_per_s_vs_sync_min": ratio - 0.1,
            "samples_per_s_vs_sync_max": ratio + 0.1, "test_accuracy": accuracy, **extra}


ROWS = [_row("sync", "sync", 1.0, 900.0, 1.0, 0.850), _row("async", "async", 1.0, 810.0, 0.9 - 0.05, 0.80),
        _row("local-sgd H=16", "local-sgd", 1.0, 950.0, 1.05, 0.84),
        _row("sync", "sync", 3.0, 300.0, 1.0, 0.850), _row("async", "async", 3.0, 480.0, 1.6, 0.845),
        _row("local-sgd H=16", "local-sgd", 3.0, 330.0, 1.1, 0.835)]


def test_goal_lines_judge_the_medians():
    lines = goal_lines(ROWS)
    assert lines[0].startswith("# the 3x straggler slows sync 3.00x")  # 900 / 300
    async_slow, local_slow, async_plain = lines[1:]
    # 1.6 >= 1.5 (but 1.5 lies in 1.5-1.7: straddles); 84.5% is 0.5 pp below 85.0%
    assert "1.60x (1.50-1.70)" in async_slow and "goal >= 1.5x): met, straddles" in async_slow
    assert "(-0.50 pp; goal within 1 pp): met" in async_slow
    assert "[local SGD (no DiLoCo row in this table)]" in local_slow and "goal >= 2x): missed" in local_slow
    assert "(-1.50 pp; goal within 1 pp): missed" in local_slow
    assert "no straggler" in async_plain and "0.85x" in async_plain and "goal >= 0.9x): missed" in async_plain


def test_diloco_rows_are_preferred_over_plain_local_sgd():
    diloco = _row("diloco H=16", "local-sgd", 3.0, 700.0, 2.3, 0.851, outer_optimizer="nesterov")
    rows, name = diloco_rows(ROWS + [diloco])
    assert rows == [diloco] and name == "DiLoCo"
    line = [line for line in goal_lines(ROWS + [diloco]) if "[DiLoCo]" in line]
    assert len(line) == 1 and "goal >= 2x): met" in line[0] and "+0.10 pp" in line[0]


def test_model_options_and_their_refusals():
    assert model_options("cnn", None) == {}
    assert model_options("cnn", 512) == {"batch_size": 512}
    assert model_options("gpt", None) == {"model": "gpt", "lr": GPT_LR}  # gradsync train's gpt default
    assert model_options("gpt", 8, lr=0.01) == {"model": "gpt", "batch_size": 8}
    assert describe({"batch_size": 512}) == "MNIST-1D CNN, 512 samples per worker per step"
    with pytest.raises(ValueError, match="--model: unknown model 'resnet'; choose one of"):
        run_bench(model="resnet", repeat=1, epochs=1)  # refused before any process starts
    with pytest.raises(ValueError, match="--batch-size must be an int >= 1, got 0"):
        run_bench(batch_size=0, repeat=1, epochs=1)
