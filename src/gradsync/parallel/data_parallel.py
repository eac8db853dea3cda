"""DataParallel: a module wrapper whose backward leaves averaged gradients (PyTorch DDP's contract).

At construction the replicas are checked (same parameter names, shapes and dtypes on every rank) and made
identical (rank 0's parameters and buffers are broadcast). During ``loss.backward()`` the
:class:`~gradsync.parallel.reducer.Reducer` reduces gradient buckets on a communication thread while backward
goes on; ``backward()`` returns once every ``.grad`` holds the average of every rank's gradient, bitwise equal
on every rank. ``join()`` handles uneven inputs (DDP's ``join``, Horovod's ``hvd.join``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn

from gradsync import compression as compressions
from gradsync.collectives import ops as collectives
from gradsync.errors import GradsyncError, GroupClosedError
from gradsync.parallel.bucketing import bucket_cap_bytes
from gradsync.parallel.debug_checks import DebugChecks, resolve_debug, tensors_in
from gradsync.parallel.reducer import Reducer
from gradsync.parallel.shard_layout import check_sharding
from gradsync.parallel.zero import ZERO2_SLABS, ZERO3_SLABS, ShardedModel, ZeroState, held_tensors, unit_assignment, zero_units
from gradsync.parallel.join import join_step, sync_final_model
from gradsync.parallel.replica_check import ReplicaCheck, check_replicas
from gradsync.parallel.replicas import (ParameterWatch, agree_on_arguments, broadcast_tensors, buffer_signature,
                                        describe_buffer_change, name_code, placeholders, verify_parameters)


class DataParallel(ShardedModel, nn.Module):
    """Synchronous data parallelism over gradsync collectives, with communication overlapped with backward.

    Args:
        module: the model; every rank must build the same architecture.
        bucket_cap_mb: most MiB of gradients per bucket (> 0); the first
            bucket is capped at 1 MiB so communication starts early (as DDP).
        algorithm: the AllReduce algorithm, a name in ``gradsync.ALGORITHMS``.
        compression: None (exact AllReduce), a :class:`gradsync.compression.Compressor`
            instance (``FP16()``, ``BF16()``, ``OneBit()``, ``TopK(ratio)``,
            ``PowerSGD(rank)``; one instance per model) or one of their names
            in ``gradsync.compression.COMPRESSIONS`` (default settings). Each
            bucket is then averaged by the compressor (which divides once);
            ``algorithm`` carries the parts it sends uncompressed. Its
            per-rank state is ``model.compression.state_dict()``.
        broadcast_buffers: copy rank 0's buffers (BatchNorm statistics) to
            every rank before each forward with grad enabled, as DDP does;
            forwards under ``no_grad`` (evaluation) do not communicate.
        group: None (the default group), a Communicator or a torch ProcessGroup.
        gradient_as_bucket_view: make each ``.grad`` a view into its bucket,
            saving one copy of the gradients in memory (DDP's option of the same name).
        debug: checks that name the usual mistakes, raising ``gradsync.DebugCheckError`` on every
            rank (:mod:`~gradsync.parallel.debug_checks`); None (default) reads ``GRADSYNC_DEBUG``.
        shard: ``"none"``; ``"optimizer"`` (ZeRO-1) or ``"gradients"`` (ZeRO-2): each rank keeps the
            optimizer state (and gradients) of its chunk of every bucket only, buckets are reduce-scattered
            and the parameters all-gathered after the step (:mod:`~gradsync.parallel.zero`); then build the
            optimizer as usual and train with ``optimizer = model.shard_optimizer(optimizer)``. After a
            synchronised backward ``.grad`` is None: the average lives in the optimizer's pieces.
            ``"parameters"`` (ZeRO-3): the parameters too, each unit gathered for its forward and backward
            only (:mod:`~gradsync.parallel.unit_params`); ``model.full_parameters()`` makes them whole
            for a block; ``module.state_dict()`` is then collective. docs/sharding.md.
        units: ZeRO-3's units (:func:`~gradsync.parallel.units.choose_units`): None (by size, at most
            ``bucket_cap_mb`` each: one per transformer block), or submodule names, submodules or classes.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``group`` is not a group
            (the peers learn both at once, see CollectiveMismatchError; a bad
            ``group`` is reported to them on the default group).
        ValueError: bad ``bucket_cap_mb``, unknown ``algorithm``, compression name or ``shard``, a
            compressor already used by another model, a compressor that cannot reduce-scatter (only
            fp16 and bf16 can) or ``gradient_as_bucket_view`` with ``shard``.
        TypeError: ``compression`` is neither None, a name nor a Compressor; a
            parameter or buffer without plain bytes (sparse), naming it.
        CollectiveMismatchError: replicas differ (on every rank, naming the
            first differing parameter), or another rank was given a bad
            argument (naming that rank and the argument; that rank raises its
            own ValueError/TypeError).

    At a later forward or backward:
        GradsyncError: raised on every rank at the end of a synchronised
            backward when some rank's parameters or buffers changed after
            wrapping (wrap the module again), its backward raised (then
            :meth:`reset_after_failure`), or it ran ``torch.autograd.grad``
            for parameter gradients (use ``loss.backward()``); the message
            names each such rank. Also when the ranks ran different numbers
            of grad-enabled forwards (``no_sync`` ones included) since their
            last synchronised backward: a rank skipped ``backward()`` or used
            ``no_sync()`` alone, and this backward's buckets were paired with
            another iteration's (``.grad`` is then garbage; then
            :meth:`reset_after_failure`). After all but ``autograd.grad``, every forward and
            every collective on the group raises until
            :meth:`reset_after_failure` is called on every rank.
        GroupClosedError: the group was shut down (``gradsync.shutdown()``);
            wrap the module again after ``gradsync.init()``.

    Collectives called from inside backward (an autograd Function's backward,
    SimCLR's GatherLayer) run on the communication thread in issue order with
    the buckets.

    Attributes:
        comm_seconds: seconds of gradient AllReduce, buffer broadcast and join bookkeeping, summed over
            steps (overlapped time included).
        exposed_comm_seconds: the part of it that the caller waited for: the end-of-backward wait, buffer
            broadcasts and join bookkeeping.
        timeline: a :class:`~gradsync.parallel.timeline.Timeline` that bucket AllReduce spans are recorded in.
    Example::

        model = gradsync.DataParallel(Net())
        loss_fn(model(x), y).backward()   # .grad is now the average over ranks
        optimizer.step()
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0,
                 algorithm: str = collectives.DEFAULT_ALGORITHM, compression=None,
                 broadcast_buffers: bool = True, group=None, gradient_as_bucket_view: bool = False,
                 debug: bool | None = None, shard: str = "none", units=None):
        super().__init__()
        settings = {"algorithm": algorithm, "auto_profile": "", "bucket_cap_mb": bucket_cap_mb, "compression": compression,
                    "debug": debug, "shard": shard, "units": None,
                    "broadcast_buffers": broadcast_buffers, "gradient_as_bucket_view": gradient_as_bucket_view}

        chosen = []  # ZeRO-3's units

        def check() -> None:
            if not isinstance(module, nn.Module):
                raise TypeError(f"DataParallel wraps a torch.nn.Module, got {type(module).__name__}")
            bucket_cap_bytes(bucket_cap_mb)
            collectives.validate_algorithm(algorithm)
            settings["auto_profile"] = collectives.auto_profiles_fingerprint() if algorithm == collectives.AUTO else ""
            settings["debug"] = resolve_debug(debug)
            settings["compression"] = compressions.resolve(compression)
            check_sharding(shard, settings["compression"], gradient_as_bucket_view, algorithm)
            chosen.extend(zero_units(module, shard, units, bucket_cap_mb))
            settings["units"] = ",".join(unit.name for unit in chosen) if chosen else None
            if settings["compression"] is not None:
                settings["compression"].attach(self)  # raises if another model uses it

        self.comm = agree_on_arguments("DataParallel", group, settings, check)
        compression = settings["compression"]
        self.module = module
        self.algorithm = algorithm
        self.compression = compression
        self.broadcast_buffers = broadcast_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._sync_disabled = 0
        self._joining = False
        self._buffer_src = 0
        self._other_comm_seconds = 0.0  # buffer broadcasts and join bookkeeping (all exposed)
        verify_parameters(list(module.named_parameters()) + list(module.named_buffers()), self.comm)
        named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
        broadcast_tensors([param.data for param in module.parameters()] + list(module.buffers()),
                          self.comm, names=[name for name, _ in module.named_parameters()] +
                          [name for name, _ in module.named_buffers()])
        self._watch = ParameterWatch(module)
        self._buffer_layout = buffer_signature(module)
        assignment, unit_buckets = unit_assignment(chosen, [p for _, p in named]) if chosen else (None, None)
        self._reducer = Reducer(named, self.comm, algorithm, bucket_cap_bytes(bucket_cap_mb),
                                gradient_as_bucket_view, should_sync=lambda: not self._sync_disabled,
                                compression=compression, sharded=shard != "none",
                                slabs={"gradients": ZERO2_SLABS, "parameters": ZERO3_SLABS}.get(shard, 0),
                                assignment=assignment)
        self.shard = shard
        self._zero = None
        if shard != "none":
            self._zero = ZeroState(module, named, self._reducer.plan.assignment, self.comm, algorithm, shard,
                                   compression, self._reducer.plan.layouts, chosen, unit_buckets)
            self._reducer.runner.shards = self._zero.grads
        self._reducer.wrapped_names = [name for name, _ in module.named_parameters()] + \
            [name for name, _ in module.named_buffers()]  # the same on every rank (verified above)
        self.debug = settings["debug"]
        self._debug = DebugChecks(named, self.comm, self._reducer) if self.debug else None

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self.comm.closed:
            raise GroupClosedError(f"DataParallel on rank {self.comm.rank}: this DataParallel belongs to a "
                                   f"group that was shut down; wrap the module again after gradsync.init()")
        self._reducer.settle_if_stale()
        training = torch.is_grad_enabled()
        will_sync = training and not self._sync_disabled
        if training and self._zero is not None:
            self._zero.require_optimizer()
        if training:  # a change is reported to every rank in the next synchronised backward
            self._reducer.forwards += 1  # compared across ranks there too
            change = self._watch.change()
            self._reducer.report_change(change, 0 if change is None else self._name_code(change))
        if self._joining:
            self._join_step(active=True, will_sync=will_sync, sync_buffers=training)
        if training:  # evaluation under no_grad does not communicate here (ZeRO-3's gathers aside)
            self._sync_buffers()
        with self._read_check():  # ZeRO-3's first forward: a read of a unit not gathered is named
            if training and self._debug is not None:  # one small all_gather; DebugCheckError on every rank
                output = self._debug.forward(self.module, args, kwargs)
            else:
                output = self.module(*args, **kwargs)
        if will_sync:
            self._hook_outputs(output)
        if self._zero is not None:
            self._zero.flat.wait_all()
        return output

    def _sync_buffers(self) -> None:
        """Broadcast the module's buffers, looked up by name now (a buffer may have been replaced)."""
        if not self.broadcast_buffers or self.comm.world_size == 1 or not self._buffer_layout:
            return
        named = list(self.module.named_buffers())
        buffers = [buffer for _, buffer in named]
        if buffer_signature(self.module, named) != self._buffer_layout:  # same sizes on the wire as
            buffers = placeholders(self._buffer_layout)                  # the peers; reported in backward
            if self._reducer.problem is None:
                change = describe_buffer_change(self._buffer_layout, named)
                self._reducer.report_change(change, self._name_code(change))
        started = time.perf_counter()  # layout verified by the broadcast at construction
        broadcast_tensors(buffers, self.comm, src=self._buffer_src, verify=False)
        self._other_comm_seconds += time.perf_counter() - started

    def _name_code(self, change: str) -> int:
        """What the peers are told about ``change``: index + 1 of the wrapped name it quotes (0: none)."""
        return name_code(self._reducer.wrapped_names, change)

    def _hook_outputs(self, output) -> None:
        """Start the gradient sync when backward reaches an output, even if no parameter gets a gradient."""
        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if not self._sync_disabled:
            self._reducer.start_round(from_output=True)

    def reset_after_failure(self) -> None:
        """Use the model again after a DataParallel error was raised in a backward (on every rank).

        A backward that raised on one rank (and was caught) leaves every rank's
        DataParallel refusing to run, so that no rank pairs its next messages
        with another's unfinished ones; call this on every rank, then go on
        with the next iteration (gradients of the failed one are garbage: zero
        them). It does not undo a change of the parameters after wrapping;
        wrap the module again for that.
        """
        self._reducer.reset()

    # -- no_sync and join ------------------------------------------------------------------------

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally: backward inside this block does not communicate.

        The next backward outside the block synchronises everything
        accumulated, including parameters used only inside the block.
        """
        self._sync_disabled += 1
        try:
            yield
        finally:
            self._sync_disabled -= 1

    @contextmanager
    def join(self, enable: bool = True):
        """Train on uneven inputs: a rank that leaves this block early shadows the others until all have left.

        Inside the block each forward first exchanges which ranks are still
        active (one small AllReduce). A rank that has left the block answers
        the others' buffer broadcasts and gradient AllReduces with zeros, and
        gradients are averaged over the ranks that still had data. When every
        rank has left, the parameters and buffers of the last rank(s) to leave
        are broadcast, so replicas end identical (DDP's ``join`` and its
        final model sync; Horovod's ``hvd.join``).

        Inside the block, only this module's forward/backward communicate; other
        collectives (a loss AllReduce, evaluation) would not be shadowed.
        Every forward that requires grad must be followed by one backward.

        Args:
            enable: False makes the block a no-op (as DDP's ``join(enable=False)``).

        Raises:
            GradsyncError: ranks disagree on ``no_sync`` in the same iteration.
        """
        if self._joining:
            raise GradsyncError("DataParallel.join() cannot be nested")
        if not enable or self.comm.world_size == 1:
            yield
            return
        self._joining = True
        self._last_active: list[int] | None = None
        self._keep_units(True)
        try:
            yield
            while self._join_step(active=False, will_sync=False, sync_buffers=False):
                pass
            self._sync_final_model()
        finally:
            self._keep_units(False)
            self._joining = False
            self._buffer_src = 0
            self._reducer.set_divisor(self.comm.world_size)

    def _keep_units(self, keep: bool) -> None:
        """ZeRO-3 inside join: every unit gathered at the forward and kept to the end of backward."""
        if self.shard == "parameters":
            self._zero.flat.keep_gathered = keep

    def _join_step(self, active: bool, will_sync: bool, sync_buffers: bool) -> bool:
        """One join exchange; a joined rank then shadows the iteration. Returns whether any rank is active."""
        return join_step(self, active, will_sync, sync_buffers)

    def _sync_final_model(self) -> None:
        sync_final_model(self)

    def check_replicas(self, optimizer=None, *, buffers: bool | None = None, step: int | None = None,
                       timeout: float | None = None) -> ReplicaCheck:
        """Raise ReplicaDivergenceError on every rank unless the replicas are bitwise equal.

        See :func:`gradsync.check_replicas` for what is compared and raised.
        ``buffers=None`` compares buffers only with ``broadcast_buffers=False``:
        otherwise they are rank 0's at every forward, and statistics a forward
        updates (batch norm's) differ between forwards by design. ``step``
        (None: this replica's count of synchronized backwards, quoted in the
        error but not compared, as ranks under ``join()`` count differently).

        Collective: every rank must call this at the same point, outside a backward.
        """
        buffers = not self.broadcast_buffers if buffers is None else buffers
        if self._zero is not None:  # the optimizer state differs by design
            optimizer = None
        with self.full_parameters():  # parameters whole and equal first
            return check_replicas(self.module, optimizer, buffers=buffers, group=self.comm, timeout=timeout,
                                  step=self._reducer.rounds if step is None else step,
                                  compare_step=step is not None)

    # -- sharding (shard_optimizer, zero_grad, wait_for_parameters: ShardedModel) ---------------------

    def held_tensors(self, optimizer=None) -> dict[str, list[torch.Tensor]]:
        """The tensors this model (and ``optimizer``'s state) holds now, by kind: ``"parameters"``,
        ``"gradients"`` (``.grad`` and shards), ``"optimizer_state"``, ``"buffers"`` (buckets, staging);
        :func:`gradsync.parallel.memory.count_bytes` counts their bytes."""
        return held_tensors(self, optimizer)

    # -- measurements ----------------------------------------------------------------------------

    @property
    def comm_seconds(self) -> float:
        return self._reducer.comm_seconds + self._other_comm_seconds

    @property
    def exposed_comm_seconds(self) -> float:
        return self._reducer.exposed_comm_seconds + self._other_comm_seconds

    @property
    def timeline(self):
        return self._reducer.timeline

    @timeline.setter
    def timeline(self, timeline) -> None:
        self._reducer.record_into(timeline)

    @property
    def bucket_numels(self) -> list[int]:
        """Gradient elements per bucket, in the order buckets are reduced."""
        return self._reducer.bucket_numels

    def bucket_algorithms(self) -> list[tuple[int, str]]:
        """Per bucket, in reduction order: (bytes of its AllReduce, the algorithm that reduces it).

        ``auto`` is resolved as the collectives resolve it for that size on this
        group. A compressed bucket reads ``"<algorithm>+<compressor>"`` (e.g.
        ``"ring+onebit"``): the compressor averages it, the algorithm carries
        what it sends uncompressed. A sharded bucket reads ``"<algorithm> reduce_scatter"``.
        """
        suffix = f"+{self.compression.name}" if self.compression is not None else ""
        if self._zero is not None:  # reduce-scattered in backward, all-gathered after the step
            return [(nbytes, collectives.resolve_algorithm(self.comm, nbytes, self.algorithm,
                                                           collective="reduce_scatter") + " reduce_scatter" + suffix)
                    for nbytes in self._reducer.bucket_nbytes]
        return [(nbytes, collectives.resolve_algorithm(self.comm, nbytes, self.algorithm) + suffix)
                for nbytes in self._reducer.bucket_nbytes]

    @property
    def bucket_layout(self) -> list[list[int]] | None:
        """Parameter indices per bucket once rebuilt after the first backward (None before).

        The layout fixes where each gradient sits in a bucket, and so the
        order in which the ring sums it; a checkpoint saves it so that a
        resumed job sums exactly as the uninterrupted one would.
        """
        return [list(bucket) for bucket in self._reducer.assignment] if self._reducer.rebuilt else None

    @bucket_layout.setter
    def bucket_layout(self, layout: list[list[int]]) -> None:
        """Use ``layout`` (from :attr:`bucket_layout`, the same on every rank) instead of rebuilding.

        Raises:
            ValueError: ``layout`` is not a partition of the parameter indices.
        """
        self._reducer.set_layout([[int(index) for index in bucket] for bucket in layout])

    @property
    def last_bucket_spans(self) -> list[tuple[int, float, float]]:
        """(bucket index, start, end) of each bucket's AllReduce in the last sync, ``time.perf_counter`` seconds."""
        return self._reducer.last_bucket_spans

