"""What GradsyncStrategy changes in Lightning's DDPStrategy, written once for both Lightning packages.

:class:`GradsyncStrategyMixin` goes before ``DDPStrategy`` in the bases of the strategy class that
:mod:`gradsync.integrations.lightning` (``lightning.pytorch``) and :mod:`gradsync.integrations.pytorch_lightning`
(``pytorch_lightning``) define; the class attribute ``_pl`` is the Lightning package. Lightning's own parts
stay: its launchers (subprocess, spawn, fork, an external launcher such as torchrun or SLURM), its cluster
environments and its ``torch.distributed`` set-up. The changes, after the former ``BaguaStrategy``:

* once Lightning has initialised ``torch.distributed``, ``gradsync.init()`` adopts that group;
* the LightningModule is wrapped in ``gradsync.DataParallel`` instead of ``DistributedDataParallel``;
* ``accumulate_grad_batches`` runs its non-final micro-batches under ``DataParallel.no_sync()``;
* under ``shard="optimizer"|"gradients"`` (ZeRO-1/2) the optimizers from ``configure_optimizers`` are
  wrapped with ``model.shard_optimizer``; norm clipping (``gradient_clip_val``) then takes the global norm
  over every rank's shard (``gradsync.clip_grad_norm_``);
* checkpoints carry every rank's gradsync state (:mod:`~gradsync.integrations.lightning_checkpoint`);
* a callback logs gradsync's summary (:mod:`~gradsync.integrations.lightning_summary`).
"""

from __future__ import annotations

import datetime
import math
from contextlib import contextmanager

import torch

import gradsync
from gradsync.integrations import lightning_checkpoint as checkpoints
from gradsync.integrations.adopt import adopt_torch_group
from gradsync.integrations.lightning_options import check_extra_options, check_values
from gradsync.integrations.lightning_summary import SummaryHooks


def _seconds(timeout) -> float:
    """``timeout`` (a ``datetime.timedelta``, as DDPStrategy takes, or seconds) in seconds.

    Raises:
        ValueError: not a finite duration > 0.
    """
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ValueError(f"GradsyncStrategy: timeout must be a datetime.timedelta or seconds, finite and > 0, "
                         f"got {timeout!r}")
    return float(seconds)


def adopt_lightning_group(timeout_s: float | None) -> None:
    """``gradsync.init`` over the group Lightning (or Fabric) initialised, with that group's backend (so
    ``process_group_backend="gloo"`` on a CUDA machine stays Gloo) and ``timeout_s`` (None: gradsync's default);
    gradsync already initialised (by hand, or by an earlier fit in this process): ``timeout_s`` must be its
    timeout (None: any). Collective.

    Raises:
        ValueError: another timeout than gradsync's, in one line (CollectiveMismatchError on the peers).
    """
    adopt_torch_group(timeout_s, "GradsyncStrategy", "timeout",
                      "give the strategy the same timeout (or none), or call gradsync.shutdown() before the fit")


class StepAfterClosure:
    """A :class:`gradsync.ShardedOptimizer` as Lightning's precision plugins step it: ``step(closure)`` runs
    the closure (forward, backward, the ``on_before_optimizer_step`` hooks, clipping), then steps.

    Every other attribute is the sharded optimizer's.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, closure=None, **kwargs):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.optimizer.step(**kwargs)
        return loss

    def __getattr__(self, name):
        if name == "optimizer":  # not yet set (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)


class GradsyncStrategyMixin:
    """The overrides of Lightning's ``DDPStrategy`` (see the module's docstring); ``_pl`` is set by the class."""

    _pl = None  # lightning.pytorch or pytorch_lightning
    strategy_name = "gradsync"

    def __init__(self, algorithm: str = "auto", compression=None, bucket_cap_mb: float = 25.0, shard: str = "none",
                 *, broadcast_buffers: bool = True, gradient_as_bucket_view: bool = False, debug: bool | None = None,
                 accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None, process_group_backend: str | None = None, timeout=None,
                 start_method: str = "popen", **options):
        check_extra_options(options)
        check_values(algorithm, compression, bucket_cap_mb, shard, broadcast_buffers, gradient_as_bucket_view, debug,
                     start_method, process_group_backend)
        extra = {} if timeout is None else {"timeout": datetime.timedelta(seconds=_seconds(timeout))}
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         start_method=start_method, **extra)
        self.gradsync_options = {"algorithm": algorithm, "compression": compression, "bucket_cap_mb": bucket_cap_mb,
                                 "shard": shard, "broadcast_buffers": broadcast_buffers,
                                 "gradient_as_bucket_view": gradient_as_bucket_view, "debug": debug}
        self._gradsync_timeout = None if timeout is None else _seconds(timeout)  # None: gradsync's default / any
        self.gradsync_model = None  # the DataParallel of the last fit (kept after teardown for its counters)
        self._summary = None

    # -- process group and wrapping ---------------------------------------------------------------------

    def setup_distributed(self) -> None:
        """Lightning's set-up of ``torch.distributed`` (its cluster environment), then :func:`adopt_lightning_group`
        (collective: the ranks exchange host identities, agree on the timeout).

        Raises:
            ValueError / CollectiveMismatchError: gradsync is already initialised with another ``timeout``.
        """
        super().setup_distributed()
        adopt_lightning_group(self._gradsync_timeout)

    def configure_ddp(self) -> None:
        """Wrap the LightningModule in ``gradsync.DataParallel`` (collective: rank 0's parameters are broadcast)."""
        self.model = self._setup_model(self.model)

    def _setup_model(self, model):
        wrapped = gradsync.DataParallel(model, **self.gradsync_options)
        self.gradsync_model = wrapped
        return wrapped

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == self._pl.trainer.states.TrainerFn.FITTING:
            self._add_summary(trainer)
            if self.gradsync_options["shard"] != "none":
                self._clip_globally()

    def setup_optimizers(self, trainer) -> None:
        """``configure_optimizers``' optimizers, each wrapped by ``model.shard_optimizer`` when sharding."""
        super().setup_optimizers(trainer)
        if self.gradsync_options["shard"] != "none" and isinstance(self.model, gradsync.DataParallel):
            self.optimizers = [self.model.shard_optimizer(optimizer) for optimizer in self.optimizers]

    def _add_summary(self, trainer) -> None:
        if self._summary is None:
            callback_class = type("GradsyncSummary", (SummaryHooks, self._pl.Callback), {})
            self._summary = callback_class(self)
        if self._summary not in trainer.callbacks:
            trainer.callbacks.append(self._summary)

    def _clip_globally(self) -> None:
        """Norm clipping over every rank's shard: Lightning's clips the norm of this rank's pieces only."""
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer, clip_val) -> None:
            gradsync.clip_grad_norm_(self.model, float(clip_val))

        plugin.clip_grad_by_norm = clip_grad_by_norm

    # -- training ------------------------------------------------------------------------------------------

    @contextmanager
    def block_backward_sync(self):
        """Backwards inside do not communicate (``DataParallel.no_sync``): Lightning's gradient accumulation."""
        if isinstance(self.model, gradsync.DataParallel):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Lightning's step; a sharded optimizer runs the closure first (it steps only after backward)."""
        if checkpoints.is_sharded(optimizer):
            model = model or self.lightning_module
            return self.precision_plugin.optimizer_step(StepAfterClosure(optimizer), model=model, closure=closure,
                                                        **kwargs)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def teardown(self) -> None:
        """Wait for a sharded step's all-gather, then unwrap the LightningModule (its parameters whole)."""
        if isinstance(self.model, gradsync.DataParallel):
            self.model.wait_for_parameters()
            self.model = self.lightning_module
        trainer = getattr(self.lightning_module, "_trainer", None)
        if self._summary is not None and trainer is not None and self._summary in trainer.callbacks:
            trainer.callbacks.remove(self._summary)
        super().teardown()

    # -- checkpoints ---------------------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict:
        if self.gradsync_model is not None:
            self.gradsync_model.wait_for_parameters()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> dict:
        """An optimizer's whole state; a sharded one's every shard consolidated on rank 0 (``{}`` on the others,
        as Lightning does for torch's ZeroRedundancyOptimizer). Collective when sharded."""
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        if checkpoints.is_sharded(inner):
            return checkpoints.sharded_optimizer_state(inner, self.global_rank, self.world_size)
        return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Add every rank's gradsync state under ``checkpoint["gradsync"]``, then Lightning's save (rank 0).
        Collective: every rank calls it (``Trainer.save_checkpoint`` does)."""
        if self.gradsync_model is not None:
            entry = checkpoints.gradsync_entry(self.gradsync_model, self.global_rank, self.world_size)
            if entry is not None:
                checkpoint[checkpoints.KEY] = entry
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Lightning's optimizer restore (a sharded optimizer keeps its slices of the whole state), then this
        rank's gradsync state (its compressor's error feedback) and the bucket layout."""
        super().load_optimizer_state_dict(checkpoint)
        if isinstance(self.model, gradsync.DataParallel):
            checkpoints.restore(self.model, checkpoint.get(checkpoints.KEY), self.global_rank, self.world_size)

    # -- registry -------------------------------------------------------------------------------------------

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """``Trainer(strategy="gradsync")`` (subprocess launcher) and ``"gradsync_spawn"`` (spawn)."""
        for name, start_method in ((cls.strategy_name, "popen"), (cls.strategy_name + "_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"gradsync DataParallel, start_method "
                                                                  f"{start_method!r}", start_method=start_method)
