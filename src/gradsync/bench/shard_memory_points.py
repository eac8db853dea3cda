"""``bench memory``'s sampling points: after forward, backward and the step, and inside the pass at every block.

Every row of ``gradsync bench memory`` (gradsync at each shard level, torch's
ZeRO, FSDP2) is sampled at the same points of one training step; at each
point the bytes the rank holds are counted (a ``count()`` callable, e.g.
``count_bytes(model.held_tensors(optimizer))``), nothing else is done, and
the point with the largest total is the step's peak. The blocks are the
modules FSDP2 wraps (:func:`gradsync.bench.shard_memory_fsdp2.units`: the
gpt's blocks, the MLP's ``Linear`` layers), the same modules for every row;
for block ``i`` (in the model's order):

* ``fwd i``: right after block ``i``'s forward, before any wrapper's forward
  post-hook (a forward hook registered with ``prepend=True``): a ZeRO-3 or
  FSDP2 unit is still whole there, and a prefetched next one too;
* ``bwd-in i``: when backward enters block ``i``: a hook on the gradient of
  the block's output, registered after every wrapper's, so a ZeRO-3 or FSDP2
  unit has been gathered by the wrappers' own hooks on that tensor and the
  one before it prefetched;
* ``grads i``: each time autograd accumulates the gradient of one of the
  block's parameters (the parameters the block holds during its forward:
  FSDP2's unsharded ones), before any other post-accumulate-grad hook of
  that parameter (the wrappers' reducers copy a gradient into a bucket and
  release it, ZeRO-3 frees a unit whose gradients are all there): the
  largest of these counts. At the block's last parameter every gradient of
  the block is alive, not yet reduce-scattered, beside the whole unit.

A block whose output does not require grad has no ``bwd-in`` point. Then
``forward`` (the loss computed), ``backward`` (``loss.backward()``
returned) and ``step`` (the optimizer stepped). The hooks hold no tensor and
change no value: the pass computes what it computes without them (slower:
the byte run samples, the timed run does not).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

POINTS = ("forward", "backward", "step")   # the points outside the pass, in the order a step reaches them
BLOCK_POINTS = ("fwd", "bwd-in", "grads")  # each block's points: "fwd 0", "bwd-in 0", "grads 0", ...


def point_names(blocks: int) -> list[str]:
    """Every point a step of a model with ``blocks`` sampled blocks can reach, in a fixed order (the
    same on every rank: a point travels between ranks as its index here).

    >>> point_names(1)
    ['forward', 'backward', 'step', 'fwd 0', 'bwd-in 0', 'grads 0']
    """
    return list(POINTS) + [f"{kind} {index}" for index in range(blocks) for kind in BLOCK_POINTS]


def _first_grad_tensor(value) -> torch.Tensor | None:
    """The first tensor of ``value`` (a tensor, or a tuple / list of them) that requires grad, else None."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
        if isinstance(item, torch.Tensor) and item.requires_grad:
            return item
    return None


def _first_post_accumulate_hook(param: torch.Tensor, hook) -> object:
    """``param.register_post_accumulate_grad_hook(hook)``, run before the hooks already registered.

    torch keeps them in ``param._post_accumulate_grad_hooks`` (an ``OrderedDict``, handle id -> hook)
    and runs them in the dict's insertion order as C sees it (``PyDict_Next``, which ignores
    ``move_to_end``): the others are taken out and put back after this one. Returns the handle."""
    handle = param.register_post_accumulate_grad_hook(hook)
    hooks = param._post_accumulate_grad_hooks
    others = [(key, hooks.pop(key)) for key in list(hooks) if key != handle.id]
    hooks.update(others)
    return handle


class PassSampler:
    """Counts what a rank holds at every point of one training step (see the module's docstring).

    Args:
        blocks: the modules whose forward and backward are sampled (the same ones for every row).
        count: ``() -> {part: bytes}``, what the rank holds now.

    Use ``with PassSampler(blocks, count) as sampler:`` around the step, passing ``sampler.sample`` as
    :func:`~gradsync.bench.shard_memory.train_step`'s ``sample``; the hooks are removed on exit.
    ``counts`` then maps each point reached, in the order first reached, to its counts (a point reached
    several times keeps the largest total).
    """

    def __init__(self, blocks: list[nn.Module], count: Callable[[], dict[str, int]]):
        self.blocks, self.count = blocks, count
        self.counts: dict[str, dict[str, int]] = {}
        self._handles: list = []

    def sample(self, point: str) -> None:
        """Count now, as ``point``."""
        counts = self.count()
        kept = self.counts.get(point)
        if kept is None or sum(counts.values()) > sum(kept.values()):
            self.counts[point] = counts

    def _pre_forward(self, index: int, block: nn.Module, args) -> None:
        """Hook the gradients of the parameters the block holds now (FSDP2's unsharded ones by now)."""
        if not torch.is_grad_enabled():
            return
        point = f"{BLOCK_POINTS[2]} {index}"
        for param in block.parameters():
            if param.requires_grad:
                self._handles.append(_first_post_accumulate_hook(param, lambda param: self.sample(point)))

    def _post_forward(self, index: int, output) -> None:
        tensor = _first_grad_tensor(output)
        if tensor is not None and torch.is_grad_enabled():
            point = f"{BLOCK_POINTS[1]} {index}"
            tensor.register_hook(lambda grad: self.sample(point))

    def __enter__(self) -> "PassSampler":
        for index, block in enumerate(self.blocks):
            self._handles += [
                block.register_forward_pre_hook(lambda module, args, i=index: self._pre_forward(i, module, args)),
                block.register_forward_hook(lambda module, args, output, i=index: self.sample(f"{BLOCK_POINTS[0]} {i}"),
                                            prepend=True),
                block.register_forward_hook(lambda module, args, output, i=index: self._post_forward(i, output))]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def peak(self) -> str:
        """The point with the largest total (the first such in the order reached)."""
        return max(self.counts, key=lambda point: sum(self.counts[point].values()))
