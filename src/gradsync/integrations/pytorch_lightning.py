"""GradsyncStrategy for the separate ``pytorch_lightning`` package (the same strategy as for ``lightning.pytorch``).

``import pytorch_lightning as pl; from gradsync.integrations.pytorch_lightning import GradsyncStrategy;
pl.Trainer(strategy=GradsyncStrategy(...), accelerator="cpu", devices=2)``, or ``pl.Trainer(strategy="gradsync")``
once this module is imported. Its options, errors and behaviour are those of
:class:`gradsync.integrations.lightning.GradsyncStrategy` (both are built from
:class:`~gradsync.integrations.lightning_strategy.GradsyncStrategyMixin` over their package's ``DDPStrategy``).
Needs the ``lightning`` extra (``pip install 'gradsync[lightning]'``, which installs both packages).
"""

from __future__ import annotations

from gradsync.errors import import_extra

pl = import_extra("pytorch_lightning", "lightning", "gradsync.integrations.pytorch_lightning")

from gradsync.integrations.lightning_strategy import GradsyncStrategyMixin  # noqa: E402  (after the extra's check)


class GradsyncStrategy(GradsyncStrategyMixin, pl.strategies.DDPStrategy):
    """``pytorch_lightning``'s ``DDPStrategy`` with the LightningModule wrapped in :class:`gradsync.DataParallel`.

    Args and Raises: as :class:`gradsync.integrations.lightning.GradsyncStrategy` (docs/lightning.md).
    """

    _pl = pl


GradsyncStrategy.register_strategies(pl.strategies.StrategyRegistry)

__all__ = ["GradsyncStrategy"]
