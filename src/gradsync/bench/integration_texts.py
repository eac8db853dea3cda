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
    "train_integrations_after": """\
How to read it. A row's `vs gradsync loop` above 1 means the framework's
job stepped faster than the plain loop's in the same repetition: every job
is a fresh set of processes, and the jobs of one repetition run one after
another, so load from other programs that lasts a whole job lands on some
rows and not on others (the windows' median removes only short bursts); the
min–max beside each median shows how far that moved them. The goal is judged
on the median only. The per-step work Lightning adds (its hooks, the
closure, the optimizer wrapper) and Ray Train adds (none inside the loop:
the workers run the user's function) is small against a step of this MLP,
which is why the issue asks for this model; on the 5k-parameter CNN of
`bench train` Lightning's per-step cost is a large share of a step.""",
}
