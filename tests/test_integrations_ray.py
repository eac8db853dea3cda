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
