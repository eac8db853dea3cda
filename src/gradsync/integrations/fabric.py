"""GradsyncStrategy for Lightning Fabric (``lightning.fabric``): ``fabric.setup`` wraps the model in DataParallel.

``Fabric(strategy=GradsyncStrategy(algorithm="auto", compression=None, bucket_cap_mb=25.0, shard="none"),
accelerator="cpu", devices=2)``; then as with Fabric's ``DDPStrategy``: ``fabric.launch()``,
``model, optimizer = fabric.setup(model, optimizer)``, ``fabric.backward(loss)``, ``optimizer.step()``;
``fabric.no_backward_sync(model)`` is ``DataParallel.no_sync()``; ``fabric.clip_gradients(model, optimizer,
max_norm=...)`` takes the global norm over every shard; ``fabric.save`` / ``fabric.load`` carry every rank's
gradsync state (:mod:`~gradsync.integrations.lightning_checkpoint`: ``state["gradsync"]``, a sharded
optimizer's state consolidated on rank 0). Under ``shard="optimizer"|"gradients"`` the model and its
optimizers are set up together (``fabric.setup(model, optimizer)``). Fabric has no epoch hooks: the counters
are ``strategy.gradsync_model.comm_seconds`` and so on. Needs the ``lightning`` extra.
"""

from __future__ import annotations

import datetime
from contextlib import nullcontext

import gradsync
from gradsync.errors import import_extra

fabric_strategies = import_extra("lightning.fabric.strategies", "lightning", "gradsync.integrations.fabric")

from lightning.fabric.strategies.strategy import _BackwardSyncControl  # noqa: E402  (after the extra's check)

from gradsync.integrations import lightning_checkpoint as checkpoints  # noqa: E402
from gradsync.integrations.lightning_options import FABRIC_OPTIONS, check_extra_options, check_values  # noqa: E402
from gradsync.integrations.lightning_strategy import _seconds, adopt_lightning_group  # noqa: E402


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: ``DataParallel.no_sync()``."""

    def no_backward_sync(self, module, enabled: bool):
        if not enabled:
            return nullcontext()
        if not isinstance(module, gradsync.DataParallel):
            raise TypeError(f"no_backward_sync needs a model set up by GradsyncStrategy (a gradsync.DataParallel), "
                            f"got {type(module).__name__}")
        return module.no_sync()


class GradsyncStrategy(fabric_strategies.DDPStrategy):
    """Fabric's ``DDPStrategy`` with the model wrapped in :class:`gradsync.DataParallel`.

    Args: as :class:`gradsync.integrations.lightning.GradsyncStrategy`, with Fabric's ``precision`` (a
    Fabric precision plugin) in place of ``precision_plugin``. Raises: the same one-line errors at construction.
    """

    def __init__(self, algorithm: str = "auto", compression=None, bucket_cap_mb: float = 25.0, shard: str = "none",
                 *, broadcast_buffers: bool = True, gradient_as_bucket_view: bool = False, debug: bool | None = None,
                 accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision=None, process_group_backend: str | None = None, timeout=None,
                 start_method: str = "popen", **options):
        check_extra_options(options, FABRIC_OPTIONS)
        check_values(algorithm, compression, bucket_cap_mb, shard, broadcast_buffers, gradient_as_bucket_view, debug,
                     start_method, process_group_backend)
        extra = {} if timeout is None else {"timeout": datetime.timedelta(seconds=_seconds(timeout))}
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, start_method=start_method, **extra)
        self._backward_sync_control = _NoSync()
        self._gradsync_timeout = None if timeout is None else _seconds(timeout)
        self.gradsync_options = {"algorithm": algorithm, "compression": compression, "bucket_cap_mb": bucket_cap_mb,
                                 "shard": shard, "broadcast_buffers": broadcast_buffers,
                                 "gradient_as_bucket_view": gradient_as_bucket_view, "debug": debug}
        self.gradsync_model = None

    def _setup_distributed(self) -> None:
        """Fabric's set-up of ``torch.distributed``, then gradsync adopts it (``adopt_lightning_group``: its backend,
        one timeout; ValueError / CollectiveMismatchError on another timeout than an initialised gradsync's)."""
        super()._setup_distributed()
        adopt_lightning_group(self._gradsync_timeout)

    # -- module and optimizers ---------------------------------------------------------------------------

    def setup_module(self, module):
        """Wrap ``module`` in ``gradsync.DataParallel`` (collective: rank 0's parameters are broadcast)."""
        self.gradsync_model = gradsync.DataParallel(module, **self.gradsync_options)
        return self.gradsync_model

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        """The wrapped module, and each optimizer wrapped by ``model.shard_optimizer`` when sharding."""
        model = self.setup_module(module)
        return model, [model.shard_optimizer(optimizer) for optimizer in optimizers], scheduler

    def setup_optimizer(self, optimizer):
        if self.gradsync_options["shard"] != "none":
            raise ValueError(self._err_msg_joint_setup_required())
        return optimizer

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        """The global norm over every rank's shard when sharding (``gradsync.clip_grad_norm_``), else Fabric's."""
        if checkpoints.is_sharded(optimizer) and isinstance(module, gradsync.DataParallel):
            return gradsync.clip_grad_norm_(module, float(max_norm), norm_type, error_if_nonfinite=error_if_nonfinite)
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    # -- checkpoints ---------------------------------------------------------------------------------------

    def get_module_state_dict(self, module):
        if isinstance(module, gradsync.DataParallel):
            module.wait_for_parameters()
            module = module.module
        return super().get_module_state_dict(module)

    def load_module_state_dict(self, module, state_dict, strict: bool = True) -> None:
        if isinstance(module, gradsync.DataParallel):
            module = module.module
        super().load_module_state_dict(module, state_dict, strict=strict)

    def get_optimizer_state(self, optimizer):
        if checkpoints.is_sharded(optimizer):
            return checkpoints.sharded_optimizer_state(optimizer, self.global_rank, self.world_size)
        return super().get_optimizer_state(optimizer)

    def save_checkpoint(self, path, state, storage_options=None, filter=None) -> None:
        """``state`` with ``"gradsync"``: every rank's gradsync state (collective: every rank calls ``fabric.save``)."""
        if self.gradsync_model is not None:
            entry = checkpoints.gradsync_entry(self.gradsync_model, self.global_rank, self.world_size)
            if entry is not None:
                state = {**state, checkpoints.KEY: entry}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None):
        """Fabric's load; with objects to restore, this rank's gradsync state goes back into the model too."""
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if state and isinstance(remainder, dict) and checkpoints.KEY in remainder:
            entry = remainder.pop(checkpoints.KEY)
            if self.gradsync_model is not None:
                checkpoints.restore(self.gradsync_model, entry, self.global_rank, self.world_size)
        return remainder

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """``Fabric(strategy="gradsync")`` (subprocess launcher) and ``"gradsync_spawn"``."""
        for name, start_method in (("gradsync", "popen"), ("gradsync_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"gradsync DataParallel, start_method "
                                                                  f"{start_method!r}", start_method=start_method)


GradsyncStrategy.register_strategies(fabric_strategies.STRATEGY_REGISTRY)

__all__ = ["GradsyncStrategy"]
