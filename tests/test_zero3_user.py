"""ZeRO-3 as a new user meets it: a bad ``units=``, a forward reading another unit's parameter, an evaluation on
one rank only, and a ``--memory-limit-mib`` too small for any rank each get one clear line naming the cause."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradsync
from _cli import run_cli
from _dist import RankError, run_threads
from gradsync.hosts import memory_children
from gradsync.parallel.units import choose_units

torch.set_num_threads(1)
WRITABLE = memory_children.unavailable_reason()
needs_cgroups = pytest.mark.skipif(WRITABLE is not None, reason=f"no writable memory cgroup here: {WRITABLE}")


@pytest.mark.parametrize("units", [3, True, 1.5])
def test_units_that_is_no_list_is_refused_naming_units(units):
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(TypeError, match="units takes a list of submodule names"):
        choose_units(net, units=units)


class _ParentReads(nn.Module):
    """The parent's forward reads ``a.weight`` without calling ``a`` (as a tied projection written by hand)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(x @ self.a.weight.t()))


def _train(base, units, x, y, steps=2):
    def body(comm):
        model = gradsync.DataParallel(copy.deepcopy(base), group=comm, shard="parameters", units=units)
        optimizer = model.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        rows = slice(comm.rank * 4, comm.rank * 4 + 4)
        for _ in range(steps):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
        with model.full_parameters():
            return [p.detach().clone() for p in model.module.parameters()]
    return run_threads(2, body)


def test_a_forward_reading_another_units_parameter_names_it_and_the_fix_trains():
    torch.manual_seed(0)
    base, x, y = _ParentReads(), torch.randn(8, 4), torch.randn(8, 2)
    with pytest.raises(RankError) as caught:  # before: "size mismatch, got input (4), mat (4x4), vec (0)"
        _train(base, ["a", "b"], x, y)
    assert "GradsyncError" in str(caught.value) and "read parameter 'a.weight'" in str(caught.value)
    assert "unit 'a'" in str(caught.value) and "units=" in str(caught.value)
    reference = copy.deepcopy(base)  # the fix the message names: a.weight in the reading module's unit
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    for whole in _train(base, ["b"], x, y):
        for got, want in zip(whole, reference.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


class _AsksHarmlessThings(nn.Module):
    """Reads what a freed parameter answers correctly: its dtype and device, and hashes it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        first = next(self.parameters())
        assert first in set(self.a.parameters()) | set(self.b.parameters())
        return self.b(torch.tanh(self.a(x.to(device=first.device, dtype=first.dtype))))


def test_the_read_check_lets_dtype_device_and_hashing_through():
    torch.manual_seed(1)
    base, x, y = _AsksHarmlessThings(), torch.randn(8, 4), torch.randn(8, 2)
    reference = copy.deepcopy(base)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    for whole in _train(base, ["a", "b"], x, y):
        for got, want in zip(whole, reference.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(30)
def test_evaluating_on_one_rank_only_says_zero3_forwards_are_collective():
    torch.manual_seed(2)
    base = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), nn.Linear(4, 2))
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def body(comm):
        model = gradsync.DataParallel(copy.deepcopy(base), group=comm, shard="parameters", units=[nn.Linear])
        optimizer = model.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        rows = slice(comm.rank * 4, comm.rank * 4 + 4)
        for _ in range(3):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
            if comm.rank == 0:  # the usual "if rank == 0: evaluate(model)", fine unsharded
                with torch.no_grad():
                    model(x)

    with pytest.raises(RankError) as caught:  # before: "... does not fit the receive buffer ..." and nothing more
        run_threads(2, body, timeout_s=20, collective_timeout_s=5)
    assert "evaluation under no_grad included" in str(caught.value)


@needs_cgroups
@pytest.mark.timeout(60)
def test_a_memory_limit_below_what_any_rank_needs_is_refused_before_a_process_starts(tmp_path, capsys, monkeypatch):
    """--memory-limit-mib 1 used to start the ranks and have them OOM-killed (the rank's data and Python objects
    alone are 15-25 MiB, before the preflight could run); now the launcher's preflight refuses it, one line."""
    monkeypatch.setenv("GRADSYNC_DATA_DIR", str(tmp_path / "data"))
    result = run_cli(["train", "--model", "mlp", "--nproc", "2", "--shard", "parameters", "--memory-limit-mib", "1",
                      "--out", str(tmp_path / "run")], capsys)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode not in (0, None) and len(lines) == 1, result.stderr
    assert "gradsync preflight: --memory-limit-mib 1 is below the" in lines[0] and "--no-preflight" in lines[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()


def test_what_a_block_writes_inside_full_parameters_is_kept_as_at_the_other_levels():
    """Weight surgery inside ``model.full_parameters()`` (as FSDP's ``summon_full_params(writeback=True)``) used to
    be silently dropped at ZeRO-3 (the gathered copy was freed, the shards kept their old values)."""
    torch.manual_seed(3)
    base = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), nn.Linear(4, 2))
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def surgery(net):
        with torch.no_grad():
            net[1].weight.mul_(-2.0)
            net[0][0].bias.fill_(0.25)

    def body(comm):
        model = gradsync.DataParallel(copy.deepcopy(base), group=comm, shard="parameters", units=[nn.Linear])
        optimizer = model.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        with model.full_parameters():
            surgery(model.module)
        rows = slice(comm.rank * 4, comm.rank * 4 + 4)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        with model.full_parameters():
            return [p.detach().clone() for p in model.module.parameters()]

    reference = copy.deepcopy(base)
    surgery(reference)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.mse_loss(reference(x), y).backward()
    optimizer.step()
    for whole in run_threads(2, body):
        for got, want in zip(whole, reference.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
