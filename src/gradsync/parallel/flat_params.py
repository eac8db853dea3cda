"""ZeRO-1/2 parameters: each bucket's parameters as views of one padded flat buffer, all-gathered after a step.

Every rank keeps the whole model (stages 1 and 2 shard the optimizer state
and the gradients, not the parameters), but only updates its own chunk of
each bucket (:mod:`~gradsync.parallel.shard_layout`). The parameters are
re-seated as views of one flat buffer per bucket, so the optimizer's shard
of a parameter is a view of it (the step writes the model directly) and the
all-gather that hands every rank the others' updates runs in place: no copy
of the parameters exists beside the model.

The all-gathers are started on the communicator's lane right after the
step, last bucket first, and overlap whatever runs before the next forward
(loading the next batch). The forward itself waits for all of them first: a
module may read any parameter (``nn.MultiheadAttention`` reads its
``out_proj.weight`` without calling ``out_proj``), so waiting per submodule
would let a forward read a half-gathered parameter. ``module.state_dict()``
waits too; code that reads parameters otherwise between the step and the
next forward calls ``model.wait_for_parameters()``.
"""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import contextmanager

import torch
from torch import nn

from gradsync.collectives.scatter_gather import all_gather_flat
from gradsync.parallel.shard_layout import Piece, ShardLayout


class FlatParameters:
    """The sharded module's parameters, re-seated into one padded flat buffer per bucket.

    Args:
        module: the wrapped module (its submodules get the forward pre-hooks).
        params: the sharded parameters, index = the layout's parameter index.
        layout: the buckets (same order and offsets as the gradient buckets).
        comm: the group; ``algorithm``: the all-gather's (a name in ``gradsync.ALGORITHMS``).

    Attributes:
        flats: per bucket, the ``(padded_numel,)`` buffer the parameters are views of (padding is zero).
        pieces: this rank's pieces; ``piece_tensors[k]``: piece ``k`` as a 1-D view of its bucket's buffer.
    """

    def __init__(self, module: nn.Module, params: list[torch.Tensor], layout: ShardLayout, comm, algorithm: str):
        self.layout, self.comm, self.algorithm = layout, comm, algorithm
        self.flats: list[torch.Tensor] = []
        with torch.no_grad():
            for bucket, offsets in enumerate(layout.offsets):
                first = params[next(iter(offsets))]
                flat = torch.zeros(layout.padded_numel[bucket], dtype=first.dtype, device=first.device)
                for index, offset in offsets.items():
                    param = params[index]
                    view = flat[offset:offset + param.numel()]
                    view.copy_(param.detach().reshape(-1))
                    param.data = view.view(param.shape)
                self.flats.append(flat)
        self.pieces: list[Piece] = layout.pieces(comm.rank)
        self.piece_tensors = [self.flats[p.bucket][p.flat_start:p.flat_stop] for p in self.pieces]
        self._futures: dict[int, Future] = {}
        self._hold: int | None = None
        # the module's forward (called through DataParallel or directly) and reading its state (saving it,
        # comparing it) wait for every gather in flight: never a half-gathered parameter
        self._hooks = [module.register_forward_pre_hook(lambda *_: self.wait_all()),
                       module.register_state_dict_pre_hook(lambda *_: self.wait_all())]

    # -- after the step --------------------------------------------------------------------------

    def gather(self) -> None:
        """Start every bucket's all-gather (in place), last bucket first, on the lane; returns at once.

        Collective: every rank calls it after each optimizer step, in the same order.
        """
        self.wait_all()
        if self.comm.world_size == 1:
            return
        lane = self.comm.lane
        self._hold = lane.hold(lambda: None)  # public collectives queue behind the gathers meanwhile
        for bucket in reversed(range(len(self.flats))):
            self._futures[bucket] = lane.submit(self._gather_one, bucket)

    def _gather_one(self, bucket: int) -> None:
        all_gather_flat(self.flats[bucket], self.comm, algorithm=self.algorithm)

    def wait(self, buckets) -> None:
        """Wait until the all-gathers of ``buckets`` are done (re-raises a failed one)."""
        for bucket in buckets:
            future = self._futures.pop(bucket, None)
            if future is not None:
                try:
                    future.result()
                finally:
                    if not self._futures:
                        self._release()

    def wait_all(self) -> None:
        """Wait for every all-gather in flight (the parameters are then whole and equal on every rank)."""
        self.wait(sorted(self._futures))
        self._release()

    def _release(self) -> None:
        if self._hold is not None:
            self.comm.lane.release(self._hold)
            self._hold = None

    @contextmanager
    def full(self):
        """The parameters whole inside the block (they are, once the step's all-gather is done)."""
        self.wait_all()
        yield

    @property
    def in_flight(self) -> bool:
        return bool(self._futures)
