"""The reducer: gradient buckets reduced while backward is still running (PyTorch DDP's Reducer).

Every parameter's post-accumulate-grad hook copies its gradient into its
bucket (or, with ``gradient_as_bucket_view``, makes ``.grad`` a view of the
bucket). When a bucket's last gradient arrives and every earlier bucket has
been started, its AllReduce is handed to a communication thread, so it
overlaps the rest of backward. Buckets start strictly in index order on every
rank, which keeps ranks in step even when gradients arrive in a different
order on different ranks.

At the end of backward (an autograd engine callback) every bucket not yet
started is started: parameters that got no gradient this iteration count as
zero. The callback copies each bucket's averages back into ``.grad`` as soon
as that bucket is done, while later ones are still reducing. The last bucket
runs on the calling thread (backward is over, a hand-off would only add
latency) and carries one flag per parameter ("had a gradient on this rank");
a parameter that had no gradient on any rank keeps ``.grad`` unchanged
(None), as it would in single-process training. ``loss.backward()`` returns
with final gradients.

After the first synchronised iteration the buckets are rebuilt in the order
rank 0 observed gradients arriving (DDP's bucket rebuild), so the first
bucket (capped at 1 MiB) fills early and communication starts early. The
rebuild (:mod:`~gradsync.parallel.rebuild`) also ends a bucket where backward paused (more than ``PAUSE_S``
between two gradients once the bucket holds ``MIN_SPLIT_BYTES``): in an MLP
the last layer's weight gradient then starts reducing at once instead of
waiting for the next layer's bias, ~100 ms later.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future
from typing import Callable, Sequence

import torch

from gradsync.collectives import ops as collectives
from gradsync.collectives.communicator import Communicator
from gradsync.compression.compressor import BucketLayout, Compressor
from gradsync.errors import GradsyncError
from gradsync.parallel.bucketing import DEFAULT_FIRST_BUCKET_CAP_BYTES, Bucket, assign_buckets, shared_bucket_nbytes
from gradsync.parallel.rebuild import RebuildAndJoin
from gradsync.parallel.round_failures import FailureHandling, accumulator, computes_grads_without_accumulating, weak_method
from gradsync.parallel.sync_round import AUTOGRAD_GRAD, SLOTS_PER_RANK, Round, decode_statuses, encode_flags



class _SkippedAfterFailure(GradsyncError):
    """A bucket not reduced because an earlier bucket of the same round failed."""


def _weak_hook(reducer: "Reducer") -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook that reaches ``reducer`` through a weak reference.

    A parameter keeps its hooks in C++, where Python's cycle collector cannot
    see them: a hook holding the reducer strongly would keep the reducer, its
    buckets and the parameters alive forever after the model is dropped.
    """
    reference = weakref.ref(reducer)

    def hook(param: torch.Tensor) -> None:
        alive = reference()
        if alive is not None:
            alive._on_grad_ready(param)

    return hook


class Reducer(FailureHandling, RebuildAndJoin):
    """Bucketed, overlapped gradient averaging for one module's parameters.

    Args:
        named_params: (name, parameter) pairs, registration order, requires_grad only.
        comm: the group.
        algorithm: AllReduce algorithm name.
        bucket_cap_bytes: cap per bucket (bytes).
        gradient_as_bucket_view: make ``.grad`` a view of the bucket (no second copy).
        should_sync: called in each hook; False under ``no_sync()``.
        compression: a :class:`~gradsync.compression.Compressor` that averages
            each bucket instead of ``algorithm``'s AllReduce, or None.
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], comm: Communicator,
                 algorithm: str, bucket_cap_bytes: int, gradient_as_bucket_view: bool,
                 should_sync: Callable[[], bool], compression: Compressor | None = None):
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.comm = comm
        self.algorithm = algorithm
        self.bucket_cap_bytes = bucket_cap_bytes
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.should_sync = should_sync
        self.compression = compression
        self.divisor = comm.world_size  # ranks whose gradients are averaged (fewer under join)
        self.timeline = None            # a Timeline to record bucket spans in, or None
        self.comm_seconds = 0.0         # summed AllReduce time of all buckets (comm thread)
        self.exposed_comm_seconds = 0.0  # time backward waited for communication at its end
        self.last_bucket_spans: list[tuple[int, float, float]] = []  # (bucket, start, end) perf_counter
        self.rebuilt = False
        self._index = {id(param): index for index, param in enumerate(self.params)}
        self._round: Round | None = None
        self._shadow: dict[int, torch.Tensor] = {}
        self._num_flags = len(self.params) + comm.world_size * SLOTS_PER_RANK  # used flags, then slots
        self.wrapped_names: list[str] = []  # what a rank's name code indexes (parameters, then buffers)
        self.problem: tuple[int, str, int] | None = None  # (code, words, name code) reported in the next round
        self.rounds = 0  # synchronised backwards completed
        self.forwards = 0  # grad-enabled forwards (no_sync ones too) since the last synchronised backward
        self.broken: str | None = None  # why the model must be reset or re-wrapped before it is used again
        self.after_sync: Callable[[int], None] | None = None  # debug mode's: called with the round's forwards
        self._accumulators = [accumulator(param) for param in self.params]  # to tell autograd.grad apart
        self._lane_check = weak_method(self, "settle_if_stale")
        self._broken_hold: int | None = None  # the lane hold that refuses collectives while broken
        self._build(assign_buckets(self.params, bucket_cap_bytes, DEFAULT_FIRST_BUCKET_CAP_BYTES))
        hook = _weak_hook(self)  # hooks live in C++, out of the garbage collector's sight: a strong
        self._hooks = [param.register_post_accumulate_grad_hook(hook) for param in self.params]  # one leaks

    # -- buckets ---------------------------------------------------------------------------------

    def _build(self, assignment: list[list[int]]) -> None:
        self.assignment = assignment
        last = len(assignment) - 1
        grads = [None if param.grad is None else param.grad.clone() for param in self.params]
        storages = self._shared_storages(assignment)
        self.buckets = [Bucket(b, indices, [self.params[i] for i in indices],
                               self._num_flags if b == last else 0, storages[b])
                        for b, indices in enumerate(assignment)]
        self._bucket_of = [0] * len(self.params)
        self._views: list[torch.Tensor] = [None] * len(self.params)
        for bucket in self.buckets:
            for index, view in zip(bucket.param_indices, bucket.views):
                self._bucket_of[index] = bucket.index
                self._views[index] = view
        self.layouts = [BucketLayout(tuple(self.names[i] for i in indices),
                                     tuple(self.params[i].shape for i in indices)) for indices in assignment]
        if self.gradient_as_bucket_view:  # from copies: new views may overlap the old ones
            for index, param in enumerate(self.params):
                if grads[index] is not None:
                    self._views[index].copy_(grads[index])
                    param.grad = self._views[index]
        self._shadow.clear()

    def _shared_storages(self, assignment: list[list[int]]) -> list[torch.Tensor | None]:
        """Zero-copy buckets: buckets of a dtype the algorithm reduces in place in its own shared storage
        (shm: float32/float64 on CPU; under "auto", the buckets it resolves to shm) live there, so the
        gradients' copy into the bucket is the only copy (with bucket views, not even that). None per
        bucket otherwise.

        Each call (construction, a rebuild) gets a fresh range of the group's arena of its own; an
        earlier range stays reserved until the group is closed (see ``shared_buffer``)."""
        storages: list[torch.Tensor | None] = [None] * len(assignment)
        algorithm = "shm" if self.algorithm == "auto" else self.algorithm
        in_place = collectives.zero_copy_dtypes(algorithm)
        if not (in_place and self.comm.world_size > 1 and self.compression is None):
            return storages
        sizes = shared_bucket_nbytes(self.params, assignment, self._num_flags, in_place)
        if self.algorithm == "auto":  # only the buckets auto will reduce with shm
            sizes = [nbytes if nbytes and self._resolves_to_shm(indices, b == len(assignment) - 1) else 0
                     for b, (nbytes, indices) in enumerate(zip(sizes, assignment))]
        if not any(sizes):
            return storages
        arena = collectives.shared_buffer(self.comm, sum(sizes), algorithm)
        offset = 0
        for b, nbytes in enumerate(sizes if arena is not None else []):
            if nbytes:
                storages[b] = arena[offset:offset + nbytes]
                offset += nbytes
        return storages

    def _resolves_to_shm(self, indices: list[int], last: bool) -> bool:
        first = self.params[indices[0]]
        numel = sum(self.params[i].numel() for i in indices) + (self._num_flags if last else 0)
        return collectives.resolve_algorithm(self.comm, numel * first.element_size(), "auto") == "shm"

    @property
    def bucket_numels(self) -> list[int]:
        return [bucket.grad_numel for bucket in self.buckets]

    @property
    def bucket_nbytes(self) -> list[int]:
        """Bytes of each bucket's AllReduce (the last one carries one used flag per parameter)."""
        return [bucket.flat.numel() * bucket.flat.element_size() for bucket in self.buckets]

    def set_divisor(self, divisor: int) -> None:
        """Average over ``divisor`` contributing ranks from the next bucket on (fewer under join)."""
        self.divisor = divisor

    def record_into(self, timeline) -> None:
        """Record each bucket's AllReduce span in ``timeline`` (a Timeline; None: stop recording)."""
        self.timeline = timeline

    # -- during backward -------------------------------------------------------------------------

    def start_round(self, from_output: bool = False) -> None:
        """Begin a synchronised backward (idempotent); the engine calls ``_finalize`` when it ends.

        ``from_output``: called from the hook on the module's output, where a
        round that will accumulate into no parameter because it is
        ``torch.autograd.grad`` with parameters among its inputs is told apart.
        """
        if self._round is not None or not self.buckets:  # no trainable parameters: nothing to sync
            return
        state = self._round = Round(self.buckets, len(self.params))
        state.status, state.detail, state.name_code = self.problem or (0, "", 0)
        state.forwards, self.forwards = self.forwards, 0  # compared across ranks at the end
        if from_output and not state.status and computes_grads_without_accumulating(self._accumulators):
            state.status = AUTOGRAD_GRAD
        if self.comm.world_size > 1:
            state.hold = self.comm.lane.hold(self._lane_check)
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.should_sync():
            return
        self.start_round()
        index, state = self._index[id(param)], self._round
        bucket = self._bucket_of[index]
        if state.ready[index]:
            if bucket < state.next_launch:
                raise GradsyncError(
                    f"DataParallel: parameter {self.names[index]!r} received a gradient twice in one "
                    f"backward, after its bucket was already reduced (reentrant checkpointing or a "
                    f"second backward through the same graph is not supported)")
            self._copy_in(index)
            return
        state.ready[index] = state.used[index] = True
        state.order.append(index)
        state.ready_s.append(time.perf_counter())
        self._copy_in(index)
        state.pending[bucket] -= 1
        if state.pending[bucket] == 0:
            self._launch_ready()

    def _copy_in(self, index: int) -> bool:
        """Put parameter ``index``'s gradient into its bucket slice (zeros if none); return whether it had one."""
        param, view = self.params[index], self._views[index]
        grad = param.grad
        if grad is None:
            view.zero_()
            return False
        if grad.is_sparse:
            raise GradsyncError(f"DataParallel: parameter {self.names[index]!r} has a sparse gradient; "
                                f"only dense gradients are supported")
        if grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            if self.gradient_as_bucket_view:
                param.grad = view
        return True

    def _launch_ready(self) -> None:
        """Hand every ready bucket, in index order, to the communication thread (the last one excepted)."""
        state = self._round
        last = len(self.buckets) - 1
        while state.next_launch < last and state.pending[state.next_launch] == 0:
            bucket = self.buckets[state.next_launch]
            state.futures.append(self._submit(bucket.flat, bucket.index, self.divisor, state))
            state.next_launch += 1

    def _submit(self, flat: torch.Tensor, bucket_index: int, divisor: int, state: Round) -> Future:
        if self.comm.world_size == 1:
            future = Future()
            future.set_result(self._reduce(flat, bucket_index, divisor, state))
            return future
        return self.comm.lane.submit(self._reduce, flat, bucket_index, divisor, state)

    def _reduce(self, flat: torch.Tensor, bucket_index: int, divisor: int,
                state: Round, thread: str = "comm") -> tuple[int, float, float]:
        """Runs on the communication thread: average ``flat`` over ``divisor`` contributing ranks."""
        if state.failed:  # one timeout per round, not one per bucket
            raise _SkippedAfterFailure(f"bucket {bucket_index} skipped after an earlier bucket failed")
        started = time.perf_counter()
        flight = self.comm.flight
        flight.label = f"bucket {bucket_index}"  # the label of this bucket's calls in the flight record
        try:
            if self.compression is not None:
                self._reduce_compressed(flat, bucket_index, divisor)
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
        layout = self.layouts[bucket_index]
        self.compression.reduce(flat[:layout.numel], layout, self.comm, divisor, self.algorithm)
        flags = flat[layout.numel:]
        if flags.numel():  # 0/1 per parameter: one byte each is exact up to 255 ranks
            counts = flags.to(torch.uint8 if self.comm.world_size < 256 else torch.int32)
            collectives.all_reduce(counts, self.comm, op="sum", algorithm=self.algorithm, verify=False)
            flags.copy_(counts)

    # -- end of backward -------------------------------------------------------------------------

    def _finalize(self) -> None:
        state = self._round
        try:
            try:
                for bucket in self.buckets[state.next_launch:]:
                    for index in bucket.param_indices:
                        if not state.ready[index]:
                            state.used[index] = self._copy_in(index)
                    state.pending[bucket.index] = 0
            except Exception as exc:  # a local failure: the peers still get this round, marked failed
                self._complete_failed(state, f"{type(exc).__name__}: {exc}")
                raise
            self._launch_ready()
            spans, waited_s = self._wait_and_copy_out(state)
            self.comm.lane.release(state.hold)  # the last bucket runs here, without a hand-off
            spans.append(self._reduce_last_bucket(state))
            self._copy_out_unused(state)
        except BaseException as exc:
            self._break(self.broken or f"its last backward failed ({type(exc).__name__}: {exc})")
            raise
        finally:
            self._round = None
            self.comm.lane.release(state.hold)
        self._raise_statuses(state)
        self.rounds += 1
        self.last_bucket_spans = spans
        comm_s = sum(end - start for _, start, end in spans)
        self.comm_seconds += comm_s
        # exposed: the time this thread waited for AllReduces or ran them, never more than they took
        # (thread hand-offs are not communication; copies in and out are local work)
        self.exposed_comm_seconds += min(waited_s + spans[-1][2] - spans[-1][1], comm_s)
        if not self.rebuilt:
            started = time.perf_counter()
            self._rebuild(state.order, state.ready_s)
            rebuild_s = time.perf_counter() - started
            self.comm_seconds += rebuild_s
            self.exposed_comm_seconds += rebuild_s
        if self.after_sync is not None:  # .grad is final (and, after a rebuild, in its new bucket)
            self.after_sync(state.forwards)

    def _wait_and_copy_out(self, state: Round) -> tuple[list[tuple[int, float, float]], float]:
        """Copy each bucket's averages into ``.grad`` as soon as it is done, while later buckets reduce.

        Returns the (bucket, start, end) spans and the seconds spent blocked waiting.
        """
        spans, waited_s = [], 0.0
        for bucket, future in zip(self.buckets, state.futures):
            started = time.perf_counter()
            spans.append(future.result())  # re-raises the first failure
            waited_s += time.perf_counter() - started
            self._copy_out_used(bucket, state)
        return spans, waited_s

    def _reduce_last_bucket(self, state: Round, copy_out: bool = True) -> tuple[int, float, float]:
        """The last bucket runs on this thread once the others are done: backward has ended, so a
        hand-off to the communication thread would only add latency. It carries the used flags and
        every rank's status (``state.statuses`` afterwards)."""
        bucket = self.buckets[-1]
        bucket.flags.copy_(encode_flags(state.used, state, self.comm.rank, self.comm.world_size))
        span = self._reduce(bucket.flat, bucket.index, self.divisor, state, thread="main")
        scale = 1 if self.compression is not None else self.divisor  # compressors sum the flags exactly
        state.statuses, state.counts, state.name_codes = decode_statuses(bucket.flags[len(self.params):], scale)
        if copy_out:
            self._copy_out_used(bucket, state)
        return span

    def _copy_out_used(self, bucket: Bucket, state: Round) -> None:
        for index in bucket.param_indices:
            if state.used[index]:
                self._copy_out(index)

    def _copy_out_unused(self, state: Round) -> None:
        """Parameters without a local gradient take the average if any rank had one; else .grad stays None."""
        used_anywhere = (self.buckets[-1].flags > 0).tolist()
        for index, used in enumerate(state.used):
            if used_anywhere[index] and not used:
                self._copy_out(index)

    def _copy_out(self, index: int) -> None:
        param, view = self.params[index], self._views[index]
        if param.grad is None:
            param.grad = view if self.gradient_as_bucket_view else view.clone()
        elif param.grad.data_ptr() != view.data_ptr():
            param.grad.copy_(view)
