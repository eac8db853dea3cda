"""``bench memory``'s FSDP2 peer in a world of 2 processes: its bytes per part at each point against shapes by
hand, its parameters against unsharded DataParallel's, and the float32 gradient check that catches a sum."""

from __future__ import annotations

import math

import pytest
import torch

from _dist import run_world
from gradsync.bench.shard_memory_models import BenchModel, build
from gradsync.bench.shard_memory_rows import BASELINE, TORCH_FSDP2

# (vocabulary, context, width, depth, heads): width 5 and context 5 make odd first dimensions, which FSDP2 pads
TINY_GPT = BenchModel("gpt", (256, 5, 5, 1, 1), 2)
WORLD = 2


def _rank_fsdp2_world():
    """FSDP2's counts at each point of its second step, the bench's byte run, the check with FSDP2 made to sum
    the gradients (divide factor 1), and the bench's check and timing of FSDP2 against shard=none."""
    import gradsync
    from gradsync.bench.shard_memory import Options, check_and_time, measure_bytes, train_step, wrap
    from gradsync.bench.shard_memory_fsdp2 import fsdp2_bytes, gradient_check
    from gradsync.bench.shard_memory_models import make_batch

    options = Options(steps=1, warmup=0, repeat=1)
    torch.manual_seed(0)
    model, optimizer = wrap(TORCH_FSDP2, build(TINY_GPT), options)
    inputs, targets = make_batch(TINY_GPT, gradsync.rank())
    points: dict[str, dict[str, int]] = {}
    train_step(model, optimizer, inputs, targets)
    train_step(model, optimizer, inputs, targets,
               sample=lambda point: points.__setitem__(point, fsdp2_bytes(model, optimizer)))
    counted = measure_bytes(TINY_GPT, TORCH_FSDP2, options)
    torch.manual_seed(0)
    summed = gradient_check(TINY_GPT, build(TINY_GPT), gradient_divide_factor=1.0)
    return points, counted, summed, check_and_time(TINY_GPT, [BASELINE, TORCH_FSDP2], options)


def _expected(rank: int) -> dict[str, dict[str, int]]:
    """Bytes per part at each point, from the parameters' shapes: FSDP2 cuts dim 0 into WORLD chunks of
    ceil(rows / WORLD) rows (rank r keeps rows [r c, (r + 1) c), the last rank fewer); a parameter's shard
    and its gradient's occupy a padded chunk, AdamW's exp_avg and exp_avg_sq the rows the rank owns, plus a
    4-byte step per parameter; after forward the root's parameters (those outside the blocks) are whole,
    padded to WORLD chunks. Inside the block's forward (``fwd 0``, before FSDP2 reshards it) the block is
    whole too, and so is the all-gather output it was copied out of, which FSDP2 keeps for the next
    all-gather: one more padded block, under buffers."""
    shards = state = root = block = 0
    for name, param in build(TINY_GPT).named_parameters():  # the tied head is the token embedding: once
        rows, rest = param.shape[0], math.prod(param.shape[1:])
        chunk = math.ceil(rows / WORLD)
        shards += 4 * chunk * rest
        state += 8 * max(0, min(chunk, rows - rank * chunk)) * rest + 4
        root += 0 if name.startswith("blocks.") else 4 * WORLD * chunk * rest
        block += 4 * WORLD * chunk * rest if name.startswith("blocks.") else 0
    after_backward = {"parameters": shards, "gradients": shards, "optimizer_state": state, "buffers": 0}
    return {"forward": {**after_backward, "parameters": shards + root, "gradients": 0},
            "backward": after_backward, "step": after_backward,
            "fwd 0": {**after_backward, "parameters": shards + root + block, "gradients": 0, "buffers": block}}


def test_fsdp2_counts_its_shards_by_hand_and_trains_what_data_parallel_trains():
    points, counted, summed, checks = run_world(WORLD, _rank_fsdp2_world, timeout_s=60)[0]
    expected = _expected(0)
    assert points == {point: expected[point] for point in ("forward", "backward", "step")}
    states = [_expected(rank)["step"]["optimizer_state"] for rank in range(WORLD)]
    assert states[0] > states[1]  # rank 0 owns the larger chunk of every odd first dimension
    # the tiny gpt's root is its embedding: the peak is while the block is whole beside it, in its forward
    assert counted["peak_at"] == "fwd 0"
    assert counted["parts"] == expected["fwd 0"] and counted["optimizer_state_bytes_per_rank"] == states
    assert counted["parameters"] == sum(param.numel() for param in build(TINY_GPT).parameters())
    assert not summed["equal"] and summed["max_abs_diff"] > 1e-3  # summing doubles the mean gradient
    fsdp2 = checks[TORCH_FSDP2]
    assert fsdp2["equal_to_none"] and fsdp2["max_abs_diff"] < 1e-9  # float64, 3 steps of AdamW
    assert fsdp2["gradient_check"]["equal"] and fsdp2["gradient_check"]["max_abs_diff"] < 1e-6  # float32
    assert len(fsdp2["elapsed_s"]) == len(checks[BASELINE]["elapsed_s"]) == 1


def test_a_failed_gradient_check_is_shown_and_the_fsdp2_ratios_divide_gradsyncs_rows_by_it():
    """Synthetic figures at world size 4: FSDP2 holds 100 bytes and took 2 s a repetition; shard=none 500
    bytes and 1 s; a gradsync row of 80 bytes and 1.6 s is 0.8x FSDP2's bytes and 1.25x its samples/s. An
    FSDP2 whose gradients summed is reported as such and not timed."""
    from gradsync.bench.shard_memory_rows import Setting, format_table, memory_rows

    def entry(total):
        parts = {"parameters": total, "gradients": 0, "optimizer_state": 0, "buffers": 0}
        return {"parts": parts, "peak_at": "step", "total_bytes_per_rank": [total] * 4,
                "peak_rss_mib_per_rank": [300.0] * 4}

    gradients = Setting("gradsync", "gradients")
    counted = {BASELINE: entry(500), gradients: entry(80), TORCH_FSDP2: entry(100)}
    base = {"model": "gpt", "world_size": 4, "optimizer": "adamw", "samples_per_step": 8, "steps": 1}
    timed = {BASELINE: {"equal_to_none": True, "elapsed_s": [1.0]},
             gradients: {"equal_to_none": True, "max_abs_diff": 0.0, "elapsed_s": [1.6]},
             TORCH_FSDP2: {"equal_to_none": True, "max_abs_diff": 0.0, "elapsed_s": [2.0],
                           "gradient_check": {"equal": True, "max_abs_diff": 0.0}}}
    none, mine, fsdp2 = memory_rows(base, counted, timed)
    assert (mine["total_vs_torch_fsdp2"], mine["samples_per_s_vs_torch_fsdp2"]) == pytest.approx((0.8, 1.25))
    assert fsdp2["total_vs_torch_fsdp2"] is None and fsdp2["total_vs_none"] == pytest.approx(0.2)
    assert fsdp2["gradient_equal_to_mean"] is True and none["gradient_equal_to_mean"] is None
    timed[TORCH_FSDP2] = {"equal_to_none": False, "max_abs_diff": 0.0, "elapsed_s": None,
                          "gradient_check": {"equal": False, "max_abs_diff": 0.5}}
    rows = memory_rows(base, counted, timed)
    assert rows[1]["samples_per_s_vs_torch_fsdp2"] is None and rows[2]["samples_per_s"] is None
    assert "grads differ 5.0e-01" in format_table(rows)
