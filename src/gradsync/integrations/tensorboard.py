"""TensorBoard for any loop around ``gradsync.DataParallel``: :class:`TensorBoardHook` (the ``tensorboard`` extra).

The hook is defined beside the training loop (:mod:`gradsync.train.tensorboard_events`), which
``gradsync train --tensorboard DIR`` uses too; this is its public, documented name. See docs/tensorboard.md.
"""

from __future__ import annotations

from gradsync.train.tensorboard_events import TAGS, TensorBoardHook, check_log_dir

__all__ = ["TAGS", "TensorBoardHook", "check_log_dir"]
