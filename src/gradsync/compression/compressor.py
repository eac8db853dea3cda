"""What every compressor shares: the bucket layout it is given and the reduce contract.

The reducer hands a compressor one bucket at a time: the flat gradients of
the bucket's parameters back to back, with a :class:`BucketLayout` naming
them. The compressor replaces the bucket, in place, by the average over the
ranks of what it transmitted, dividing exactly once. State that outlives a
step (error-feedback residuals, PowerSGD's warm-start matrices) is kept per
rank and keyed by parameter name, so that it survives a bucket rebuild and a
checkpoint taken with other buckets.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from gradsync.collectives import ops as collectives
from gradsync.collectives.communicator import Communicator
from gradsync.collectives.scatter_gather import reduce_scatter_flat

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class BucketLayout:
    """The parameters of one bucket: ``names[k]`` occupies ``[offsets[k], offsets[k] + numels[k])``."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(shape.numel() for shape in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        offsets, offset = [], 0
        for numel in self.numels:
            offsets.append(offset)
            offset += numel
        return tuple(offsets)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @classmethod
    def single(cls, name: str, shape) -> "BucketLayout":
        """A bucket holding one tensor (tests, direct use)."""
        return cls((name,), (torch.Size(shape),))


class Compressor:
    """Base class: average a bucket over the ranks by sending less than its full float32 bytes.

    Subclasses implement :meth:`_reduce_float` (and ``_state_dict`` /
    ``_load_state_dict`` for their own state). Instances are stateful and
    belong to one model on one rank: pass a fresh instance to each
    ``DataParallel``.

    Args:
        warmup_steps: the first ``warmup_steps`` reductions of each parameter
            are exact AllReduces (1-bit Adam's warm-up stage, Tang et al. 2021;
            ``start_powerSGD_iter`` of PyTorch's PowerSGD hook): early training,
            with large and fast-changing gradients, is where compression error
            hurts most.

    Raises:
        ValueError: ``warmup_steps`` is not an int >= 0.
    """

    name = "none"
    can_reduce_scatter = False
    """Whether :meth:`reduce_scatter` works (DataParallel's ``shard="optimizer"|"gradients"``): a sum of
    compressed messages must stay a sum of values, so casts combine, signs, sparse picks and low-rank
    factors (one-bit, top-k, PowerSGD, all re-encoded after the average) do not."""

    def __init__(self, warmup_steps: int = 0):
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.steps: dict[str, int] = {}  # reductions done per parameter name
        self._owner: weakref.ref | None = None

    def attach(self, owner: object) -> None:
        """Bind to one model; a second live model sharing this instance would mix their state."""
        current = self._owner() if self._owner is not None else None
        if current is not None and current is not owner:
            raise ValueError(f"this {type(self).__name__} compressor already serves another model; "
                             f"give each DataParallel its own instance")
        self._owner = weakref.ref(owner)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_owner"] = None  # a copy serves no model yet
        return state

    @torch.no_grad()
    def reduce(self, flat: torch.Tensor, layout: BucketLayout, comm: Communicator, divisor: int,
               algorithm: str = "ring") -> None:
        """Replace ``flat`` by the average over ranks of its compressed form, in place.

        Args:
            flat: ``(layout.numel,)`` contiguous floating-point gradients of the bucket.
            layout: names and shapes of the bucket's parameters.
            comm: the group.
            divisor: ranks whose gradients are averaged (``world_size``, fewer under join);
                the sum of what the ranks transmitted is divided by it exactly once.
            algorithm: AllReduce algorithm for the parts sent uncompressed.

        Collective: every rank calls it for the same buckets in the same order.
        """
        if flat.numel() != layout.numel:
            raise ValueError(f"{type(self).__name__}: bucket has {flat.numel()} elements, its layout "
                             f"{layout.numel}")
        if flat.numel() == 0:
            return
        warming_up = min(self.steps.get(name, 0) for name in layout.names) < self.warmup_steps
        for name in layout.names:
            self.steps[name] = self.steps.get(name, 0) + 1
        if warming_up:  # the reducer's exact path
            collectives.average(flat, comm, divisor, algorithm)
        elif flat.dtype in _LOW_PRECISION:  # compute and keep residuals in float32
            work = flat.float()
            self._reduce_float(work, layout, comm, divisor, algorithm)
            flat.copy_(work)
        else:
            self._reduce_float(flat, layout, comm, divisor, algorithm)

    def _reduce_float(self, flat: torch.Tensor, layout: BucketLayout, comm: Communicator, divisor: int,
                      algorithm: str) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def reduce_scatter(self, flat: torch.Tensor, layout: BucketLayout, comm: Communicator, divisor: int,
                       algorithm: str = "ring") -> tuple[int, int]:
        """ZeRO's sharded gradients: this rank's chunk of ``flat`` (``torch.tensor_split`` bounds, returned)
        becomes the average over ranks of the compressed bucket; the rest of ``flat`` is garbage afterwards.

        Args:
            flat: ``(padded_numel,)`` contiguous float32/float64 gradients, the bucket's ``layout.numel`` values
                then zero padding (so that every rank's chunk is equally long).

        Raises:
            ValueError: this compressor cannot combine with sharding (``can_reduce_scatter`` is False).

        Collective: every rank calls it for the same buckets in the same order.
        """
        if not self.can_reduce_scatter:
            raise ValueError(f"compression {self.name!r} cannot combine with sharded gradients")
        warming_up = min((self.steps.get(name, 0) for name in layout.names), default=0) < self.warmup_steps
        for name in layout.names:
            self.steps[name] = self.steps.get(name, 0) + 1
        if warming_up or comm.world_size == 1:
            start, stop = reduce_scatter_flat(flat, comm, algorithm=algorithm)
            flat[start:stop].div_(divisor)
            return start, stop
        return self._reduce_scatter_float(flat, layout, comm, divisor)

    def _reduce_scatter_float(self, flat: torch.Tensor, layout: BucketLayout, comm: Communicator,
                              divisor: int) -> tuple[int, int]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """This rank's state: ``{"steps": {name: reductions}}`` plus the compressor's own
        (error-feedback residuals, ...), tensors keyed by parameter name."""
        return {"steps": dict(self.steps), **self._state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; the next reduce continues as if never interrupted.

        Raises:
            ValueError: keys other than :meth:`state_dict`'s.
        """
        expected = set(self.state_dict())
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{type(self).__name__}.load_state_dict expects keys {sorted(expected)}, got {got}")
        steps = state["steps"]
        if not isinstance(steps, dict) or not all(isinstance(count, int) and count >= 0 for count in steps.values()):
            raise ValueError(f"{type(self).__name__} state 'steps' must be a dict of counts >= 0 keyed by "
                             f"parameter name, got {steps!r:.80}")
        self.steps = {str(name): int(count) for name, count in steps.items()}
        self._load_state_dict(state)

    def _state_dict(self) -> dict:
        return {}

    def _load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(warmup_steps={self.warmup_steps})"
