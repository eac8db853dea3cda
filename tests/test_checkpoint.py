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
    # private whatever the umask (issue 16: they were 0755 / 0644)
    assert oct(folder.stat().st_mode & 0o777) == oct(0o700)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()} == {
        name: oct(0o600) for name in manifest["files"] | {checkpoint.MANIFEST: None}}


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


def _private_folder(folder: str) -> None:
    """This process (its calling thread) gets its own mount namespace with a fresh tmpfs over ``folder``.

    Like a node whose --checkpoint-dir is a local disk: same path, other files. The machine's own
    mounts are untouched (``mount --make-rprivate /`` inside the new namespace only).
    """
    import ctypes
    import subprocess

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True, capture_output=True, timeout=10)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", folder], check=True, capture_output=True, timeout=10)


def _rank_save_into_node_local_folder(root: str) -> str:
    """Rank 1 sees its own private ``root`` (another node's local disk); both ranks save step 1."""
    import gradsync

    if gradsync.rank() == 1:
        _private_folder(root)
    try:
        checkpoint.save(root, 1, {"step": 1}, {"rank": gradsync.rank()}, gradsync.process_group.default_communicator())
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def _mount_namespaces_usable() -> str | None:
    """None when this machine lets a child process unshare its mounts, else why not."""
    import subprocess

    try:
        done = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare not runnable: {exc}"
    return None if done.returncode == 0 else f"no mount namespaces here: {done.stderr.strip()}"


@pytest.mark.timeout(60)
def test_node_local_checkpoint_folder_is_one_error_on_every_rank(tmp_path):
    """Trigger: --checkpoint-dir not shared between nodes; before: every save 'succeeded', resume began at 0."""
    reason = _mount_namespaces_usable()
    if reason:
        pytest.skip(reason)
    from _dist import run_world

    outcomes = run_world(2, _rank_save_into_node_local_folder, str(tmp_path), timeout_s=40)
    wanted = (f"CheckpointFolderError: checkpoint folder {tmp_path} is not shared between ranks: rank 0 cannot "
              f"see the files of rank(s) 1; use a folder all nodes mount")
    assert outcomes == [wanted, wanted]
    assert "\n" not in wanted
