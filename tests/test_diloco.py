"""DiLoCo: local SGD's outer rounds (outer Nesterov, compressed deltas with error feedback, fragments).

Thread ranks over :class:`~gradsync.transport.thread.ThreadWorld`. The
references are computed independently: single-process training on the
concatenated batch, ``torch.optim.SGD(nesterov=True)`` stepped on the
averaged pseudo-gradient, the error-feedback identity summed over rounds,
and the linear sum of fixed inner updates.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from _dist import RankError, run_threads
from gradsync.parallel.outer_sync import OuterSync
from gradsync.transport.thread import ThreadWorld

IN_FEATURES, HIDDEN, CLASSES, BATCH, LR = 5, 7, 3, 4, 0.1


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def make_data(world_size: int, steps: int):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(steps, world_size, BATCH, IN_FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (steps, world_size, BATCH), generator=generator)
    return x, y


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def set_flat(module: nn.Module, values: torch.Tensor) -> None:
    """Copy ``values`` into the parameters (``vector_to_parameters`` would make them views of ``values``)."""
    with torch.no_grad():
        offset = 0
        for p in module.parameters():
            p.copy_(values[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def sgd_reference(world_size: int, steps: int) -> torch.Tensor:
    """One process, plain SGD on the concatenated batch of all ranks at every step."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_data(world_size, steps)
    for step in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x[step].reshape(-1, IN_FEATURES)), y[step].reshape(-1)).backward()
        optimizer.step()
    return flat(model)


@pytest.mark.timeout(30)
def test_h1_nesterov_without_momentum_equals_averaging_equals_sync_training():
    """H = 1, inner SGD: outer Nesterov (momentum 0, lr 1) == plain averaging == one process on the whole batch."""
    world_size, steps = 2, 5
    x, y = make_data(world_size, steps)
    variants = {"none": {}, "nesterov": {"outer_optimizer": "nesterov", "outer_momentum": 0.0, "outer_lr": 1.0}}
    modules = {name: [make_model(seed=rank) for rank in range(world_size)] for name in variants}

    def body(comm):
        out = {}
        for name, options in variants.items():
            model = gradsync.LocalSGD(modules[name][comm.rank], sync_every=1, group=comm, **options)
            assert (model.outer is None) == (name == "none")
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            for step in range(steps):
                optimizer.zero_grad()
                F.cross_entropy(model(x[step, comm.rank]), y[step, comm.rank]).backward()
                optimizer.step()
                assert model.step()
            out[name] = flat(model.module)
        return out

    results = run_threads(world_size, body, timeout_s=20)
    expected = sgd_reference(world_size, steps)
    for result in results:
        torch.testing.assert_close(result["none"], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["nesterov"], result["none"], rtol=1e-5, atol=1e-6)
        assert torch.equal(result["nesterov"], results[0]["nesterov"])  # τ = 0: replicas bitwise equal


@pytest.mark.timeout(30)
def test_nesterov_outer_step_equals_torch_sgd_on_the_averaged_pseudo_gradient():
    """Fixed local parameters each round: θ_g follows torch.optim.SGD(nesterov=True) stepped with mean Δ."""
    world_size, rounds, lr, momentum = 2, 4, 0.7, 0.9
    generator = torch.Generator().manual_seed(3)
    start = torch.randn(6, generator=generator)
    local = torch.randn(rounds, world_size, 6, generator=generator)  # each rank's parameters before each sync

    def body(comm):
        module = nn.Linear(2, 2)  # 4 + 2 = 6 parameters
        set_flat(module, start)
        model = gradsync.DiLoCo(module, sync_every=1, group=comm, outer_lr=lr, outer_momentum=momentum)
        trace = []
        for r in range(rounds):
            set_flat(module, local[r, comm.rank])
            model.step()
            trace.append(flat(module))
        return trace

    traces = run_threads(world_size, body, timeout_s=20)
    theta = start.clone().requires_grad_(True)
    reference = torch.optim.SGD([theta], lr=lr, momentum=momentum, nesterov=True)
    for r in range(rounds):
        theta.grad = (theta.detach() - local[r]).mean(0)
        reference.step()
        for trace in traces:
            torch.testing.assert_close(trace[r], theta.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(30)
def test_int8_error_feedback_keeps_the_sum_over_rounds():
    """Σ applied = mean_i Σ_r Δ_i^r - mean_i e_i (workers' final residuals) - E (chunk owners' final residual)."""
    world_size, rounds = 3, 12
    generator = torch.Generator().manual_seed(5)
    deltas = torch.randn(rounds, world_size, 6, generator=generator) * torch.logspace(-3, 0, 6)  # wide range

    def body(comm):
        module = nn.Linear(2, 2)
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()
        model = gradsync.LocalSGD(module, sync_every=1, group=comm, outer_compression="int8")
        for r in range(rounds):
            # θ_g - Δ: this rank's pseudo-gradient is Δ (θ_g starts at 0)
            set_flat(module, model.outer.fragments[0].global_params - deltas[r, comm.rank])
            model.step()
        state = model.sync_state_dict()["outer"]

        def residual(kind: str) -> torch.Tensor:  # by parameter name; zeros where this rank keeps none
            kept = state[kind]
            return torch.cat([kept[name].reshape(-1) if name in kept else torch.zeros(p.numel())
                              for name, p in module.named_parameters()])

        return -state["global"][0], residual("worker_residual"), residual("server_residual")

    results = run_threads(world_size, body, timeout_s=20)
    applied = results[0][0]  # θ_g moved by -Σ applied (outer "none": θ_g -= Δ)
    workers = torch.stack([r[1] for r in results]).mean(0)
    servers = torch.stack([r[2] for r in results]).sum(0)  # each owner keeps its chunk's, zeros elsewhere
    expected = deltas.sum(0).mean(0) - workers - servers
    torch.testing.assert_close(applied, expected, rtol=1e-5, atol=1e-6)
    assert workers.abs().max() > 0 and servers.abs().max() > 0  # int8 rounded: residuals were kept
    assert all(torch.equal(r[0], applied) for r in results)


@pytest.mark.timeout(30)
def test_fragments_sync_every_parameter_once_per_round_without_losing_an_inner_step():
    """F = 2, H = 4, τ = 1: each fragment applied once per 4 steps at its staggered step, the AllReduce on the
    lane; with linear inner updates the final parameters are the start plus the mean of every update."""
    world_size, sync_every, steps = 2, 4, 10
    generator = torch.Generator().manual_seed(7)
    updates = torch.randn(steps, world_size, 6 + 3, generator=generator)  # Linear(2, 2) + Linear(2, 1): 4 tensors
    module_start = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    start = flat(module_start)
    threads = []

    def body(comm):
        module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        module.load_state_dict(module_start.state_dict())
        model = gradsync.LocalSGD(module, sync_every=sync_every, group=comm, outer_fragments=2)
        exchange = model.outer._exchange

        def spy(fragment, values):
            threads.append(threading.current_thread().name)
            exchange(fragment, values)

        model.outer._exchange = spy
        applied = []
        for step in range(steps):
            set_flat(module, flat(module) + updates[step, comm.rank])
            before = [f.global_params.clone() for f in model.outer.fragments]
            model.step()
            applied.append([not torch.equal(b, f.global_params) for b, f in zip(before, model.outer.fragments)])
        model.average()  # the end of training: what is in flight, then every fragment stepped since it was sent
        return applied, flat(module), [f.layout.names for f in model.outer.fragments]

    results = run_threads(world_size, body, timeout_s=20)
    for applied, params, names in results:
        assert [step + 1 for step, row in enumerate(applied) if row[0]] == [3, 7]  # sent after 2, 6: +τ
        assert [step + 1 for step, row in enumerate(applied) if row[1]] == [5, 9]  # sent after 4, 8: +τ
        assert sorted(n for fragment in names for n in fragment) == ["0.bias", "0.weight", "1.bias", "1.weight"]
        torch.testing.assert_close(params, start + updates.mean(1).sum(0), rtol=1e-5, atol=1e-5)
        assert torch.equal(params, results[0][1])
    assert threads and all(name.startswith("gradsync-comm") for name in threads[:2 * 4])  # overlapped ones


@pytest.mark.timeout(30)
def test_outer_state_resumes_bitwise_with_an_allreduce_in_flight():
    """A checkpoint taken between a fragment's launch and its application continues as if never taken."""
    world_size, steps, cut = 2, 9, 4  # F = 2, H = 4, τ = 1: fragment 1 sent after step 4, applied after step 5
    x, y = make_data(world_size, steps)
    start = make_model().state_dict()
    options = {"sync_every": 4, "outer_optimizer": "nesterov", "outer_compression": "int8", "outer_fragments": 2}

    def train(model, optimizer, rank, first, last):
        for step in range(first, last):
            optimizer.zero_grad()
            F.cross_entropy(model(x[step, rank]), y[step, rank]).backward()
            optimizer.step()
            model.step()

    def body(comm):
        module = make_model()
        module.load_state_dict(start)
        model = gradsync.LocalSGD(module, group=comm, **options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        train(model, optimizer, comm.rank, 0, cut)
        saved = {"sync": model.sync_state_dict(), "module": {k: v.clone() for k, v in module.state_dict().items()},
                 "optimizer": copy.deepcopy(optimizer.state_dict())}
        in_flight = len(saved["sync"]["outer"]["pending"])
        train(model, optimizer, comm.rank, cut, steps)
        again = make_model()
        resumed = gradsync.LocalSGD(again, group=comm, **options)  # rank 0's parameters are broadcast: then load
        again.load_state_dict(saved["module"])
        resumed.load_sync_state_dict(saved["sync"])
        resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=0.01)
        resumed_optimizer.load_state_dict(saved["optimizer"])
        train(resumed, resumed_optimizer, comm.rank, cut, steps)
        return flat(module), flat(again), in_flight, model.outer.rounds, resumed.outer.rounds

    for params, resumed, in_flight, rounds, resumed_rounds in run_threads(world_size, body, timeout_s=20):
        assert in_flight == 1
        assert torch.equal(params, resumed) and rounds == resumed_rounds


@pytest.mark.parametrize("options, message", [
    ({"outer_compression": "int4"}, "unknown outer_compression='int4'; choose one of fp32, bf16, fp16, int8"),
    ({"outer_optimizer": "adam"}, "unknown outer_optimizer='adam'; choose one of none, nesterov"),
    ({"outer_fragments": 5}, "outer_fragments=5 is more than the model's 4 parameter tensors"),
    ({"outer_fragments": 4}, "outer_fragments=4 must divide sync_every=6"),
    ({"outer_optimizer": "nesterov", "outer_lr": 0.0}, "outer_lr must be a finite number > 0, got 0.0"),
    ({"outer_optimizer": "nesterov", "outer_lr": float("nan")}, "outer_lr must be a finite number > 0, got nan"),
    ({"outer_optimizer": "nesterov", "outer_momentum": 1.0}, "outer_momentum must be a number in [0, 1), got 1.0"),
    ({"outer_lr": 0.3}, "outer_lr=0.3 needs outer_optimizer='nesterov' (outer_optimizer='none' averages"),
    ({"outer_momentum": 0.5}, "outer_momentum=0.5 needs outer_optimizer='nesterov' (outer_optimizer='none' averages"),
    ({"outer_fragments": 2, "outer_delay": 6}, "outer_delay must be an int in [0, sync_every) = [0, 6), got 6"),
])
def test_bad_outer_options_raise_one_line(options, message):
    """Each bad outer option is a ValueError naming its keyword argument (no CLI flag), before any communication."""
    comm = gradsync.Communicator(ThreadWorld(1).transport(0))
    with pytest.raises(ValueError) as caught:
        gradsync.LocalSGD(make_model(), sync_every=6, group=comm, **options)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    assert "--" not in str(caught.value)


@pytest.mark.parametrize("options, message", [
    ({"outer_lr": float("nan")}, "outer_lr must be a finite number > 0, got nan"),
    ({"outer_compression": "int4"}, "unknown outer_compression='int4'"),
    ({"outer_fragments": 3}, "outer_fragments=3 must divide sync_every=4"),
])
def test_diloco_names_its_keyword_arguments(options, message):
    """DiLoCo (Nesterov by default) refuses with the keyword's name; its default outer lr and momentum are accepted."""
    comm = gradsync.Communicator(ThreadWorld(1).transport(0))
    with pytest.raises(ValueError) as caught:
        gradsync.DiLoCo(make_model(), sync_every=4, group=comm, **options)
    assert str(caught.value).startswith(message) and "--" not in str(caught.value)
    model = gradsync.DiLoCo(make_model(), sync_every=4, group=comm)
    assert (model.settings["outer_lr"], model.settings["outer_momentum"]) == (0.7, 0.9)  # the paper's


@pytest.mark.timeout(30)
def test_ranks_disagreeing_on_outer_compression_fail_on_every_rank():
    """One rank int8, the other fp32: CollectiveMismatchError on both, never a hang."""
    def body(comm):
        gradsync.LocalSGD(make_model(), sync_every=2, group=comm,
                          outer_compression="int8" if comm.rank else "fp32")

    with pytest.raises(RankError) as caught:
        run_threads(2, body, timeout_s=20)
    assert "CollectiveMismatchError" in str(caught.value) and "outer_compression" in str(caught.value)


def test_outer_sync_payload_counts_encoded_bytes():
    """int8 payload: one byte per element plus a 4-byte scale per chunk, rows padded to 4 bytes."""
    comm = gradsync.Communicator(ThreadWorld(1).transport(0))
    module = nn.Linear(2, 3)  # 6 + 3 = 9 elements
    outer = OuterSync(list(module.named_parameters()), comm, sync_every=1, outer=gradsync.parallel.outer_optimizer
                      .ParameterAveraging(), compression="int8", fragments=1, delay=0, algorithm="ring", timeout=None)
    assert outer.fragment_payload_nbytes(outer.fragments[0]) == 4 + 12  # 4 + 9 rounded up to 4 bytes


def test_outer_state_at_another_world_size_keeps_the_shared_part_and_means_the_rest():
    """2 -> 3 ranks: θ_g, momentum, position and results in flight rank 0's; in-flight own deltas the mean;
    residuals mean(worker) + sum(server), so the pending error of the average is unchanged."""
    from gradsync.train.reshard import reshard_local_sgd

    def state(rank: int) -> dict:
        value = float(rank + 1)
        outer = {"steps": 9, "rounds": 4, "payload_nbytes": 100 * value, "global": [torch.ones(2)],
                 "dirty": [True], "optimizer": {"momentum": {0: torch.full((2,), 0.5)}},
                 "worker_residual": {"w": torch.full((2,), value)},
                 "server_residual": {"w": torch.tensor([value, 0.0]) if rank == 0 else torch.tensor([0.0, value])},
                 "pending": [{"key": 0, "launched_at": 9, "apply_at": 10, "own_delta": torch.full((2,), value),
                              "averaged": torch.full((2,), 1.5)}]}
        return {"local_steps": 3, "averages": 4, "payload_nbytes": 7, "outer": outer}

    old = [state(0), state(1)]
    kept, new = reshard_local_sgd(old, old[1]), reshard_local_sgd(old, None)
    for entry in (kept, new):
        outer = entry["outer"]
        assert entry["local_steps"] == 3 and outer["steps"] == 9 and torch.equal(outer["global"][0], torch.ones(2))
        torch.testing.assert_close(outer["pending"][0]["own_delta"], torch.full((2,), 1.5))
        assert torch.equal(outer["pending"][0]["averaged"], torch.full((2,), 1.5))
        torch.testing.assert_close(outer["worker_residual"]["w"], torch.tensor([1.5 + 1.0, 1.5 + 2.0]))
        assert outer["server_residual"] == {}
    assert kept["outer"]["payload_nbytes"] == 200 and new["outer"]["payload_nbytes"] == 0


@pytest.mark.timeout(30)
def test_silent_peer_of_an_overlapped_fragment_times_out_at_its_application():
    """τ = 1: the AllReduce runs on the lane; a peer that never sends makes step() raise, never hang."""
    def body(comm):
        model = gradsync.LocalSGD(make_model(), sync_every=2, group=comm, timeout=0.5, outer_fragments=2,
                                  outer_compression="int8")
        if comm.rank == 1:
            return None
        try:
            for _ in range(3):  # fragment 0 sent after step 1, applied after step 2
                model.step()
        except gradsync.CollectiveTimeoutError as exc:
            return exc, model.comm.lane.held
        return None

    exc, held = run_threads(2, body, timeout_s=20)[0]
    assert isinstance(exc, gradsync.CollectiveTimeoutError) and "peer rank 1" in str(exc), exc
    assert not held  # the lane is given back: later collectives are not queued behind a dead round


@pytest.mark.parametrize("fields, message", [
    ({"outer_optimizer": "nesterov"}, "--outer-optimizer is not honoured with --mode sync: DiLoCo's outer rounds "
                                      "replace local SGD's parameter averages"),
    ({"mode": "local-sgd", "outer_lr": 0.5}, "--outer-lr needs --outer-optimizer nesterov"),
    ({"mode": "local-sgd", "outer_compression": "int4"}, "unknown --outer-compression 'int4'"),
    ({"mode": "local-sgd", "outer_fragments": 9, "sync_every": 9}, "--outer-fragments 9 is more than the model's 8"),
    ({"mode": "local-sgd", "outer_fragments": 3}, "--outer-fragments 3 must divide --sync-every 4"),
    ({"mode": "local-sgd", "outer_optimizer": "nesterov", "outer_lr": float("nan")},
     "--outer-lr must be a finite number > 0, got nan"),
    ({"mode": "local-sgd", "outer_optimizer": "nesterov", "outer_momentum": 1.0},
     "--outer-momentum must be a number in [0, 1), got 1.0"),
    ({"mode": "local-sgd", "outer_optimizer": "nesterov", "elastic": True}, "--elastic runs --mode sync or async"),
])
def test_gradsync_train_refuses_bad_outer_options_in_one_line(fields, message):
    """Checked before any process starts (the option table and the value checks), one line naming the option."""
    from gradsync.jobs.job import check_options
    from gradsync.train.config import TrainConfig

    with pytest.raises(ValueError) as caught:
        check_options(TrainConfig(**fields), "local")
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
