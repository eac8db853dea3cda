"""One data-parallel training step: DataParallel's real buckets, their exchanges overlapped with backward.

Buckets: :func:`dataparallel_buckets` calls the code ``DataParallel`` runs
(:mod:`gradsync.parallel.bucketing`): ``assign_buckets`` with
``bucket_cap_mb`` and the 1 MiB first-bucket cap at construction, then,
after the first backward, the rebuild of :mod:`gradsync.parallel.rebuild`
(the observed ready order and ``pause_breaks``), which every later step
uses. The last bucket carries ``len(params) + world_size · SLOTS_PER_RANK``
flag elements (:class:`~gradsync.parallel.reducer.Reducer`).

Schedule (:func:`overlap`, as the Reducer runs it): one communication
thread reduces buckets 0..B-2 in index order, bucket b from
max(its last gradient ready, bucket b-1 done); when backward has ended the
main thread waits for each of them in turn and copies its averages out
(``copy_out_s[b]``), then reduces the last bucket itself. Each gradient is
copied into its bucket in backward (``copy_in``: on the main thread, so it
delays the later gradients). Exposed communication is what the Reducer
measures: the time the main thread waited plus the last bucket's
exchange, never more than all exchanges together. Step = forward +
backward (with copies in) + the sync tail (waits, last bucket, copies out)
+ optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from gradsync.parallel.bucketing import DEFAULT_FIRST_BUCKET_CAP_BYTES, assign_buckets, default_order, pause_breaks
from gradsync.parallel.rebuild import MIN_SPLIT_BYTES, PAUSE_S
from gradsync.parallel.sync_round import SLOTS_PER_RANK
from gradsync.sim.compute import StepCompute


def cap_bytes(bucket_cap_mb: float) -> int:
    """What ``DataParallel(bucket_cap_mb=...)`` gives its Reducer (MiB to bytes).

    Raises:
        ValueError: not a positive number of MiB.
    """
    if not (isinstance(bucket_cap_mb, (int, float)) and 0 < bucket_cap_mb < float("inf")) \
            or int(bucket_cap_mb * 2**20) < 1:
        raise ValueError(f"bucket_cap_mb must be a positive finite number of MiB, got {bucket_cap_mb!r}")
    return int(bucket_cap_mb * 2**20)


def ready_order(ready_s: Sequence[float]) -> list[int]:
    """Parameter indices in the order their gradients become ready (ties: reverse registration order)."""
    return sorted(range(len(ready_s)), key=lambda i: (ready_s[i], -i))


def dataparallel_buckets(params: Sequence[torch.Tensor], bucket_cap_mb: float,
                         ready_s: Sequence[float] | None = None) -> list[list[int]]:
    """DataParallel's bucket assignment: at construction (``ready_s`` None), or after its rebuild on a
    backward whose gradient ``i`` was ready at ``ready_s[i]`` seconds (the steady state)."""
    cap = cap_bytes(bucket_cap_mb)
    if ready_s is None:
        return assign_buckets(params, cap, DEFAULT_FIRST_BUCKET_CAP_BYTES)
    observed = ready_order(ready_s)
    seen = set(observed)
    order = observed + [index for index in default_order(len(params)) if index not in seen]
    breaks = pause_breaks(params, observed, [ready_s[i] for i in observed], PAUSE_S, MIN_SPLIT_BYTES)
    breaks_before = [index for index, starts in zip(order, breaks) if starts]
    return assign_buckets(params, cap, DEFAULT_FIRST_BUCKET_CAP_BYTES, order, breaks_before)


def flag_count(num_params: int, world_size: int) -> int:
    """Flag elements the last bucket carries (used flags, then every rank's status slots)."""
    return num_params + world_size * SLOTS_PER_RANK


@dataclass(frozen=True)
class Overlap:
    """The sync part of a step, in seconds from backward's start.

    ``end_s``: the main thread is done (last copy out); ``exposed_s``: as the Reducer measures it;
    ``spans``: each bucket's exchange (start, end).
    """

    end_s: float
    exposed_s: float
    spans: tuple[tuple[float, float], ...]


def overlap(ready_s: Sequence[float], comm_s: Sequence[float], backward_s: float,
            copy_out_s: Sequence[float] | None = None) -> Overlap:
    """Schedule the buckets' exchanges against backward (see the module docstring).

    Args:
        ready_s: per bucket, when its last gradient is ready (s from backward's start).
        comm_s: per bucket, its exchange's seconds.
        backward_s: when backward ends (>= every ready time).
        copy_out_s: per bucket, seconds to copy its averages into ``.grad`` (None: 0).

    Raises:
        ValueError: lengths differ or a bucket is ready after backward's end.
    """
    count = len(ready_s)
    copy_out_s = [0.0] * count if copy_out_s is None else list(copy_out_s)
    if len(comm_s) != count or len(copy_out_s) != count:
        raise ValueError(f"need one ready time, exchange time and copy time per bucket, got "
                         f"{count}, {len(comm_s)}, {len(copy_out_s)}")
    if count and max(ready_s) > backward_s + 1e-12:
        raise ValueError(f"a bucket is ready at {max(ready_s)} s, after backward's end at {backward_s} s")
    if not count:
        return Overlap(backward_s, 0.0, ())
    spans, free = [], 0.0
    for ready, seconds in zip(ready_s[:-1], comm_s[:-1]):  # the communication thread
        start = max(ready, free)
        free = start + seconds
        spans.append((start, free))
    main, waited = backward_s, 0.0
    for (_, end), copy in zip(spans, copy_out_s[:-1]):  # the main thread, once backward has ended
        waited += max(0.0, end - main)
        main = max(main, end) + copy
    spans.append((main, main + comm_s[-1]))
    main += comm_s[-1] + copy_out_s[-1]
    return Overlap(main, min(waited + comm_s[-1], sum(comm_s)), tuple(spans))


@dataclass(frozen=True)
class StepPlan:
    """A step's buckets on one world size: members, gradient elements, the last bucket's flag elements,
    when each bucket is ready, and the backward with the copies into the buckets (s)."""

    assignment: list[list[int]]
    numels: list[int]
    flags: int
    ready_s: list[float]
    backward_s: float
    copy_in_s: float
    copy_out_s: list[float]


def plan_step(compute: StepCompute, bucket_cap_mb: float, world_size: int, copy_s_per_byte: float,
              bucket_view: bool = False, rebuilt: bool = True) -> StepPlan:
    """Buckets of ``compute.params`` as DataParallel holds them in steady state (``rebuilt``; False:
    the construction-time layout, as ``set_layout`` would keep it), and when each is ready.

    ``copy_s_per_byte``: the copy of each gradient into its bucket (in backward) and of the averages
    out of it (after its exchange), unless ``bucket_view`` (``gradient_as_bucket_view=True``)."""
    params = compute.params
    sizes = [p.numel() * p.element_size() for p in params]
    per_byte = 0.0 if bucket_view else copy_s_per_byte
    shifted, copied = [0.0] * len(params), 0.0
    for index in ready_order(compute.ready_s):  # each hook copies its gradient before the next one runs
        copied += sizes[index] * per_byte
        shifted[index] = compute.ready_s[index] + copied
    assignment = dataparallel_buckets(params, bucket_cap_mb, shifted if rebuilt else None)
    flags = flag_count(len(params), world_size)
    numels = [sum(params[i].numel() for i in bucket) for bucket in assignment]
    ready = [max(shifted[i] for i in bucket) for bucket in assignment]
    copy_out = [sum(sizes[i] for i in bucket) * per_byte for bucket in assignment]
    return StepPlan(assignment, numels, flags, ready, compute.backward_s + copied, copied, copy_out)
