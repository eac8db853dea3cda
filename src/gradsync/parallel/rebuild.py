"""DDP's bucket rebuild: after the first synchronised backward, buckets follow rank 0's observed
gradient order and also end where backward paused.

A bucket ends where backward paused for more than ``PAUSE_S`` after it
already held ``MIN_SPLIT_BYTES``: launching it then lets the pause hide its
AllReduce instead of holding it for the next gradient. In an MLP the last
layer's weight gradient then starts reducing at once instead of waiting for
the next layer's bias, ~100 ms later. Used by
:meth:`~gradsync.parallel.bucket_plan.BucketPlan.rebuild` and by the simulator's step model.
"""

from __future__ import annotations

import torch

from gradsync.parallel.bucketing import DEFAULT_FIRST_BUCKET_CAP_BYTES, assign_buckets, default_order, pause_breaks

PAUSE_S = 0.002                # a gap in backward long enough to hide a bucket's AllReduce in
MIN_SPLIT_BYTES = 2**20        # smaller buckets are latency-bound: splitting them costs more than it hides


def observed_plan(params: list[torch.Tensor], observed: list[int], ready_s: list[float]) -> torch.Tensor:
    """``(2, len(params))`` int64: the observed ready order (``observed``, then the never-ready
    parameters in the default order) and, per entry, 1 where a bucket must start (a pause before it);
    ``ready_s``: the perf_counter time each of ``observed`` became ready. Rank 0's is broadcast."""
    seen = set(observed)
    order = observed + [index for index in default_order(len(params)) if index not in seen]
    breaks = pause_breaks(params, observed, ready_s, PAUSE_S, MIN_SPLIT_BYTES)
    breaks += [0] * (len(order) - len(breaks))
    return torch.tensor([order, breaks], dtype=torch.int64)


def rebuilt_assignment(params: list[torch.Tensor], bucket_cap_bytes: int, plan: torch.Tensor) -> list[list[int]]:
    """Parameter indices per bucket from an :func:`observed_plan` (rank 0's, on every rank)."""
    order, breaks = plan.tolist()
    breaks_before = [index for index, starts in zip(order, breaks) if starts]
    return assign_buckets(params, bucket_cap_bytes, DEFAULT_FIRST_BUCKET_CAP_BYTES, order, breaks_before)
