"""The optimizer of a sharded DataParallel: any ``torch.optim`` optimizer, stepping only this rank's pieces.

``optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))``: the user builds the
optimizer as for DDP (DeepSpeed's ``initialize(model, optimizer)`` takes one built the same way), and
DataParallel hands back a :class:`ShardedOptimizer` over it. Its parameter groups (hyperparameters kept)
now list this rank's pieces instead of the parameters, so the optimizer's state, created lazily at the
first step as torch optimizers do, exists for 1/world_size of the elements (ZeRO-1). ``step()`` steps the
pieces (views of the parameters: the model is updated in place) and starts the all-gather that gives every
rank the others' updates; the next forward waits for it bucket by bucket.

Per-element optimizers (SGD with or without momentum, Adam, AdamW, RMSprop, Adagrad, ...) give the same
bits on a piece as on the whole tensor. LARS and LAMB (:mod:`gradsync.optim`) look across a parameter's
elements (its norms): the wrapper gives them :class:`~gradsync.parallel.shard_norms.ShardNorms`, which
reduces each parameter's sums of squares across the ranks holding its pieces (exactly under
``DeterministicDataParallel``). Other optimizers that look across a tensor (Shampoo) are not served.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from gradsync.errors import GradsyncError
from gradsync.optim.trust import LayerwiseOptimizer
from gradsync.parallel.shard_norms import ShardNorms
from gradsync.parallel.sharded_state import piece_entries, shard_of_full


def piece_norms(shards, exact: bool) -> ShardNorms:
    """The :class:`ShardNorms` of ``shards``' pieces (a ``ZeroState``): each piece's parameter, the
    parameters' own dimensions and element counts, the model's group."""
    segment_of = {id(tensor): piece.param for piece, tensor in zip(shards.flat.pieces, shards.flat.piece_tensors)}
    ndims = [len(shards.shapes[id(param)]) for param in shards.params]
    return ShardNorms(segment_of, ndims, shards.layout.numels, shards.comm, exact)


class ShardedOptimizer(torch.optim.Optimizer):
    """A torch optimizer stepping this rank's shard of a ZeRO-1/2 DataParallel.

    A ``torch.optim.Optimizer`` (LR schedulers take it) that delegates to the one it wraps.

    Args:
        optimizer: a ``torch.optim.Optimizer`` built over the wrapped model's parameters (all of them or
            some, frozen ones included; groups and their hyperparameters are kept). State it already has
            (Adagrad's initial sums, an optimizer that stepped) is cut to this rank's pieces.
        shards: the model's sharded state (a ``ZeroState``).
        exact_norms: a :class:`~gradsync.optim.trust.LayerwiseOptimizer`'s norms summed exactly (the
            same bits at any world size: ``DeterministicDataParallel`` asks for it).

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer.
        ValueError: it holds a tensor that is not one of the model's parameters.

    Attributes:
        optimizer: the wrapped optimizer (its ``param_groups`` list the pieces).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, shards, exact_norms: bool = False):  # noqa: super().__init__ would copy the groups
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"shard_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer, self.shards = optimizer, shards
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = OrderedDict(), OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        existing = optimizer.state_dict() if optimizer.state else None
        piece_of = {id(shards.params[p.param]): k for k, p in enumerate(shards.flat.pieces)}
        self.full_groups: list[list[torch.Tensor]] = []  # per group, the parameters the optimizer was built over
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in shards.module_params:
                    raise ValueError("shard_optimizer: the optimizer holds a tensor that is not one of the "
                                     "DataParallel model's parameters; build it over model.parameters()")
            self.full_groups.append(list(group["params"]))
            group["params"] = [shards.flat.piece_tensors[piece_of[id(p)]] for p in group["params"]
                               if id(p) in piece_of]  # frozen parameters have no piece: never stepped
        self.piece_of = piece_of
        if isinstance(optimizer, LayerwiseOptimizer):  # LARS / LAMB: whole-parameter norms across the pieces
            optimizer.use_norms(piece_norms(shards, exact_norms))
        optimizer.state.clear()
        if existing is not None:
            self.optimizer.load_state_dict(shard_of_full(existing, self))

    # -- torch.optim.Optimizer's surface -----------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, state) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict) -> None:
        self.optimizer.defaults = defaults

    def step(self, closure=None):
        """Step this rank's pieces, then start the parameters' all-gather (the next forward waits for it).

        Raises:
            ValueError: a ``closure`` (it would run forward and backward inside the step: step after backward).

        Collective: every rank calls it after each synchronised backward (a rank under ``join`` that has
        run out of data steps inside its shadow round).
        """
        if closure is not None:
            raise ValueError("ShardedOptimizer.step takes no closure: call loss.backward(), then step()")
        self.optimizer.step()
        self.shards.flat.gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the pieces' gradients and the model's local ones (accumulated under ``no_sync``)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.shards.grads.release()
        for param in self.shards.params:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    def add_param_group(self, group: dict) -> None:
        raise GradsyncError("ShardedOptimizer: add parameter groups before model.shard_optimizer(optimizer)")

    # -- state -------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's shard: the wrapped optimizer's state dict over its pieces (``state`` keyed by the
        piece's position in the groups), with ``"shard"``: per piece ``(parameter name, param_start,
        param_stop)`` and the world size, which :func:`~gradsync.parallel.sharded_state.consolidate` and
        :meth:`load_state_dict` read."""
        self.shards.flat.wait_all()
        state = self.optimizer.state_dict()
        state["shard"] = self._shard_entry()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Load a state saved by :meth:`state_dict` on this rank of the same layout, or a whole (unsharded)
        optimizer state dict keyed as ``optimizer.state_dict()`` of the same groups over the full
        parameters (this rank keeps its pieces' slices).

        Raises:
            ValueError: a shard of another layout (world size or rank): consolidate first
                (``gradsync.parallel.sharded_state.consolidate``).
        """
        if "shard" in state:
            shard = state["shard"]
            if shard.get("world_size") != self.shards.comm.world_size or \
                    shard.get("pieces") != self._shard_entry()["pieces"]:
                raise ValueError("ShardedOptimizer.load_state_dict: this shard was saved by another layout "
                                 f"(world size {shard.get('world_size')}); consolidate the shards into a full "
                                 "state dict first (gradsync.parallel.sharded_state.consolidate)")
            state = {key: value for key, value in state.items() if key != "shard"}
        else:
            state = shard_of_full(state, self)
        self.optimizer.load_state_dict(state)

    def _shard_entry(self) -> dict:
        return {"world_size": self.shards.comm.world_size, "rank": self.shards.comm.rank,
                "group_sizes": [len(params) for params in self.full_groups],
                "pieces": piece_entries(self, self.shards.names)}

    def __repr__(self) -> str:
        return f"ShardedOptimizer({type(self.optimizer).__name__}, rank {self.shards.comm.rank} of " \
               f"{self.shards.comm.world_size})"
