"""GradsyncStrategy for ``lightning.pytorch``: Lightning's Trainer with gradsync.DataParallel in place of DDP.

``Trainer(strategy=GradsyncStrategy(algorithm="auto", compression=None, bucket_cap_mb=25.0, shard="none"),
accelerator="cpu", devices=2)``, or ``Trainer(strategy="gradsync")`` once this module is imported
(``"gradsync_spawn"``: the spawn launcher). Needs the ``lightning`` extra (``pip install 'gradsync[lightning]'``).
What it changes in ``DDPStrategy``: :mod:`gradsync.integrations.lightning_strategy`; the options:
:mod:`gradsync.integrations.lightning_options`; docs/lightning.md. The same class for the separate
``pytorch_lightning`` package: :mod:`gradsync.integrations.pytorch_lightning`.
"""

from __future__ import annotations

from gradsync.errors import import_extra

pl = import_extra("lightning.pytorch", "lightning", "gradsync.integrations.lightning")

from gradsync.integrations.lightning_strategy import GradsyncStrategyMixin  # noqa: E402  (after the extra's check)


class GradsyncStrategy(GradsyncStrategyMixin, pl.strategies.DDPStrategy):
    """Lightning's ``DDPStrategy`` with the LightningModule wrapped in :class:`gradsync.DataParallel`.

    Args:
        algorithm: the AllReduce algorithm, a name in ``gradsync.ALGORITHMS`` ("auto": the fastest for each
            bucket size on this group).
        compression: None, a name in ``gradsync.compression.COMPRESSIONS`` ("fp16", "bf16", "onebit",
            "topk", "powersgd") or a :class:`gradsync.compression.Compressor` (one per strategy and fit).
        bucket_cap_mb: most MiB of gradients per bucket (> 0).
        shard: "none", "optimizer" (ZeRO-1) or "gradients" (ZeRO-2): the optimizers of
            ``configure_optimizers`` step this rank's shard (``model.shard_optimizer``). "parameters"
            (ZeRO-3) is refused: Lightning reads the LightningModule's parameters whole.
        broadcast_buffers, gradient_as_bucket_view, debug: DataParallel's options of the same names.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        start_method ("popen": Lightning's subprocess launcher; "spawn", "fork", "forkserver"): as
        ``DDPStrategy``. process_group_backend: "gloo" (CPU), "nccl" (CUDA) or None (Lightning's choice). timeout: a ``datetime.timedelta`` or seconds, for torch's group and
        gradsync's collectives (None: each one's default).

    Raises (at construction, before any process starts, in one line):
        ValueError: an unknown algorithm, compression name, shard level, start method or process group
            backend (gradsync runs over "gloo" and "nccl"), a bad
            ``bucket_cap_mb`` or ``timeout``, a shard level that cannot combine with the compression or the
            algorithm, shard="parameters", or one of torch DDP's own options (``find_unused_parameters``,
            ``static_graph``, ``ddp_comm_hook``, ...; the message says why).
        TypeError: any other unknown option (the message lists the accepted ones); a compression of another type.

    While fitting, ``gradsync_model`` is the DataParallel (kept after the fit for its counters).
    """

    _pl = pl


GradsyncStrategy.register_strategies(pl.strategies.StrategyRegistry)

__all__ = ["GradsyncStrategy"]
