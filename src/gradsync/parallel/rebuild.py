"""The reducer's bucket rebuild (DDP's: buckets in rank 0's observed gradient order, split where
backward pauses), a saved layout, and the shadow rounds of a rank that has joined (``DataParallel.join``).

A mixin of :class:`~gradsync.parallel.reducer.Reducer`: it uses the reducer's
``params``, ``assignment``, ``buckets``, ``comm`` and ``_build`` / ``_submit``.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_EXCEPTION, wait

import torch

from gradsync.collectives import ops as collectives
from gradsync.parallel.bucketing import (DEFAULT_FIRST_BUCKET_CAP_BYTES, assign_buckets, check_assignment,
                                        default_order, pause_breaks)
from gradsync.parallel.sync_round import Round

PAUSE_S = 0.002                # a gap in backward long enough to hide a bucket's AllReduce in
MIN_SPLIT_BYTES = 2**20        # smaller buckets are latency-bound: splitting them costs more than it hides


class RebuildAndJoin:
    """Bucket rebuild, saved layouts and join's shadow rounds, for the reducer."""

    def _rebuild(self, observed: list[int], ready_s: list[float]) -> None:
        """Re-bucket in rank 0's observed ready order (collective: every rank calls it once).

        A bucket also ends where backward paused for more than ``PAUSE_S``
        after it already held ``MIN_SPLIT_BYTES``: launching it then lets the
        pause hide its AllReduce instead of holding it for the next gradient.
        """
        self.rebuilt = True
        seen = set(observed)
        order = observed + [index for index in default_order(len(self.params)) if index not in seen]
        breaks = pause_breaks(self.params, observed, ready_s, PAUSE_S, MIN_SPLIT_BYTES)
        breaks += [0] * (len(order) - len(breaks))
        if self.comm.world_size > 1:
            plan = torch.tensor([order, breaks], dtype=torch.int64)
            collectives.broadcast(plan, self.comm, src=0, verify=False)
            order, breaks = plan.tolist()
        breaks_before = [index for index, starts in zip(order, breaks) if starts]
        assignment = assign_buckets(self.params, self.bucket_cap_bytes, DEFAULT_FIRST_BUCKET_CAP_BYTES, order,
                                    breaks_before)
        if assignment != self.assignment:
            self._build(assignment)

    def set_layout(self, assignment: list[list[int]]) -> None:
        """Adopt a saved bucket layout and skip the rebuild (every rank must pass the same one)."""
        check_assignment(self.params, assignment)
        self.rebuilt = True
        if assignment != self.assignment:
            self._build(assignment)

    def shadow_round(self, divisor: int) -> None:
        """Take part in the other ranks' gradient sync with zeros (this rank has joined)."""
        if not self.buckets:
            return
        futures, state = [], Round([], 0)
        for bucket in self.buckets:
            if bucket.shared:  # the zero-copy AllReduce reads peers' data in the arena
                zeros = bucket.flat
            else:
                zeros = self._shadow.get(bucket.index)
                if zeros is None:
                    zeros = self._shadow[bucket.index] = torch.zeros_like(bucket.flat)
            zeros.zero_()
            futures.append(self._submit(zeros, bucket.index, divisor, state))
        started = time.perf_counter()
        wait(futures, return_when=FIRST_EXCEPTION)
        spans = [future.result() for future in futures]
        comm_s = sum(end - start for _, start, end in spans)
        self.comm_seconds += comm_s
        self.exposed_comm_seconds += min(time.perf_counter() - started, comm_s)
        if not self.rebuilt:
            self._rebuild([], [])
