"""The bookkeeping of one synchronised backward of the reducer."""

from __future__ import annotations

from concurrent.futures import Future

from gradsync.parallel.bucketing import Bucket


class Round:
    """Bookkeeping of one synchronised backward."""

    def __init__(self, buckets: list[Bucket], num_params: int):
        self.pending = [len(bucket.param_indices) for bucket in buckets]
        self.ready = [False] * num_params
        self.used = [False] * num_params
        self.order: list[int] = []
        self.ready_s: list[float] = []  # perf_counter time of each entry of ``order``
        self.next_launch = 0
        self.futures: list[Future] = []
        self.failed = False  # a bucket failed: later buckets of this round are skipped, not waited for again
