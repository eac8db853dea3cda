"""DataParallel's ``join()`` steps: the exchange of who still has data, shadowing, the final model sync.

A rank that has run out of inputs answers the others' collectives with zeros
(DDP's ``join``, Horovod's ``hvd.join``); under ZeRO it also steps its shard
with the others' average and joins the parameters' all-gather (at ZeRO-3,
every rank gathers every unit at each forward inside ``join``: the joined
rank has no forward to follow unit by unit).
"""

from __future__ import annotations

import time

import torch

from gradsync.collectives import ops as collectives
from gradsync.errors import GradsyncError
from gradsync.parallel.replicas import broadcast_tensors


def join_step(model, active: bool, will_sync: bool, sync_buffers: bool) -> bool:
    """``model``'s (a DataParallel inside ``join()``) exchange at a forward; a joined rank then shadows the
    iteration. Returns whether any rank is active."""
    started = time.perf_counter()
    world_size = model.comm.world_size
    state = torch.zeros(world_size + 2, dtype=torch.int64)  # active ranks, syncing grads, syncing buffers
    if active:
        state[model.comm.rank] = 1
        state[world_size] = int(will_sync)
        state[world_size + 1] = int(sync_buffers)
    collectives.all_reduce(state, model.comm, op="sum", algorithm=model.algorithm)
    active_ranks = [rank for rank in range(world_size) if state[rank] > 0]
    syncing, buffers = int(state[world_size]), int(state[world_size + 1])
    model._other_comm_seconds += time.perf_counter() - started
    if not active_ranks:
        return False
    if syncing not in (0, len(active_ranks)) or buffers not in (0, len(active_ranks)):
        raise GradsyncError(f"DataParallel.join(): in the same iteration {syncing} of the "
                            f"{len(active_ranks)} active ranks synchronise gradients ({buffers} run "
                            f"with grad enabled) and the others do not (no_sync() or no_grad); every "
                            f"rank must make the same choice")
    model._last_active = active_ranks
    model._buffer_src = active_ranks[0]
    model._reducer.set_divisor(len(active_ranks))
    if not active:
        if buffers:
            model._sync_buffers()
            if model._debug is not None:  # the active ranks' debug exchange follows their buffers'
                model._debug.shadow()
        if model.shard == "parameters":  # the active ranks' forward gathers every unit (join keeps them)
            model._zero.flat.gather_all()
            model._zero.flat.free_all()
        if syncing and model._zero is not None:
            model._zero.shadow(lambda: model._reducer.shadow_round(len(active_ranks)))
        elif syncing:
            model._reducer.shadow_round(len(active_ranks))
    return True

def sync_final_model(model) -> None:
    """After every rank left ``join()``: the last active rank's parameters and buffers to every rank."""
    if model._last_active is None:
        return  # no rank ran a forward inside the block: nothing changed
    started = time.perf_counter()
    # sharded parameters: each rank stepped its own chunk with the same average; only buffers differ
    params = [] if model.shard == "parameters" else [param.data for param in model.module.parameters()]
    tensors = params + list(model.module.buffers())
    broadcast_tensors(tensors, model.comm, src=model._last_active[0], verify=False)
    model._other_comm_seconds += time.perf_counter() - started
