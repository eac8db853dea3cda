"""The words of ``bench train --integrations``' section in docs/benchmarks.md (Lightning, Ray Train)."""

from __future__ import annotations

INTEGRATIONS_TITLES = {"train_integrations": "Training through Lightning and Ray Train against the plain loop"}

INTEGRATIONS_ABOUT = {
    "train_integrations": """\
The same training loop (the ~25.2M-parameter MLP of `bench train`, SGD, each
rank's fixed batch of 64, one torch thread per rank, 2 ranks) run six ways,
each as a fresh job per repetition in an order rotated by one each
repetition: the plain loop with gradsync `DataParallel` (`gradsync`) and with
torch DDP (`ddp`); Lightning's `Trainer` with `GradsyncStrategy`
(`lightning-gradsync`) and with Lightning's own `DDPStrategy`
(`lightning-ddp`), launched by Lightning's subprocess launcher, no logger,
checkpointing or progress bar; and a Ray Train `TorchTrainer` on a local Ray
cluster with `gradsync.integrations.ray.prepare_model` (`ray-gradsync`) and
with `ray.train.torch.prepare_model` (`ray-ddp`). Every job runs the same
warm-up, then times the same 30 steps in 5 windows of 6, each between two
barriers (the slowest rank's seconds), and reports the median window's
seconds per step, so a burst of other load moves one window rather than the
job's figure; Ray's and Lightning's start-up are outside the windows. `vs gradsync loop` is samples/s over
the plain gradsync loop's in the same repetition (the goal: the gradsync
integrations within 3%, median); `vs own plain loop` is over the plain loop
of the same reducer (gradsync or DDP): what the framework's per-step work
costs.""",
}
