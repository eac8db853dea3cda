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
zero. The last bucket also carries one flag per parameter ("had a gradient on
this rank"); after the reduction a parameter that had no gradient on any rank
keeps ``.grad`` unchanged (None), as it would in single-process training.
Then the callback waits for the communication thread and copies the averages
back into ``.grad``, so ``loss.backward()`` returns with final gradients.

After the first synchronised iteration the buckets are rebuilt in the order
rank 0 observed gradients arriving (DDP's bucket rebuild), so the first
bucket (capped at 1 MiB) fills early and communication starts early.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Sequence

import torch

from gradsync.collectives import api as collectives
from gradsync.collectives.communicator import Communicator
from gradsync.errors import GradsyncError
from gradsync.parallel.bucketing import DEFAULT_FIRST_BUCKET_CAP_BYTES, assign_buckets, default_order


class Bucket:
    """One flat buffer: the gradients of ``params`` back to back, then optional per-parameter flags.

    ``flat`` has shape ``(grad_numel + num_flags,)`` and the parameters' dtype;
    ``views[k]`` is ``params[k]``'s slice shaped like the parameter.
    """

    def __init__(self, index: int, param_indices: list[int], params: list[torch.Tensor], num_flags: int):
        self.index = index
        self.param_indices = param_indices
        self.grad_numel = sum(param.numel() for param in params)
        self.flat = torch.zeros(self.grad_numel + num_flags, dtype=params[0].dtype, device=params[0].device)
        self.flags = self.flat[self.grad_numel:]
        self.views, offset = [], 0
        for param in params:
            self.views.append(self.flat[offset:offset + param.numel()].view_as(param))
            offset += param.numel()


class _Round:
    """Bookkeeping of one synchronised backward."""

    def __init__(self, buckets: list[Bucket], num_params: int):
        self.pending = [len(bucket.param_indices) for bucket in buckets]
        self.ready = [False] * num_params
        self.used = [False] * num_params
        self.order: list[int] = []
        self.next_launch = 0
        self.futures: list[Future] = []
        self.failed = False  # a bucket failed: later buckets of this round are skipped, not waited for again


class _SkippedAfterFailure(GradsyncError):
    """A bucket not reduced because an earlier bucket of the same round failed."""


class Reducer:
    """Bucketed, overlapped gradient averaging for one module's parameters.

    Args:
        named_params: (name, parameter) pairs, registration order, requires_grad only.
        comm: the group.
        algorithm: AllReduce algorithm name.
        bucket_cap_bytes: cap per bucket (bytes).
        gradient_as_bucket_view: make ``.grad`` a view of the bucket (no second copy).
        should_sync: called in each hook; False under ``no_sync()``.
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], comm: Communicator,
                 algorithm: str, bucket_cap_bytes: int, gradient_as_bucket_view: bool,
                 should_sync: Callable[[], bool]):
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.comm = comm
        self.algorithm = algorithm
        self.bucket_cap_bytes = bucket_cap_bytes
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.should_sync = should_sync
        self.divisor = comm.world_size  # ranks whose gradients are averaged (fewer under join)
        self.timeline = None            # a Timeline to record bucket spans in, or None
        self.comm_seconds = 0.0         # summed AllReduce time of all buckets (comm thread)
        self.exposed_comm_seconds = 0.0  # time backward waited for communication at its end
        self.last_bucket_spans: list[tuple[int, float, float]] = []  # (bucket, start, end) perf_counter
        self.rebuilt = False
        self._index = {id(param): index for index, param in enumerate(self.params)}
        self._round: _Round | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._shadow: dict[int, torch.Tensor] = {}
        self._build(assign_buckets(self.params, bucket_cap_bytes, DEFAULT_FIRST_BUCKET_CAP_BYTES))
        self._hooks = [param.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for param in self.params]

    # -- buckets ---------------------------------------------------------------------------------

    def _build(self, assignment: list[list[int]]) -> None:
        self.assignment = assignment
        last = len(assignment) - 1
        self.buckets = [Bucket(b, indices, [self.params[i] for i in indices],
                               len(self.params) if b == last else 0)
                        for b, indices in enumerate(assignment)]
        self._bucket_of = [0] * len(self.params)
        self._views: list[torch.Tensor] = [None] * len(self.params)
        for bucket in self.buckets:
            for index, view in zip(bucket.param_indices, bucket.views):
                self._bucket_of[index] = bucket.index
                self._views[index] = view
        if self.gradient_as_bucket_view:
            for index, param in enumerate(self.params):
                if param.grad is not None:
                    self._views[index].copy_(param.grad)
                    param.grad = self._views[index]
        self._shadow.clear()

    @property
    def bucket_numels(self) -> list[int]:
        return [bucket.grad_numel for bucket in self.buckets]

    # -- during backward -------------------------------------------------------------------------

    def start_round(self) -> None:
        """Begin a synchronised backward (idempotent); the engine calls ``_finalize`` when it ends."""
        if self._round is not None:
            return
        self._round = _Round(self.buckets, len(self.params))
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
        state = self._round
        while state.next_launch < len(self.buckets) and state.pending[state.next_launch] == 0:
            bucket = self.buckets[state.next_launch]
            if bucket.flags.numel():
                bucket.flags.copy_(torch.tensor(state.used, dtype=bucket.flags.dtype))
            state.futures.append(self._submit(bucket.flat, bucket.index, self.divisor, state))
            state.next_launch += 1

    def _submit(self, flat: torch.Tensor, bucket_index: int, divisor: int, state: _Round) -> Future:
        if self.comm.world_size == 1:
            future = Future()
            future.set_result(self._reduce(flat, bucket_index, divisor, state))
            return future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradsync-comm")
        return self._executor.submit(self._reduce, flat, bucket_index, divisor, state)

    def _reduce(self, flat: torch.Tensor, bucket_index: int, divisor: int,
                state: _Round) -> tuple[int, float, float]:
        """Runs on the communication thread: average ``flat`` over ``divisor`` contributing ranks."""
        if state.failed:  # one timeout per round, not one per bucket
            raise _SkippedAfterFailure(f"bucket {bucket_index} skipped after an earlier bucket failed")
        started = time.perf_counter()
        try:
            if divisor == self.comm.world_size:
                collectives.all_reduce(flat, self.comm, op="avg", algorithm=self.algorithm, verify=False)
            else:  # join: ranks without data send zeros; divide first so fp16 sums cannot overflow
                flat.div_(divisor)
                collectives.all_reduce(flat, self.comm, op="sum", algorithm=self.algorithm, verify=False)
        except BaseException:
            state.failed = True
            raise
        ended = time.perf_counter()
        if self.timeline is not None:
            self.timeline.add("allreduce", started, ended, thread="comm", bucket=bucket_index,
                              nbytes=flat.numel() * flat.element_size())
        return bucket_index, started, ended

    # -- end of backward -------------------------------------------------------------------------

    def _finalize(self) -> None:
        started = time.perf_counter()
        state = self._round
        try:
            for bucket in self.buckets[state.next_launch:]:
                for index in bucket.param_indices:
                    if not state.ready[index]:
                        state.used[index] = self._copy_in(index)
                state.pending[bucket.index] = 0
            self._launch_ready()
            spans = self._wait(state.futures)
            self._copy_out()
        finally:
            self._round = None
        self.last_bucket_spans = spans
        self.comm_seconds += sum(end - start for _, start, end in spans)
        if not self.rebuilt:
            self._rebuild(state.order)
        self.exposed_comm_seconds += time.perf_counter() - started

    @staticmethod
    def _wait(futures: list[Future]) -> list[tuple[int, float, float]]:
        wait(futures)
        return [future.result() for future in futures]  # re-raises the first failure

    def _copy_out(self) -> None:
        used_anywhere = (self.buckets[-1].flags > 0).tolist()
        for index, param in enumerate(self.params):
            if not used_anywhere[index]:
                continue  # no rank had a gradient: leave .grad as single-process training would
            view = self._views[index]
            if param.grad is None:
                param.grad = view if self.gradient_as_bucket_view else view.clone()
            elif param.grad.data_ptr() != view.data_ptr():
                param.grad.copy_(view)

    def reset_if_stale(self) -> None:
        """Forget a round whose backward failed before its end callback ran."""
        if self._round is not None:
            wait(self._round.futures)
            self._round = None

    # -- bucket rebuild and join -----------------------------------------------------------------

    def _rebuild(self, observed: list[int]) -> None:
        """Re-bucket in rank 0's observed ready order (collective: every rank calls it once)."""
        self.rebuilt = True
        seen = set(observed)
        order = observed + [index for index in default_order(len(self.params)) if index not in seen]
        if self.comm.world_size > 1:
            order_tensor = torch.tensor(order, dtype=torch.int64)
            collectives.broadcast(order_tensor, self.comm, src=0, verify=False)
            order = order_tensor.tolist()
        assignment = assign_buckets(self.params, self.bucket_cap_bytes, DEFAULT_FIRST_BUCKET_CAP_BYTES, order)
        if assignment != self.assignment:
            self._build(assignment)

    def shadow_round(self, divisor: int) -> None:
        """Take part in the other ranks' gradient sync with zeros (this rank has joined)."""
        futures, state = [], _Round([], 0)
        for bucket in self.buckets:
            zeros = self._shadow.get(bucket.index)
            if zeros is None:
                zeros = self._shadow[bucket.index] = torch.zeros_like(bucket.flat)
            zeros.zero_()
            futures.append(self._submit(zeros, bucket.index, divisor, state))
        started = time.perf_counter()
        spans = self._wait(futures)
        self.comm_seconds += sum(end - start for _, start, end in spans)
        self.exposed_comm_seconds += time.perf_counter() - started
        if not self.rebuilt:
            self._rebuild([])

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
