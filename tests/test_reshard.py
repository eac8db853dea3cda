"""The pure functions that move a checkpoint from world size N to M: data position, residuals, RNG, rank states.

No processes: the data order is compared with torch's own ``DistributedSampler``,
the residual identity ``sum(e')/M == sum(e)/N`` is checked on random tensors, and
the rank states are built as ``resume.rank_state`` writes them.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler

from gradsync.train import resume
from gradsync.train.config import TrainConfig
from gradsync.train.global_batch import epoch_permutation
from gradsync.train.position import EpochOrder, order_steps, rank_steps, reorder, steps_taken
from gradsync.train.reshard import (mean_tensors, reshard_compressor, reshard_epoch_loss, reshard_rank_states,
                                    reshard_rng, world_change)
from gradsync.train.rng import fresh_rng_state, rng_state, set_rng_state, stream_seed


def _sampler_steps(num_train: int, world_size: int, rank: int, batch_size: int, accumulate: int, seed: int,
                   epoch: int) -> list[list[list[int]]]:
    sampler = DistributedSampler(range(num_train), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    batches = list(BatchSampler(sampler, batch_size, drop_last=True))
    steps = len(batches) // accumulate
    return [batches[i * accumulate:(i + 1) * accumulate] for i in range(steps)]


@pytest.mark.parametrize("num_train, world_size, batch_size, accumulate", [
    (100, 1, 8, 1), (100, 3, 8, 2), (101, 4, 5, 3), (7, 3, 1, 1), (2, 3, 1, 1)])
def test_order_from_sample_0_is_distributed_samplers(num_train, world_size, batch_size, accumulate):
    permutation = epoch_permutation(num_train, seed=5, epoch=2)
    for rank in range(world_size):
        ours = [[batch.tolist() for batch in step]
                for step in rank_steps(permutation, EpochOrder(), world_size, rank, batch_size, accumulate)]
        assert ours == _sampler_steps(num_train, world_size, rank, batch_size, accumulate, seed=5, epoch=2)
    assert order_steps(num_train, EpochOrder(), world_size, batch_size, accumulate) == len(ours)


def _consumed(permutation, order, world_size, batch_size, accumulate, steps: range) -> list[int]:
    ids = []
    for rank in range(world_size):
        rank_order = rank_steps(permutation, order, world_size, rank, batch_size, accumulate)
        ids += [i for step in steps for batch in rank_order[step] for i in batch.tolist()]
    return ids


@pytest.mark.parametrize("old, new, accumulate", [(4, 2, 1), (2, 3, 2), (3, 5, 1), (1, 4, 2)])
def test_after_k_steps_the_ranks_consumed_the_prefix_and_another_world_continues_it(old, new, accumulate):
    """k steps at ``old`` = the permutation's first k*b*a*old samples; ``new`` continues from there, no repeats."""
    num_train, batch_size, k = 997, 6, 5
    permutation = epoch_permutation(num_train, seed=1, epoch=0)
    before = _consumed(permutation, EpochOrder(), old, batch_size, accumulate, range(k))
    offset = k * batch_size * accumulate * old
    assert sorted(before) == sorted(permutation[:offset].tolist())
    order = reorder(EpochOrder(), offset, old, new)
    assert order == EpochOrder(offset)
    rest = order_steps(num_train, order, new, batch_size, accumulate)
    after = _consumed(permutation, order, new, batch_size, accumulate, range(rest))
    used = before + after
    assert len(set(used)) == len(used) and sorted(used) == sorted(permutation[:len(used)].tolist())
    assert num_train - len(used) < batch_size * accumulate * new  # only the last partial global batch is left
    assert steps_taken(offset + 2 * batch_size * accumulate * new, order, batch_size * accumulate * new) == 2


def test_the_same_world_size_keeps_its_order_and_positions_must_be_whole_steps():
    assert reorder(EpochOrder(96), 160, 2, 2) == EpochOrder(96)
    with pytest.raises(ValueError, match="not a whole number of 32-sample steps"):
        steps_taken(100, EpochOrder(0), 32)


def test_positions_of_checkpoints_from_before_the_sample_offset_was_saved():
    """An old checkpoint knows steps only: 5 steps of 4 workers x 16 = sample 320; resumed by 2, a new order."""
    config = TrainConfig(batch_size=16)
    assert resume.data_position({"steps_in_epoch": 5}, config, 4, 4) == (320, 0)
    assert resume.data_position({"steps_in_epoch": 5}, config, 4, 2) == (320, 320)
    assert resume.data_position({"steps_in_epoch": 7, "samples_in_epoch": 256, "order_start": 96}, config, 2, 2) \
        == (256, 96)


# ---------------------------------------------------------------- residuals


def _residuals(world_size: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"0.weight": torch.randn(4, 3, generator=generator), "0.bias": torch.randn(4, generator=generator)}
            for _ in range(world_size)]


@pytest.mark.parametrize("old, new", [(4, 2), (2, 3), (3, 1)])
def test_residuals_keep_the_pending_error_mass(old, new):
    """Every new rank gets the old mean: sum over the new ranks / M == sum over the old ones / N."""
    states = [{"steps": {"0.weight": 9, "0.bias": 9}, "residual": e} for e in _residuals(old, seed=old)]
    resharded = [reshard_compressor(states) for _ in range(new)]
    for name in ("0.weight", "0.bias"):
        pending_before = sum(state["residual"][name] for state in states) / old
        pending_after = sum(state["residual"][name] for state in resharded) / new
        torch.testing.assert_close(pending_after, pending_before, rtol=0, atol=1e-6)
    assert resharded[0]["steps"] == {"0.weight": 9, "0.bias": 9}


def test_onebit_server_residuals_fold_into_the_workers_and_powersgd_q_is_kept():
    """OneBit: mean(worker') + sum(server') == mean(worker) + sum(server); PowerSGD: Q is rank 0's."""
    workers, servers = _residuals(4, seed=1), _residuals(4, seed=2)
    for rank, server in enumerate(servers):  # each rank holds the server residual of its own chunk only
        for tensor in server.values():
            keep = torch.zeros(tensor.numel(), dtype=torch.bool)
            keep[rank::4] = True
            tensor.view(-1)[~keep] = 0
    states = [{"steps": {}, "worker": w, "server": s} for w, s in zip(workers, servers)]
    new = reshard_compressor(states)
    assert new["server"] == {}
    for name in ("0.weight", "0.bias"):
        before = sum(w[name] for w in workers) / 4 + sum(s[name] for s in servers)
        torch.testing.assert_close(new["worker"][name], before, rtol=0, atol=1e-6)
    q = torch.randn(3, 2)
    powersgd = [{"steps": {"0.weight": 3}, "residual": e, "q": {"0.weight": q}} for e in _residuals(2, seed=3)]
    assert torch.equal(reshard_compressor(powersgd)["q"]["0.weight"], q)
    with pytest.raises(ValueError, match=r"\['momentum'\] has no rule"):
        reshard_compressor([{"steps": {}, "momentum": {}}])


def test_mean_counts_a_missing_name_as_zeros():
    means = mean_tensors([{"a": torch.tensor([2.0, 4.0])}, {}])
    assert torch.equal(means["a"], torch.tensor([1.0, 2.0]))


# ---------------------------------------------------------------- RNG streams and rank states


def test_rng_streams_kept_fresh_or_dropped():
    """Ranks in both keep theirs; a new rank's stream is (seed, rank)'s own, not another rank's."""
    old = [fresh_rng_state(7, 100 + rank) for rank in range(2)]
    grown = reshard_rng(old, 4, seed=7)
    assert grown[0] is old[0] and grown[1] is old[1]
    draws = []
    for state in grown:
        set_rng_state(state)
        draws.append(torch.rand(4))
    assert len({tuple(d.tolist()) for d in draws}) == 4  # four distinct streams
    set_rng_state(grown[3])
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(stream_seed(7, 3))))
    assert reshard_rng(old, 1, seed=7) == [old[0]]
    assert stream_seed(7, 3) != stream_seed(8, 3) and stream_seed(7, 3) != stream_seed(7, 2)


def _rank_state(rank: int, local_sgd: bool = False) -> dict:
    own = {"rng": rng_state(), "epoch_loss": torch.tensor([1.5 * (rank + 1), 4.0], dtype=torch.float64),
           "times": {"compute_s": float(rank), "comm_s": 0.5}, "step_bytes_sent": 10 * rank,
           "bytes_sent": 100 * rank, "bytes_received": 1000 * rank,
           "compression": {"steps": {"w": 4}, "residual": {"w": torch.full((2,), float(rank))}}}
    if local_sgd:
        own.update(model={"w": torch.full((2,), float(rank)), "count": torch.tensor(rank)}, local_steps=2,
                   optimizer={"state": {0: {"step": torch.tensor(4.0),
                                            "momentum_buffer": torch.full((2,), 2.0 * rank)}},
                              "param_groups": [{"lr": 0.1, "params": [0]}]})
    return own


def test_rank_states_shrink_and_grow():
    old = [_rank_state(rank, local_sgd=True) for rank in range(3)]
    assert reshard_rank_states(old, 3, seed=0) == old  # the same world size: as they are
    shrunk = reshard_rank_states(old, 2, seed=0)
    # the epoch's summed loss and steps survive the all-reduce at its end
    assert torch.equal(sum(s["epoch_loss"] for s in shrunk), sum(s["epoch_loss"] for s in old))
    assert [s["bytes_sent"] for s in shrunk] == [0, 100] and shrunk[1]["times"] == old[1]["times"]
    assert torch.equal(shrunk[1]["compression"]["residual"]["w"], torch.full((2,), 1.0))  # mean of 0, 1, 2
    assert torch.equal(shrunk[0]["model"]["w"], torch.full((2,), 1.0)) and int(shrunk[0]["model"]["count"]) == 0
    assert shrunk[1]["optimizer"] is old[1]["optimizer"] and shrunk[0]["local_steps"] == 0
    grown = reshard_rank_states(old, 5, seed=0)
    assert grown[4]["bytes_sent"] == 0 and grown[4]["times"] == {"compute_s": 0.0, "comm_s": 0.0}
    assert torch.equal(grown[4]["optimizer"]["state"][0]["momentum_buffer"], torch.full((2,), 2.0))
    assert torch.equal(grown[4]["epoch_loss"], torch.zeros(2, dtype=torch.float64))
    deterministic = reshard_epoch_loss([s["epoch_loss"] for s in old], 2, deterministic=True)
    assert all(torch.equal(loss, old[0]["epoch_loss"]) for loss in deterministic)
    with pytest.raises(ValueError, match="new world size must be an int >= 1"):
        reshard_rank_states(old, 0, seed=0)


def test_the_change_line_names_what_changed(capfd, tmp_path):
    config = TrainConfig(compression="powersgd", mode="sync")
    change = world_change(2, 4, config, 3200, 1, 16000, 40)
    assert change["line"] == (
        "written by 2 workers, now 4: data position kept (sample 3200 of 16000 in epoch 1, 40 steps left in it); "
        "global batch now 128 samples, was 64 (--batch-size x --accumulate x workers: the trajectory changes); "
        "per-rank RNG streams: ranks 0-1 keep theirs, ranks 2-3 start fresh ones from (seed, rank); compressor "
        "residuals: every rank gets the mean of the 2 old ranks' (pending error kept; PowerSGD's Q warm start "
        "kept, the same on every rank)")
    from gradsync.fault.events import EventLog, read_events
    from gradsync.train.state import TrainState

    resume.announce(TrainState(step=50), 120, "ckpt/step-000000050", EventLog(tmp_path), change)
    said = capfd.readouterr().err.splitlines()
    assert said == [f"gradsync: attempt 1: resuming from ckpt/step-000000050 (step 50 of 120) {change['line']}"]
    assert read_events(tmp_path)[-1]["world_size_from"] == 2
