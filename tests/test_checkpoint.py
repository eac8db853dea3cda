"""Checkpoints: atomic files, checksums, a manifest written last; corrupt or partial ones are skipped."""

from __future__ import annotations

import json
import os

import pytest
import torch

from _dist import run_threads
from gradsync.fault import checkpoint
from gradsync.fault.checkpoint import CheckpointWarning


def _save_world(root, step, world_size=3, keep=2):
    """Every thread-rank saves ``step``: shared = a tensor of the step, rank state = its rank's tensor."""
    def body(comm):
        shared = {"step": step, "weights": torch.full((4,), float(step))} if comm.rank == 0 else None
        return checkpoint.save(root, step, shared, {"rank": comm.rank, "rng": torch.arange(3) + comm.rank}, comm,
                               keep=keep)
    return run_threads(world_size, body, timeout_s=20)[0]


def test_round_trip_every_rank_and_the_manifest(tmp_path):
    folder = _save_world(tmp_path, 7)
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 3
    assert set(manifest["files"]) == {"shared.pt", "rank-00000.pt", "rank-00001.pt", "rank-00002.pt"}
    found = checkpoint.latest(tmp_path)
    assert (found.step, found.world_size, found.folder) == (7, 3, folder)
    assert torch.equal(found.load_shared()["weights"], torch.full((4,), 7.0))
    for rank in range(3):
        state = found.load_rank(rank)
        assert state["rank"] == rank and torch.equal(state["rng"], torch.arange(3) + rank)
    with pytest.raises(KeyError, match="3 ranks; it has no rank 5"):
        found.load_rank(5)
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_keeps_the_newest_two(tmp_path):
    for step in (10, 20, 30, 40):
        _save_world(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000030", "step-000000040"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_rank_file", "no_manifest", "bad_manifest"])
def test_corrupt_or_partial_newest_is_skipped_with_a_warning_naming_the_file(tmp_path, damage):
    _save_world(tmp_path, 1)
    newest = _save_world(tmp_path, 2)
    target = newest / "rank-00001.pt"
    if damage == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[:len(data) // 2])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "delete_rank_file":
        target.unlink()
    elif damage == "no_manifest":
        (newest / checkpoint.MANIFEST).unlink()
        target = newest / checkpoint.MANIFEST
    else:
        (newest / checkpoint.MANIFEST).write_text("{not json")
        target = newest / checkpoint.MANIFEST
    with pytest.warns(CheckpointWarning, match=str(target.name)):
        found = checkpoint.latest(tmp_path)
    assert found.step == 1
    assert torch.equal(found.load_shared()["weights"], torch.full((4,), 1.0))


def test_nothing_to_resume(tmp_path):
    assert checkpoint.latest(tmp_path / "missing") is None
    assert checkpoint.latest(tmp_path) is None


def test_write_atomic_replaces_whole_files(tmp_path):
    path = tmp_path / "f.bin"
    checkpoint.write_atomic(path, b"old")
    checkpoint.write_atomic(path, b"new contents")
    assert path.read_bytes() == b"new contents"
    assert os.listdir(tmp_path) == ["f.bin"]


@pytest.mark.parametrize("step, keep", [(-1, 2), (1.5, 2), (True, 2), (1, 0), (1, -1)])
def test_bad_arguments(tmp_path, step, keep):
    def body(comm):
        return checkpoint.save(tmp_path, step, {}, {}, comm, keep=keep)
    with pytest.raises(Exception, match="step|keep"):
        run_threads(1, body, timeout_s=10)


def test_loading_refuses_pickled_code(tmp_path):
    """weights_only=True: a file holding an arbitrary object does not load (nor run code)."""
    folder = _save_world(tmp_path, 3, world_size=1)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo should-not-run",))

    import io
    buffer = io.BytesIO()
    torch.save({"x": Evil()}, buffer)
    data = buffer.getvalue()
    (folder / "shared.pt").write_bytes(data)
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    manifest["files"]["shared.pt"] = {"sha256": checkpoint._digest(data).hex(), "nbytes": len(data)}
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    found = checkpoint.latest(tmp_path)
    with pytest.raises(Exception, match="[Ww]eights only|weights_only|Unsupported"):
        found.load_shared()
