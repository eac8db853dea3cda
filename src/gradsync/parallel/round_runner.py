"""The execution of a synchronised backward's buckets (the reducer's rounds).

Buckets start strictly in index order on every rank (which keeps ranks in
step even when gradients arrive in a different order on different ranks):
each bucket whose gradients are all in, once every earlier one has started,
is handed to the communicator's communication thread, so it overlaps the
rest of backward. At the end of backward (:meth:`RoundRunner.finish`) every
bucket not yet started is started, with zeros for parameters that got no
gradient; each bucket's averages are copied back into ``.grad`` as soon as
it is done, while later ones are still reducing; the last bucket runs on
the calling thread (backward is over, a hand-off would only add latency)
and carries one flag per parameter ("had a gradient on this rank") and every
rank's status (:mod:`~gradsync.parallel.sync_round`). A parameter that had no
gradient on any rank keeps ``.grad`` unchanged (None).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_EXCEPTION, Future, wait

import torch

from gradsync.collectives import ops as collectives
from gradsync.parallel.sync_round import Round, SkippedAfterFailure, decode_statuses, encode_flags

Span = tuple[int, float, float]  # (bucket index, start, end) perf_counter seconds


class RoundRunner:
    """Runs the rounds of one :class:`~gradsync.parallel.bucket_plan.BucketPlan`.

    Args:
        plan: the buckets.
        comm: the group (a Communicator).
        algorithm: AllReduce algorithm name.
        compression: a Compressor that averages each bucket instead of ``algorithm``'s AllReduce, or None.

    Attributes (stats, summed over rounds): ``comm_seconds`` (bucket AllReduce time, overlapped or
    not), ``exposed_comm_seconds`` (the part the caller waited for), ``last_bucket_spans`` (the last
    round's). ``current``: the round in flight, or None. ``divisor``: the ranks averaged over (fewer
    under join). ``timeline``: a Timeline bucket spans are recorded in, or None.
    """

    def __init__(self, plan, comm, algorithm: str, compression=None):
        self.plan = plan
        self.comm = comm
        self.algorithm = algorithm
        self.compression = compression
        self.divisor = comm.world_size
        self.timeline = None
        self.current: Round | None = None
        self.shards = None  # ZeRO-1/2: a ShardGradients that reduce-scatters each bucket instead
        self.comm_seconds = 0.0
        self.exposed_comm_seconds = 0.0
        self.last_bucket_spans: list[Span] = []

    def begin(self) -> Round:
        """Start a round (the caller fills in this rank's status and hold)."""
        self.current = Round(self.plan.buckets, len(self.plan.params))
        if self.shards is not None:
            self.current.fresh = self.shards.fresh()
        if self._divides_on_copy_out():
            self.current.divide_out = self.divisor
        return self.current

    def _divides_on_copy_out(self) -> bool:
        """Whether this round's buckets are summed and the division by the ranks is done while copying the
        sums into ``.grad`` (``torch.div(out=)``: the same bits as ``op="avg"``, which sums, then divides
        the bucket in place; one pass over every gradient less). Only where ``.grad`` is a copy (not a
        bucket view), there is no compressor, and every rank contributes (under join the bucket is divided
        before the sum, as :func:`~gradsync.collectives.ops.average` does)."""
        return (self.compression is None and self.shards is None and not self.plan.gradient_as_bucket_view
                and self.comm.world_size > 1 and self.divisor == self.comm.world_size)

    def launch_ready(self, state: Round) -> None:
        """Hand every ready bucket, in index order, to the communication thread (the last one excepted)."""
        buckets = self.plan.buckets
        last = len(buckets) - 1
        while state.next_launch < last and state.pending[state.next_launch] == 0:
            bucket = buckets[state.next_launch]
            self._copy_in_deferred(bucket, state)
            state.futures.append(self.submit(bucket.flat, bucket.index, self.divisor, state))
            state.next_launch += 1

    def _copy_in_deferred(self, bucket, state: Round) -> None:
        """ZeRO-2's slabs: once the bucket ``slabs`` before this one has left the slab they share (its
        reduce-scatter done), copy this bucket's gradients in (releasing each ``.grad``)."""
        plan = self.plan
        if not plan.deferred:
            return
        earlier = bucket.index - plan.slabs
        if 0 <= earlier < len(state.futures):
            try:
                state.futures[earlier].result()
            except BaseException:  # noqa: BLE001 - raised where the round waits for that bucket
                pass
        for index in bucket.param_indices:
            had = plan.copy_in(index)
            if not state.ready[index]:
                state.used[index] = had

    def submit(self, flat: torch.Tensor, bucket_index: int, divisor: int, state: Round) -> Future:
        """Average ``flat`` over ``divisor`` contributing ranks on the communication thread; a future of its span."""
        if self.comm.world_size == 1:
            future = Future()
            future.set_result(self._reduce(flat, bucket_index, divisor, state))
            return future
        return self.comm.lane.submit(self._reduce, flat, bucket_index, divisor, state)

    def _reduce(self, flat: torch.Tensor, bucket_index: int, divisor: int,
                state: Round, thread: str = "comm") -> Span:
        if state.failed:  # one timeout per round, not one per bucket
            raise SkippedAfterFailure(f"bucket {bucket_index} skipped after an earlier bucket failed")
        started = time.perf_counter()
        flight = self.comm.flight
        flight.label = f"bucket {bucket_index}"  # the label of this bucket's calls in the flight record
        try:
            if self.shards is not None:
                self.shards.reduce(flat, bucket_index, divisor)
            elif self.compression is not None:
                self._reduce_compressed(flat, bucket_index, divisor)
            elif state.divide_out > 1:  # divided while copied out
                collectives.all_reduce(flat, self.comm, op="sum", algorithm=self.algorithm, verify=False)
            else:  # under join, ranks without data send zeros
                collectives.average(flat, self.comm, divisor, self.algorithm)
        except BaseException:
            state.failed = True
            raise
        finally:
            flight.label = None
        ended = time.perf_counter()
        if self.timeline is not None:
            self.timeline.add("allreduce", started, ended, thread=thread, bucket=bucket_index,
                              nbytes=flat.numel() * flat.element_size())
        return bucket_index, started, ended

    def _reduce_compressed(self, flat: torch.Tensor, bucket_index: int, divisor: int) -> None:
        """The compressor averages the gradients; the used flags (last bucket) are summed exactly."""
        layout = self.plan.layouts[bucket_index]
        self.compression.reduce(flat[:layout.numel], layout, self.comm, divisor, self.algorithm)
        flags = flat[layout.numel:]
        if flags.numel():  # 0/1 per parameter: one byte each is exact up to 255 ranks
            counts = flags.to(torch.uint8 if self.comm.world_size < 256 else torch.int32)
            collectives.all_reduce(counts, self.comm, op="sum", algorithm=self.algorithm, verify=False)
            flags.copy_(counts)

    def finish(self, state: Round) -> tuple[list[Span], float]:
        """End of backward: start every bucket left, copy the averages out, reduce the last bucket here;
        return the buckets' spans and the seconds this thread blocked waiting (for :meth:`record`).

        A local failure before the exchange still completes the round with the peers, marked failed
        (:meth:`complete_failed`), then raises.
        """
        plan = self.plan
        try:
            for bucket in plan.buckets[state.next_launch:]:
                for index in bucket.param_indices:
                    if not state.ready[index] and not plan.deferred:
                        state.used[index] = plan.copy_in(index)
                state.pending[bucket.index] = 0
        except Exception as exc:
            self.complete_failed(state, f"{type(exc).__name__}: {exc}")
            raise
        self.launch_ready(state)
        spans, waited_s = self._wait_and_copy_out(state)
        self.comm.lane.release(state.hold)  # the last bucket runs here, without a hand-off
        spans.append(self._reduce_last_bucket(state))
        self._copy_out_unused(state)
        return spans, waited_s

    def record(self, spans: list[Span], waited_s: float) -> None:
        """Count a finished round's spans (from :meth:`finish`) in the stats."""
        self.last_bucket_spans = spans
        comm_s = sum(end - start for _, start, end in spans)
        self.comm_seconds += comm_s
        # exposed: the time this thread waited for AllReduces or ran them, never more than they took
        # (thread hand-offs are not communication; copies in and out are local work)
        self.exposed_comm_seconds += min(waited_s + spans[-1][2] - spans[-1][1], comm_s)

    def _wait_and_copy_out(self, state: Round) -> tuple[list[Span], float]:
        """Copy each bucket's averages into ``.grad`` as soon as it is done; the spans and seconds blocked."""
        spans, waited_s = [], 0.0
        for bucket, future in zip(self.plan.buckets, state.futures):
            started = time.perf_counter()
            spans.append(future.result())  # re-raises the first failure
            waited_s += time.perf_counter() - started
            self._copy_out_used(bucket, state)
        return spans, waited_s

    def _reduce_last_bucket(self, state: Round, copy_out: bool = True) -> Span:
        """The last bucket, on this thread once the others are done, with the used flags and every
        rank's status (``state.statuses`` afterwards)."""
        bucket, num_params = self.plan.buckets[-1], len(self.plan.params)
        self._copy_in_deferred(bucket, state)
        bucket.flags.copy_(encode_flags(state.used, state, self.comm.rank, self.comm.world_size))
        span = self._reduce(bucket.flat, bucket.index, self.divisor, state, thread="main")
        # compressors sum the flags exactly; so does a round divided on copy-out
        scale = 1 if self.compression is not None or state.divide_out > 1 or self.shards is not None \
            else self.divisor
        state.statuses, state.counts, state.name_codes = decode_statuses(bucket.flags[num_params:], scale)
        if copy_out:
            self._copy_out_used(bucket, state)
        return span

    def _copy_out_used(self, bucket, state: Round) -> None:
        if self.shards is not None:  # the shard was kept on the communication thread
            return
        for index in bucket.param_indices:
            if state.used[index]:
                self.plan.copy_out(index, state.divide_out)

    def _copy_out_unused(self, state: Round) -> None:
        """Parameters without a local gradient take the average if any rank had one; else .grad stays None."""
        used_anywhere = (self.plan.buckets[-1].flags > 0).tolist()
        if self.shards is not None:
            self.shards.drop_unused(used_anywhere, state.fresh)
            return
        for index, used in enumerate(state.used):
            if used_anywhere[index] and not used:
                self.plan.copy_out(index, state.divide_out)

    def complete_failed(self, state: Round, detail: str) -> None:
        """Finish a round this rank cannot use, so that no peer waits for its buckets or pairs them with
        a later message: every bucket still goes out in order, the last one with BACKWARD_FAILED in
        this rank's status slot, and the peers raise naming this rank."""
        state.fail(detail)
        self.launch_ready(state)
        wait(state.futures)
        self.comm.lane.release(state.hold)
        if not state.failed:  # after a timeout the group is unusable anyway
            self._reduce_last_bucket(state, copy_out=False)

    def shadow_round(self, divisor: int) -> None:
        """Take part in the other ranks' gradient sync with zeros (this rank has joined)."""
        futures, state = [], Round([], 0)
        for bucket in self.plan.buckets:
            futures.append(self.submit(self.plan.zeros(bucket), bucket.index, divisor, state))
        started = time.perf_counter()
        wait(futures, return_when=FIRST_EXCEPTION)
        spans = [future.result() for future in futures]
        comm_s = sum(end - start for _, start, end in spans)
        self.comm_seconds += comm_s
        self.exposed_comm_seconds += min(time.perf_counter() - started, comm_s)

    def count_exposed(self, seconds: float) -> None:
        """Add communication the caller waited for outside the rounds (a rebuild's broadcast)."""
        self.comm_seconds += seconds
        self.exposed_comm_seconds += seconds
