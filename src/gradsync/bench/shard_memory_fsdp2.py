"""``bench memory``'s FSDP2 peer: PyTorch's ``fully_shard`` per unit then on the root, its bytes, its full tensors.

FSDP2 (``torch.distributed.fsdp.fully_shard``; Zhao et al. 2023, "PyTorch
FSDP", arXiv 2304.11277, per-parameter sharding on ``DTensor``) is applied as
its documentation recommends for a transformer: ``fully_shard`` on each block,
then on the root module, over a 1-D CPU ``DeviceMesh`` of the default group
(Gloo here), with its defaults (``reshard_after_forward=True``, which FSDP2
turns off for the root, no mixed precision, no offload); the optimizer is built
on the sharded parameters afterwards. Every parameter is then a ``DTensor``
sharded on dim 0, each rank's shard padded to ``ceil(dim0 / world_size)`` rows.

FSDP2 picks its gradient reduction by dtype (``_get_gradient_divide_factors``):
float32 and bfloat16 reduce-scatter with ``ReduceOp.AVG``, float64 with a
SUM between a pre- and a post-division. The bench's parameter check runs in
float64, so :func:`gradient_check` checks the float32 reduction the timed steps
use: FSDP2's reduced gradient against the mean of every rank's local gradient.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from gradsync.bench.shard_memory_models import BenchModel, loss_of, make_batch
from gradsync.parallel.memory import count_bytes, state_tensors

GRADIENT_RTOL, GRADIENT_ATOL = 1e-5, 1e-6  # the parameter check's tolerances


def units(module: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` wraps before the root: the gpt's blocks (``module.blocks``), else every
    ``nn.Linear`` (the MLP's layers)."""
    blocks = getattr(module, "blocks", None)
    if blocks is not None:
        return list(blocks)
    return [child for child in module.modules() if isinstance(child, nn.Linear)]


def fully_shard_model(module: nn.Module, gradient_divide_factor: float | None = None) -> nn.Module:
    """``module`` sharded in place by FSDP2: ``fully_shard`` on each of :func:`units`, then on ``module``.

    Collective: every rank of the default group, the same module. ``gradient_divide_factor`` (None: FSDP2's
    default, the world size, i.e. the mean) is passed to ``set_gradient_divide_factor`` together with
    ``set_force_sum_reduction_for_comms(True)`` (a factor other than the world size is otherwise a
    ``PREMUL_SUM``, which Gloo lacks); 1.0 sums the gradients, the failure the bench's check exists to
    catch. Returns ``module`` (now an ``FSDPModule``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # a 1-D mesh over all ranks: the default group
    for unit in units(module):
        fully_shard(unit, mesh=mesh)
    fully_shard(module, mesh=mesh)
    if gradient_divide_factor is not None:
        for child in module.modules():
            if hasattr(child, "set_gradient_divide_factor"):
                child.set_gradient_divide_factor(gradient_divide_factor)
                child.set_force_sum_reduction_for_comms(True)
    return module


def local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a ``DTensor`` (``to_local()``, a view of FSDP2's padded shard); others unchanged."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full_tensors(tensors) -> list[torch.Tensor]:
    """Every tensor whole: a ``DTensor``'s ``full_tensor()`` (an all-gather: collective, same order on every
    rank), others as they are."""
    return [tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor for tensor in tensors]


def _param_groups(model: nn.Module) -> list:
    """FSDP2's parameter groups, one per ``fully_shard`` call (private API: ``FSDPState._fsdp_param_groups``)."""
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for child in model.modules():
        if isinstance(child, FSDPModule):
            state = child._get_fsdp_state()
            found = getattr(state, "_fsdp_param_groups", None)
            if found is None:
                raise ValueError("torch FSDP2's state has no _fsdp_param_groups: cannot count its unsharded "
                                 "parameters with this torch version")
            groups += found
    return groups


def _comm_buffers(groups: list) -> list[torch.Tensor]:
    """The communication buffers FSDP2 holds between its collectives, where it keeps them: a group's pending
    all-gather output, the all-gather kept for the next copy-in, the reduce-scatter inputs kept for
    reuse, HSDP's all-reduce buffer and a partial reduction (accumulation without reducing)."""
    found = []
    for group in groups:
        result = getattr(group, "_all_gather_result", None)
        found.append(None if result is None else result.all_gather_output)
        found.append(getattr(group, "_partial_reduce_output", None))
        reduce_state = getattr(group, "_all_reduce_state", None)
        found.append(None if reduce_state is None else reduce_state.all_reduce_input)
        context = getattr(group, "comm_ctx", None)
        kept = getattr(context, "all_gather_state", None)
        found.append(None if kept is None else kept.all_gather_result.all_gather_output)
        found += [state.reduce_scatter_input for state in getattr(context, "reduce_scatter_states", [])]
    return found


def fsdp2_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What a rank of FSDP2 holds now, as :func:`gradsync.parallel.memory.count_bytes` (each storage once).

    * parameters: each parameter's local shard (its whole padded storage, ``ceil(dim0 / world_size)`` rows),
      plus the unsharded parameters alive now (each ``FSDPParam``'s all-gather output, padded; a resharded
      one has freed its storage and counts 0): after forward, the root's (FSDP2 keeps the root unsharded
      for backward), none after backward or the step;
    * gradients: the local shards of ``.grad`` (views of each group's reduce-scatter output, counted whole),
      plus unsharded gradients: those kept for accumulation, and inside backward those autograd has
      accumulated into the unsharded parameters of a unit not yet reduce-scattered;
    * optimizer state: the local shards of the optimizer's state tensors (and its ``step`` scalars);
    * buffers: the communication buffers it holds between collectives (:func:`_comm_buffers`).

    Raises:
        ValueError: FSDP2's private state is not where this torch version is expected to keep it.
    """
    groups = _param_groups(model)
    fsdp_params = [fsdp_param for group in groups for fsdp_param in group.fsdp_params]
    # While a unit is unsharded its module holds the unsharded parameters: the shards are each FSDPParam's
    sharded = [fsdp_param.sharded_param for fsdp_param in fsdp_params] + list(model.parameters())
    unsharded = [tensor for fsdp_param in fsdp_params for tensor in fsdp_param.all_gather_outputs]
    accumulated = [getattr(fsdp_param, "unsharded_accumulated_grad", None) for fsdp_param in fsdp_params]
    in_backward = [getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None) for fsdp_param in fsdp_params]
    return count_bytes({"parameters": [local(param) for param in sharded] + unsharded,
                        "gradients": [local(param.grad) for param in sharded] + accumulated + in_backward,
                        "optimizer_state": [local(tensor) for tensor in state_tensors(optimizer)],
                        "buffers": _comm_buffers(groups)})


def gradient_check(spec: BenchModel, initial: nn.Module, gradient_divide_factor: float | None = None) -> dict:
    """FSDP2's reduced gradient against data parallelism's, in float32, after one backward from ``initial``.

    The reference: a plain copy of ``initial`` computes this rank's gradient on this rank's batch
    (:func:`make_batch`), summed over ranks with ``torch.distributed.all_reduce`` and divided by the world
    size. FSDP2 (:func:`fully_shard_model` of another copy) runs the same forward and backward; its
    ``.grad`` are gathered whole. Collective: every rank of the default group.

    Returns (the same on every rank): ``equal`` (allclose, rtol 1e-5, atol 1e-6, on every rank) and
    ``max_abs_diff`` (the largest difference over ranks).
    """
    inputs, targets = make_batch(spec, dist.get_rank())
    plain = copy.deepcopy(initial).float()
    loss_of(plain(inputs), targets).backward()
    reference = [param.grad for param in plain.parameters()]
    for grad in reference:
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    sharded = fully_shard_model(copy.deepcopy(initial).float(), gradient_divide_factor)
    loss_of(sharded(inputs), targets).backward()
    grads = full_tensors([param.grad for param in sharded.parameters()])
    equal = all(torch.allclose(mine, theirs, rtol=GRADIENT_RTOL, atol=GRADIENT_ATOL)
                for mine, theirs in zip(grads, reference))
    diff = max(float((mine - theirs).abs().max()) for mine, theirs in zip(grads, reference))
    verdict = torch.tensor([float(equal), -diff], dtype=torch.float64)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    return {"equal": bool(verdict[0] > 0), "max_abs_diff": -float(verdict[1])}
