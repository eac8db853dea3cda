"""Property tests for the pure helpers: ``chunk_bounds`` (collectives) and ``assign_buckets`` (parallel)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradsync.collectives.chunking import chunk_bounds
from gradsync.parallel.bucketing import assign_buckets

numels = st.integers(min_value=0, max_value=10_000)
world_sizes = st.integers(min_value=1, max_value=64)


@given(numel=numels, world_size=world_sizes)
def test_chunk_bounds_sizes_match_tensor_split(numel, world_size):
    """Chunk sizes equal those of ``torch.tensor_split(arange(numel), world_size)``."""
    expected = [part.numel() for part in torch.tensor_split(torch.arange(numel), world_size)]
    assert [stop - start for start, stop in chunk_bounds(numel, world_size)] == expected


@given(numel=numels, world_size=world_sizes)
def test_chunk_bounds_cover_range_contiguously(numel, world_size):
    """The chunks are world_size half-open ranges that tile [0, numel) in order."""
    bounds = chunk_bounds(numel, world_size)
    assert len(bounds) == world_size
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (_, stop), (start, _) in zip(bounds, bounds[1:]):
        assert stop == start
    assert all(start <= stop for start, stop in bounds)


@given(numel=numels, world_size=world_sizes)
def test_chunk_bounds_sizes_differ_by_at_most_one(numel, world_size):
    """Chunk sizes differ by at most one element, larger chunks first."""
    sizes = [stop - start for start, stop in chunk_bounds(numel, world_size)]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("numel,world_size", [(-1, 2), (3, 0), (0, -1)])
def test_chunk_bounds_rejects_bad_arguments(numel, world_size):
    """A negative numel or a world_size below one raises ValueError."""
    with pytest.raises(ValueError):
        chunk_bounds(numel, world_size)


_DTYPES = (torch.float32, torch.float64, torch.float16)
params_strategy = st.lists(
    st.tuples(st.integers(min_value=0, max_value=300), st.sampled_from(_DTYPES)),
    min_size=0, max_size=30,
).map(lambda specs: [torch.zeros(numel, dtype=dtype) for numel, dtype in specs])
caps = st.integers(min_value=1, max_value=4096)


def _nbytes(param):
    return param.numel() * param.element_size()


@given(params=params_strategy, cap=caps)
def test_assign_buckets_uses_each_index_exactly_once(params, cap):
    """Every parameter index appears in exactly one bucket, and no bucket is empty."""
    buckets = assign_buckets(params, bucket_cap_bytes=cap)
    flat = [index for bucket in buckets for index in bucket]
    assert sorted(flat) == list(range(len(params)))
    assert all(buckets)


@given(params=params_strategy, cap=caps)
def test_assign_buckets_keeps_reverse_registration_order(params, cap):
    """Inside a bucket indices run in reverse registration order (the order backward produces grads)."""
    for bucket in assign_buckets(params, bucket_cap_bytes=cap):
        assert bucket == sorted(bucket, reverse=True)


@given(params=params_strategy, cap=caps)
def test_assign_buckets_respects_cap_unless_single_param_larger(params, cap):
    """A bucket holds at most cap bytes unless it is one parameter that alone exceeds the cap."""
    for bucket in assign_buckets(params, bucket_cap_bytes=cap):
        total = sum(_nbytes(params[index]) for index in bucket)
        assert total <= cap or (len(bucket) == 1 and _nbytes(params[bucket[0]]) > cap)


@given(params=params_strategy, cap=caps)
def test_assign_buckets_groups_one_dtype_per_bucket(params, cap):
    """Every bucket holds parameters of a single dtype (a flat buffer needs one dtype)."""
    for bucket in assign_buckets(params, bucket_cap_bytes=cap):
        assert len({params[index].dtype for index in bucket}) == 1


def test_assign_buckets_matches_documented_example():
    """Three float32 params of 100, 100, 300 elements with an 800-byte cap give [[2], [1, 0]]."""
    params = [torch.zeros(100), torch.zeros(100), torch.zeros(300)]
    assert assign_buckets(params, bucket_cap_bytes=800) == [[2], [1, 0]]


@pytest.mark.parametrize("cap", [0, -1])
def test_assign_buckets_rejects_non_positive_cap(cap):
    """A cap of zero or fewer bytes raises ValueError."""
    with pytest.raises(ValueError):
        assign_buckets([torch.zeros(1)], bucket_cap_bytes=cap)
