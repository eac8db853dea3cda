"""gradsync's summary in Lightning's loggers: per epoch, communication time and share; once, the bucket algorithms.

:class:`SummaryHooks` holds the hooks of a Lightning ``Callback`` (the strategy builds the callback class over
the Lightning package in use and adds one instance to the Trainer's callbacks while fitting). Every epoch it
logs, with ``logger.log_metrics(..., step=trainer.global_step)`` on every logger of the Trainer (loggers write
on rank 0 only), this rank's (rank 0's):

* ``gradsync/comm_seconds``: seconds of gradient AllReduce (reduce-scatter and all-gather when sharded) and
  buffer broadcasts in the epoch, overlapped time included (``DataParallel.comm_seconds``);
* ``gradsync/exposed_comm_seconds``: the part the training step waited for (``exposed_comm_seconds``);
* ``gradsync/step_seconds``: wall seconds from each training batch's start to its end, summed;
* ``gradsync/comm_share`` and ``gradsync/exposed_comm_share``: the two above over ``step_seconds``;
* ``gradsync/bytes_sent``: payload bytes this rank sent through the transport in the epoch (0 over shared
  memory, ``algorithm="shm"``, which "auto" picks on one host).

After the first epoch it logs once, with ``log_hyperparams``, the requested algorithm, compression and
shard level and ``gradsync/bucket_algorithms``: per bucket, in reduction order, ``"<algorithm> <size>"``
(``DataParallel.bucket_algorithms()``: ``auto`` resolved per bucket size).
"""

from __future__ import annotations

import time

METRIC_NAMES = ("gradsync/comm_seconds", "gradsync/exposed_comm_seconds", "gradsync/step_seconds",
                "gradsync/comm_share", "gradsync/exposed_comm_share", "gradsync/bytes_sent")


def bucket_text(bucket_algorithms: list[tuple[int, str]]) -> str:
    """``[(bytes, algorithm), ...]`` as ``"ring 2.5 KiB, tree 3.00 MiB"``.

    >>> bucket_text([(2560, "ring"), (3 * 2**19, "ring+topk")])
    'ring 2.5 KiB, ring+topk 1.50 MiB'
    """
    def amount(nbytes: int) -> str:
        return f"{nbytes / 2**10:.1f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.2f} MiB"

    return ", ".join(f"{algorithm} {amount(nbytes)}" for nbytes, algorithm in bucket_algorithms)


def epoch_metrics(comm_s: float, exposed_s: float, step_s: float, bytes_sent: int) -> dict[str, float]:
    """The metrics logged for one epoch (shares are 0.0 when no step time was measured).

    >>> epoch_metrics(1.0, 0.25, 4.0, 10)["gradsync/exposed_comm_share"]
    0.0625
    """
    share = (lambda seconds: seconds / step_s if step_s > 0 else 0.0)
    return dict(zip(METRIC_NAMES, (comm_s, exposed_s, step_s, share(comm_s), share(exposed_s), float(bytes_sent))))


class SummaryHooks:
    """The hooks of the callback that logs gradsync's summary (see the module's docstring).

    Args:
        strategy: the GradsyncStrategy; its ``model`` is the wrapped DataParallel while fitting.
    """

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self._logged_buckets = False
        self._start = (0.0, 0.0, 0)  # comm_seconds, exposed_comm_seconds, bytes sent at the epoch's start
        self._step_s = 0.0
        self._batch_started = None

    def _model(self):
        return self.strategy.gradsync_model

    def _counters(self) -> tuple[float, float, int]:
        model = self._model()
        if model is None:
            return 0.0, 0.0, 0
        return model.comm_seconds, model.exposed_comm_seconds, model.comm.stats.bytes_sent

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._start = self._counters()
        self._step_s = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._batch_started is not None:
            self._step_s += time.perf_counter() - self._batch_started
            self._batch_started = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._model() is None or not trainer.loggers:
            return
        comm_s, exposed_s, sent = self._counters()
        metrics = epoch_metrics(comm_s - self._start[0], exposed_s - self._start[1], self._step_s,
                                sent - self._start[2])
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        if not self._logged_buckets:
            self._log_buckets(trainer)

    def _log_buckets(self, trainer) -> None:
        model, strategy = self._model(), self.strategy
        params = {"gradsync/algorithm": model.algorithm,
                  "gradsync/compression": model.compression.name if model.compression is not None else "none",
                  "gradsync/shard": model.shard, "gradsync/bucket_algorithms": bucket_text(model.bucket_algorithms()),
                  "gradsync/world_size": strategy.world_size}
        for logger in trainer.loggers:
            logger.log_hyperparams(params)
            logger.save()
        self._logged_buckets = True
