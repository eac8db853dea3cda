"""How the reducer tells apart, and survives, a backward it cannot use (issue 16).

* ``torch.autograd.grad`` through DataParallel: the post-accumulate-grad
  hooks never fire, so no gradient would be averaged. The output hook asks
  the engine whether it will accumulate into the parameters
  (:func:`computes_grads_without_accumulating`); if not, the round still runs
  (the peers are in it) and reports ``AUTOGRAD_GRAD``, raised on every rank.
* A backward that raised on one rank (a user Function, a sparse gradient):
  the engine drops the round's end callback, so the round stays in flight.
  Before the next forward, or the next collective on the group, this rank
  completes it with ``BACKWARD_FAILED`` in its status slot
  (:meth:`FailureHandling.settle_if_stale`): the peers, still waiting at the end of
  their backward, get every bucket in order and raise naming this rank, and
  no message is ever paired with a later call's. Every rank then refuses its
  forwards and every collective on the group until
  ``DataParallel.reset_after_failure()`` (:meth:`FailureHandling.reset`).
* Ranks that ran different numbers of grad-enabled forwards since their last
  synchronised backward (a skipped ``backward()``, ``no_sync()`` on one rank):
  their buckets were paired with another iteration's; every rank raises
  (:func:`~gradsync.parallel.sync_round.sequence_error`) and is broken as above.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from gradsync.errors import GradsyncError
from gradsync.parallel.sync_round import BREAKS_MODEL, Round, sequence_error, status_error


def weak_method(reducer: object, name: str) -> Callable[[], None]:
    """``reducer.name()`` through a weak reference (for the communicator's lane, which outlives models)."""
    reference = weakref.ref(reducer)

    def call() -> None:
        alive = reference()
        if alive is not None:
            getattr(alive, name)()

    return call


def in_backward() -> bool:
    """Whether this thread is running an autograd graph task (a backward or torch.autograd.grad)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def accumulator(param: torch.Tensor):
    """The AccumulateGrad node of a leaf ``param`` (kept alive by whoever holds it)."""
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]


def computes_grads_without_accumulating(accumulators) -> bool:
    """Whether the running graph task is torch.autograd.grad asking for some parameter's gradient."""
    probe = getattr(torch._C, "_will_engine_execute_node", None)
    for node in accumulators if probe is not None else ():
        try:
            if probe(node):
                return False  # backward(): it accumulates into .grad
        except RuntimeError:  # "a leaf node was passed ... while running autograd.grad()"
            return True
    return False


class FailureHandling:
    """The reducer's failure paths: a round whose backward raised, statuses to raise, a broken model.

    Args:
        comm: the group (a Communicator; its lane refuses collectives while the model is broken).
        runner: the reducer's :class:`~gradsync.parallel.round_runner.RoundRunner` (its round in flight).

    ``broken``: why the model must be reset or re-wrapped before it is used again (None: it need not).
    ``lane_check``: what the lane calls before a collective while a round or the broken state holds it.
    """

    def __init__(self, comm, runner):
        self.comm = comm
        self.runner = runner
        self.broken: str | None = None
        self._broken_hold: int | None = None  # the lane hold that refuses collectives while broken
        self.lane_check = weak_method(self, "settle_if_stale")

    def raise_statuses(self, state: Round, names: list[str]) -> None:
        """Raise on every rank when some rank reported a status in this round (``names``: what a rank's
        name code indexes)."""
        where = [names[code - 1] if 0 < code <= len(names) else None for code in state.name_codes]
        error = status_error(state.statuses, self.comm.rank, state.detail, where)
        mismatch = sequence_error(state.counts, self.comm.rank)
        if mismatch is not None:  # this round's buckets were paired with another iteration's
            self.mark_broken("the ranks ran different forward/backward sequences (that error says how)")
            error = mismatch if error is None else GradsyncError(f"{error}; and {mismatch}")
        if error is not None:
            if any(code in BREAKS_MODEL for code in state.statuses):
                self.mark_broken("its last backward failed on every rank (that error says why)")
            raise error

    def _settle(self) -> bool:
        """Finish (marked failed) a round whose backward raised before its end; return whether there was one."""
        state = self.runner.current
        if state is None or in_backward():
            return False
        try:
            self.runner.complete_failed(state, "its backward raised")
        finally:
            self.runner.current = None
            self.comm.lane.release(state.hold)
        self.mark_broken("its last backward raised on this rank before the gradients were synchronised "
                         "(the other ranks were told)")
        return True

    def settle_if_stale(self) -> None:
        """Called before each forward and each collective issued outside backward while a round is held.

        Raises:
            GradsyncError: a backward raised on this rank (now settled with the peers), or the model
            is broken since an earlier failure.
        """
        self._settle()
        if self.broken is not None:
            raise GradsyncError(f"DataParallel on rank {self.comm.rank} cannot be used: {self.broken}. "
                                f"Call model.reset_after_failure() on every rank (or wrap the module again) "
                                f"before using it or its group again")

    def reset(self) -> None:
        """Forget an earlier failure (after settling a failed round with the peers)."""
        self._settle()
        self.broken = None
        self.comm.lane.release(self._broken_hold)
        self._broken_hold = None

    def mark_broken(self, reason: str) -> None:
        """Refuse this model's forwards, and every collective on its group, until :meth:`reset`."""
        self.broken = reason
        if self._broken_hold is None and self.comm.world_size > 1:
            self._broken_hold = self.comm.lane.hold(self.lane_check)
            weakref.finalize(self, self.comm.lane.release, self._broken_hold)  # a model dropped while broken
