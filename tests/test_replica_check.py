"""Replica checks: the bit checksum, and check_replicas naming the tensor, the ranks and the step."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradsync
from gradsync.parallel.checksum import ROW_WORDS, SMALL_WORDS, checksum, fingerprint
from _dist import RankError, capture_error, run_threads

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool]


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8,
                         generator=generator)
    return bits.view(dtype) if dtype != torch.bool else bits.remainder(2).bool()


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), numel=st.integers(1, 3 * ROW_WORDS + 5), seed=st.integers(0, 2**16),
       where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 63))
def test_a_flipped_bit_anywhere_changes_the_checksum(dtype, numel, seed, where, bit):
    tensor = _random(numel, dtype, seed)
    raw = tensor.clone().view(torch.uint8) if dtype != torch.bool else tensor.clone().view(torch.uint8)
    nbits = raw.numel() * 8 if dtype != torch.bool else raw.numel()
    position = int(where * nbits)
    if dtype == torch.bool:
        raw[position] ^= 1
    else:
        raw[position // 8] ^= 1 << (position % 8)
    assert checksum(raw.view(dtype) if dtype != torch.bool else raw.bool()) != checksum(tensor)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES[:-1]), numel=st.integers(2, 3 * ROW_WORDS + 5), seed=st.integers(0, 2**16),
       first=st.floats(0, 1, exclude_max=True), second=st.floats(0, 1, exclude_max=True))
def test_two_swapped_elements_change_the_checksum(dtype, numel, seed, first, second):
    tensor = _random(numel, dtype, seed)
    i, j = int(first * numel), int(second * numel)
    if i == j or torch.equal(tensor[i:i + 1].view(torch.uint8), tensor[j:j + 1].view(torch.uint8)):
        return
    swapped = tensor.clone()
    swapped[i], swapped[j] = tensor[j], tensor[i]
    assert checksum(swapped) != checksum(tensor)


def test_swaps_a_linear_word_sum_misses_are_caught():
    # x and -x differ only in the top bit of a 64-bit word's upper half: a weighted sum of words
    # modulo 2**64 cannot see them swapped (2**63 * an even weight difference); the second sum can
    tensor = torch.randn(2 * ROW_WORDS + 8)
    tensor[1], tensor[2 * ROW_WORDS + 5] = 1.5, -1.5
    swapped = tensor.clone()
    swapped[1], swapped[2 * ROW_WORDS + 5] = -1.5, 1.5
    assert checksum(swapped)[0] == checksum(tensor)[0]  # the case the second checksum exists for
    assert checksum(swapped) != checksum(tensor)
    doubles = torch.tensor([2.0, -2.0, 3.0], dtype=torch.float64)
    assert checksum(doubles.flip(0)[[1, 2, 0]]) != checksum(doubles)


def test_checksum_reads_bits_not_values_and_ignores_layout():
    zeros = torch.zeros(8)
    negative_zero = zeros.clone()
    negative_zero[3] = -0.0
    assert checksum(negative_zero) != checksum(zeros)  # equal as floats, not as bits
    matrix = torch.randn(64, 48)
    assert checksum(matrix.t()) == checksum(matrix.t().contiguous())
    assert checksum(torch.empty(0)) == (0, 0)
    with pytest.raises(TypeError, match="dense"):
        checksum(torch.randn(4, 4).to_sparse())


def test_fingerprint_sees_a_change_in_any_tensor_small_or_large():
    tensors = [torch.randn(SMALL_WORDS * 2 + 3), torch.randn(5), torch.randn(3, 7), torch.randn(SMALL_WORDS * 2)]
    reference = fingerprint(tensors)
    for index in range(len(tensors)):
        changed = [tensor.clone() for tensor in tensors]
        changed[index].view(-1)[-1] += 1.0
        assert fingerprint(changed) != reference
    assert fingerprint([tensor.clone() for tensor in tensors]) == reference


def _model(seed: int = 0) -> nn.Module:
    """The same weights for the same seed, whatever other thread-ranks do to torch's global RNG."""
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return model


def _train(model, optimizer, rank: int, steps: int = 2) -> None:
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        loss = model(torch.randn(4, 6, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_equal_replicas_pass_and_report_what_was_compared():
    def body(comm):
        model = _model()
        optimizer = torch.optim.Adam(model.parameters())
        _train(model, optimizer, rank=0)  # the same data on every rank: still equal
        return gradsync.check_replicas(model, optimizer, step=2, group=comm)

    for check in run_threads(3, body):
        assert check.step == 2
        assert check.tensors == 4 + 3 * 4  # parameters + Adam's step, exp_avg, exp_avg_sq per parameter
        assert check.nbytes == sum(p.numel() * 4 for p in _model().parameters()) * 3 + 4 * 4


def _divergent(comm, where: str, rank_that_differs: int):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    _train(model, optimizer, rank=0)
    if comm.rank == rank_that_differs:
        with torch.no_grad():
            if where == "parameter":
                model[2].weight[1, 2] = torch.nextafter(model[2].weight[1, 2], torch.tensor(9.0))
            else:
                optimizer.state[model[0].bias]["exp_avg"][4] *= -1
    try:
        gradsync.check_replicas(model, optimizer, step=7, group=comm)
    except gradsync.ReplicaDivergenceError as error:
        return str(error), error.tensor, error.groups, error.step
    return None


@pytest.mark.parametrize("where, name", [("parameter", "parameter '2.weight'"),
                                         ("optimizer", "optimizer state '0.bias' exp_avg")])
def test_a_divergent_rank_is_named_on_every_rank(where, name):
    results = run_threads(3, lambda comm: _divergent(comm, where, rank_that_differs=1))
    for message, tensor, groups, step in results:
        assert tensor == name and groups == [[0, 2], [1]] and step == 7
        assert name in message and "step 7" in message and "ranks 0, 2 have checksum" in message
        assert "rank 1 has checksum" in message


def test_ranks_at_different_steps_or_with_other_tensors_diverge():
    def steps(comm):
        with pytest.raises(gradsync.ReplicaDivergenceError, match="different steps: ranks 0, 2 have step 5; "
                                                                  "rank 1 has step 6"):
            gradsync.check_replicas(_model(), step=6 if comm.rank == 1 else 5, group=comm)

    def extra(comm):
        model = _model()
        if comm.rank == 0:
            model.register_buffer("mask", torch.ones(3))
        with pytest.raises(gradsync.ReplicaDivergenceError, match="different numbers of tensors, first at "
                                                                  r"buffer 'mask' \(tensor 4\): ranks 1, 2 have no"):
            gradsync.check_replicas(model, group=comm)

    run_threads(3, steps)
    run_threads(3, extra)


def test_a_rank_with_a_bad_argument_raises_its_error_and_the_others_name_it():
    def body(comm):
        if comm.rank == 1:
            with pytest.raises(ValueError, match="step must be an int"):
                gradsync.check_replicas(_model(), step=-3, group=comm)
        else:
            with pytest.raises(gradsync.CollectiveMismatchError, match="rank 1 rejected the check"):
                gradsync.check_replicas(_model(), step=3, group=comm)

    run_threads(3, body, timeout_s=20)


def test_data_parallel_and_local_sgd_check_where_replicas_must_agree():
    def body(comm):
        model = gradsync.DataParallel(_model(seed=comm.rank), group=comm)  # rank 0's weights everywhere
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        _train(model, optimizer, rank=comm.rank, steps=3)  # different data per rank, averaged gradients
        assert model.check_replicas(optimizer).tensors == 8
        with torch.no_grad():
            if comm.rank == 0:
                model.module[0].weight[0, 0] = torch.nextafter(model.module[0].weight[0, 0], torch.tensor(9.0))
        with pytest.raises(gradsync.ReplicaDivergenceError, match=r"at step 3: parameter '0.weight'"):
            model.check_replicas()
        local = gradsync.LocalSGD(_model(seed=comm.rank), sync_every=2, group=comm)
        local_optimizer = torch.optim.SGD(local.parameters(), lr=0.01)
        _train(local, local_optimizer, rank=comm.rank, steps=1)
        local.step()
        with pytest.raises(ValueError, match="right after an average"):
            local.check_replicas()
        _train(local, local_optimizer, rank=comm.rank, steps=1)
        assert local.step()
        return local.check_replicas().step

    assert run_threads(2, body) == [1, 1]


def test_without_a_group_on_one_process_it_compares_nothing_and_passes():
    def body(comm):
        return gradsync.check_replicas(_model(), group=comm).tensors

    assert run_threads(1, body) == [4]
    with pytest.raises(RankError, match="torch.nn.Module"):
        run_threads(2, lambda comm: gradsync.check_replicas("model", group=comm))


def _bench_row():
    from gradsync.bench.replica_checks import bench_model

    return bench_model("cnn", steps=2, checks=2, repeat=1)


@pytest.mark.timeout(90)
def test_bench_replicas_times_a_step_and_both_checks(capsys):
    from _dist import run_world
    from gradsync.bench.replica_checks import format_table, run_bench

    row = run_world(2, _bench_row, timeout_s=80)[0]
    assert row["parameters"] == 5210 and row["world_size"] == 2 and row["parameter_bytes"] == 4 * 5210
    assert 0 < row["check_s"] and 0 < row["check_optimizer_s"] and 0 < row["step_s"]
    assert row["check_fraction_of_step"] == pytest.approx(row["check_s"] / row["step_s"])
    assert row["overhead_every_100"] == pytest.approx(row["check_optimizer_s"] / (100 * row["step_s"]))
    assert format_table([row]).splitlines()[2].split()[:3] == ["cnn", "2", "5210"]
    for options, needle in (({"nproc": "1"}, "--nproc"), ({"nproc": "abc"}, "--nproc must list"),
                            ({"models": "resnet"}, "resnet"),
                            ({"checks": 0}, "--checks"), ({"repeat": 0}, "--repeat")):
        arguments = {"nproc": "2", "models": "cnn", "steps": 1, "checks": 1, "repeat": 1, "json_path": None}
        with pytest.raises(ValueError, match=needle):
            run_bench(**{**arguments, **options})


@pytest.mark.parametrize("numel", [1, 7, 2 * ROW_WORDS, 16 * 2 * ROW_WORDS + 2, 40 * 2 * ROW_WORDS + 3])
def test_checksum_is_the_position_weighted_word_sum_of_its_docstring(numel):
    """The fast paths (one call for small tensors, column and row sums, shifts in chunks) against the
    formula written out: word i in row r, column j weighs (2j + 1) + 2K (2r + 1), modulo 2**64."""
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    raw = tensor.view(torch.uint8)
    padded = torch.zeros(-(-raw.numel() // 8) * 8, dtype=torch.uint8)
    padded[:raw.numel()] = raw
    words = [int(word) for word in padded.view(torch.int64)]
    expected = []
    for values in (words, [word >> 32 for word in words]):
        total = sum(((2 * (i % ROW_WORDS) + 1) + 2 * ROW_WORDS * (2 * (i // ROW_WORDS) + 1)) * value
                    for i, value in enumerate(values))
        expected.append(total % 2**64)
    assert checksum(tensor) == tuple(expected)


@pytest.mark.parametrize("bad, error", [
    ({"timeout": -1.0}, ValueError), ({"buffers": "no"}, TypeError), ({"step": 2**63}, ValueError),
    ({"sparse": True}, TypeError), ({"local_steps": 1}, ValueError)])
def test_a_bad_argument_on_one_rank_never_leaves_the_others_waiting(bad, error):
    """Each rejection on rank 1 is raised there; rank 0 learns it in the same exchange (no timeout)."""
    def body(comm):
        model = _model()
        if "local_steps" in bad:
            local = gradsync.LocalSGD(model, sync_every=4, group=comm)
            if comm.rank == 1:
                local.step()  # a step after the last average: this rank cannot be compared now
            return capture_error(local.check_replicas)
        options = {key: value for key, value in bad.items() if key != "sparse"} if comm.rank == 1 else {}
        if comm.rank == 1 and "sparse" in bad:
            model.register_buffer("mask", torch.eye(3).to_sparse())
        return capture_error(lambda: gradsync.check_replicas(model, group=comm, **options))

    started = time.monotonic()
    errors = run_threads(2, body, timeout_s=30, collective_timeout_s=10)
    assert time.monotonic() - started < 5  # not the 10 s collective timeout
    assert isinstance(errors[1], error), errors[1]
    assert isinstance(errors[0], gradsync.CollectiveMismatchError) and "rank 1 rejected" in str(errors[0])
