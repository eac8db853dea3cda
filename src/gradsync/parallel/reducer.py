"""The reducer: gradient buckets reduced while backward is still running (PyTorch DDP's Reducer).

Every parameter's post-accumulate-grad hook copies its gradient into its
bucket (or, with ``gradient_as_bucket_view``, makes ``.grad`` a view of the
bucket); when a bucket's last gradient arrives its AllReduce starts, so it
overlaps the rest of backward, and ``loss.backward()`` returns with final
gradients. The :class:`Reducer` composes three collaborators, each with its
own state:

* :class:`~gradsync.parallel.bucket_plan.BucketPlan`: which parameter sits in
  which bucket, the views, copies in and out, and the rebuild after the first
  synchronised backward (DDP's, :mod:`~gradsync.parallel.rebuild`);
* :class:`~gradsync.parallel.round_runner.RoundRunner`: a round's execution
  (buckets handed to the communication thread in index order, the wait,
  the last bucket with every rank's status) and its time stats;
* :class:`~gradsync.parallel.round_failures.FailureHandling`: a backward it
  cannot use, statuses raised on every rank, a broken model.

The reducer itself is the hooks and the round's start and end.
"""

from __future__ import annotations

import time
import weakref
from typing import Callable, Sequence

import torch

from gradsync.errors import GradsyncError
from gradsync.parallel.bucket_plan import BucketPlan
from gradsync.parallel.round_failures import FailureHandling, accumulator, computes_grads_without_accumulating
from gradsync.parallel.round_runner import RoundRunner
from gradsync.parallel.sync_round import AUTOGRAD_GRAD, PARAMS_CHANGED, flag_count


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


class Reducer:
    """Bucketed, overlapped gradient averaging for one module's parameters.

    Args:
        named_params: (name, parameter) pairs, registration order, requires_grad only.
        comm: the group (a Communicator).
        algorithm: AllReduce algorithm name.
        bucket_cap_bytes: cap per bucket (bytes).
        gradient_as_bucket_view: make ``.grad`` a view of the bucket (no second copy).
        should_sync: called in each hook; False under ``no_sync()``.
        compression: a :class:`~gradsync.compression.Compressor` that averages
            each bucket instead of ``algorithm``'s AllReduce, or None.
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], comm, algorithm: str,
                 bucket_cap_bytes: int, gradient_as_bucket_view: bool, should_sync: Callable[[], bool],
                 compression=None, sharded: bool = False, slabs: int = 0,
                 assignment: list[list[int]] | None = None):
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.comm = comm
        self.should_sync = should_sync
        self.wrapped_names: list[str] = []  # what a rank's name code indexes (parameters, then buffers)
        self.problem: tuple[int, str, int] | None = None  # (code, words, name code) reported in the next round
        self.rounds = 0  # synchronised backwards completed
        self.forwards = 0  # grad-enabled forwards (no_sync ones too) since the last synchronised backward
        self.after_sync: Callable[[int], None] | None = None  # debug mode's: called with the round's forwards
        self._index = {id(param): index for index, param in enumerate(self.params)}
        self._accumulators = [accumulator(param) for param in self.params]  # to tell autograd.grad apart
        self.plan = BucketPlan(self.names, self.params, comm, algorithm, bucket_cap_bytes, gradient_as_bucket_view,
                               flag_count(len(self.params), comm.world_size), zero_copy=compression is None,
                               sharded=sharded, slabs=slabs, assignment=assignment)
        self.runner = RoundRunner(self.plan, comm, algorithm, compression)
        self.failures = FailureHandling(comm, self.runner)
        hook = _weak_hook(self)  # hooks live in C++, out of the garbage collector's sight: a strong
        self._hooks = [param.register_post_accumulate_grad_hook(hook) for param in self.params]  # one leaks

    # -- what DataParallel reads and sets ----------------------------------------------------------

    @property
    def buckets(self):
        return self.plan.buckets

    @property
    def assignment(self) -> list[list[int]]:
        return self.plan.assignment

    @property
    def rebuilt(self) -> bool:
        return self.plan.rebuilt

    @property
    def bucket_numels(self) -> list[int]:
        return self.plan.bucket_numels

    @property
    def bucket_nbytes(self) -> list[int]:
        """Bytes of each bucket's AllReduce (the last one carries one used flag per parameter)."""
        return self.plan.bucket_nbytes

    @property
    def comm_seconds(self) -> float:
        return self.runner.comm_seconds

    @property
    def exposed_comm_seconds(self) -> float:
        return self.runner.exposed_comm_seconds

    @property
    def last_bucket_spans(self) -> list[tuple[int, float, float]]:
        return self.runner.last_bucket_spans

    @property
    def timeline(self):
        return self.runner.timeline

    @property
    def broken(self) -> str | None:
        return self.failures.broken

    def set_layout(self, assignment: list[list[int]]) -> None:
        """Adopt a saved bucket layout and skip the rebuild (every rank must pass the same one)."""
        self.plan.adopt(assignment)

    def set_divisor(self, divisor: int) -> None:
        """Average over ``divisor`` contributing ranks from the next bucket on (fewer under join)."""
        self.runner.divisor = divisor

    def record_into(self, timeline) -> None:
        """Record each bucket's AllReduce span in ``timeline`` (a Timeline; None: stop recording)."""
        self.runner.timeline = timeline

    def report_change(self, change: str | None, name_code: int = 0) -> None:
        """Report ``change`` (this rank's parameters or buffers changed after wrapping, in words;
        ``name_code``: index + 1 of the wrapped name it quotes) to every rank in the next synchronised
        backward; None: nothing changed (forgets an earlier report)."""
        self.problem = None if change is None else (PARAMS_CHANGED, change, name_code)

    def settle_if_stale(self) -> None:
        """Before a forward: settle a round whose backward raised; raise while the model is broken."""
        self.failures.settle_if_stale()

    def reset(self) -> None:
        """Forget an earlier failure (after settling a failed round with the peers)."""
        self.failures.reset()

    # -- during backward -------------------------------------------------------------------------

    def start_round(self, from_output: bool = False) -> None:
        """Begin a synchronised backward (idempotent); the engine calls ``_finalize`` when it ends.

        ``from_output``: called from the hook on the module's output, where a
        round that will accumulate into no parameter because it is
        ``torch.autograd.grad`` with parameters among its inputs is told apart.
        """
        if self.runner.current is not None or not self.plan.buckets:  # no trainable parameters: nothing to sync
            return
        state = self.runner.begin()
        state.status, state.detail, state.name_code = self.problem or (0, "", 0)
        state.forwards, self.forwards = self.forwards, 0  # compared across ranks at the end
        if from_output and not state.status and computes_grads_without_accumulating(self._accumulators):
            state.status = AUTOGRAD_GRAD
        if self.comm.world_size > 1:
            state.hold = self.comm.lane.hold(self.failures.lane_check)
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.should_sync():
            return
        self.start_round()
        index, state, plan = self._index[id(param)], self.runner.current, self.plan
        bucket = plan.bucket_of[index]
        if state.ready[index]:
            if bucket < state.next_launch:
                raise GradsyncError(
                    f"DataParallel: parameter {self.names[index]!r} received a gradient twice in one "
                    f"backward, after its bucket was already reduced (reentrant checkpointing or a "
                    f"second backward through the same graph is not supported)")
            if not plan.deferred:  # deferred: autograd accumulated it into .grad, copied in at launch
                plan.copy_in(index)
            return
        state.ready[index] = state.used[index] = True
        state.order.append(index)
        state.ready_s.append(time.perf_counter())
        if not plan.deferred:
            plan.copy_in(index)
        state.pending[bucket] -= 1
        if state.pending[bucket] == 0:
            self.runner.launch_ready(state)

    # -- end of backward -------------------------------------------------------------------------

    def _finalize(self) -> None:
        runner, failures = self.runner, self.failures
        state = runner.current
        try:
            spans, waited_s = runner.finish(state)
        except BaseException as exc:
            failures.mark_broken(failures.broken or f"its last backward failed ({type(exc).__name__}: {exc})")
            raise
        finally:
            runner.current = None
            self.comm.lane.release(state.hold)
        failures.raise_statuses(state, self.wrapped_names)
        self.rounds += 1
        runner.record(spans, waited_s)
        if not self.plan.rebuilt:
            started = time.perf_counter()
            self.plan.rebuild(state.order, state.ready_s)
            runner.count_exposed(time.perf_counter() - started)
        if self.after_sync is not None:  # .grad is final (and, after a rebuild, in its new bucket)
            self.after_sync(state.forwards)

    def shadow_round(self, divisor: int) -> None:
        """Take part in the other ranks' gradient sync with zeros (this rank has joined)."""
        if not self.plan.buckets:
            return
        self.runner.shadow_round(divisor)
        if not self.plan.rebuilt:
            self.plan.rebuild([], [])
