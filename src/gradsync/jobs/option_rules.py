"""Every ``gradsync train`` option's rule: honoured, or refused before any process starts, per combination.

A run is one combination of a mode (``sync``, ``async``, ``local-sgd``), a
membership (``static``, ``elastic``) and a placement (``local`` processes,
one ``torchrun`` rank, ``test hosts``, one ``slurm`` task under srun). Each :class:`~gradsync.train.config.TrainConfig`
field has a :class:`Rule`: the combinations it is honoured in (everywhere
unless it says otherwise), the other options it needs and the option values
it cannot go with (``--num-samples`` with ``--model gpt``). An option set to
anything but its default in a combination its rule leaves out is refused
with one line naming the option and the combination (:func:`refusal`);
``tests/test_option_rules.py`` walks every field under every combination and
checks that validation agrees with this table, so a new option cannot be
added without a rule. Value checks (ranges, formats) stay in
:func:`~gradsync.train.config.validate`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gradsync.train.config import TrainConfig

MODES = ("sync", "async", "local-sgd")
MEMBERSHIPS = ("static", "elastic")
PLACEMENTS = ("local", "torchrun", "test hosts", "slurm")

# (mode, membership, placement) patterns (None: any) that gradsync train refuses whatever the options
REFUSED_COMBINATIONS = {
    (None, "elastic", "torchrun"): "--elastic starts its own launcher per worker (membership is gradsync's): run "
                                   "`gradsync train --elastic` directly, not under torchrun",
    ("async", None, "test hosts"): "--hosts runs --mode sync only (for now)",
    ("local-sgd", None, "test hosts"): "--hosts runs --mode sync only (for now)",
    ("local-sgd", "elastic", None): "--elastic runs --mode sync or async (local-sgd is not elastic yet)",
    (None, "elastic", "slurm"): "--elastic starts its own launcher per worker: under srun each task is one worker "
                                "of a fixed group (a preempted job requeues and resumes from its checkpoint)",
    ("async", None, "slurm"): "under srun, --mode sync or local-sgd (a parameter server's roles are not "
                              "placed on SLURM tasks yet)",
}


@dataclass(frozen=True)
class Rule:
    """Where a non-default value of an option is honoured, and what it needs.

    ``also_refused``: ``(mode, membership, placement)`` patterns (None: any) refused besides;
    ``needs``: ``(field, value)`` pairs of which another option must have one (a value of None:
    anything but its default); ``excludes``: ``(field, value)`` pairs none of which another option may
    have; ``why``: said when the option is refused.
    """

    modes: tuple[str, ...] = MODES
    memberships: tuple[str, ...] = MEMBERSHIPS
    placements: tuple[str, ...] = PLACEMENTS
    also_refused: tuple[tuple, ...] = ()
    needs: tuple[tuple[str, object], ...] = ()
    excludes: tuple[tuple[str, object], ...] = ()
    why: str = ""

    def honoured_in(self, mode: str, membership: str, placement: str) -> bool:
        where = (mode, membership, placement)
        return (mode in self.modes and membership in self.memberships and placement in self.placements
                and not any(_matches(pattern, where) for pattern in self.also_refused))

    def missing(self, config: TrainConfig) -> str | None:
        """The option this one needs and ``config`` lacks (e.g. ``--compression topk``), or None."""
        if not self.needs or any(_has(config, field, value) for field, value in self.needs):
            return None
        field, value = self.needs[0]
        return option(field) + ("" if value is None or value is True else f" {value}")

    def clash(self, config: TrainConfig) -> str | None:
        """The option value this one cannot go with that ``config`` has (e.g. ``--model gpt``), or None."""
        for field, value in self.excludes:
            if getattr(config, field) == value:
                return f"{option(field)} {value}"
        return None


def _matches(pattern: tuple, where: tuple) -> bool:
    return all(p is None or p == w for p, w in zip(pattern, where))


def _has(config: TrainConfig, field: str, value) -> bool:
    have = getattr(config, field)
    return have != getattr(_DEFAULTS, field) if value is None else have == value


def option(name: str) -> str:
    """The command-line flag that sets field ``name`` away from its default (``--no-progress`` for a
    switch that is on by default)."""
    flag = name.replace("_", "-")
    return f"--no-{flag}" if getattr(_DEFAULTS, name) is True else f"--{flag}"


EVERYWHERE = Rule()
NOT_ASYNC = Rule(modes=("sync", "local-sgd"), why="async workers push gradients to a server")
SYNC = Rule(modes=("sync",), why="only --mode sync reduces gradients in buckets")
HOSTS = Rule(placements=("test hosts",), needs=(("hosts", None),), why="it acts on test hosts")
_TORCHRUN_HOSTS = Rule(memberships=("static",), placements=("test hosts",), needs=(("hosts", None),),
                       why="it is torchrun's rendezvous across test hosts; an elastic run has a quorum instead")
ELASTIC = Rule(memberships=("elastic",), needs=(("elastic", True),), why="it sets an elastic run's membership")
CHECKPOINTS = Rule(needs=(("checkpoint_dir", None), ("max_restarts", None)), why="it sets how checkpoints are kept")
FAULTS = Rule(modes=("sync", "local-sgd"), why="a parameter server's faults are injected by killing its PID")
OUTER = Rule(modes=("local-sgd",), why="DiLoCo's outer rounds replace local SGD's parameter averages")
NESTEROV = Rule(modes=("local-sgd",), needs=(("outer_optimizer", "nesterov"),), why="it sets the outer Nesterov step")
GPT_SIZE = Rule(needs=(("model", "gpt"),), why="it sizes the gpt (the other models have fixed sizes)")

RULES: dict[str, Rule] = {
    "nproc": Rule(placements=("local", "test hosts", "slurm"),
                  why="torchrun's --nproc-per-node sets the workers (under srun it must equal SLURM_NTASKS)"),
    "mode": EVERYWHERE,
    "max_staleness": Rule(modes=("async",), why="only a parameter server has stale gradients"),
    "staleness_lr": Rule(modes=("async",), why="only a parameter server has stale gradients"),
    "sync_every": Rule(modes=("local-sgd",), why="only local SGD averages every H steps"),
    "outer_optimizer": OUTER, "outer_compression": OUTER, "outer_fragments": OUTER,
    "outer_lr": NESTEROV, "outer_momentum": NESTEROV,
    "straggler": EVERYWHERE,
    "model": EVERYWHERE, "gpt_width": GPT_SIZE, "gpt_depth": GPT_SIZE, "gpt_heads": GPT_SIZE,
    "gpt_context": GPT_SIZE, "epochs": EVERYWHERE, "batch_size": EVERYWHERE, "accumulate": EVERYWHERE,
    "global_batch_size": NOT_ASYNC,
    "deterministic": Rule(modes=("sync",), needs=(("global_batch_size", None),),
                          why="the exact sum of a fixed global batch is --mode sync's"),
    "micro_shards": Rule(modes=("sync",), needs=(("deterministic", True),), why="it cuts --deterministic's batch"),
    "lr": EVERYWHERE, "lr_schedule": EVERYWHERE, "optimizer": EVERYWHERE, "weight_decay": EVERYWHERE,
    "lr_scaling": Rule(needs=(("base_batch_size", None),),
                       why="it scales --lr from the global batch --lr was tuned for (an elastic run's global "
                           "batch is fixed, async's is one worker's batch x --accumulate)"),
    "base_batch_size": Rule(needs=(("lr_scaling", None),), why="it is the batch --lr-scaling scales --lr from"),
    "warmup_steps": EVERYWHERE, "warmup_epochs": EVERYWHERE,
    "algorithm": NOT_ASYNC,
    "bucket_cap_mb": SYNC,
    "gradient_as_bucket_view": SYNC,
    "debug": SYNC,
    "compression": SYNC,
    "topk_ratio": Rule(modes=("sync",), needs=(("compression", "topk"),), why="it sets topk's share"),
    "powersgd_rank": Rule(modes=("sync",), needs=(("compression", "powersgd"),), why="it sets powersgd's rank"),
    "compression_warmup_steps": Rule(modes=("sync",), needs=(("compression", None),),
                                     why="it delays a compressor"),
    "shard": Rule(modes=("sync",), memberships=("static",),
                  why="ZeRO shards the gradients a synchronous step reduce-scatters and the optimizer state over a "
                      "fixed group (async and local-SGD workers step alone; an elastic membership change would "
                      "have to re-shard the optimizer state, docs/elastic.md)"),
    "clip_grad_norm": Rule(modes=("sync", "local-sgd"),
                           why="a parameter server applies each worker's gradient on arrival: there is no "
                               "step's gradient to take the global norm of"),
    "trace": NOT_ASYNC,
    "tensorboard": EVERYWHERE,
    "seed": EVERYWHERE, "timeout": EVERYWHERE,
    "memory_limit_mib": Rule(memberships=("static",), placements=("local",),
                             why="gradsync train's own launcher puts each rank of a fixed group on this machine in "
                                 "a memory cgroup (torchrun, test hosts and srun start their ranks themselves; "
                                 "elastic workers come and go)"),
    "preflight": Rule(modes=("sync", "local-sgd"), memberships=("static",),
                      why="the preflight runs where the trainer builds a fixed group's replicas (a parameter "
                          "server's roles and an elastic membership's hand-over do not run it)"),
    "max_restarts": Rule(modes=("sync", "local-sgd"), memberships=("static",), placements=("local", "test hosts"),
                         why="torch's agent restarts a static sync or local-sgd job (torchrun: give it to torchrun;"
                             " srun: SLURM requeues the job, which resumes from its checkpoint; --elastic: "
                             "survivors go on)"),
    "checkpoint_dir": Rule(also_refused=(("async", "static", None),),
                           why="a parameter server without --elastic does not checkpoint"),
    "checkpoint_every": CHECKPOINTS,
    "keep_checkpoints": CHECKPOINTS,
    "fail_at": FAULTS,
    "hang_at": FAULTS,
    "check_replicas_every": NOT_ASYNC,
    "num_samples": Rule(excludes=(("model", "gpt"),),
                        why="it sets how many MNIST-1D examples are drawn; the gpt reads its whole corpus"),
    "data_dir": EVERYWHERE, "out": EVERYWHERE, "progress": EVERYWHERE,
    "hosts": Rule(placements=("test hosts",), why="it starts one torchrun per test host itself (under srun, "
                                                  "SLURM placed the tasks)"),
    "inter_host_gbit": HOSTS,
    "join_timeout": _TORCHRUN_HOSTS,
    "cut_link_at": Rule(memberships=("static",), placements=("test hosts",), needs=(("hosts", None),),
                        why="an elastic run across hosts loses a host by --kill-host-at"),
    "kill_host_at": HOSTS,
    "elastic": Rule(placements=("local", "test hosts"), why=REFUSED_COMBINATIONS[(None, "elastic", "torchrun")]),
    "min_nproc": ELASTIC,
    "max_nproc": ELASTIC,
    "max_relaunches": ELASTIC,
    "join": Rule(modes=("sync",), memberships=("elastic",), placements=("local",), needs=(("elastic", True),),
                 why="it adds a local worker to a running elastic job, with that job's options"),
    "elastic_fault": Rule(modes=("sync",), memberships=("elastic",), needs=(("elastic", True),),
                          why="it injects faults into an elastic sync run's step or hand-over"),
}

_DEFAULTS = TrainConfig()
_JOIN_TAKES = {"join", "elastic", "progress"}  # --join RUN runs the running job's options, not its own


def combination(config: TrainConfig, placement: str) -> tuple[str, str, str]:
    return config.mode, "elastic" if config.elastic else "static", placement


def describe(mode: str, membership: str, placement: str) -> str:
    """``--mode async --elastic under torchrun``: a combination as the user typed it."""
    words = [f"--mode {mode}"] + (["--elastic"] if membership == "elastic" else [])
    return " ".join(words) + {"local": "", "torchrun": " under torchrun", "test hosts": " with --hosts",
                              "slurm": " under srun"}[placement]


def set_options(config: TrainConfig, given=frozenset()) -> list[str]:
    """The fields of ``config`` that differ from their default, or that the user named (``given``)."""
    return [item.name for item in dataclasses.fields(TrainConfig)
            if item.name in given or getattr(config, item.name) != getattr(_DEFAULTS, item.name)]


def refusal(config: TrainConfig, placement: str, given=frozenset()) -> str | None:
    """The one-line reason ``config`` is refused in ``placement`` (None: every option it sets is honoured);
    ``given``: fields the user named even at their default value (``--nproc 4`` under torchrun)."""
    where = combination(config, placement)
    for pattern, why in REFUSED_COMBINATIONS.items():
        if _matches(pattern, where):
            return why
    chosen = set_options(config, given)
    if config.join is not None and set(chosen) - _JOIN_TAKES:
        extra = ", ".join(option(name) for name in chosen if name not in _JOIN_TAKES)
        return f"--join RUN adds a worker with the running job's options; leave out {extra}"
    for name in chosen:
        rule = RULES[name]
        missing = rule.missing(config)
        if missing:
            return f"{option(name)} needs {missing}: {rule.why}"
        clash = rule.clash(config)
        if clash:
            return f"{option(name)} is not honoured with {clash}: {rule.why}"
        if not rule.honoured_in(*where):
            return f"{option(name)} is not honoured with {describe(*where)}: {rule.why}"
    return None
