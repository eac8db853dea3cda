"""``gradsync.preflight``: does the estimate fit, and if not, what would; the memory available; the one-line refusal.

:func:`check_fit` compares one rank's :class:`~gradsync.parallel.preflight.MemoryEstimate`
with the bytes available and, when it does not fit, looks for what would,
in this order: the shard levels above the run's (``none`` → ``optimizer``
→ ``gradients`` → ``parameters``) at its world size; while activations are
the largest part, a micro-batch halved (measured again) with the
accumulation raised to keep the step's samples, at each level; the world
size doubled up to :data:`MAX_WORLD_SIZE` (computed by the same formulas:
more ranks shrink only the sharded parts), at each level. The first that
fits is named; if none does, not even ZeRO-3 on 64 ranks with a
micro-batch of 1, the model needs tensor or pipeline parallelism, which
gradsync does not have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from gradsync.collectives.registry import DEFAULT_ALGORITHM
from gradsync.errors import MemoryPreflightError
from gradsync.hosts import memory_cgroup
from gradsync.parallel.bucketing import bucket_cap_bytes
from gradsync.parallel.pass_memory import measure_pass
from gradsync.parallel.preflight import (MemoryEstimate, check_level, check_world_size, estimate_from,
                                         state_slots)
from gradsync.parallel.shard_layout import SHARD_LEVELS

MAX_WORLD_SIZE = 64  # the largest world size the refusal suggests
_MEMINFO = "/proc/meminfo"


@dataclass(frozen=True)
class Trial:
    """One setting the preflight estimates: ``world_size`` ranks at ``shard`` with micro-batches of
    ``micro_batch`` samples, ``accumulate`` per optimizer step."""

    world_size: int
    shard: str
    micro_batch: int
    accumulate: int = 1


def host_available_bytes() -> int | None:
    """This machine's ``MemAvailable`` (``/proc/meminfo``) in bytes, or None where it cannot be read."""
    try:
        with open(_MEMINFO, encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(module: nn.Module) -> int | None:
    """The bytes a rank training ``module`` may use, its parameters (already allocated) included; None
    when nothing says.

    On a GPU (the module's parameters there): ``torch.cuda.mem_get_info``'s free bytes plus what
    torch's caching allocator holds unused. On the CPU: the smaller of this process's memory cgroup
    limit less the cgroup's usage and the machine's ``MemAvailable``.
    """
    params = list(module.parameters())
    device = next((p.device for p in params if p.device.type == "cuda"), None)
    own = sum(p.numel() * p.element_size() for p in params if device is None or p.device == device)
    if device is not None:
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) + own
    candidates = [value for value in (host_available_bytes(),) if value is not None]
    limit, usage = memory_cgroup.own_limit_bytes(), memory_cgroup.own_usage_bytes()
    if limit is not None and usage is not None:
        candidates.append(max(limit - usage, 0))
    return min(candidates) + own if candidates else None


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


PART_NAMES = {"parameter_bytes": "parameters", "gradient_bytes": "gradients",
              "optimizer_state_bytes": "optimizer state", "buffer_bytes": "buffers", "activation_bytes": "activations",
              "copied_bytes": "copy-on-write pages"}


def _name(part: str) -> str:
    return PART_NAMES[part]


def _suggestion(trial: Trial, base: Trial, options: bool) -> str:
    parts = []
    if trial.world_size != base.world_size:
        parts.append(f"--nproc {trial.world_size}" if options else f"world size {trial.world_size}")
    if trial.micro_batch != base.micro_batch:
        parts.append(f"--batch-size {trial.micro_batch} --accumulate {trial.accumulate}" if options else
                     f"micro-batches of {trial.micro_batch} with accumulate={trial.accumulate}")
    parts.append(f"--shard {trial.shard}" if options else f"shard={trial.shard!r}")
    return " ".join(parts) if options else ", ".join(parts)


class _Search:
    """Estimates of other settings for one module and optimizer (a pass asked once per micro-batch)."""

    def __init__(self, module, optimizer, settings: dict, passed, pass_at, evaluated, copied: int = 0):
        self.module, self.settings, self.pass_at, self.evaluated = module, settings, pass_at, evaluated
        self.copied = copied
        self.slots = state_slots(optimizer)
        self.passes = {}
        self.first = passed

    def at(self, trial: Trial, base: Trial) -> MemoryEstimate:
        passed = self.first
        if trial.micro_batch != base.micro_batch:
            if trial.micro_batch not in self.passes:
                self.passes[trial.micro_batch] = self.pass_at(trial.micro_batch)
            passed = self.passes[trial.micro_batch]
        evaluated = self.evaluated(trial.world_size) if callable(self.evaluated) else self.evaluated
        found = estimate_from(self.module, self.slots, passed, trial.world_size, trial.shard,
                              evaluated=evaluated, **self.settings)
        return replace(found, copied_bytes=self.copied)


def _levels_from(shard: str) -> tuple[str, ...]:
    return SHARD_LEVELS[SHARD_LEVELS.index(shard):]


def _first_fit(search: _Search, base: Trial, found: MemoryEstimate, available: int):
    """The first setting that fits (see the module's docstring) and its estimate, or None."""
    for level in _levels_from(base.shard)[1:]:
        other = search.at(replace(base, shard=level), base)
        if other.total_bytes <= available:
            return replace(base, shard=level), other
    size, largest = base.micro_batch // 2, found.largest_part()
    while search.pass_at is not None and size >= 1 and largest == "activation_bytes":
        samples = base.micro_batch * base.accumulate
        for level in _levels_from(base.shard):
            trial = Trial(base.world_size, level, size, -(-samples // size))
            other = search.at(trial, base)
            if other.total_bytes <= available:
                return trial, other
            largest = other.largest_part() if level == base.shard else largest
        size //= 2
    size = base.world_size * 2
    while size <= MAX_WORLD_SIZE:
        for level in _levels_from(base.shard):
            other = search.at(replace(base, world_size=size, shard=level), base)
            if other.total_bytes <= available:
                return replace(base, world_size=size, shard=level), other
        size *= 2
    return None


def refusal(found: MemoryEstimate, base: Trial, available: int, fit, options: bool = False) -> str:
    """The one-line refusal: what one rank needs by part, what is available, the largest part, what fits."""
    parts = ", ".join(f"{_name(part)} {getattr(found, part) / 2**20:.1f}" for part in found.__dataclass_fields__
                      if part != "copied_bytes" or found.copied_bytes)
    setting = (f"--nproc {base.world_size} --shard {base.shard}" if options
               else f"world size {base.world_size} with shard={base.shard!r}")
    largest = found.largest_part()
    words = (f"gradsync preflight: one rank needs {_mib(found.total_bytes)} at {setting} ({parts} MiB), "
             f"{_mib(available)} available; the largest part is {_name(largest)} "
             f"({_mib(getattr(found, largest))})")
    if fit is not None:
        trial, other = fit
        return f"{words}; {_suggestion(trial, base, options)} would need {_mib(other.total_bytes)}"
    top = "--shard parameters" if options else "shard='parameters'"
    return (f"{words}; nothing fits, not even {top} at world size {MAX_WORLD_SIZE} with micro-batches of 1: "
            f"the model needs tensor or pipeline parallelism beyond gradsync")


def check_fit(module: nn.Module, optimizer, base: Trial, available: int | None, settings: dict, passed,
              pass_at=None, *, evaluated=None, options: bool = False, copied: int = 0) -> MemoryEstimate:
    """``base``'s estimate from the measured pass ``passed`` if it fits ``available`` bytes (None: no
    limit known, so it fits).

    ``settings``: :func:`~gradsync.parallel.preflight.estimate_from`'s keywords; ``pass_at(size)``: the
    :class:`~gradsync.parallel.pass_memory.PassMemory` of a micro-batch of ``size`` samples, measured or
    :func:`~gradsync.parallel.pass_memory.scaled` (None: smaller micro-batches are not tried);
    ``evaluated``: an evaluation pass (see ``estimate_from``), or ``world_size -> PassMemory`` where
    the evaluation's share shrinks with more ranks; ``options``: name what fits as ``gradsync train`` options;
    ``copied``: the estimate's ``copied_bytes`` at every setting (see :class:`MemoryEstimate`).

    Raises:
        MemoryPreflightError: it does not fit (the message: :func:`refusal`).
    """
    search = _Search(module, optimizer, settings, passed, pass_at, evaluated, copied)
    found = search.at(base, base)
    if available is None or found.total_bytes <= available:
        return found
    fit = _first_fit(search, base, found, available)
    raise MemoryPreflightError(refusal(found, base, available, fit, options), estimate=found)


def preflight(module: nn.Module, optimizer: torch.optim.Optimizer, sample_batch, world_size: int,
              shard: str = "none", *, available_bytes: int | None = None, bucket_cap_mb: float = 25.0,
              loss_fn=None, algorithm: str = DEFAULT_ALGORITHM, one_host: bool = True, gradient_as_bucket_view: bool = False,
              accumulate: int = 1) -> MemoryEstimate:
    """:func:`~gradsync.parallel.preflight.estimate`, checked against ``available_bytes`` per rank (None: what this process may still
    take, :func:`~gradsync.parallel.preflight_fit.available_memory`).

    When it does not fit, the shard levels above ``shard``, then (while activations are the largest part,
    and only with the default loss, which takes any batch size: a ``loss_fn`` may hold targets of
    ``sample_batch``'s size) smaller micro-batches (``sample_batch``'s tensors cut along their first
    dimension, halved each time, with ``accumulate`` raised to keep the step's samples), then world sizes
    doubled up to 64 are estimated, and the message names the first that fits.

    Raises:
        MemoryPreflightError: the estimate exceeds ``available_bytes``; the one-line message names the
            largest part and what would fit, or that nothing does (the model then needs tensor or pipeline
            parallelism beyond gradsync).
        ValueError / TypeError: as :func:`~gradsync.parallel.preflight.estimate`.
    """
    check_level(shard)
    check_world_size(world_size)
    bucket_cap_bytes(bucket_cap_mb)
    available = available_memory(module) if available_bytes is None else available_bytes
    settings = {"bucket_cap_mb": bucket_cap_mb, "algorithm": algorithm, "one_host": one_host,
                "gradient_as_bucket_view": gradient_as_bucket_view}
    pass_at = (lambda size: measure_pass(module, _cut(sample_batch, size))) if loss_fn is None else None
    return check_fit(module, optimizer, Trial(world_size, shard, _batch_size(sample_batch), accumulate), available,
                     settings, measure_pass(module, sample_batch, loss_fn), pass_at)


def _batch_size(sample_batch) -> int:
    tensors = sample_batch if isinstance(sample_batch, (tuple, list)) else (sample_batch,)
    return next((t.shape[0] for t in tensors if isinstance(t, torch.Tensor) and t.dim() > 0), 1)


def _cut(sample_batch, size: int):
    if isinstance(sample_batch, (tuple, list)):
        return type(sample_batch)(t[:size] if isinstance(t, torch.Tensor) and t.dim() > 0 else t
                                  for t in sample_batch)
    return sample_batch[:size]
