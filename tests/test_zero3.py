"""ZeRO-3's own behaviour: which units are chosen, that a unit is whole only while it runs, and what reads
the parameters outside a forward sees (the equivalence with unsharded training is in test_zero.py)."""

from __future__ import annotations

import copy

import torch.utils.checkpoint

import pytest
import torch
from torch import nn

import gradsync
from _dist import run_threads
from gradsync.parallel.units import choose_units
from gradsync.train.gpt import GPT

torch.set_num_threads(1)


def test_the_size_policy_makes_one_unit_per_gpt_block_and_keeps_the_tied_head_in_the_root():
    model = GPT(width=32, depth=3, heads=2, context=8, vocab_size=50)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    units = choose_units(model, max_unit_numel=block)
    assert [unit.name for unit in units] == ["blocks.2", "blocks.1", "blocks.0", ""]
    assert [unit.numel for unit in units[:3]] == [block] * 3
    names = [name for name, _ in model.named_parameters()]
    root = {names[i] for i in units[-1].params}
    assert "token.weight" in root and not any(name.startswith("blocks.") for name in root)
    assert sum(unit.numel for unit in units) == sum(p.numel() for p in model.parameters())


class _TwoTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.b = nn.Sequential(nn.Linear(4, 4))
        self.b[0].weight = self.a[1].weight  # tied across two named units

    def forward(self, x):
        return self.b(self.a(x))


def test_a_weight_tied_across_two_units_lives_in_their_common_ancestor():
    model = _TwoTowers()
    units = {unit.name: unit for unit in choose_units(model, units=["a.1", "b.0"])}
    names = [name for name, _ in model.named_parameters()]
    assert {names[i] for i in units["a.1"].params} == {"a.1.bias"}
    assert {names[i] for i in units["b.0"].params} == {"b.0.bias"}
    assert "a.1.weight" in {names[i] for i in units[""].params}


def test_units_are_whole_only_while_they_run_and_eval_frees_everything():
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)], nn.Linear(16, 2))
    x, y = torch.randn(8, 16), torch.randn(8, 2)

    def body(comm):
        model = gradsync.DataParallel(copy.deepcopy(base), group=comm, shard="parameters", units=[nn.Sequential])
        optimizer = model.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        flat = model._zero.flat
        whole_at_forward = []
        for block in model.module[:4]:
            block.register_forward_pre_hook(lambda *_: whole_at_forward.append(sum(flat.gathered[:-1])))
        rows = slice(comm.rank * 4, comm.rank * 4 + 4)
        for _ in range(2):
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            after_backward = sum(flat.gathered)
            optimizer.step()
            optimizer.zero_grad()
        shape_outside = tuple(model.module[0][0].weight.shape)
        with torch.no_grad():
            model(x[rows])
        after_eval = sum(flat.gathered)
        with model.full_parameters():
            whole = [p.detach().clone() for p in model.module.parameters()]
        return whole_at_forward, after_backward, shape_outside, after_eval, whole

    results = run_threads(2, body)
    for whole_at_forward, after_backward, shape_outside, after_eval, _ in results:
        # first forward: no prefetch (order not yet known), then the running unit and the prefetched one
        assert whole_at_forward[:4] == [1, 1, 1, 1] and whole_at_forward[4:] == [2, 2, 2, 1] * 2  # and the eval forward
        assert after_backward == 0 and after_eval == 0 and shape_outside == (0,)
    reference = copy.deepcopy(base)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    for _, _, _, _, whole in results:
        for got, want in zip(whole, reference.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_loads_every_ranks_chunk():
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    other = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)).state_dict()

    def body(comm):
        model = gradsync.DataParallel(copy.deepcopy(base), group=comm, shard="parameters", units=["0"])
        model.module.load_state_dict(other)
        state = model.module.state_dict()
        return {name: tensor.clone() for name, tensor in state.items()}

    for state in run_threads(2, body):
        for name, tensor in other.items():
            assert torch.equal(state[name], tensor), name


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def test_activation_checkpointing_recomputes_a_unit_while_it_is_whole():
    torch.manual_seed(2)
    base = _Checkpointed()
    x, y = torch.randn(8, 8), torch.randn(8, 2)

    def body(comm):
        model = gradsync.DataParallel(copy.deepcopy(base), group=comm, shard="parameters",
                                      units=["blocks.0", "blocks.1", "blocks.2"])
        optimizer = model.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        rows = slice(comm.rank * 4, comm.rank * 4 + 4)
        for _ in range(2):
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
            optimizer.zero_grad()
        with model.full_parameters():
            return [p.detach().clone() for p in model.module.parameters()]

    reference = copy.deepcopy(base)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    for whole in run_threads(2, body):
        for got, want in zip(whole, reference.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
