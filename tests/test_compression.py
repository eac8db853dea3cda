"""Gradient compressors on thread ranks: error feedback, codecs, agreement across ranks, state, bytes, warm-up.

Every check compares against values computed here independently of the
compressor: exact averages as plain sums over the ranks' gradients divided by
the number of contributing ranks, residuals read back through
``state_dict()``, sign bits and block scales recomputed from the input, and
bytes against a float32 ring AllReduce measured on the same group. Real
processes, DataParallel and the CLI are in ``test_compression_dp.py``.
"""

import copy
import math

import pytest
import torch

from _dist import run_threads
from gradsync.collectives import ops as collectives
from gradsync.collectives.chunking import chunk_bounds
from gradsync.compression import (BF16, COMPRESSIONS, FP16, BucketLayout, ErrorFeedback, OneBit, PowerSGD, TopK,
                                  make)
from gradsync.compression.low_precision import fp16_scale
from gradsync.compression.onebit import SignCodec, pack_signs, unpack_signs
from gradsync.compression.powersgd import approximation_rank
from gradsync.compression.topk import top_indices
from gradsync.compression.two_phase import row_nbytes

# two compressible matrices around a 1-D bias: PowerSGD keeps two residual regions in one bucket
LAYOUT = BucketLayout(("w", "b", "v"), (torch.Size((16, 12)), torch.Size((7,)), torch.Size((10, 30))))
FACTORIES = {"fp16": FP16, "bf16": BF16, "onebit": OneBit, "topk": lambda: TopK(0.1),
             "powersgd": lambda: PowerSGD(2)}
FEEDBACK_KEY = {"topk": "residual", "powersgd": "residual", "onebit": "worker"}


def gradient(layout, rank, step, seed=0, dtype=torch.float32):
    """Rank ``rank``'s flat gradient at ``step``: normal values, scaled differently on each rank."""
    generator = torch.Generator().manual_seed(10_000 * seed + 100 * step + rank)
    return (torch.randn(layout.numel, generator=generator, dtype=torch.float64) * (1 + rank)).to(dtype)


def flatten(state, layout):
    """Per-name tensors of ``state`` back to back in ``layout`` order; zeros for absent names."""
    return torch.cat([state[name].reshape(-1) if name in state else torch.zeros(numel)
                      for name, numel in zip(layout.names, layout.numels)])


def reduce_steps(world_size, factory, layout, steps, contributing=None, seed=0):
    """Each rank reduces ``steps`` gradients with its own compressor.

    Ranks ``>= contributing`` send zeros (as ranks that joined) and the divisor
    is ``contributing``. Returns, per rank, a list of ``(gradient, state
    before, state after, result)``.
    """
    contributing = world_size if contributing is None else contributing

    def body(comm):
        compressor, records = factory(), []
        for step in range(steps):
            grad = gradient(layout, comm.rank, step, seed)
            if comm.rank >= contributing:
                grad.zero_()
            before = copy.deepcopy(compressor.state_dict())
            result = grad.clone()
            compressor.reduce(result, layout, comm, contributing)
            records.append((grad, before, copy.deepcopy(compressor.state_dict()), result))
        return records
    return run_threads(world_size, body)


def exact_average(layout, world_size, step, seed=0, contributing=None):
    contributing = world_size if contributing is None else contributing
    total = sum(gradient(layout, rank, step, seed, torch.float64) for rank in range(contributing))
    return total / contributing


# ---------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("world_size, contributing", [(2, 2), (3, 3), (3, 2)], ids=["ws2", "ws3", "ws3-joined"])
@pytest.mark.parametrize("name", ["topk", "powersgd", "onebit"])
def test_error_feedback_identity(name, world_size, contributing):
    """Nothing is lost, only delayed: result * divisor == sum over ranks of (g + r_old - r_new), every
    step and every parameter, also when a rank sends zeros (join); for 1-bit the chunk owner's server
    residual (non-zero only on its own chunk) accounts for the second compression."""
    per_rank = reduce_steps(world_size, FACTORIES[name], LAYOUT, steps=4, contributing=contributing)
    chunks = chunk_bounds(LAYOUT.numel, world_size)
    for step in range(4):
        sent = sum(grad + flatten(before[FEEDBACK_KEY[name]], LAYOUT) - flatten(after[FEEDBACK_KEY[name]], LAYOUT)
                   for grad, before, after, _ in (records[step] for records in per_rank))
        expected = sent / contributing
        if name == "onebit":
            for rank, records in enumerate(per_rank):
                _, before, after, _ = records[step]
                server_old, server_new = flatten(before["server"], LAYOUT), flatten(after["server"], LAYOUT)
                start, stop = chunks[rank]
                outside = torch.cat([server_new[:start], server_new[stop:]])
                assert torch.count_nonzero(outside) == 0, f"rank {rank} keeps server residual outside its chunk"
                expected[start:stop] += server_old[start:stop] - server_new[start:stop]
        for rank, records in enumerate(per_rank):
            torch.testing.assert_close(records[step][3], expected, rtol=1e-5, atol=1e-4,
                                       msg=lambda m: f"step {step} rank {rank}: {m}")
    final = flatten(per_rank[0][-1][2][FEEDBACK_KEY[name]], LAYOUT)
    assert final.abs().max() > 1e-2, "the compressor kept no residual: the identity was not exercised"


def test_error_feedback_step_keeps_what_transmit_leaves_out():
    """ErrorFeedback.step: transmit sees gradient + old residual, and transmitted + new residual equals
    it; two disjoint regions of one bucket keep separate residuals; the state is shaped like the
    parameters and follows names into a bucket with another order and a partial region."""
    layout = BucketLayout(("a", "b"), (torch.Size((2, 3)), torch.Size((5,))))
    feedback = ErrorFeedback()
    old = torch.zeros(layout.numel)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        grad = torch.randn(layout.numel, generator=generator)
        seen = []

        def quantise(values):
            seen.append(values.clone())
            return torch.round(values * 2) / 2

        transmitted = torch.cat([feedback.step(layout, grad[:6].clone(), quantise, start=0),
                                 feedback.step(layout, grad[6:].clone(), quantise, start=6)])
        torch.testing.assert_close(torch.cat(seen), grad + old, rtol=0, atol=1e-6)
        state = feedback.state_dict()
        assert state["a"].shape == (2, 3) and state["b"].shape == (5,)
        new = flatten(state, layout)
        torch.testing.assert_close(transmitted + new, grad + old, rtol=0, atol=1e-6)
        assert torch.equal(transmitted, torch.round((grad + old) * 2) / 2)
        old = new
    assert old.abs().max() > 0.01
    swapped = BucketLayout(("b", "a"), (torch.Size((5,)), torch.Size((2, 3))))
    assert torch.equal(feedback.residual(swapped, 0, 11, old), torch.cat([old[6:], old[:6]]))
    assert torch.equal(feedback.residual(swapped, 3, 9, old), torch.cat([old[6:], old[:6]])[3:9])
    restored = ErrorFeedback()
    restored.load_state_dict(copy.deepcopy(feedback.state_dict()))
    assert {name: t.shape for name, t in restored.state_dict().items()} == {"a": (2, 3), "b": (5,)}
    assert torch.equal(restored.residual(swapped, 0, 11, old), torch.cat([old[6:], old[:6]]))
    restored.load_state_dict({"a": torch.zeros(4), "b": torch.zeros(5)})
    with pytest.raises(ValueError, match="'a' has 4 elements"):
        restored.residual(layout, 0, 11, old)
    with pytest.raises(ValueError, match="'a'"):
        restored.load_state_dict({"a": [0.0] * 6})


# ---------------------------------------------------------------------------- 1-bit codec


def block_signals(numel, seed, zero_block=True):
    """Normal values whose blocks of 32 span 2^-12..1 in magnitude, with exact zeros and -0.0."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator)
    blocks = -(-numel // 32)
    scales = torch.exp2(-12 * torch.rand(blocks, generator=generator)).repeat_interleave(32)[:numel]
    values *= scales
    values[::7] = 0.0
    values[3::11] = -0.0
    if zero_block and numel >= 96:
        values[64:96] = 0.0
    return values


def encode_decode(codec, values):
    payload = torch.zeros(row_nbytes(codec, values.numel()), dtype=torch.uint8)
    codec.encode(values, payload)
    return codec.decode(payload, values.numel()), payload


@pytest.mark.parametrize("block_numel", [8, 32, 64])
@pytest.mark.parametrize("numel", [0, 1, 13, 64, 1000])
def test_sign_codec_round_trip_bounds(numel, block_numel):
    """Decoded values: +-(block scale) with the input's sign (x >= 0 is +); the scale is within 2^(1/4)
    of the block's mean |x|, exactly the largest for the largest block, clamped to ref * 2^-7 for blocks
    further below, zero for all-zero blocks; the payload has the documented size."""
    codec = SignCodec(block_numel)
    values = block_signals(numel, seed=numel + block_numel)
    decoded, _ = encode_decode(codec, values)
    blocks = -(-numel // block_numel)
    assert decoded.shape == (numel,) and torch.isfinite(decoded).all()
    assert codec.payload_nbytes(numel) == 4 + -(-blocks // 2) + -(-numel // 8)
    if numel == 0:
        return
    means = [values[b * block_numel:(b + 1) * block_numel].double().abs().mean().item() for b in range(blocks)]
    ref = max(means)
    eps = 1e-6
    for b, mean in enumerate(means):
        x, d = values[b * block_numel:(b + 1) * block_numel], decoded[b * block_numel:(b + 1) * block_numel]
        scale = d.abs().double()
        assert torch.all(scale == scale[0]), f"block {b}: one magnitude per block"
        scale = scale[0].item()
        if mean == 0:
            assert scale == 0, f"block {b}: all-zero block decodes to zeros"
            continue
        assert torch.equal(d > 0, ~torch.signbit(x) | (x == 0)), f"block {b}: signs"
        if mean >= ref * 2 ** -7:
            assert 2 ** -0.25 * (1 - eps) <= scale / mean <= 2 ** 0.25 * (1 + eps), (b, scale, mean)
        else:
            assert scale == pytest.approx(ref * 2 ** -7, rel=eps), (b, scale, ref)
    assert max(decoded.abs().double()).item() == pytest.approx(ref, rel=eps)
    assert any(mean < ref * 2 ** -7.25 for mean in means) or numel < 100  # the clamp was exercised


def test_sign_codec_zeros_give_zeros():
    """An all-zero input decodes to exact zeros (no NaN from the log of 0/0), at any length."""
    codec = SignCodec()
    for numel in (1, 7, 40, 333):
        decoded, _ = encode_decode(codec, torch.zeros(numel))
        assert torch.equal(decoded, torch.zeros(numel)), numel


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 100])
def test_pack_unpack_signs(numel):
    """Bit k is (x[k] >= 0), most significant bit first; unpacking gives +1 / -1 (-0.0 counts as +)."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    values[::3] = 0.0
    values[1::5] = -0.0
    packed = torch.full((-(-numel // 8),), 0xAA, dtype=torch.uint8)
    pack_signs(values, packed)
    bits = [(not torch.signbit(v) or v == 0) for v in values]
    expected = [sum(int(bit) << (7 - k) for k, bit in enumerate(bits[i:i + 8])) for i in range(0, numel, 8)]
    assert packed.tolist() == expected
    out = torch.zeros(numel)
    unpack_signs(packed, numel, out)
    assert out.tolist() == [1.0 if bit else -1.0 for bit in bits]


# ---------------------------------------------------------------------------- agreement across ranks


def _layouts(world_size):
    """Buckets of 1 element, fewer elements than ranks, an odd size, a matrix and several parameters
    (names unique across buckets, as in a model)."""
    sizes = sorted({1, max(world_size - 1, 1), 37})
    layouts = [BucketLayout.single(f"x{numel}", (numel,)) for numel in sizes] + [
        BucketLayout.single("m", (5, 7)), LAYOUT,
        BucketLayout(("a", "c", "d", "e"), (torch.Size((3, 5)), torch.Size((4,)), torch.Size((1, 1)),
                                            torch.Size((9, 20))))]
    assert len({name for layout in layouts for name in layout.names}) == sum(len(l.names) for l in layouts)
    return layouts


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("name", list(FACTORIES))
def test_every_rank_gets_the_bitwise_same_result(name, world_size):
    """Buckets of 1 element, fewer elements than ranks, odd sizes, one matrix and several parameters,
    in float32 and float16: every rank ends with the same bits, finite, dtype kept; 16-bit
    compressors stay within their rounding of the exact average."""
    layouts = _layouts(world_size)

    def body(comm):
        results = []
        for dtype in (torch.float32, torch.float16):
            compressor = FACTORIES[name]()
            for step in range(2):
                for index, layout in enumerate(layouts):
                    flat = gradient(layout, comm.rank, step, seed=index, dtype=dtype)
                    compressor.reduce(flat, layout, comm, comm.world_size)
                    results.append(flat)
        return results
    per_rank = run_threads(world_size, body)
    for rank in range(1, world_size):
        for index, (mine, first) in enumerate(zip(per_rank[rank], per_rank[0])):
            assert mine.dtype == first.dtype and torch.equal(mine, first), f"rank {rank} result {index} differs"
    assert all(torch.isfinite(result).all() for result in per_rank[0])
    if name in ("fp16", "bf16"):
        tolerance = {"fp16": 2e-3, "bf16": 2e-2}[name]
        for index, layout in enumerate(layouts):
            expected = exact_average(layout, world_size, step=1, seed=index)
            result = per_rank[0][len(layouts) + index].double()
            assert (result - expected).abs().max() <= tolerance * expected.abs().max() + 1e-6, (name, index)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_empty_bucket_and_wrong_size(name):
    """A 0-element bucket returns at once without communication; a flat that does not match its
    layout raises ValueError on every rank."""
    def body(comm):
        compressor = FACTORIES[name]()
        before = comm.stats.bytes_sent
        compressor.reduce(torch.zeros(0), BucketLayout.single("e", (0, 4)), comm, comm.world_size)
        with pytest.raises(ValueError, match="3 elements"):
            compressor.reduce(torch.zeros(3), BucketLayout.single("x", (4,)), comm, comm.world_size)
        return comm.stats.bytes_sent - before
    assert run_threads(2, body) == [0, 0]


def same_sign_values(magnitude, world_size, numel=257):
    """Per-rank values magnitude * (1..1.2) with one sign per element shared by all ranks (no cancellation)."""
    generator = torch.Generator().manual_seed(11)
    signs = torch.where(torch.rand(numel, generator=generator) < 0.5, -1.0, 1.0).double()
    return [magnitude * signs * (1 + 0.2 * torch.rand(numel, generator=generator, dtype=torch.float64))
            for _ in range(world_size)]


@pytest.mark.parametrize("name, magnitude, tolerance", [
    ("fp16", 1e6, 1e-3), ("fp16", 1e-9, 1e-3), ("fp16", 7e4, 1e-3), ("bf16", 1e6, 1e-2), ("bf16", 1e-30, 1e-2)])
def test_16_bit_range(name, magnitude, tolerance):
    """Values far outside float16's range (1e6, 70000 > 65504, 1e-9 below its subnormals) average
    without inf or flush to zero: relative error below 1e-3 (fp16, scaled) or 1e-2 (bf16)."""
    per_rank = same_sign_values(magnitude, 3)
    expected = sum(per_rank) / 3
    layout = BucketLayout.single("x", (257,))

    def body(comm):
        flat = per_rank[comm.rank].float()
        FACTORIES[name]().reduce(flat, layout, comm, comm.world_size)
        return flat
    result = run_threads(3, body)[0].double()
    assert torch.isfinite(result).all() and torch.count_nonzero(result) == result.numel()
    assert ((result - expected).abs() / expected.abs()).max() < tolerance


def test_fp16_scale_is_a_power_of_two_below_2_15():
    """The scale maps the largest magnitude into [2^14, 2^15); 1.0 for empty, zero or non-finite input."""
    for largest in (1e-9, 3.0, 65504.0, 7e4, 1e6):
        scale = fp16_scale(torch.tensor([largest / 3, -largest]))
        assert math.frexp(scale)[0] == 0.5 and 2 ** 14 <= largest * scale < 2 ** 15, largest
    for values in (torch.zeros(0), torch.zeros(3), torch.tensor([1.0, math.inf])):
        assert fp16_scale(values) == 1.0


@pytest.mark.parametrize("numel, k", [(100, 7), (5000, 1), (100_000, 10), (100_000, 1000), (100_000, 25_000),
                                     (300_000, 3000)])
def test_top_indices_are_exactly_the_k_largest(numel, k):
    """The sampled-threshold selection returns the k largest values, as a full sort does: for plain
    values, when the strided sample overestimates the threshold (too few candidates: fallback) or
    underestimates it (many candidates), and with many ties."""
    magnitudes = torch.randn(numel, generator=torch.Generator().manual_seed(numel + k)).abs()
    sampled_big, sampled_small = magnitudes.clone(), magnitudes.clone()
    sampled_big[::64] *= 1000
    sampled_small[::64] *= 1e-3
    for values in (magnitudes, sampled_big, sampled_small, torch.round(magnitudes * 4) / 4):
        chosen = top_indices(values, k)
        assert chosen.numel() == k and len(set(chosen.tolist())) == k
        largest = torch.sort(values, descending=True).values[:k]
        assert torch.equal(torch.sort(values[chosen], descending=True).values, largest)


# ---------------------------------------------------------------------------- PowerSGD shapes


def test_approximation_rank():
    """Compressed only where (n + m) * r * 2 < n * m, with r capped by the matrix's dimensions."""
    cases = {((10,), 2): 0, ((1, 1), 2): 0, ((0, 5), 2): 0, ((4, 4), 2): 0, ((16, 12), 2): 2,
             ((20, 3, 3), 2): 2, ((100, 100), 4): 4, ((3, 100), 5): 0, ((50, 200), 60): 0,
             ((200, 300), 60): 0, ((300, 400), 60): 60}
    for (shape, rank), expected in cases.items():
        assert approximation_rank(torch.Size(shape), rank) == expected, (shape, rank)


def test_powersgd_1d_and_1x1_are_exact():
    """Biases and 1x1 weights travel uncompressed: the exact average, and no residual or Q state."""
    layout = BucketLayout(("bias", "scalar"), (torch.Size((10,)), torch.Size((1, 1))))
    per_rank = reduce_steps(3, lambda: PowerSGD(2), layout, steps=2)
    for step in range(2):
        for records in per_rank:
            torch.testing.assert_close(records[step][3].double(), exact_average(layout, 3, step), rtol=1e-6,
                                       atol=1e-6)
    assert per_rank[0][-1][2]["residual"] == {} and per_rank[0][-1][2]["q"] == {}


@pytest.mark.parametrize("rank", [1, 2])
def test_powersgd_rank_deficient_gradients(rank):
    """A rank-1 gradient equal on every rank is reproduced at once (relative error < 1e-5, residual ~0);
    a zero gradient gives zeros and finite state (no NaN from orthogonalising a zero matrix), and the
    steps after it still sum to the gradients sent."""
    layout = BucketLayout.single("w", (30, 20))
    generator = torch.Generator().manual_seed(0)
    matrix = (torch.randn(30, 1, generator=generator) @ torch.randn(1, 20, generator=generator)).reshape(-1)

    def body(comm):
        fresh, after_zero = PowerSGD(rank), PowerSGD(rank)
        out = {"fresh": [], "after_zero": []}
        for _ in range(3):
            flat = matrix.clone()
            fresh.reduce(flat, layout, comm, comm.world_size)
            out["fresh"].append((flat, fresh.state_dict()["residual"]["w"].clone()))
        for grad in (torch.zeros(600), matrix, matrix, matrix):
            flat = grad.clone()
            after_zero.reduce(flat, layout, comm, comm.world_size)
            out["after_zero"].append((flat, copy.deepcopy(after_zero.state_dict())))
        return out
    result = run_threads(3, body)[0]
    for flat, residual in result["fresh"]:
        assert (flat - matrix).norm() / matrix.norm() < 1e-5
        assert residual.norm() < 1e-5 * matrix.norm()
    zero_result, zero_state = result["after_zero"][0]
    assert torch.equal(zero_result, torch.zeros(600))
    for flat, state in result["after_zero"]:
        assert torch.isfinite(flat).all() and torch.isfinite(state["q"]["w"]).all()
        assert torch.isfinite(state["residual"]["w"]).all()
    sent = sum(flat for flat, _ in result["after_zero"])
    torch.testing.assert_close(sent + result["after_zero"][-1][1]["residual"]["w"].reshape(-1), 3 * matrix,
                               rtol=1e-5, atol=1e-4)
    assert (result["after_zero"][-1][0] - matrix).norm() / matrix.norm() < 1e-4


# ---------------------------------------------------------------------------- state


STATEFUL = {"onebit": lambda: OneBit(warmup_steps=1), "topk": lambda: TopK(0.1),
            "powersgd": lambda: PowerSGD(2, seed=5), "fp16": lambda: FP16(warmup_steps=4)}
# the same parameters as LAYOUT, in two buckets of another order
REBUCKETED = [BucketLayout.single("v", (10, 30)), BucketLayout(("b", "w"), (torch.Size((7,)), torch.Size((16, 12))))]


def _by_name(flat, layout):
    return {name: flat[offset:offset + numel] for name, offset, numel in zip(layout.names, layout.offsets,
                                                                             layout.numels)}


def _continue(comm, compressor, layouts, steps):
    """Reduce steps 3.. of the rank's gradients (defined per name on LAYOUT) bucketed as ``layouts``."""
    results = []
    for step in range(3, 3 + steps):
        grads = _by_name(gradient(LAYOUT, comm.rank, step), LAYOUT)
        for layout in layouts:
            flat = torch.cat([grads[name] for name in layout.names])
            compressor.reduce(flat, layout, comm, comm.world_size)
            results.append(flat)
    return results


@pytest.mark.parametrize("layouts", [[LAYOUT], REBUCKETED], ids=["same-buckets", "rebucketed"])
@pytest.mark.parametrize("name", list(STATEFUL))
def test_state_dict_round_trip_continues_bitwise(name, layouts):
    """3 steps, state_dict (deep copy), 2 more steps; a fresh compressor loaded with the copy repeats
    those 2 steps bit for bit on every rank, also with the parameters in other buckets; a fresh one
    without the state does not (the state matters)."""
    def body(comm):
        original = STATEFUL[name]()
        for step in range(3):
            original.reduce(gradient(LAYOUT, comm.rank, step), LAYOUT, comm, comm.world_size)
        saved = copy.deepcopy(original.state_dict())
        assert set(saved["steps"]) == set(LAYOUT.names)
        for key in FEEDBACK_KEY.values():
            if key in saved:
                assert set(saved[key]) <= set(LAYOUT.names) and saved[key]["w"].shape == (16, 12)
        a = _continue(comm, original, layouts, steps=2)
        restored = STATEFUL[name]()
        restored.load_state_dict(saved)
        b = _continue(comm, restored, layouts, steps=2)
        c = _continue(comm, STATEFUL[name](), layouts, steps=2)
        return a, b, c
    for rank, (a, b, c) in enumerate(run_threads(3, body)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {rank}: restored state diverged"
        assert not all(torch.equal(x, z) for x, z in zip(a, c)), f"rank {rank}: state had no effect"


@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_residuals_follow_names_into_new_buckets(name):
    """After 3 steps on one bucket, the next step on other buckets still satisfies result * ranks ==
    sum(g + r_old - r_new) per parameter, with r_old the residual saved under that parameter's name."""
    def body(comm):
        compressor = STATEFUL[name]()
        for step in range(3):
            compressor.reduce(gradient(LAYOUT, comm.rank, step), LAYOUT, comm, comm.world_size)
        before = copy.deepcopy(compressor.state_dict()["residual"])
        results = _continue(comm, compressor, REBUCKETED, steps=1)
        return before, compressor.state_dict()["residual"], results
    per_rank = run_threads(2, body)
    sent = sum(_by_name(gradient(LAYOUT, rank, 3), LAYOUT)["v"] + before["v"].reshape(-1) - after["v"].reshape(-1)
               for rank, (before, after, _) in enumerate(per_rank))
    assert per_rank[0][0]["v"].abs().max() > 0.01
    torch.testing.assert_close(per_rank[0][2][0] * 2, sent, rtol=1e-5, atol=1e-4)
    sent_w = sum(_by_name(gradient(LAYOUT, rank, 3), LAYOUT)["w"] + before["w"].reshape(-1) - after["w"].reshape(-1)
                 for rank, (before, after, _) in enumerate(per_rank))
    torch.testing.assert_close(per_rank[0][2][1][7:] * 2, sent_w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_load_state_dict_rejects_wrong_keys(name):
    """Missing, extra or renamed top-level keys, or a non-dict, raise ValueError naming the expected keys."""
    compressor = FACTORIES[name]()
    good = compressor.state_dict()
    bad_states = [{**good, "extra": {}}, {"stepz": {}, **{k: v for k, v in good.items() if k != "steps"}}, [],
                  {k: v for k, v in good.items() if k != "steps"}]
    if len(good) > 1:
        bad_states.append({"steps": {}})
    for bad in bad_states:
        with pytest.raises(ValueError, match="expects keys"):
            compressor.load_state_dict(bad)
    compressor.load_state_dict(copy.deepcopy(good))


def test_powersgd_state_of_another_rank_is_rejected():
    """Q matrices saved with rank 2 do not fit a rank-1 PowerSGD: ValueError naming the parameter."""
    def body(comm):
        two = PowerSGD(2)
        two.reduce(gradient(LAYOUT, comm.rank, 0), LAYOUT, comm, comm.world_size)
        one = PowerSGD(1)
        one.load_state_dict(two.state_dict())
        with pytest.raises(ValueError, match="'w'"):
            one.reduce(gradient(LAYOUT, comm.rank, 1), LAYOUT, comm, comm.world_size)
    run_threads(2, body)


# ---------------------------------------------------------------------------- bytes on the wire


@pytest.mark.parametrize("name, bound", [
    ("onebit", 1 / 28), ("fp16", 0.5 * 1.01), ("bf16", 0.5 * 1.01), ("topk", 0.01 * 4 * 1.01),
    ("powersgd", 2000 * 2 / 1e6 * 1.05)])
def test_bytes_sent_against_a_float32_ring(name, bound):
    """One 1000 x 1000 float32 bucket on 4 ranks: payload bytes each rank sends (transport counters)
    relative to a ring AllReduce of the same tensor on the same group."""
    factory = {"topk": lambda: TopK(0.01), "powersgd": lambda: PowerSGD(2)}.get(name, FACTORIES[name])
    layout = BucketLayout.single("w", (1000, 1000))

    def body(comm):
        flat = gradient(layout, comm.rank, 0)
        before = comm.stats.bytes_sent
        collectives.all_reduce(flat.clone(), comm, algorithm="ring")
        ring = comm.stats.bytes_sent - before
        before = comm.stats.bytes_sent
        factory().reduce(flat, layout, comm, comm.world_size)
        return ring, comm.stats.bytes_sent - before
    for rank, (ring, compressed) in enumerate(run_threads(4, body)):
        assert ring >= 2 * 3 / 4 * 4e6, ring
        assert 0 < compressed <= ring * bound, f"rank {rank}: {compressed} bytes vs ring {ring}"


# ---------------------------------------------------------------------------- warm-up and construction


@pytest.mark.parametrize("name", list(FACTORIES))
def test_warmup_steps_are_exact_then_compressed(name):
    """With warmup_steps=2 (through make) the first two reductions are the exact average, the third is
    compressed; steps are counted per parameter name."""
    per_rank = reduce_steps(3, lambda: make(name, topk_ratio=0.1, powersgd_rank=2, warmup_steps=2), LAYOUT, steps=3)
    for step in range(3):
        expected = exact_average(LAYOUT, 3, step)
        for records in per_rank:
            error = (records[step][3].double() - expected).abs().max().item()
            if step < 2:
                assert error < 1e-5, (step, error)
            else:
                assert error > 1e-4 * expected.abs().max().item(), f"step 3 was not compressed ({error})"
    assert per_rank[0][-1][2]["steps"] == {"w": 3, "b": 3, "v": 3}


@pytest.mark.parametrize("name", ["fp16", "onebit"])
def test_warmup_on_float16_buckets_does_not_overflow(name):
    """Exact warm-up reductions of a float16 bucket whose sum exceeds 65504 (60000 on each of 2 ranks)
    stay finite, as the uncompressed path does, and so does the compressed step after them."""
    layout = BucketLayout.single("h", (10,))

    def body(comm):
        compressor, results = make(name, warmup_steps=1), []
        for _ in range(2):
            flat = torch.full((10,), 60000.0, dtype=torch.float16)
            compressor.reduce(flat, layout, comm, comm.world_size)
            results.append(flat)
        return results
    for result in run_threads(2, body)[0]:
        assert result.dtype == torch.float16 and torch.isfinite(result).all(), result
        torch.testing.assert_close(result.float(), torch.full((10,), 60000.0), rtol=2e-3, atol=0)


def test_make_and_bad_arguments():
    """make() builds each named compressor with its settings; bad ratios, ranks, block sizes and
    warm-up counts raise ValueError."""
    assert COMPRESSIONS == ("none", "fp16", "bf16", "onebit", "topk", "powersgd")
    assert make("none") is None
    built = {name: make(name, topk_ratio=0.25, powersgd_rank=3, warmup_steps=2) for name in COMPRESSIONS[1:]}
    assert {name: type(c) for name, c in built.items()} == {"fp16": FP16, "bf16": BF16, "onebit": OneBit,
                                                            "topk": TopK, "powersgd": PowerSGD}
    assert all(c.warmup_steps == 2 and c.name == name for name, c in built.items())
    assert built["topk"].ratio == 0.25 and built["powersgd"].rank == 3
    with pytest.raises(ValueError, match="bogus.*none, fp16, bf16, onebit, topk, powersgd"):
        make("bogus")
    for bad in (lambda: TopK(ratio=0), lambda: TopK(1.5), lambda: TopK(-0.1), lambda: TopK(True),
                lambda: PowerSGD(rank=0), lambda: PowerSGD(rank=1.5), lambda: OneBit(block_numel=12),
                lambda: OneBit(block_numel=0), lambda: FP16(warmup_steps=-1), lambda: OneBit(warmup_steps=-1),
                lambda: TopK(warmup_steps=1.5), lambda: PowerSGD(warmup_steps=-1), lambda: BF16(warmup_steps=-1),
                lambda: make("topk", topk_ratio=0), lambda: make("powersgd", powersgd_rank=0)):
        with pytest.raises(ValueError):
            bad()
