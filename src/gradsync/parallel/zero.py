"""DataParallel's ZeRO-1/2/3 state: the layout, the flat parameters, the gradient shards and the optimizer.

The split follows FSDP2's (``torch/distributed/fsdp/_fully_shard/``): the
collectives live in :mod:`~gradsync.collectives.scatter_gather`, the layout in
:mod:`~gradsync.parallel.shard_layout`, the parameters and their all-gather in
:mod:`~gradsync.parallel.flat_params`, the gradients and their reduce-scatter
in :mod:`~gradsync.parallel.shard_grads`, the optimizer in
:mod:`~gradsync.parallel.sharded_optimizer`; this module wires them to one
DataParallel (its reducer's buckets) and answers what the model holds.

Levels (Rajbhandari et al. 2020, "ZeRO: memory optimizations toward training trillion parameter
models"; DeepSpeed stages 1 and 2):

* ``"optimizer"`` (ZeRO-1): optimizer state for this rank's chunk only. The gradient buckets stay whole
  and persistent (each ``.grad`` is copied in and released), reduce-scattered instead of all-reduced.
* ``"gradients"`` (ZeRO-2): the gradient buckets too are transient: two bucket-sized slabs, reused in
  turn, instead of one buffer per bucket; what persists of the gradients is this rank's chunk.
* ``"parameters"`` (ZeRO-3): the parameters too: one bucket per unit (:mod:`~gradsync.parallel.units`),
  whole only while the unit runs (:mod:`~gradsync.parallel.unit_params`); gradients as at ZeRO-2.

ZeRO-1/2 move the bytes of one AllReduce per step (a reduce-scatter of the gradients in backward, an
all-gather of the parameters after the step); ZeRO-3 gathers each unit twice (forward and backward), 1.5
times those bytes.
"""

from __future__ import annotations

import contextlib

import torch

from gradsync.errors import GradsyncError
from gradsync.optim.trust import LayerwiseOptimizer
from gradsync.parallel.flat_params import FlatParameters
from gradsync.parallel.shard_grads import ShardGradients
from gradsync.parallel.shard_layout import ShardLayout
from gradsync.parallel.shard_norms import ShardNorms
from gradsync.parallel.sharded_optimizer import ShardedOptimizer
from gradsync.parallel.unit_params import UnitParameters
from gradsync.parallel.units import Unit, choose_units


class ShardedModel:
    """What DataParallel and DeterministicDataParallel offer for sharding (their ``_zero``: a ZeroState or None)."""

    _zero: "ZeroState | None"

    def shard_optimizer(self, optimizer):
        """The optimizer to step: ``optimizer`` itself with ``shard="none"``, else a
        :class:`~gradsync.parallel.sharded_optimizer.ShardedOptimizer` over this rank's pieces (build
        ``optimizer`` over ``model.parameters()``; one per model). Under ``DeterministicDataParallel`` a LARS
        or LAMB optimizer passed here (at every level, ``"none"`` too) sums its norms exactly."""
        exact = getattr(self, "exact_norm", False)  # DeterministicDataParallel: LARS/LAMB's norms summed exactly
        if self._zero is None:
            if exact and isinstance(optimizer, LayerwiseOptimizer):
                optimizer.use_norms(ShardNorms(exact=True))
            return optimizer
        return self._zero.shard_optimizer(optimizer, exact_norms=exact)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and under sharding the optimizer pieces' gradients too."""
        super().zero_grad(set_to_none)
        if self._zero is not None:
            self._zero.zero_grad(set_to_none)

    def wait_for_parameters(self) -> None:
        """Wait for the parameters' all-gather that a sharded ``optimizer.step()`` started (a no-op otherwise).

        The next forward and ``state_dict()`` wait by themselves; call this before reading parameters in
        any other way right after a step (their other ranks' chunks may still be arriving).
        """
        if self._zero is not None:
            self._zero.flat.wait_all()

    def full_parameters(self):
        """A context manager in which every parameter is whole and equal on every rank (collective on entry).

        At ``shard="parameters"`` it all-gathers every unit and frees them after the block (save or compare
        parameters inside it; what the block writes into them is kept); at the other levels it waits for the
        step's all-gather.
        """
        if self._zero is None:
            return contextlib.nullcontext()
        return self._zero.flat.full()


    def _read_check(self):
        """The context DataParallel calls its module in: ZeRO-3's check of the first forward for reads of
        parameters whose unit is not gathered (:class:`~gradsync.parallel.unit_params.FreedReadCheck`)."""
        if self._zero is None or self._zero.level != "parameters":
            return contextlib.nullcontext()
        return self._zero.flat.first_forward_check(self._zero.names)


def zero_units(module, shard: str, units, bucket_cap_mb: float) -> list[Unit]:
    """ZeRO-3's units of ``module`` (empty below ``shard="parameters"``; ``units`` given elsewhere is refused).

    Raises:
        ValueError: ``units`` with another shard level, or a bad ``units`` (see ``choose_units``).
    """
    if shard != "parameters":
        if units is not None:
            raise ValueError(f"units= names ZeRO-3's gathered units; it needs shard='parameters', not {shard!r}")
        return []
    trainable = [param for param in module.parameters() if param.requires_grad]
    itemsize = trainable[0].element_size() if trainable else 4
    return choose_units(module, units, max(1, int(bucket_cap_mb * 2 ** 20) // itemsize))


def unit_assignment(units: list[Unit], params: list[torch.Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    """ZeRO-3's buckets: one per unit and dtype, in unit order. Returns ``(assignment, unit_buckets)``:
    parameter indices per bucket, and bucket indices per unit."""
    assignment, unit_buckets = [], []
    for unit in units:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index in unit.params:
            by_dtype.setdefault(params[index].dtype, []).append(index)
        unit_buckets.append(list(range(len(assignment), len(assignment) + len(by_dtype))))
        assignment.extend(by_dtype.values())
    return assignment, unit_buckets


ZERO2_SLABS = 2  # ZeRO-2's bucket buffers: one filling while the one before it is reduce-scattered
ZERO3_SLABS = 1  # ZeRO-3's: a unit's copy-in waits for the unit before it (reduce-scattered during its backward)


class ZeroState:
    """The sharded state of one DataParallel.

    Args:
        module: the wrapped module.
        named: its trainable ``(name, parameter)`` pairs, index = parameter index of ``assignment``.
        assignment: parameter indices per bucket (DataParallel's gradient buckets).
        comm, algorithm: the model's.
        level: ``"optimizer"``, ``"gradients"`` or ``"parameters"``.
        compression, layouts: the model's compressor (fp16/bf16, or None) and its per-bucket layouts.
        units, unit_buckets: ZeRO-3's units (root last) and bucket indices per unit (``unit_assignment``).
    """

    def __init__(self, module, named, assignment: list[list[int]], comm, algorithm: str, level: str,
                 compression=None, layouts=None, units: list[Unit] | None = None,
                 unit_buckets: list[list[int]] | None = None):
        self.level, self.comm = level, comm
        self.params = [param for _, param in named]
        self.module_params = {id(param) for param in module.parameters()}  # frozen ones too
        self.names = {id(param): name for name, param in named}
        self.shapes = {id(param): param.shape for param in self.params}  # a freed ZeRO-3 parameter has (0,)
        self.layout = ShardLayout([p.numel() for p in self.params], assignment, comm.world_size)
        if level == "parameters":
            self.flat = UnitParameters(module, self.params, self.layout, units, unit_buckets, comm, algorithm)
        else:
            self.flat = FlatParameters(module, self.params, self.layout, comm, algorithm)
        dtypes = [self.params[indices[0]].dtype for indices in assignment]
        self.grads = ShardGradients(self.layout, self.flat.pieces, self.flat.piece_tensors, comm, algorithm,
                                    compression, layouts, dtypes)
        self.optimizer: ShardedOptimizer | None = None

    def shard_optimizer(self, optimizer, exact_norms: bool = False) -> ShardedOptimizer:
        """Wrap ``optimizer`` (see :class:`ShardedOptimizer`; ``exact_norms``: LARS/LAMB's norms summed
        exactly); one per model.

        Raises:
            ValueError: the model already has one (it would step the same pieces twice).
        """
        if self.optimizer is not None and optimizer is not self.optimizer:
            if optimizer is self.optimizer.optimizer:
                return self.optimizer
            raise ValueError("this DataParallel already has a sharded optimizer; shard one optimizer per model")
        if optimizer is self.optimizer:
            return optimizer
        self.optimizer = ShardedOptimizer(optimizer, self, exact_norms)
        return self.optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the pieces' gradients (``model.zero_grad()`` as well as ``optimizer.zero_grad()``)."""
        for tensor in self.flat.piece_tensors:
            if tensor.grad is not None and not set_to_none:
                tensor.grad.zero_()
            else:
                tensor.grad = None
        self.grads.release()

    def require_optimizer(self) -> None:
        """Refuse a training forward before the optimizer is sharded (every rank raises the same, at once)."""
        if self.optimizer is None:
            raise GradsyncError(f"DataParallel(shard={self.level!r}): call optimizer = "
                                f"model.shard_optimizer(optimizer) before training; a plain optimizer would see "
                                f"no gradients (each rank keeps only its shard of them) and update nothing")

    def shadow(self, shadow_round) -> None:
        """Under ``join``, a rank without data takes part in the others' reduce-scatter (``shadow_round``),
        steps its shard with their average and joins the all-gather, as the active ranks do after their
        backward; its own gradients of before are dropped first (the shard must hold only this round's)."""
        for tensor in self.flat.piece_tensors:
            tensor.grad = None
        self.grads.release()
        shadow_round()
        if self.optimizer is not None:
            self.optimizer.step()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What the sharded state holds beyond the module: shard gradients (``"gradients"``), optimizer state."""
        state = [value for entry in (self.optimizer.state.values() if self.optimizer else ())
                 for value in entry.values() if isinstance(value, torch.Tensor)]
        grads = [tensor.grad for tensor in self.flat.piece_tensors if tensor.grad is not None]
        shards = getattr(self.flat, "shards", [])
        return {"parameters": list(self.flat.flats) + shards, "gradients": [b for b in self.grads.buffers if b is not None] + grads,
                "optimizer_state": state}


def held_tensors(model, optimizer=None) -> dict[str, list[torch.Tensor]]:
    """What a DataParallel ``model`` (and ``optimizer``'s state) holds now, by kind (see ``held_tensors``)."""
    module, reducer, zero = model.module, model._reducer, model._zero
    held: dict[str, list[torch.Tensor]] = {"parameters": [p for p in module.parameters()],
                                           "gradients": [p.grad for p in module.parameters() if p.grad is not None],
                                           "optimizer_state": [], "buffers": []}
    if zero is not None:
        for kind, tensors in zero.held_tensors().items():
            held[kind].extend(tensors)
    elif optimizer is not None:
        held["optimizer_state"] = [value for entry in optimizer.state.values() for value in entry.values()
                                   if isinstance(value, torch.Tensor)]
    held["buffers"] = [bucket.flat for bucket in reducer.buckets] + list(model.comm.workspace.tensors())
    return held
