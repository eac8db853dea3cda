"""``summary.json``: one builder for sync, async and local SGD, and the end-of-run algorithm line.

Every mode reports the same core (accuracy, throughput, where the time
went, bytes per rank, the AllReduce algorithm per bucket size) and adds its
own fields (restarts and per-phase times for sync and local SGD; pushes,
updates and the staleness bound for async). Seconds are means over the
workers unless a key says ``per_rank``; bytes are payload bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradsync import api
from gradsync.train.config import TrainConfig
from gradsync.train.data import Splits
from gradsync.train.task import task_for

PARAMETER_SERVER = "parameter_server"  # async mode's "algorithm": gradients pushed to the server


@dataclass
class RunTotals:
    """What every mode measures for its summary (seconds: means over workers; bytes: whole run)."""

    world_size: int
    num_workers: int
    steps: int
    samples: int
    wall_s: float
    train_wall_s: float  # wall_s less evaluation
    compute_s: float
    communication_s: float
    exposed_communication_s: float
    bytes_sent_per_step: float
    bytes_sent_per_rank: list[int]
    bytes_received_per_rank: list[int]
    per_rank_compute_s: list[float]
    per_rank_communication_s: list[float]


def _hosts() -> int:
    """How many hosts the default group's ranks run on (from the host identities they exchanged)."""
    from gradsync.process_group import default_communicator, is_initialized

    locality = default_communicator().locality if is_initialized() else None
    return len(set(locality.hosts)) if locality is not None else 1


def build_summary(config: TrainConfig, epochs: list[dict], totals: RunTotals, staleness: dict,
                  algorithms: list[tuple[int, str]], model: torch.nn.Module, data: Splits,
                  extra: dict) -> dict:
    """The ``summary.json`` dict of a finished run.

    Args:
        epochs: the run's epoch records (``test_accuracy``, ``test_loss``, ``train_loss``).
        staleness: :meth:`StalenessStats.as_dict` of the applied gradients.
        algorithms: ``(bucket nbytes, algorithm name)`` per bucket, as used.
        model: the unwrapped module (for its parameter count).
        extra: the mode's own fields, merged in after ``steps``.
    """
    t = totals
    last = epochs[-1] if epochs else {"test_accuracy": math.nan, "test_loss": math.nan, "train_loss": math.nan}
    comm_s, exposed_s = t.communication_s, t.exposed_communication_s
    return {
        "final_test_accuracy": last["test_accuracy"],
        "best_test_accuracy": max((r["test_accuracy"] for r in epochs), default=math.nan),
        "final_test_loss": last["test_loss"],
        **task_for(config.model).summary_fields(epochs),
        "final_train_loss": last["train_loss"],
        "world_size": t.world_size,
        "hosts": _hosts(),
        "mode": config.mode,
        "num_workers": t.num_workers,
        "compression": config.compression,
        "shard": config.shard,  # ZeRO level: none, optimizer (ZeRO-1), gradients (ZeRO-2)
        "algorithms": [{"bucket_nbytes": int(nbytes), "algorithm": name} for nbytes, name in algorithms],
        **staleness,
        "steps": t.steps,
        **extra,
        "samples": t.samples,
        "samples_per_s": t.samples / t.train_wall_s if t.train_wall_s > 0 else math.nan,
        "wall_s": t.wall_s,
        "train_wall_s": t.train_wall_s,
        "compute_s": t.compute_s,
        "communication_s": comm_s,
        "exposed_communication_s": exposed_s,
        "exposed_communication_fraction": exposed_s / comm_s if comm_s > 0 else 0.0,
        "bytes_sent_per_step": t.bytes_sent_per_step,
        "bytes_sent_per_rank": t.bytes_sent_per_rank,
        "bytes_received_per_rank": t.bytes_received_per_rank,
        "per_rank_compute_s": t.per_rank_compute_s,
        "per_rank_communication_s": t.per_rank_communication_s,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "train_samples": len(data.y_train),
        "test_samples": len(data.y_test),
        "config": config.to_dict(),
    }


def gather_totals(state, stats, world_size: int, wall_s: float) -> tuple[RunTotals, dict]:
    """Every rank's times and byte counts (collective: ``all_gather``) as the run's :class:`RunTotals`
    and the per-phase means; ``state`` a :class:`~gradsync.train.state.TrainState`, ``stats`` this
    rank's communicator counters (bytes since its group formed)."""
    t = state.times
    own = torch.tensor([t.compute_s, t.comm_s, state.bytes_sent_offset + stats.bytes_sent,
                        state.bytes_received_offset + stats.bytes_received, t.exposed_comm_s,
                        t.forward_s, t.backward_s, t.optimizer_s, state.step_bytes_sent], dtype=torch.float64)
    per_rank = torch.stack(api.all_gather(own))  # (world_size, 9)
    mean = per_rank.mean(0).tolist()
    totals = RunTotals(
        world_size=world_size, num_workers=world_size, steps=state.step, samples=state.samples, wall_s=wall_s,
        train_wall_s=wall_s - state.eval_s, compute_s=mean[0], communication_s=mean[1],
        exposed_communication_s=mean[4],
        # inside the steps only: the start-up broadcast and evaluation sums are not per-step traffic
        bytes_sent_per_step=mean[8] / max(state.step, 1),
        bytes_sent_per_rank=[int(v) for v in per_rank[:, 2].tolist()],
        bytes_received_per_rank=[int(v) for v in per_rank[:, 3].tolist()],
        per_rank_compute_s=per_rank[:, 0].tolist(), per_rank_communication_s=per_rank[:, 1].tolist())
    extra = {"resumed_from_step": state.resumed_from_step, "checkpoint_s": state.checkpoint_s,
             "forward_s": mean[5], "backward_s": mean[6], "optimizer_s": mean[7],
             "per_rank_exposed_communication_s": per_rank[:, 4].tolist()}
    return totals, extra


def pushed_gradient(model: torch.nn.Module) -> list[tuple[int, str]]:
    """Async mode's entry: one gradient of ``model``'s parameters pushed to the server per step."""
    return [(sum(p.numel() * p.element_size() for p in model.parameters()), PARAMETER_SERVER)]


def algorithm_line(summary: dict) -> str:
    """One line naming the algorithm used per bucket size, e.g. ``AllReduce: shm for 1 bucket of 20.4 KiB``."""
    entries = summary.get("algorithms") or []
    if not entries:
        return "gradsync: no gradient communication (one worker)"
    if entries[0]["algorithm"] == PARAMETER_SERVER:
        return f"gradsync: gradients pushed to the parameter server ({_size(entries[0]['bucket_nbytes'])} per push)"
    groups: dict[str, list[int]] = {}
    for entry in entries:
        groups.setdefault(entry["algorithm"], []).append(entry["bucket_nbytes"])
    what = "parameter averages" if summary.get("mode") == "local-sgd" else "buckets"
    chosen = "auto chose " if summary.get("config", {}).get("algorithm") == "auto" else ""
    parts = [f"{name} for {_count(sizes, what)} of {_span(sizes)}" for name, sizes in groups.items()]
    shard = summary.get("shard", "none")
    label = "AllReduce algorithm" if shard in ("none", None) else \
        f"--shard {shard}: reduce-scatter (gradients) and all-gather (parameters) algorithm"
    return f"gradsync: {label}: {chosen}" + "; ".join(part.replace(" reduce_scatter", "") for part in parts)


def _count(sizes: list[int], what: str) -> str:
    return f"{len(sizes)} {what if len(sizes) > 1 else what[:-1]}"


def _span(sizes: list[int]) -> str:
    low, high = min(sizes), max(sizes)
    return _size(low) if low == high else f"{_size(low)} to {_size(high)}"


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"
