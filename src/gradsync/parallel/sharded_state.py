"""Sharded optimizer state and the whole one: slicing a full state dict, consolidating the ranks' shards.

A full (unsharded) optimizer state dict is ``optimizer.state_dict()`` of the optimizer built over the whole
parameters: ``state`` keyed by the parameter's position over all groups, ``param_groups`` listing those
positions. A shard (:meth:`ShardedOptimizer.state_dict`) is the same format over this rank's pieces, plus
``"shard"``: ``{"world_size", "rank", "group_sizes", "pieces": [[name, full_position, param_start,
param_stop, param_shape], ...]}`` in piece-position order. Per-element state (momentum, Adam's moments: tensors with the
parameter's element count) is sliced and stitched by ``param_start:param_stop``; anything else (Adam's
``step`` count, a scalar) is the same on every piece and taken from any. This is how a checkpoint written at
one world size and shard level resumes at another.
"""

from __future__ import annotations

import copy

import torch


def _full_positions(full_groups: list[list[torch.Tensor]]) -> dict[int, int]:
    """id(parameter) -> its position over all groups of the full optimizer."""
    positions, position = {}, 0
    for params in full_groups:
        for param in params:
            positions[id(param)] = position
            position += 1
    return positions


def piece_entries(sharded, names: dict[int, str]) -> list[list]:
    """``[name, full_position, param_start, param_stop, param_shape]`` of each piece in the optimizer's
    groups, in the order torch numbers them (``sharded``: a ShardedOptimizer; ``names``: id(param) -> name)."""
    positions = _full_positions(sharded.full_groups)
    pieces = sharded.shards.flat.pieces
    entries = []
    for params in sharded.full_groups:
        for param in params:
            k = sharded.piece_of.get(id(param))
            if k is not None:
                piece = pieces[k]
                entries.append([names[id(param)], positions[id(param)], piece.param_start, piece.param_stop,
                                list(sharded.shards.shapes[id(param)])])
    return entries


def _slice_value(key: str, value, shape: torch.Size, start: int, stop: int):
    """A per-element state tensor (the parameter's ``shape``; for a 0-dim parameter any 0-dim entry but
    torch's ``step`` count) cut to the piece; anything else copied whole."""
    per_element = isinstance(value, torch.Tensor) and value.shape == shape and (len(shape) > 0 or key != "step")
    if per_element:
        return value.reshape(-1)[start:stop].clone()
    return copy.deepcopy(value)


def shard_of_full(full: dict, sharded) -> dict:
    """This rank's shard (the wrapped optimizer's format) of a full optimizer state dict.

    Raises:
        ValueError: ``full`` does not have the optimizer's groups.
    """
    groups = full.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(sharded.full_groups) or \
            [len(g["params"]) for g in groups] != [len(params) for params in sharded.full_groups]:
        raise ValueError("ShardedOptimizer.load_state_dict: the state dict's parameter groups differ from the "
                         "optimizer's (number of groups or of parameters per group)")
    state, out_groups, position = {}, [], 0
    for saved, params in zip(groups, sharded.full_groups):
        listed = []
        for key, param in zip(saved["params"], params):
            k = sharded.piece_of.get(id(param))
            if k is not None:
                piece = sharded.shards.flat.pieces[k]
                if key in full["state"]:
                    shape = sharded.shards.shapes[id(param)]  # ZeRO-3's freed parameters have none
                    state[position] = {name: _slice_value(name, value, shape, piece.param_start,
                                                          piece.param_stop)
                                       for name, value in full["state"][key].items()}
                listed.append(position)
                position += 1
        out_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": listed})
    return {"state": state, "param_groups": out_groups}


def consolidate(shards: list[dict]) -> dict:
    """One full optimizer state dict from every rank's :meth:`ShardedOptimizer.state_dict` (any order).

    Raises:
        ValueError: the shards are not one world's (world sizes differ, a rank missing or repeated).
    """
    sizes = {shard["shard"]["world_size"] for shard in shards}
    ranks = sorted(shard["shard"]["rank"] for shard in shards)
    if len(sizes) != 1 or ranks != list(range(next(iter(sizes)))):
        raise ValueError(f"consolidate needs one shard per rank of one world, got ranks {ranks} of world sizes "
                         f"{sorted(sizes)}")
    state: dict[int, dict] = {}
    for shard in shards:
        for position, (_name, full, start, stop, shape) in enumerate(shard["shard"]["pieces"]):
            for key, value in shard["state"].get(position, {}).items():
                entry = state.setdefault(full, {})
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == stop - start:
                    whole = entry.setdefault(key, torch.zeros(shape, dtype=value.dtype))
                    whole.view(-1)[start:stop] = value.reshape(-1)
                else:
                    entry.setdefault(key, copy.deepcopy(value))
    return {"state": state, "param_groups": _full_groups(shards[0])}


def _full_groups(shard: dict) -> list[dict]:
    """The full optimizer's groups: hyperparameters from a shard, positions from the pieces' entries."""
    sizes = shard["shard"].get("group_sizes")
    groups, first = [], 0
    for group, size in zip(shard["param_groups"], sizes):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(first, first + size))})
        first += size
    return groups
