"""Large-batch optimizers: LARS (You et al. 2017) and LAMB (You et al. 2019), shard-aware torch optimizers.

``gradsync.optim.LARS(model.parameters(), lr=2.0)`` and ``gradsync.optim.LAMB(model.parameters(), lr=1e-3)``
are ``torch.optim.Optimizer`` subclasses: pass them to ``model.shard_optimizer(...)`` at any ZeRO level
and each parameter's trust ratio is still taken over the whole parameter (its norms reduced across the
ranks holding its pieces), exactly under ``DeterministicDataParallel``.
"""

from gradsync.optim.lamb import LAMB
from gradsync.optim.lars import LARS
from gradsync.optim.trust import LayerwiseOptimizer, TensorNorms

__all__ = ["LAMB", "LARS", "LayerwiseOptimizer", "TensorNorms"]
