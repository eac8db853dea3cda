"""One timed Lightning run for ``gradsync bench train --integrations``: ``python -m gradsync.bench.lightning_job SPEC``.

``SPEC`` is a JSON object: ``impl`` ("lightning-gradsync" or "lightning-ddp"), ``algorithm``, ``model``,
``world_size``, ``steps``, ``warmup``, ``result`` (the JSON file rank 0 writes ``{"step_s": ...}``
to) and ``root`` (Lightning's ``default_root_dir``). Lightning's subprocess launcher starts the other
ranks by running the same command again (:mod:`gradsync.bench.integration_jobs`).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _module_class():
    import lightning.pytorch as pl

    from gradsync.bench.train import LR, MODEL_SEED, build_bench_model, make_batch

    class BenchModule(pl.LightningModule):
        """The bench model; every step is this rank's fixed batch (no sampler, no collation)."""

        def __init__(self, model: str, batches: int):
            super().__init__()
            torch.manual_seed(MODEL_SEED)
            self.net = build_bench_model(model)
            self.model_name, self.batches = model, batches

        def training_step(self, batch, batch_idx):
            inputs, labels = batch
            return F.cross_entropy(self.net(inputs), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self):
            batch = make_batch(self.model_name, self.global_rank)
            return torch.utils.data.DataLoader([batch] * self.batches, batch_size=None)

    return BenchModule


def _timer_class(warmup: int, steps: int):
    import lightning.pytorch as pl

    from gradsync.bench.integration_jobs import slowest_rank, step_seconds, window_sizes

    sizes = window_sizes(steps)
    starts = [warmup + sum(sizes[:index]) for index in range(len(sizes))]
    ends = {start + size - 1: index for index, (start, size) in enumerate(zip(starts, sizes))}

    class StepTimer(pl.Callback):
        """Times the windows of :func:`~gradsync.bench.integration_jobs.window_sizes` after ``warmup``
        steps, each between two barriers; ``step_s``: the median window's seconds per step, slowest rank."""

        step_s = None

        def __init__(self):
            self.seconds: list[float] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx in starts:
                dist.barrier()
                self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx in ends:
                dist.barrier()
                self.seconds.append(time.perf_counter() - self.started)
                if len(self.seconds) == len(sizes):
                    self.step_s = step_seconds(slowest_rank(self.seconds), sizes)

    return StepTimer()


def _strategy(impl: str, algorithm: str):
    from gradsync.bench.train import DDP_BUCKET_CAP_MB

    if impl == "lightning-gradsync":
        from gradsync.integrations.lightning import GradsyncStrategy

        return GradsyncStrategy(algorithm=algorithm)
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(bucket_cap_mb=DDP_BUCKET_CAP_MB, gradient_as_bucket_view=False, static_graph=False,
                       find_unused_parameters=False)


def main(spec: dict) -> None:
    import lightning.pytorch as pl

    from gradsync.train.setup import threads_per_worker

    torch.set_num_threads(threads_per_worker(spec["world_size"]))
    total = spec["warmup"] + spec["steps"]
    timer = _timer_class(spec["warmup"], spec["steps"])
    trainer = pl.Trainer(accelerator="cpu", devices=spec["world_size"], strategy=_strategy(spec["impl"],
                         spec["algorithm"]), max_steps=total, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, use_distributed_sampler=False, default_root_dir=spec["root"],
                         callbacks=[timer])
    trainer.fit(_module_class()(spec["model"], total))
    if trainer.global_rank == 0:
        with open(spec["result"], "w", encoding="utf-8") as file:
            json.dump({"step_s": timer.step_s}, file)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
