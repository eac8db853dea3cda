"""Independent expected values for collective tests: closed forms and plain-torch references.

Rank r of p writes ``x[j] = i_j*p + r`` with ``i_j = j mod period``; the sum
is ``i_j*p*p + p(p-1)/2``. The period keeps every partial sum (and the
average, a half-integer) exact in the dtype, so results can be compared
bitwise whatever order an algorithm adds in (the mpi4py / gloo test idea).
"""

import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES
# Largest value whose half-integers (floats) or integers are exact in the dtype.
EXACT_LIMIT = {torch.float32: 2**23, torch.float64: 2**52, torch.float16: 2**10, torch.bfloat16: 2**7,
               torch.int8: 127, torch.uint8: 255, torch.int16: 2**15 - 1, torch.int32: 2**31 - 1,
               torch.int64: 2**62}


def _period(dtype, world_size):
    """Largest period such that every closed-form sum i*p*p + p(p-1)/2 stays exact in ``dtype``."""
    p = world_size
    return (EXACT_LIMIT[dtype] - p * (p - 1) // 2) // (p * p) + 1


def closed_form_input(numel, rank, world_size, dtype):
    """Rank ``rank``'s ``(numel,)`` input: ``x[j] = (j mod period) * p + rank``."""
    index = torch.arange(numel, dtype=torch.int64) % _period(dtype, world_size)
    return (index * world_size + rank).to(dtype)


def closed_form_result(numel, world_size, dtype, op):
    """The exact sum ``i_j*p*p + p(p-1)/2`` (or that over p for avg), in ``dtype``."""
    p = world_size
    index = torch.arange(numel, dtype=torch.int64) % _period(dtype, p)
    total = index * p * p + p * (p - 1) // 2
    return (total.double() / p if op == "avg" else total).to(dtype)


def reference_all_reduce(inputs, op):
    """``torch.stack(inputs).sum(0)`` in float64 / int64 (over len(inputs) for avg), cast to the inputs' dtype."""
    dtype = inputs[0].dtype
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    total = torch.stack([tensor.to(wide) for tensor in inputs]).sum(0)
    if op == "avg":
        total = total / len(inputs)
    return total.to(dtype)


def _dense_copy(tensor):
    """A fresh (numel,) tensor with unit stride (``contiguous()`` keeps odd strides of 1-element views)."""
    return torch.empty(tensor.numel(), dtype=tensor.dtype).copy_(tensor.reshape(-1))


def bitwise_difference(actual, expected):
    """Return "" when dtype, shape and bytes agree, else a description of the difference."""
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != {expected.dtype}"
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.numel() and not torch.equal(_dense_copy(actual).view(torch.uint8),
                                          _dense_copy(expected).view(torch.uint8)):
        wrong = (_dense_copy(actual) != _dense_copy(expected)).nonzero().flatten()
        first = int(wrong[0]) if wrong.numel() else 0
        return (f"{wrong.numel()} of {actual.numel()} elements differ; first at flat index {first}: "
                f"{_dense_copy(actual)[first].item()} != {_dense_copy(expected)[first].item()}")
    return ""


def assert_bitwise_equal(actual, expected, what):
    """Assert same dtype, same shape and the same bytes."""
    difference = bitwise_difference(actual, expected)
    assert not difference, f"{what}: {difference}"


SENTINEL = 99


def strided_column_view(values):
    """A non-contiguous view: column 1 of a (numel, 3) tensor whose other columns hold SENTINEL."""
    base = torch.full((values.numel(), 3), SENTINEL, dtype=values.dtype)
    base[:, 1] = values
    return base, base[:, 1]


def transposed_view(values):
    """A non-contiguous view covering its whole storage: the transpose of a (3, numel/3) tensor."""
    base = values.reshape(3, -1).clone()
    return base, base.t()


def assert_rejected_everywhere(outcomes, bad_rank: int, bad_type: type, words: str,
                               expected_follow_up: torch.Tensor, max_wait_s: float) -> None:
    """``outcomes[rank] = (exception, seconds waited, follow-up all_reduce result)``: ``bad_rank``
    raised its own ``bad_type``, every other rank a CollectiveMismatchError naming it as rejecting,
    all mention ``words``, none waited ``max_wait_s``, and the follow-up call is exact everywhere."""
    from gradsync import CollectiveMismatchError

    for rank, (exc, elapsed_s, follow_up) in enumerate(outcomes):
        if rank == bad_rank:
            assert type(exc) is bad_type, f"rank {rank}: {exc!r}"
        else:
            assert isinstance(exc, CollectiveMismatchError), f"rank {rank}: {exc!r}"
            assert f"rank {bad_rank} rejected the call" in str(exc), f"rank {rank}: {exc}"
        assert words in str(exc), f"rank {rank}: {exc}"
        assert elapsed_s < max_wait_s, f"rank {rank} waited {elapsed_s:.2f} s"
        assert_bitwise_equal(follow_up, expected_follow_up, f"rank {rank} follow-up")
