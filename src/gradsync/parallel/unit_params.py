"""ZeRO-3 parameters: each rank keeps its chunk of every unit; a unit is whole only while it runs.

Each unit's parameters (:mod:`~gradsync.parallel.units`) are views of one
padded flat buffer per bucket, as at ZeRO-1/2
(:mod:`~gradsync.parallel.flat_params`), but the buffer's storage is freed
(``untyped_storage().resize_(0)``, as FSDP1's flat parameters do) whenever
the unit is not running: what persists is this rank's chunk, a separate
``shard`` tensor the optimizer steps. The parameter objects never change, so
autograd's saved references to them (and to views of them, as ``weight.t()``)
stay valid; their memory comes and goes. A freed parameter's ``.data`` is an
empty tensor (shape ``(0,)``), so that code reading it outside a forward sees
no elements instead of freed memory.

A unit is all-gathered (on the communicator's lane, in issue order on every
rank) just before its forward and freed right after it; all-gathered again
when backward reaches its outputs and freed once every one of its
parameters has its gradient (the reducer reduce-scatters that gradient
meanwhile); the next unit in forward order (backward: the one before) is
prefetched so its gather overlaps the current unit's compute. The root unit
(the parameters no smaller unit claims: embeddings, final norm, head) stays
whole from its forward to the end of backward. After the optimizer step only
the root unit's gather is started (overlapping the next batch's loading).

``module.state_dict()`` and ``load_state_dict()`` gather every unit first
(collective: every rank calls them, as FSDP's full state dict) and hand out
copies; :meth:`UnitParameters.full` keeps every unit whole for a block
(``check_replicas``, saving). Inside ``DataParallel.join()`` every unit is
gathered at the forward and kept to the end of backward (``keep_gathered``):
a rank that has run out of data cannot follow per-unit gathers it has no
forward for, so it takes part in one gather of every unit instead.
"""

from __future__ import annotations

import contextlib
import weakref
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from gradsync.collectives.scatter_gather import all_gather_flat
from gradsync.errors import GradsyncError
from gradsync.parallel.debug_checks import tensors_in
from gradsync.parallel.shard_layout import Piece, ShardLayout
from gradsync.parallel.unit_reads import FreedReadCheck, checked_once


def _recomputing() -> bool:
    """Whether a forward runs inside a backward (activation checkpointing recomputing it)."""
    return torch._C._current_graph_task_id() != -1


def _weak(owner, method: str):
    """A hook that reaches ``owner.method`` through a weak reference (hooks on parameters live in C++)."""
    reference = weakref.ref(owner)

    def hook(*args):
        alive = reference()
        return None if alive is None else getattr(alive, method)(*args)

    return hook


GATHER_HINT = ("under shard='parameters' every forward gathers the units, evaluation under no_grad included, "
               "and so do state_dict(), load_state_dict(), full_parameters() and check_replicas(): every rank "
               "must run them, in the same order (evaluate on every rank, each its share; save rank 0's copy "
               "of a state_dict every rank made)")

class UnitParameters:
    """The parameters of a ``shard="parameters"`` model: persistent chunks, units gathered on demand.

    Args:
        module: the wrapped module (the root unit); ``params``: the sharded parameters (layout indices).
        layout: one bucket per unit and dtype; ``units``: :class:`~gradsync.parallel.units.Unit` list,
            root last; ``unit_buckets``: bucket indices per unit.
        comm: the group; ``algorithm``: the all-gathers' (a name in ``gradsync.ALGORITHMS``).

    Attributes:
        flats: per bucket, the ``(padded_numel,)`` buffer the parameters view (storage freed when not whole).
        shards: per bucket, this rank's ``(chunk_numel,)`` chunk (what the optimizer steps).
        pieces, piece_tensors: this rank's pieces and their 1-D views of ``shards``.
        keep_gathered: gather every unit at the forward and keep them to the end of backward (join).
    """

    def __init__(self, module: nn.Module, params: list[torch.Tensor], layout: ShardLayout, units,
                 unit_buckets: list[list[int]], comm, algorithm: str):
        self.layout, self.comm, self.algorithm = layout, comm, algorithm
        self.units, self.unit_buckets = units, unit_buckets
        self.root = len(units) - 1
        self.flats: list[torch.Tensor] = []
        self.shards: list[torch.Tensor] = []
        self._views: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per bucket: (parameter, its view)
        with torch.no_grad():
            for bucket, offsets in enumerate(layout.offsets):
                first = params[next(iter(offsets))]
                flat = torch.zeros(layout.padded_numel[bucket], dtype=first.dtype, device=first.device)
                views = []
                for index, offset in offsets.items():
                    view = flat[offset:offset + params[index].numel()].view(params[index].shape)
                    view.copy_(params[index].detach())
                    views.append((params[index], view))
                self._views.append(views)
                start, stop = layout.chunk(bucket, comm.rank)
                self.shards.append(flat[start:stop].clone())
                self.flats.append(flat)
        self._nbytes = [flat.untyped_storage().nbytes() for flat in self.flats]
        self.pieces: list[Piece] = layout.pieces(comm.rank)
        self.piece_tensors = [self._shard_view(piece) for piece in self.pieces]
        self.gathered = [False] * len(units)  # whole, or its gather in flight
        self.keep_gathered = False
        self._futures: dict[int, Future] = {}
        self._hold: int | None = None
        self._pinned = 0
        self._order: list[int] = []  # units in forward order, recorded at the first training forward
        self._recording = False
        self._in_backward = False
        self._seen: set[int] = set()
        self._done = [0] * len(units)
        self._read_checked = False
        for bucket in range(len(self.flats)):
            self._release_storage(bucket)
        self._hooks = self._register(module, params)

    def _shard_view(self, piece: Piece) -> torch.Tensor:
        start = self.layout.chunk(piece.bucket, self.comm.rank)[0]
        return self.shards[piece.bucket][piece.flat_start - start:piece.flat_stop - start]

    def _register(self, module: nn.Module, params: list[torch.Tensor]) -> list:
        hooks = [module.register_forward_pre_hook(_weak(self, "_root_pre_forward")),
                 module.register_forward_hook(_weak(self, "_root_post_forward")),
                 module.register_state_dict_pre_hook(_weak(self, "_state_dict_pre")),
                 module._register_state_dict_hook(_weak(self, "_state_dict_post")),
                 module.register_load_state_dict_pre_hook(_weak(self, "_load_pre")),
                 module.register_load_state_dict_post_hook(_weak(self, "_load_post"))]
        for u, unit in enumerate(self.units[:-1]):
            hooks.append(unit.module.register_forward_pre_hook(partial(_weak(self, "_pre_forward"), u)))
            hooks.append(unit.module.register_forward_hook(partial(_weak(self, "_post_forward"), u)))
        for u, unit in enumerate(self.units):
            for index in unit.params:
                hooks.append(params[index].register_post_accumulate_grad_hook(
                    partial(_weak(self, "_post_accumulate"), u)))
        return hooks

    # -- gather and free ---------------------------------------------------------------------------

    def _release_storage(self, bucket: int) -> None:
        flat = self.flats[bucket]
        flat.untyped_storage().resize_(0)
        empty = flat.new_empty(0)
        for param, _ in self._views[bucket]:
            param.data = empty

    def _allocate_storage(self, bucket: int) -> None:
        self.flats[bucket].untyped_storage().resize_(self._nbytes[bucket])
        for param, view in self._views[bucket]:
            param.data = view

    def _start(self, u: int) -> None:
        """Start unit ``u``'s all-gather unless it is whole or in flight (collective, in issue order)."""
        if self.gathered[u]:
            return
        self.gathered[u] = True
        for bucket in self.unit_buckets[u]:
            flat = self.flats[bucket]
            self._allocate_storage(bucket)
            start, stop = self.layout.chunk(bucket, self.comm.rank)
            flat[start:stop].copy_(self.shards[bucket])
        if self.comm.world_size == 1 or not self.unit_buckets[u]:
            return
        if self._hold is None:  # public collectives queue behind the gathers meanwhile
            self._hold = self.comm.lane.hold(lambda: None)
        self._futures[u] = self.comm.lane.submit(self._gather_unit, u)

    def _gather_unit(self, u: int) -> None:
        for bucket in self.unit_buckets[u]:
            all_gather_flat(self.flats[bucket], self.comm, algorithm=self.algorithm)

    def _wait(self, u: int) -> None:
        future = self._futures.pop(u, None)
        if future is None:
            return
        try:
            future.result()
        except GradsyncError as exc:  # most often a collective some rank ran alone: say which ones are
            if exc.args and isinstance(exc.args[0], str) and GATHER_HINT not in exc.args[0]:
                exc.args = (f"{exc.args[0]} [while gathering a ZeRO-3 unit: {GATHER_HINT}]", *exc.args[1:])
            raise
        finally:
            if not self._futures and self._hold is not None:
                self.comm.lane.release(self._hold)
                self._hold = None

    def _ensure(self, u: int) -> None:
        self._start(u)
        self._wait(u)

    def _free(self, u: int) -> None:
        if not self.gathered[u] or self._pinned:
            return
        self._wait(u)
        for bucket in self.unit_buckets[u]:
            self._release_storage(bucket)
        self.gathered[u] = False

    def gather_all(self) -> None:
        """Make every unit whole (collective: starts the missing gathers in unit order, waits for all)."""
        for u in range(len(self.units)):
            self._start(u)
        self.wait_all()

    def free_all(self) -> None:
        """Free every whole unit (waits for gathers in flight; nothing while :meth:`full` holds them)."""
        for u in range(len(self.units)):
            self._free(u)

    def wait_all(self) -> None:
        """Wait for every all-gather in flight (re-raises a failed one)."""
        for u in sorted(self._futures):
            self._wait(u)

    def gather(self) -> None:
        """After the optimizer step: start the root unit's gather (the next forward needs it first).

        Collective: every rank calls it after each step, as at ZeRO-1/2.
        """
        self._start(self.root)

    @contextmanager
    def full(self):
        """Every unit whole inside the block (collective on entry), freed after it; what the block wrote into
        the parameters is kept (this rank's chunk of each unit written back, as FSDP's
        ``summon_full_params(writeback=True)``), as at the other levels, whose parameters are always whole."""
        self.gather_all()
        self._pinned += 1
        try:
            yield
        finally:
            self._pinned -= 1
            if not self._pinned:
                self._write_back()
            self.free_all()

    def _write_back(self) -> None:
        """Copy this rank's chunk of every whole unit's flat buffer into its shard (what persists)."""
        with torch.no_grad():
            for u, whole in enumerate(self.gathered):
                for bucket in self.unit_buckets[u] if whole else ():
                    self._wait(u)
                    start, stop = self.layout.chunk(bucket, self.comm.rank)
                    self.shards[bucket].copy_(self.flats[bucket][start:stop])

    def first_forward_check(self, names: dict[int, str]):
        """A context for the module's call: :class:`FreedReadCheck` at the first forward, nothing after it
        (``names``: ``id(parameter) -> name``). The check stays armed until a forward completes."""
        if self._read_checked:
            return contextlib.nullcontext()
        whole = {id(param): (view.numel(), names.get(id(param), "?"), self.units[u].name)
                 for u, unit_buckets in enumerate(self.unit_buckets) for bucket in unit_buckets
                 for param, view in self._views[bucket]}
        return checked_once(self, FreedReadCheck(whole))

    @property
    def in_flight(self) -> bool:
        return bool(self._futures)

    # -- forward and backward hooks ------------------------------------------------------------------

    def _root_pre_forward(self, module, args) -> None:
        if _recomputing():
            self._ensure(self.root)
            return
        if self._in_backward:  # the last backward raised before its end: forget it
            self._end_backward()
        self._recording = not self._order and torch.is_grad_enabled() and not self._pinned
        if self.keep_gathered:
            self.gather_all()
            return
        self._ensure(self.root)
        if self._order:
            self._start(self._order[0])

    def _root_post_forward(self, module, args, output) -> None:
        if _recomputing():
            return
        self._recording = False
        needs_backward = torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in(output))
        if not needs_backward:
            self.free_all()
            return
        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(partial(_weak(self, "_pre_backward"), self.root))

    def _pre_forward(self, u: int, module, args) -> None:
        if _recomputing():  # activation checkpointing re-runs the forward inside backward: the unit stays
            self._ensure(u)
            return
        if self._recording and u not in self._order:
            self._order.append(u)
        self._ensure(u)
        if not self.keep_gathered:
            self._prefetch(u, +1)

    def _post_forward(self, u: int, module, args, output) -> None:
        if self.keep_gathered or _recomputing():
            return
        if torch.is_grad_enabled():
            for tensor in tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(partial(_weak(self, "_pre_backward"), u))
        self._free(u)

    def _prefetch(self, u: int, step: int) -> None:
        """Start the gather of the unit after ``u`` in forward order (``step`` -1: the one before)."""
        if u in self._order:
            position = self._order.index(u) + step
            if 0 <= position < len(self._order):
                self._start(self._order[position])

    def _pre_backward(self, u: int, grad) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(_weak(self, "_end_backward"))
        if u in self._seen:
            return
        self._seen.add(u)
        self._ensure(u)
        if not self.keep_gathered and u != self.root:
            self._prefetch(u, -1)

    def _post_accumulate(self, u: int, param) -> None:
        self._done[u] += 1
        if self._done[u] == len(self.units[u].params) and not self.keep_gathered and u != self.root:
            self._free(u)

    def _end_backward(self) -> None:
        self._in_backward = False
        self._seen.clear()
        self._done = [0] * len(self.units)
        self.free_all()

    # -- state dicts ----------------------------------------------------------------------------------

    def _state_dict_pre(self, module, prefix, keep_vars) -> None:
        self.gather_all()
        self._pinned += 1

    def _state_dict_post(self, module, state_dict, prefix, local_metadata) -> None:
        flats = {flat.untyped_storage().data_ptr() for flat in self.flats}
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in flats:
                state_dict[key] = value.detach().clone()
        self._pinned -= 1
        self.free_all()

    def _load_pre(self, module, state_dict, prefix, *args) -> None:
        self.gather_all()
        self._pinned += 1

    def _load_post(self, module, incompatible_keys) -> None:
        self._write_back()
        self._pinned -= 1
        self.free_all()
