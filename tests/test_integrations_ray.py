"""gradsync.integrations.ray without a Ray cluster: option refusals, the worker check, checkpoints on thread ranks.

The checkpoint tests write each thread rank's part into its own folder and merge them into one, as Ray
Train merges the files its workers report under one ``checkpoint_dir_name``; a run resumed from the merged
folder must end bitwise where the uninterrupted run ends (compressor error feedback and ZeRO shards
included). The Ray clusters (one host, two test hosts, a worker failure) are in test_integrations_ray_cluster.py.
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from torch import nn

import gradsync
from gradsync.errors import MissingExtraError
from gradsync.process_group import default_communicator
from _dist import run_threads

ray_train = pytest.importorskip("ray.train", reason="gradsync.integrations.ray needs gradsync[ray] (ray[train])")
gray = pytest.importorskip("gradsync.integrations.ray")

torch.set_num_threads(1)
STEPS_BEFORE, STEPS_AFTER = 3, 3
_GEN = torch.Generator().manual_seed(3)
_BATCHES = [(torch.randn(8, 6, generator=_GEN), torch.randint(0, 3, (8,), generator=_GEN))
            for _ in range(STEPS_BEFORE + STEPS_AFTER)]


@pytest.mark.parametrize("options, needle", [
    ({"algorithm": "bogus"}, "algorithm"),
    ({"shard": "zero9"}, "shard"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
    ({"compression": "bogus"}, "compression"),
    ({"compression": "onebit", "shard": "optimizer"}, "compression"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"move_to_device": "cpu"}, "move_to_device"),
    ({"parallel_strategy": "fsdp"}, "parallel_strategy"),
    ({"bucket_size": 5}, "bucket_size"),
])
def test_a_bad_option_is_refused_in_one_line_naming_it(options, needle):
    """Checked before anything else: no Ray worker, no process group needed."""
    with pytest.raises((TypeError, ValueError)) as caught:
        gray.prepare_model(nn.Linear(2, 2), **options)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_outside_a_ray_train_worker_prepare_model_says_so_in_one_line():
    with pytest.raises(RuntimeError) as caught:
        gray.prepare_model(nn.Linear(2, 2))
    message = str(caught.value)
    assert "inside a Ray Train worker" in message and "TorchTrainer" in message and "\n" not in message


def test_without_the_extra_the_error_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.train", None)  # import ray.train -> ImportError
    with pytest.raises(MissingExtraError, match=r"needs the 'ray' extra.*pip install 'gradsync\[ray\]'"):
        gray.prepare_model(nn.Linear(2, 2))


def _module() -> nn.Module:
    torch.manual_seed(0)  # threads share torch's RNG; each rank builds before any draws (DataParallel syncs)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _wrap(comm, compression, shard):
    model = gradsync.DataParallel(_module(), group=comm, algorithm="ring", compression=compression, shard=shard)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, model.shard_optimizer(optimizer) if shard != "none" else optimizer


def _steps(model, optimizer, comm, batches) -> None:
    rows = slice(comm.rank * 4, comm.rank * 4 + 4)
    for inputs, labels in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs[rows]), labels[rows]).backward()
        optimizer.step()


def _parameters(model) -> list[torch.Tensor]:
    with model.full_parameters():
        return [p.detach().clone() for p in model.module.parameters()]


def _merge(tmp_path, world_size: int):
    """Every rank's folder into one, as Ray merges the workers' reported files."""
    merged = tmp_path / "merged"
    merged.mkdir(exist_ok=True)
    for rank in range(world_size):
        for path in (tmp_path / f"rank{rank}").iterdir():
            shutil.copy2(path, merged / path.name)
    return merged


@pytest.mark.parametrize("compression, shard", [("onebit", "none"), ("fp16", "optimizer")])
def test_a_resumed_run_ends_bitwise_where_the_uninterrupted_one_ends(tmp_path, compression, shard):
    """Save after 3 steps (each rank its own folder), run 3 more; new replicas loading the merged folder and
    running the same 3 steps end with the same bits: model, optimizer (sharded too), error feedback."""
    def uninterrupted(comm):
        model, optimizer = _wrap(comm, compression, shard)
        _steps(model, optimizer, comm, _BATCHES[:STEPS_BEFORE])
        saved = gray.save_checkpoint(model, optimizer, tmp_path / f"rank{comm.rank}", step=STEPS_BEFORE,
                                     extra={"step": STEPS_BEFORE, "note": ["x", 1.5]})
        feedback = model.compression.state_dict()
        _steps(model, optimizer, comm, _BATCHES[STEPS_BEFORE:])
        return _parameters(model), saved, feedback

    def resumed(comm):
        model, optimizer = _wrap(comm, compression, shard)
        extra = gray.load_checkpoint(model, optimizer, ray_train.Checkpoint.from_directory(str(merged)))
        _steps(model, optimizer, comm, _BATCHES[extra["step"]:])
        return _parameters(model), extra

    first = run_threads(2, uninterrupted)
    assert isinstance(first[0][1], ray_train.Checkpoint)
    if compression == "onebit":  # there is error feedback to carry over
        assert any(float(t.abs().sum()) > 0 for t in _tensors(first[1][2]))
    merged = _merge(tmp_path, 2)
    for (want, _, _), (got, extra) in zip(first, run_threads(2, resumed)):
        assert extra == {"step": STEPS_BEFORE, "note": ["x", 1.5]}
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def test_a_sharded_checkpoint_resumes_on_one_rank_consolidated(tmp_path):
    """ZeRO-1 at 2 ranks, resumed by 1 rank: the optimizer's shards are consolidated; the continuation
    equals the 2-rank one within float tolerance (one process on the whole batch)."""
    def two(comm):
        model, optimizer = _wrap(comm, None, "optimizer")
        _steps(model, optimizer, comm, _BATCHES[:STEPS_BEFORE])
        gray.save_checkpoint(model, optimizer, tmp_path / f"rank{comm.rank}", step=STEPS_BEFORE)
        _steps(model, optimizer, comm, _BATCHES[STEPS_BEFORE:])
        return _parameters(model)

    def one(comm):
        model = gradsync.DataParallel(_module(), group=comm, algorithm="ring")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        assert gray.load_checkpoint(model, optimizer, merged) == {}
        for inputs, labels in _BATCHES[STEPS_BEFORE:]:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
        return _parameters(model)

    want = run_threads(2, two)[0]
    merged = _merge(tmp_path, 2)
    for a, b in zip(run_threads(1, one)[0], want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_damaged_checkpoint_and_a_bad_extra_are_refused_naming_the_file_and_the_entry(tmp_path):
    def save(comm):
        model, optimizer = _wrap(comm, None, "none")
        with pytest.raises(TypeError, match=r"extra\['when'\] is a object"):
            gray.save_checkpoint(model, optimizer, tmp_path / "bad", extra={"when": object()})
        gray.save_checkpoint(model, optimizer, tmp_path / "rank0", step=1)
        return model, optimizer

    model, optimizer = run_threads(1, save)[0]
    (tmp_path / "rank0" / "rank-00000.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"rank-00000\.pt is corrupt"):
        gray.load_checkpoint(model, optimizer, tmp_path / "rank0")


def test_an_already_wrapped_model_is_refused_in_one_line(single_process):
    """A gradsync DataParallel or a torch DDP is not wrapped again (its state_dict keys would become
    module.module.*); refused before the worker check, so no Ray worker is needed."""
    inner = nn.Linear(2, 2)
    for wrapped, name in ((gradsync.DataParallel(inner), "gradsync.DataParallel"),
                          (nn.parallel.DistributedDataParallel(inner), "torch.nn.DistributedDataParallel")):
        with pytest.raises(TypeError) as caught:
            gray.prepare_model(wrapped)
        message = str(caught.value)
        assert f"already wrapped in {name}:" in message and ".module" in message and "\n" not in message


def _as_worker(monkeypatch):
    """prepare_model as in a one-worker Ray Train run: this process counts as worker 1 of 1."""
    monkeypatch.setattr(gray, "worker_world_size", lambda train: 1)


def test_a_timeout_other_than_the_initialised_one_is_refused_not_ignored(single_process, monkeypatch):
    """After gradsync.init(timeout=30) (the fixture), prepare_model(timeout_s=2) cannot change the group's
    timeout: refused in one line; the same timeout, or none, wraps over the group with 30 s."""
    _as_worker(monkeypatch)
    with pytest.raises(ValueError) as caught:
        gray.prepare_model(nn.Linear(2, 2), timeout_s=2.0, move_to_device=False)
    message = str(caught.value)
    assert "timeout 30 s" in message and "timeout_s=2" in message and "gradsync.init" in message
    assert "\n" not in message
    for options in ({"timeout_s": 30}, {}):
        model = gray.prepare_model(nn.Linear(2, 2), move_to_device=False, **options)
        assert model.comm is default_communicator() and model.comm.timeout_s == 30.0


def test_the_first_prepare_model_initialises_gradsync_with_its_timeout(monkeypatch, tmp_path):
    """Over a torch.distributed group set up as Ray's TorchConfig does (gloo, 1 rank), the first call
    initialises gradsync with timeout_s; a second call with another timeout is refused."""
    import torch.distributed as dist

    _as_worker(monkeypatch)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = gray.prepare_model(nn.Linear(2, 2), timeout_s=7.5, move_to_device=False)
        assert default_communicator().timeout_s == 7.5 and model.comm.timeout_s == 7.5
        with pytest.raises(ValueError, match=r"initialised with timeout 7\.5 s; prepare_model\(timeout_s=300\)"):
            gray.prepare_model(nn.Linear(2, 2), timeout_s=300, move_to_device=False)
    finally:
        gradsync.shutdown()
        dist.destroy_process_group()


def test_workers_asking_for_different_timeouts_all_raise_at_once():
    """The timeout check is collective: the worker asking for another timeout raises ValueError, its peer
    CollectiveMismatchError naming it, well before the group's 10 s timeout (no waiting on each other)."""
    def ask(comm):
        try:
            gray.agree_on_timeout(comm, None if comm.rank == 0 else 2.0)
        except (ValueError, gradsync.CollectiveMismatchError) as error:
            return type(error).__name__, str(error)
        return None

    outcomes = run_threads(2, ask, timeout_s=20, collective_timeout_s=10)
    assert outcomes[1][0] == "ValueError" and "timeout 10 s" in outcomes[1][1]
    assert outcomes[0][0] == "CollectiveMismatchError" and "rank 1" in outcomes[0][1]
    assert run_threads(2, lambda comm: gray.agree_on_timeout(comm, 10), collective_timeout_s=10) == [None, None]
