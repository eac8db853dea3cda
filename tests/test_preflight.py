"""gradsync.preflight: the per-rank estimate against hand-computed bytes, the measured pass, and the refusal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync
from gradsync.collectives.shm_setup import DEFAULT_CELL_BYTES, MAILBOX_BYTES
from gradsync.parallel import comm_buffers
from gradsync.parallel.pass_memory import PassMemory, measure_pass, scaled
from gradsync.parallel.preflight import estimate, estimate_from, state_slots
from gradsync.parallel.preflight_fit import Trial, check_fit, refusal
from gradsync.parallel.sync_round import SLOTS_PER_RANK
from gradsync.transport.shm_segment import LINE_BYTES, MAILBOX_SLOTS
from gradsync.train.memory_report import preflight_line

MiB = 2**20


def _linear():
    torch.manual_seed(0)
    return nn.Linear(10, 20)  # 200 + 20 parameters: 880 bytes of float32, one bucket [bias, weight]


@pytest.mark.parametrize("optimizer, slots", [
    (lambda p: torch.optim.AdamW(p), 2), (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
    (lambda p: torch.optim.SGD(p, lr=0.1), 0), (lambda p: torch.optim.Adagrad(p), 1)])
def test_optimizer_state_slots_are_measured_from_its_layout(optimizer, slots):
    assert state_slots(optimizer(_linear().parameters())) == slots


class _Sin(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return (x * self.w).sin()


def test_the_measured_pass_holds_the_backwards_temporaries():
    """sin saves its input a = x * w (4n bytes); its backward computes cos(a) and grad * cos(a) while a is
    still saved: 12n bytes, three times what autograd saves, plus the 4-byte loss and its seed gradient;
    once w's gradient (4n) is accumulated it counts as a gradient, and only those two scalars remain."""
    n = 4096
    passed = measure_pass(_Sin(n), torch.randn(n))
    assert passed.peak_by_ready == (3 * 4 * n + 2 * 4, 2 * 4)
    assert passed.ready_order == (0,) and passed.grad_bytes == (4 * n,)
    assert passed.as_run() == 12 * n + 8


def _pass(peaks, order, grads):
    return PassMemory(tuple(peaks), tuple(order), tuple(grads))


def test_a_pass_scales_linearly_between_two_probes():
    """Two probes of the Sin model (4n elements per sample-like row) extrapolate to the measured pass."""
    n = 1024
    model = _Sin(n)
    passes = {rows: measure_pass(model, torch.randn(rows, n)) for rows in (1, 2, 8)}
    assert scaled(passes[1], passes[2], 1, 2, 8).peak_by_ready == passes[8].peak_by_ready
    assert passes[8].peak_by_ready[0] == 3 * 4 * n * 8 + 8


def test_the_estimate_matches_a_hand_computed_case():
    """Linear(10, 20) (220 parameters, one bucket), AdamW, a pass that held 1000 bytes before any gradient,
    500 after the bias's and 100 after both (hand-made, so that every part is a formula)."""
    model = _linear()
    passed = _pass([1000, 500, 100], [0, 1], [80, 800])  # bias ready first, then weight
    flags = (2 + 2 * SLOTS_PER_RANK) * 4  # the last bucket's used flags and per-rank slots, float32
    ring = 4 * min(4 * MiB, -(-(880 + flags) // 2))  # four receive segments (ring.IN_FLIGHT) of a chunk of the bucket
    # none: .grad whole (880) and the bucket; the pass's peak holds the gradients set by then
    whole = estimate_from(model, 2, passed, 2, "none", algorithm="ring")
    peak = max(1000 + 0, 500 + 80, 100 + 880)
    assert whole == gradsync.MemoryEstimate(880, 880, 2 * 880, 880 + flags + ring, peak - 880)
    # ZeRO-1: this rank's chunk of the bucket (440), the bucket padded to the world size; each .grad released
    zero1 = estimate_from(model, 2, passed, 2, "optimizer", algorithm="ring")
    chunk = 440
    peak1 = max(1000, 500, 100 + chunk)  # the chunk exists once the bucket is reduce-scattered
    assert zero1 == gradsync.MemoryEstimate(880, chunk, 2 * chunk, 880 + flags + ring, peak1 - chunk)
    # ZeRO-2: the bucket waits for the weight, holding the bias's .grad (80) meanwhile; one slab (one bucket)
    zero2 = estimate_from(model, 2, passed, 2, "gradients", algorithm="ring")
    peak2 = max(1000, 500 + 80, 100 + chunk)
    assert zero2 == gradsync.MemoryEstimate(880, chunk, 2 * chunk, 880 + flags + ring, peak2 - chunk)
    # ZeRO-3 with the whole module as its root unit: the shard plus the root gathered
    zero3 = estimate_from(model, 2, passed, 4, "parameters", algorithm="ring")
    shard = 220 // 4 * 4
    assert zero3.parameter_bytes == shard + 880 and zero3.gradient_bytes == shard
    assert zero3.optimizer_state_bytes == 2 * shard


def test_shared_memory_buffers_follow_the_segment_and_arena_constants():
    """Under shm, a rank writes its counter line and mailboxes, and: without sharding its slot of the
    arena holding the zero-copy buckets twice (the rebuild lays them out again); sharded, one cell of
    each of its two region sets."""
    buckets = comm_buffers.bucket_bytes([250_000, 2_000_000], 4, 4, padded=False, num_params=6)
    assert buckets == [1_000_000, (2_000_000 + 6 + 4 * SLOTS_PER_RANK) * 4]
    own = LINE_BYTES + MAILBOX_SLOTS * MAILBOX_BYTES
    arena = -(-sum(-(-size // 64) * 64 for size in buckets) // 4096) * 4096
    assert comm_buffers.buffer_bytes("none", buckets, 0, 4, "shm", True, True) == own + 2 * arena
    cells = 2 * -(-min(DEFAULT_CELL_BYTES, max(buckets)) // 4096) * 4096
    assert comm_buffers.buffer_bytes("optimizer", buckets, 0, 4, "shm", True, True) == sum(buckets) + own + cells
    assert comm_buffers.buffer_bytes("gradients", buckets, 0, 4, "shm", True, True) == 2 * max(buckets) + own + cells
    # one rank communicates nothing
    assert comm_buffers.buffer_bytes("none", buckets, 0, 1, "shm", True, True) == sum(buckets)


def test_the_library_estimate_runs_one_pass():
    model, batch = _linear(), torch.randn(4, 10)
    found = estimate(model, torch.optim.AdamW(model.parameters()), batch, 2)
    assert (found.parameter_bytes, found.gradient_bytes, found.optimizer_state_bytes) == (880, 880, 1760)
    assert found.activation_bytes >= 0 and all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="world_size"):
        estimate(model, torch.optim.AdamW(model.parameters()), batch, 0)
    with pytest.raises(ValueError, match="unknown shard level"):
        estimate(model, torch.optim.AdamW(model.parameters()), batch, 2, "everything")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])  # 8 x 16.6 KB


def test_a_run_that_does_not_fit_is_refused_naming_the_level_that_would():
    model = _mlp()
    adamw = torch.optim.AdamW(model.parameters())
    passed = _pass([4096] + [0] * 16, range(16), [p.numel() * 4 for p in model.parameters()])
    settings = {"bucket_cap_mb": 0.02, "algorithm": "ring", "one_host": True, "gradient_as_bucket_view": False}
    base = Trial(4, "none", 2)
    whole = check_fit(model, adamw, base, None, settings, passed)
    assert check_fit(model, adamw, base, whole.total_bytes, settings, passed) == whole
    zero1 = estimate_from(model, 2, passed, 4, "optimizer", **settings)
    with pytest.raises(gradsync.MemoryPreflightError, match=r"largest part is optimizer state .*; "
                                                           r"shard='optimizer' would need") as caught:
        check_fit(model, adamw, base, zero1.total_bytes, settings, passed)
    assert caught.value.estimate == whole and "\n" not in str(caught.value)
    # as gradsync train options, a larger world size when no level fits at this one
    levels = ("none", "optimizer", "gradients", "parameters")
    at4 = min(estimate_from(model, 2, passed, 4, level, **settings).total_bytes for level in levels)
    at8 = {level: estimate_from(model, 2, passed, 8, level, **settings).total_bytes for level in levels}
    fits = next(level for level in levels if at8[level] < at4)
    with pytest.raises(gradsync.MemoryPreflightError, match=f"--nproc 8 --shard {fits} would need"):
        check_fit(model, adamw, base, at4 - 1, settings, passed, options=True)
    with pytest.raises(gradsync.MemoryPreflightError, match="tensor or pipeline parallelism beyond gradsync"):
        check_fit(model, adamw, base, whole.parameter_bytes // 2, settings, passed)


def test_activations_too_large_suggest_a_smaller_micro_batch():
    """Activations that scale with the micro-batch: halved until they fit, accumulation keeping the samples."""
    model = _linear()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = {"bucket_cap_mb": 25.0, "algorithm": "ring", "one_host": True, "gradient_as_bucket_view": False}

    def pass_at(size):  # 100 KB of activations per sample
        return _pass([100_000 * size, 0, 0], [0, 1], [80, 800])

    base = Trial(2, "none", 16, 1)
    found = estimate_from(model, 0, pass_at(16), 2, "none", **settings)
    at4 = estimate_from(model, 0, pass_at(4), 2, "none", **settings)
    with pytest.raises(gradsync.MemoryPreflightError) as caught:
        check_fit(model, sgd, base, at4.total_bytes, settings, pass_at(16), pass_at, options=True)
    assert str(caught.value) == refusal(found, base, at4.total_bytes, (Trial(2, "none", 4, 4), at4), options=True)
    assert "largest part is activations" in str(caught.value)
    assert "--batch-size 4 --accumulate 4 --shard none would need" in str(caught.value)


def test_the_library_call_refuses_with_the_default_loss():
    model = _linear()
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(gradsync.MemoryPreflightError, match="tensor or pipeline parallelism"):
        gradsync.preflight(model, adamw, torch.randn(4, 10), 2, available_bytes=100)
    assert gradsync.preflight(model, adamw, torch.randn(4, 10), 2, available_bytes=2**40).parameter_bytes == 880


def test_the_resident_peak_is_measured_and_survives_a_reset():
    """64 MiB touched then freed: the peak above the baseline holds them, and a reset of the high-water mark
    (the preflight's, before each measured pass) does not lose them from the process's whole peak."""
    from gradsync.hosts import resident
    from gradsync.train.process_memory import measured_peak, snapshot

    before = snapshot()
    block = torch.ones(16 * 2**20)  # 64 MiB, every page written
    peak = resident.peak_resident_bytes()
    del block
    if not resident.reset_peak():
        pytest.skip("this kernel does not let a process reset its peak resident set")
    # the kernel's counters lag by up to a few hundred KiB (proc(5): VmHWM "is inaccurate")
    assert resident.peak_resident_bytes(since_reset=True) < peak - 32 * MiB
    assert resident.peak_resident_bytes() >= peak - MiB
    found = measured_peak(before)
    assert found.source in ("rss", "cgroup") and found.bytes >= 60 * MiB


def test_copied_pages_join_every_estimate_and_the_refusal():
    """``copied``: pages a cgroup charges beyond the rank's own growth, the same at every setting tried."""
    model = _mlp()
    adamw = torch.optim.AdamW(model.parameters())
    passed = _pass([4096] + [0] * 16, range(16), [p.numel() * 4 for p in model.parameters()])
    settings = {"bucket_cap_mb": 0.02, "algorithm": "ring", "one_host": True, "gradient_as_bucket_view": False}
    base = Trial(4, "none", 2)
    plain = check_fit(model, adamw, base, None, settings, passed)
    copied = check_fit(model, adamw, base, None, settings, passed, copied=5 * MiB)
    assert plain.copied_bytes == 0 and copied.total_bytes == plain.total_bytes + 5 * MiB
    zero1 = estimate_from(model, 2, passed, 4, "optimizer", **settings)
    assert check_fit(model, adamw, base, zero1.total_bytes + 5 * MiB, settings, passed).total_bytes == \
        plain.total_bytes  # fits without the copies
    with pytest.raises(gradsync.MemoryPreflightError, match=r"copy-on-write pages 5\.0 MiB.*shard='optimizer' would "
                                                           rf"need {(zero1.total_bytes + 5 * MiB) / MiB:.1f} MiB"):
        check_fit(model, adamw, base, zero1.total_bytes + 5 * MiB, settings, passed, copied=5 * MiB)
    assert "copy-on-write" not in refusal(plain, base, 1, None)


def test_preflight_line_gives_no_error_against_a_zero_peak():
    """A run whose measured peak above the baseline is 0 MiB (nothing measured above it) prints no
    percentage: an error over zero is no figure (it printed +15040588378.9%)."""
    fields = {"measured_by": "rss", "measured_peak_mib": 0.0, "estimate_mib": 150.4}
    line = preflight_line({"preflight": fields})
    assert "%" not in line and "estimated 150.4 MiB" in line and "no error" in line
    fields["measured_peak_mib"] = 100.0
    assert preflight_line({"preflight": fields}).endswith(": +50.4%")
