"""DataParallel divides the summed bucket while copying it into ``.grad`` (one pass over the gradients less).

Gradients here are integers, so every rank's sum is exact whatever order the
AllReduce adds in, and the average's bits are those of one division of the
exact sum: ``fl(S / 3)``. Dividing each rank's gradient first would round
three times (``fl(a/3) + fl(b/3) + fl(c/3)``), which these values tell apart.
"""

import pytest
import torch
from torch import nn

import gradsync
from _dist import run_threads

WORLD = 3
IN, OUT = 8, 2


def _integer_inputs(rank: int) -> torch.Tensor:
    """Rank r's batch (4, IN): integers below 2**20, so d(sum of outputs)/dW is an integer matrix (column
    sums) and every sum over ranks stays below 2**24, exact in float32."""
    return torch.randint(1, 2**20, (4, IN), generator=torch.Generator().manual_seed(100 + rank)).float()


def _exact_sum() -> torch.Tensor:
    """The sum over ranks of every rank's gradient (OUT, IN): exact, small integers."""
    return sum(_integer_inputs(rank).sum(0) for rank in range(WORLD)).expand(OUT, IN)


@pytest.mark.parametrize("view", [False, True])
def test_average_is_one_division_of_the_exact_sum(view):
    """.grad is bitwise fl(sum / 3) with and without bucket views; without them the bucket keeps the sum
    (the division happened on the copy into .grad, not in a pass over the bucket)."""
    def body(comm):
        layer = nn.Linear(IN, OUT, bias=False)
        model = gradsync.DataParallel(layer, group=comm, algorithm="ring", gradient_as_bucket_view=view)
        for _ in range(2):  # the second round runs on the rebuilt buckets
            model.zero_grad(set_to_none=True)
            model(_integer_inputs(comm.rank)).sum().backward()
        bucket = model._reducer.buckets[0]
        return layer.weight.grad.clone(), bucket.views[0].clone(), model._reducer.runner._divides_on_copy_out()

    total = _exact_sum()
    expected = total / WORLD
    pre_divided = sum(_integer_inputs(rank).sum(0) / WORLD for rank in range(WORLD)).expand(OUT, IN)
    assert not torch.equal(expected, pre_divided)  # the values tell the two roundings apart
    for grad, in_bucket, divides_on_copy_out in run_threads(WORLD, body):
        assert torch.equal(grad, expected), (grad - expected).abs().max()
        assert divides_on_copy_out is (not view)
        assert torch.equal(in_bucket, expected if view else total)


def test_copy_out_refuses_to_divide_a_bucket_view():
    """A bucket view is its own .grad: a divisor on copy-out would divide the bucket twice, so it is refused."""
    def body(comm):
        model = gradsync.DataParallel(nn.Linear(IN, OUT), group=comm, gradient_as_bucket_view=True)
        with pytest.raises(ValueError, match="bucket view"):
            model._reducer.plan.copy_out(0, 2)
        return True

    assert run_threads(2, body) == [True, True]
