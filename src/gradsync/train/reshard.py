"""A checkpoint's per-rank state mapped from world size N to M: pure functions of the old ranks' states.

Used when a job resumes at another world size (``resume.load_latest``) and
by anything that changes the world between steps. ``states[r]`` is old rank
``r``'s :func:`~gradsync.train.resume.rank_state` dict; the result's entry
``r'`` is what new rank ``r'`` loads. What happens to each part:

- **RNG streams**: ranks in both worlds keep theirs; a new rank gets a fresh
  stream seeded from ``(seed, rank)`` (never a copy of another rank's); the
  streams of dropped ranks are discarded.
- **Error-feedback residuals** (TopK, PowerSGD, OneBit's worker side): the
  update applies the mean over ranks of ``g_r + e_r``, so every new rank gets
  the mean of the old ranks' residuals, and ``sum(e')/M == sum(e)/N``: the
  pending error is kept, and no residual is applied twice. OneBit's server
  residuals (each entry held by the rank owning its chunk, which depends on
  the world size) are added to that mean and start empty: ``mean(worker) +
  sum(server)`` is the same pending error. PowerSGD's Q (its warm start,
  equal on every rank after its all-reduce) and the warm-up step counters
  (equal on every rank) are rank 0's.
- **Epoch running loss**: new rank 0 holds the old ranks' summed loss and
  step count, the others none, so the epoch's train loss stays the mean over
  every rank's steps; with ``deterministic`` every rank's loss is already the
  global batch's, and rank 0's is kept on every rank.
- **Counters** (times, bytes): ranks in both keep theirs; a new rank counts from zero.
- **Local SGD**: every rank starts from the mean of the old replicas (an
  average at the checkpoint; ``local_steps`` 0); optimizer state: ranks in
  both keep theirs, a new rank gets the old ranks' elementwise mean.
- **DiLoCo's outer state** (equal on every rank: the global parameters, the
  outer momentum, the round's position and the averaged results in flight)
  is rank 0's; what is per rank is linear in the replicas, so it is the old
  ranks' mean as the replicas are: each in-flight fragment's own
  pseudo-gradient, and the worker residuals with the chunk owners' server
  residuals folded in (``mean(worker) + sum(server)``, as OneBit's).
"""

from __future__ import annotations

import torch

from gradsync.train.rng import fresh_rng_state


def mean_tensors(parts: list[dict]) -> dict:
    """``{name: mean over parts}`` of same-shaped tensors; a name missing from a part counts as zeros.

    Raises:
        ValueError: no parts.
    """
    if not parts:
        raise ValueError("no states to re-shard: the old world has at least one rank")
    names = list(dict.fromkeys(name for part in parts for name in part))
    means = {}
    for name in names:
        like = next(part[name] for part in parts if name in part)
        total = torch.zeros_like(like, dtype=torch.float64)
        for part in parts:
            if name in part:
                total += part[name].to(torch.float64)
        means[name] = (total / len(parts)).to(like.dtype)
    return means


def reshard_compressor(states: list[dict]) -> dict:
    """The compressor state every new rank loads, from the old ranks' ``Compressor.state_dict()`` outputs.

    Raises:
        ValueError: a state key without a re-shard rule (named).
    """
    first = states[0]
    unknown = set(first) - {"steps", "residual", "worker", "server", "q"}
    if unknown:
        raise ValueError(f"compressor state {sorted(unknown)} has no rule for another world size")
    new = {"steps": dict(first["steps"])}
    if "residual" in first:
        new["residual"] = mean_tensors([state["residual"] for state in states])
    if "worker" in first:  # OneBit: the server's share of the pending error moves to the workers'
        worker = mean_tensors([state["worker"] for state in states])
        server = _sum_exact([state["server"] for state in states])
        new["worker"] = {name: value + server[name] if name in server else value for name, value in worker.items()}
        new["server"] = {}
    if "q" in first:
        new["q"] = {name: q.clone() for name, q in first["q"].items()}
    return new


def _sum_exact(parts: list[dict]) -> dict:
    """``{name: sum over parts}`` summed in float64, in each tensor's dtype (OneBit's server residuals are
    disjoint: one rank's value and zeros per entry, so the sum is exact)."""
    totals: dict = {}
    dtypes: dict = {}
    for part in parts:
        for name, value in part.items():
            dtypes.setdefault(name, value.dtype)
            totals[name] = totals.get(name, torch.zeros_like(value, dtype=torch.float64)) + value.to(torch.float64)
    return {name: total.to(dtypes[name]) for name, total in totals.items()}


def reshard_rng(rngs: list[dict], new_world_size: int, seed: int) -> list[dict]:
    """New rank r's RNG state: old rank r's if it existed, else a fresh stream from ``(seed, r)``."""
    return [rngs[rank] if rank < len(rngs) else fresh_rng_state(seed, rank) for rank in range(new_world_size)]


def reshard_epoch_loss(losses: list[torch.Tensor], new_world_size: int, deterministic: bool) -> list[torch.Tensor]:
    """New ranks' ``(loss sum, steps)`` float64 ``(2,)`` of the epoch so far (see the module's rules)."""
    if deterministic:
        return [losses[0].clone() for _ in range(new_world_size)]
    total = torch.stack([loss.to(torch.float64) for loss in losses]).sum(0)
    return [total if rank == 0 else torch.zeros(2, dtype=torch.float64) for rank in range(new_world_size)]


def mean_optimizer_state(states: list[dict]) -> dict:
    """An optimizer ``state_dict`` whose floating-point per-parameter tensors are the old ranks' mean."""
    first = states[0]
    merged = {}
    for index, entry in first["state"].items():
        merged[index] = {key: mean_tensors([{key: s["state"][index][key]} for s in states])[key]
                         if isinstance(value, torch.Tensor) and value.is_floating_point() else value
                         for key, value in entry.items()}
    return {"state": merged, "param_groups": first["param_groups"]}


def mean_model(models: list[dict]) -> dict:
    """A model ``state_dict``: floating-point entries the old replicas' mean, others (counters) rank 0's."""
    floating = [{k: v for k, v in model.items() if v.is_floating_point()} for model in models]
    return {**models[0], **mean_tensors(floating)}


def reshard_rank_states(states: list[dict], new_world_size: int, seed: int, deterministic: bool = False) -> list[dict]:
    """The ``new_world_size`` per-rank states that continue the run the old ranks' ``states`` describe.

    Args:
        states: old rank r's ``rank_state`` dict at index r (N >= 1 of them).
        new_world_size: M >= 1.
        seed: the run's seed (fresh RNG streams of new ranks).
        deterministic: step losses are the global batch's on every rank.

    Returns:
        M dicts of the same form. With M == N the states are returned as they are.

    Raises:
        ValueError: no states, M < 1, or a compressor state without a rule.
    """
    if isinstance(new_world_size, bool) or not isinstance(new_world_size, int) or new_world_size < 1:
        raise ValueError(f"new world size must be an int >= 1, got {new_world_size!r}")
    if not states:
        raise ValueError("no states to re-shard: the old world has at least one rank")
    if new_world_size == len(states):
        return list(states)
    rngs = reshard_rng([state["rng"] for state in states], new_world_size, seed)
    losses = reshard_epoch_loss([state["epoch_loss"] for state in states], new_world_size, deterministic)
    compression = reshard_compressor([s["compression"] for s in states]) if "compression" in states[0] else None
    local_sgd = "model" in states[0]
    if local_sgd:
        model = mean_model([s["model"] for s in states])
        optimizer = mean_optimizer_state([s["optimizer"] for s in states])
    new = []
    for rank in range(new_world_size):
        kept = states[rank] if rank < len(states) else None
        own = {"rng": rngs[rank], "epoch_loss": losses[rank],
               "times": dict(kept["times"]) if kept else {name: 0.0 for name in states[0]["times"]},
               **{name: int(kept[name]) if kept else 0 for name in ("step_bytes_sent", "bytes_sent", "bytes_received")}}
        if compression is not None:
            own["compression"] = compression
        if local_sgd:
            own.update(model=model, optimizer=kept["optimizer"] if kept else optimizer, local_steps=0)
        if "local_sgd" in states[0]:
            own["local_sgd"] = reshard_local_sgd([s["local_sgd"] for s in states], kept and kept["local_sgd"])
        new.append(own)
    return new


def _ranks(first: int, last: int, singular: str, plural: str) -> str:
    return f"rank {first} {singular}" if first == last else f"ranks {first}-{last} {plural}"


def world_change(old_world_size: int, new_world_size: int, config, samples_in_epoch: int, epoch: int,
                 num_train: int, steps_left: int) -> dict:
    """What a resume at another world size does, for the resumed run's first line and its event.

    ``config``: the run's :class:`~gradsync.train.config.TrainConfig`; ``steps_left``: optimizer steps of
    the epoch still to do. Returns ``{"world_size_from", "world_size_to", "sample", "line"}``.
    """
    old, new = old_world_size, new_world_size
    parts = [f"data position kept (sample {samples_in_epoch} of {num_train} in epoch {epoch}, "
             f"{steps_left} steps left in it)"]
    if config.deterministic:
        parts.append(f"global batch {config.global_batch_size} and --deterministic: the trajectory is unchanged")
    elif config.global_batch_size is not None:
        parts.append(f"global batch stays {config.global_batch_size} (--global-batch-size)")
    else:
        parts.append(f"global batch now {config.samples_per_step(new)} samples, was {config.samples_per_step(old)} "
                     f"(--batch-size x --accumulate x workers: the trajectory changes)")
    kept = _ranks(0, min(old, new) - 1, "keeps its own", "keep theirs")
    dropped = f"that of rank {new} is" if new == old - 1 else f"those of ranks {new}-{old - 1} are"
    other = (f"{dropped} dropped" if new < old
             else _ranks(old, new - 1, "starts a fresh one", "start fresh ones") + " from (seed, rank)")
    parts.append(f"per-rank RNG streams: {kept}, {other}")
    if config.mode == "local-sgd":
        parts.append(f"local-SGD replicas averaged over the {old} old ones; optimizer states: {kept}"
                     + (", " + _ranks(old, new - 1, "gets", "get") + " the old ranks' mean" if new > old else ""))
    if config.compression in ("onebit", "topk", "powersgd"):
        residuals = f"compressor residuals: every rank gets the mean of the {old} old ranks' (pending error kept"
        endings = {"onebit": ", the server residuals folded into them)",
                   "powersgd": "; PowerSGD's Q warm start kept, the same on every rank)"}
        residuals += endings.get(config.compression, ")")
        parts.append(residuals)
    return {"world_size_from": old, "world_size_to": new, "sample": samples_in_epoch,
            "line": f"written by {old} workers, now {new}: " + "; ".join(parts)}


def reshard_local_sgd(states: list[dict], kept: dict | None) -> dict:
    """A new rank's ``LocalSGD.sync_state_dict()`` from the old ranks' (``kept``: its own old one, if any):
    plain averaging restarts its H steps (the replicas were averaged); DiLoCo's outer state per the
    module's rules; the byte counter is the rank's own (0 for a new rank)."""
    first = states[0]
    new = {"local_steps": 0, "averages": int(first["averages"]),
           "payload_nbytes": int(kept["payload_nbytes"]) if kept else 0, "outer": None}
    if first["outer"] is None:
        return new
    outers = [state["outer"] for state in states]
    outer = {**outers[0], "payload_nbytes": int(kept["outer"]["payload_nbytes"]) if kept else 0}
    worker = mean_tensors([o["worker_residual"] for o in outers]) if outers[0]["worker_residual"] else {}
    server = _sum_exact([o["server_residual"] for o in outers])
    outer["worker_residual"] = {name: value + server[name] if name in server else value
                                for name, value in worker.items()}
    outer["server_residual"] = {}
    outer["pending"] = [{**pending, "own_delta": mean_tensors([{"d": o["pending"][i]["own_delta"]}
                                                               for o in outers])["d"]}
                        for i, pending in enumerate(outers[0]["pending"])]
    new["local_steps"] = int(first["local_steps"])  # the round's position: the fragments' schedule goes on
    return {**new, "outer": outer}
