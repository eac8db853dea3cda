"""DataParallel's debug mode: checks that name the usual data-parallel mistakes, with their evidence.

``DataParallel(..., debug=True)``, or ``GRADSYNC_DEBUG=1`` in the environment
(read at construction; an explicit ``debug=True``/``False`` wins over it).
Each rank notes what it sees; at every forward with grad enabled the ranks
all-gather one small int64 row each (:class:`~gradsync.parallel.debug_findings.Report`)
and every rank decides from the same table, so all raise together
(:class:`gradsync.DebugCheckError`) or none does. What a step did is reported
at the next forward (the last step of a run goes unchecked).

=================  ==========================================================================
same_input         two or more ranks got bitwise-identical input batches (checksum of the
                   forward's input tensors): a missing ``DistributedSampler``.
grads_differ       at an optimizer step ``.grad`` differed across ranks (a checksum of every
                   ``.grad`` of the model, taken by an optimizer step pre-hook), named with its
                   cause: gradients accumulated under ``no_sync()`` and never synchronised, or
                   ``.grad`` written per rank after backward.
reduced_twice      at a step every changed ``.grad`` was world_size x (within 0.1%) the average
                   DataParallel wrote (its norm, noted after each synchronised backward): the
                   user's own ``all_reduce`` of ``p.grad`` on top of DataParallel's.
loss_not_divided   ``k >= 2`` micro-batches accumulated under ``no_sync()`` each had loss scale
                   1 (within 1%): the loss was not divided by ``k`` (and ``.grad`` was not
                   divided by ``k`` before the step instead, which is as good).
=================  ==========================================================================

Why the loss scale is read at the output: a ratio of gradients cannot show
it. ``L_i = c * f_i`` gives an accumulated gradient ``c * sum(g_i)`` and a
first micro-batch ``c * g_1``, whatever ``c`` is: the ratio is
``|sum g_i| / |g_1|`` (between ~sqrt(k) and k) for ``c = 1/k`` and ``c = 1``
alike. The gradient reaching the model's output shows ``c`` itself for a
cross-entropy loss (:func:`~gradsync.parallel.debug_findings.ce_loss_scale`,
exact to ~1e-6): correct code has ``c = 1/k <= 0.5``, a factor ``k >= 2`` from
the 1% band around 1. Other losses (MSE, label smoothing) are not checked.
A sum-reduced cross-entropy divided by ``k`` with batch size ``k`` has the
same gradient as a mean one not divided and is reported.

One warning, :class:`gradsync.EpochOrderWarning`, once per model: the first
``ORDER_WINDOW`` input batches of training come back later, bitwise and in
order (a missing ``sampler.set_epoch(epoch)``; DataParallel does not see the
sampler). A fixed order is legitimate (``shuffle=False``, overfitting one
batch): ``warnings.filterwarnings("ignore", category=gradsync.EpochOrderWarning)``.
Inputs that change every epoch (random augmentation) hide the repeat.

Under ``join()`` a rank that has left shadows the exchange (its inputs do not
count). Compressed gradients are equal on every rank after decompression, so
every check holds. Debug mode is DataParallel's only (not LocalSGD's). The
``grads_differ`` and ``reduced_twice`` checks need a ``torch.optim`` optimizer
(they use its global step pre-hook). Normal mode costs nothing: DataParallel
only tests ``self._debug is None`` (and the reducer ``after_sync is None``).
Debug mode costs one all_gather of ``REPORT_NUMEL`` int64 per rank per forward
(a second message at the first one, its layout check), a checksum of the
inputs, and, at world size > 1, one checksum of every ``.grad`` per optimizer
step and one norm per parameter per synchronised backward: the checksum reads
every gradient (~150 ms per 100 MB on a busy CPU core; accelerator tensors are
copied to the host first).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from collections import deque
from typing import Callable, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradsync.collectives import ops as collectives
from gradsync.collectives.communicator import Communicator
from gradsync.errors import DebugCheckError, EpochOrderWarning
from gradsync.parallel.debug_findings import (ORDER_WINDOW, PPM, RATIO_RTOL, SCALE_RTOL, Report, ce_loss_scale,
                                              checksum, decide)

DEBUG_ENV = "GRADSYNC_DEBUG"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def resolve_debug(debug, environ=os.environ) -> bool:
    """Whether debug mode is on: ``debug`` if True/False, else ``GRADSYNC_DEBUG`` (1/0, true/false, yes/no, on/off).

    Raises:
        TypeError: ``debug`` is not a bool or None.
        ValueError: ``GRADSYNC_DEBUG`` holds another word.
    """
    if debug is not None:
        if not isinstance(debug, bool):
            raise TypeError(f"debug must be True, False or None (None reads {DEBUG_ENV}), got {debug!r}")
        return debug
    text = environ.get(DEBUG_ENV, "").strip().lower()
    if text not in _ON + _OFF:
        raise ValueError(f"{DEBUG_ENV} must be 1 or 0 (or true/false, yes/no, on/off), got {environ[DEBUG_ENV]!r}")
    return text in _ON


class OrderWatch:
    """Whether the first ``ORDER_WINDOW`` input checksums of training come back later, in order.

    >>> watch = OrderWatch()
    >>> [watch.see(value, forward) for forward, value in enumerate([5, 6, 7, 8, 9, 5, 6, 7, 8], start=1)]
    [0, 0, 0, 0, 0, 0, 0, 0, 6]
    """

    def __init__(self):
        self.first: list[int] = []
        self.recent: deque[int] = deque(maxlen=ORDER_WINDOW)
        self.found = False

    def see(self, value: int, forward: int) -> int:
        """Note ``forward``'s input checksum; return the forward the repeat started at (once), else 0."""
        if self.found:
            return 0
        self.recent.append(value)
        if len(self.first) < ORDER_WINDOW:
            self.first.append(value)
            return 0
        if list(self.recent) != self.first:
            return 0
        self.found = True
        return forward - ORDER_WINDOW + 1


def _weak_call(owner: object, name: str) -> Callable:
    """``owner.name(*args)`` through a weak reference (hooks outlive nothing they should not keep alive)."""
    reference = weakref.ref(owner)

    def call(*args) -> None:
        alive = reference()
        if alive is not None:
            getattr(alive, name)(*args)

    return call


# The debug checks of every live model, told of each optimizer step by ONE global pre-hook that is never
# removed: removing a model's own global hook from its finalizer mutated torch's hook dict whenever the
# garbage collector ran it during another step's iteration over that dict (any thread, any moment).
_STEP_WATCHERS: "weakref.WeakSet[DebugChecks]" = weakref.WeakSet()
_STEP_HOOK: list = []
_STEP_HOOK_LOCK = threading.Lock()


def _watch_optimizer_steps(checks: "DebugChecks") -> None:
    with _STEP_HOOK_LOCK:
        _STEP_WATCHERS.add(checks)
        if not _STEP_HOOK:
            _STEP_HOOK.append(register_optimizer_step_pre_hook(_on_any_optimizer_step))


def _on_any_optimizer_step(optimizer, args, kwargs) -> None:
    for checks in list(_STEP_WATCHERS):
        checks._on_optimizer_step(optimizer, args, kwargs)


def _remove(handles) -> None:
    for handle in handles:
        handle.remove()


def _norm(grad: torch.Tensor) -> float:
    """The L2 norm, accumulated in float32 at least (a float16 norm overflows above 65504)."""
    half = grad.dtype in (torch.float16, torch.bfloat16)
    return float(torch.linalg.vector_norm(grad.detach(), dtype=torch.float32 if half else None))


def _all_near(changed: list[tuple[int, float]], factor: float) -> bool:
    """Whether there are ratios and every one is ``factor`` within ``RATIO_RTOL``."""
    return bool(changed) and all(abs(ratio / factor - 1) <= RATIO_RTOL for _, ratio in changed)


def tensors_in(value):
    """The tensors in ``value``: a tensor, or lists, tuples and dicts of them, nested (a forward's output)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


class DebugChecks:
    """One DataParallel's debug checks: what this rank saw, exchanged and decided at each forward.

    Args:
        named_params: DataParallel's (name, parameter) pairs (requires_grad ones, the same on every rank).
        comm: the model's group.
        reducer: the model's :class:`~gradsync.parallel.reducer.Reducer`: its ``should_sync()`` says
            whether a gradient is accumulated under ``no_sync()``; it calls :meth:`after_sync`.

    Attributes:
        comm_seconds: seconds spent in the exchanges so far.
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], comm: Communicator, reducer):
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.comm = comm
        self.should_sync: Callable[[], bool] = reducer.should_sync
        self._reducer = reducer
        self.comm_seconds = 0.0
        self.forwards = 0   # grad-enabled forwards of the model so far
        self.exchanges = 0  # debug exchanges so far (forwards, and shadowed ones under join())
        self.steps = 0      # optimizer steps over its parameters so far
        self._index = {id(param): index for index, param in enumerate(self.params)}
        self._pending = Report()
        self._unsynced: set[int] = set()  # parameters given a gradient under no_sync() since the last sync
        self._written: list[tuple[int, int, float] | None] = [None] * len(self.params)  # (id, version, norm)
        self._scales: dict[int, float | None] = {}  # forward -> its loss scale, until its window closes
        self._order = OrderWatch()
        self._warned = False
        hooks = [param.register_post_accumulate_grad_hook(_weak_call(self, "_on_grad_accumulated"))
                 for param in self.params]
        weakref.finalize(self, _remove, hooks)
        _watch_optimizer_steps(self)
        reducer.after_sync = self.after_sync

    def forward(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        """``module(*args, **kwargs)`` of a forward with grad enabled, with the debug exchange before it.

        Raises:
            DebugCheckError: on every rank, when a check fired (the message has the evidence).
        """
        self.before_forward(args, kwargs)
        output = module(*args, **kwargs)
        self.watch_output(output)
        return output

    # -- at each forward with grad enabled --------------------------------------------------------

    def before_forward(self, args: tuple, kwargs: dict) -> None:
        """Note this forward's inputs, then exchange and decide (collective)."""
        self.forwards += 1
        report = self._pending
        report.present, report.forward, report.steps = 1, self.forwards, self.steps
        tensors = list(tensors_in((args, kwargs)))
        if tensors:
            report.has_input, report.input_sum = 1, checksum(tensors)
            report.repeat_at = report.repeat_at or self._order.see(report.input_sum, self.forwards)
        self._exchange(report)

    def shadow(self) -> None:
        """Take part in the others' exchange after leaving ``join()`` (collective); raises as they do."""
        self._pending.present = 0
        self._exchange(self._pending)

    def watch_output(self, output) -> None:
        """Read the loss scale from the gradient at the first (B, C) output, C >= 2, in backward, when
        this forward accumulates (under ``no_sync()``, or after forwards that did)."""
        forward = self.forwards
        if self.should_sync() and self._reducer.forwards < 2:
            return  # a step of one micro-batch: no accumulation to check
        for tensor in tensors_in(output):
            if tensor.requires_grad and tensor.is_floating_point() and tensor.dim() == 2 and tensor.shape[1] >= 2:
                logits = tensor.detach()
                tensor.register_hook(lambda grad: self._scales.__setitem__(forward, ce_loss_scale(logits, grad)))
                return

    def _exchange(self, report: Report) -> None:
        self._pending = Report()
        self.exchanges += 1  # the same count on every rank (a rank that left join() shadows), unlike forwards
        if self.comm.world_size == 1:
            reports = [report]
        else:
            started = time.perf_counter()
            # the row's layout is fixed: compared across ranks once (a second message per call otherwise)
            rows = collectives.all_gather(report.to_row(), self.comm, verify=self.exchanges == 1)
            self.comm_seconds += time.perf_counter() - started
            reports = [Report.from_row(row) for row in rows]
        error, checks, warning = decide(reports, self.names, self.comm.rank)
        if warning is not None and not self._warned:
            self._warned = True
            warnings.warn(warning, EpochOrderWarning, stacklevel=7)  # the caller's model(x)
        if error is not None:
            raise DebugCheckError(error, checks=checks)

    # -- during backward and at the optimizer step ------------------------------------------------

    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        if not self.should_sync():
            self._unsynced.add(self._index[id(param)])

    def after_sync(self, micro_batches: int) -> None:
        """Called at the end of a synchronised backward that averaged ``micro_batches`` forwards' gradients."""
        self._unsynced.clear()
        self._check_loss_scales(micro_batches)
        # the norms DataParallel wrote: for reduced_twice, and for a step that divides .grad by k instead
        noted = self.comm.world_size > 1 or self._pending.micro_batches
        for index, param in enumerate(self.params):
            grad = param.grad
            self._written[index] = None if grad is None or not noted else (id(grad), grad._version, _norm(grad))

    def _check_loss_scales(self, micro_batches: int) -> None:
        """Note a window of ``micro_batches`` >= 2 forwards whose every loss scale was 1 (not divided by k)."""
        window = [self._scales.get(forward) for forward in range(self.forwards - micro_batches + 1,
                                                                 self.forwards + 1)]
        self._scales.clear()
        if micro_batches < 2 or self._pending.micro_batches:
            return
        if all(scale is not None and abs(scale - 1) <= SCALE_RTOL for scale in window):
            self._pending.micro_batches = micro_batches
            self._pending.scale_sum_ppm = round(sum(window) * PPM)
            self._pending.first_scale_ppm = round(window[0] * PPM)

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Every optimizer's step pre-hook: note a checksum of this model's ``.grad`` it is about to use."""
        indices = sorted({self._index[id(param)] for group in optimizer.param_groups
                          for param in group["params"] if id(param) in self._index})
        if not indices:
            return
        self.steps += 1
        report = self._pending
        report.steps, report.step_calls = self.steps, report.step_calls + 1
        if self.comm.world_size > 1:  # compared across ranks
            report.step_sum = checksum([self.params[index].grad for index in indices], seed=report.step_sum)
        unsynced = [index for index in indices if index in self._unsynced]
        if unsynced and not report.unsynced:
            report.unsynced, report.unsynced_first = len(unsynced), unsynced[0]
        changed, with_grad = self._changed_since_sync([index for index in indices if index not in self._unsynced])
        world_size, k = self.comm.world_size, report.micro_batches
        if world_size > 1 and not report.doubled and _all_near(changed, world_size):
            report.doubled, report.doubled_first, report.with_grad = len(changed), changed[0][0], with_grad
            report.doubled_ppm = round(sum(ratio for _, ratio in changed) / len(changed) * PPM)
        if k and len(changed) == with_grad and _all_near(changed, 1 / k):  # .grad /= k before the step:
            report.micro_batches = report.scale_sum_ppm = report.first_scale_ppm = 0  # as good as loss / k

    def _changed_since_sync(self, indices: list[int]) -> tuple[list[tuple[int, float]], int]:
        """(index, norm of .grad now / norm DataParallel wrote) of the parameters whose ``.grad`` changed
        since the last synchronised backward, and how many of ``indices`` had a written gradient."""
        changed, with_grad = [], 0
        for index in indices:
            grad, written = self.params[index].grad, self._written[index]
            if grad is None or written is None or written[2] == 0:
                continue
            with_grad += 1
            # always the norm: torch.distributed.all_reduce (Gloo) writes .grad without moving its
            # version counter, so an unchanged version does not mean an unchanged gradient
            ratio = _norm(grad) / written[2]
            if abs(ratio - 1) > RATIO_RTOL:
                changed.append((index, ratio))
        return changed, with_grad
