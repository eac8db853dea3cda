"""TensorBoard: ``gradsync train --tensorboard DIR`` and ``TensorBoardHook``, read back with tensorboard's own reader.

The values are checked against numbers known without TensorBoard: the run's
``metrics.jsonl`` and ``summary.json`` (losses, bytes per step, evaluation
accuracy, the algorithm per bucket), and in a loop of two thread ranks the
transport's byte counters read by the test itself around each step. The
2-worker ``gradsync train`` run is an early job (its start-up overlaps the
other tests); the other modes (async, local SGD, deterministic with
sharding, elastic) are ``slow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import gradsync
from _cli import run_cli
from _dist import run_threads
from _early import early_job
from gradsync.errors import MissingExtraError
from gradsync.train.metrics import METRICS_FILE, SUMMARY_FILE, read_metrics

pytest.importorskip("tensorboard", reason="TensorBoard logging needs gradsync[tensorboard]")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402

from gradsync.integrations.tensorboard import TAGS, TensorBoardHook  # noqa: E402

TRAIN = early_job("tensorboard-train", [
    "train", "--nproc", "2", "--model", "mlp", "--epochs", "2", "--num-samples", "400", "--batch-size", "32",
    "--algorithm", "ring", "--bucket-cap-mb", "0.05", "--seed", "1", "--timeout", "60", "--no-progress",
    "--data-dir", "{folder}/data", "--out", "{folder}/run", "--tensorboard", "{folder}/tb"])


def _events(folder: Path) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def _scalars(events: EventAccumulator, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in events.Scalars(tag)}


def _texts(events: EventAccumulator, tag: str) -> dict[int, str]:
    return {event.step: tensor_util.make_ndarray(event.tensor_proto).item().decode()
            for event in events.Tensors(tag + "/text_summary")}


def _rows(text: str) -> list[tuple[int, str]]:
    """``(bytes, algorithm)`` per row of the bucket table (a header and a rule first)."""
    return [(int(nbytes), name.strip()) for nbytes, name in (line.split("|")[2:4] for line in text.splitlines()[2:])]


@pytest.mark.early_job(TRAIN)
def test_train_writes_what_metrics_and_summary_record(early):
    """--tensorboard's loss, bytes and evaluation scalars are metrics.jsonl's; the bucket text is summary.json's."""
    result = early.wait(timeout_s=120)
    assert result.returncode == 0, result.stderr[-3000:]
    run = early.folder / "run"
    records = read_metrics(run / METRICS_FILE)
    steps = [r for r in records if r.get("kind") == "step"]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    summary = json.loads((run / SUMMARY_FILE).read_text())
    events = _events(early.folder / "tb")
    assert len(steps) == 10 and len(epochs) == 2  # 320 training samples / (2 x 32) per step, 2 epochs

    loss = _scalars(events, "train/loss")  # event values are float32
    assert loss == {r["step"]: pytest.approx(r["loss"], rel=1e-6) for r in steps}
    assert _scalars(events, "comm/bytes_sent") == {r["step"]: r["bytes_sent"] for r in steps}
    assert sum(r["bytes_sent"] for r in steps) > 0  # ring over the transport: counted
    share = _scalars(events, "comm/share")
    assert share.keys() == loss.keys() and all(0 < value <= 1 for value in share.values())
    wall = _scalars(events, "step/wall_s")
    samples = summary["samples"] / summary["steps"]  # every step of the run has the same global batch
    assert _scalars(events, "throughput/samples_per_s") == {
        step: pytest.approx(samples / seconds, rel=1e-5) for step, seconds in wall.items()}
    ends = [r["step"] for r in steps if r["step"] % (len(steps) // len(epochs)) == 0]  # each epoch's last step
    assert _scalars(events, "eval/accuracy") == {
        step: pytest.approx(r["test_accuracy"], rel=1e-6) for step, r in zip(ends, epochs)}
    assert _scalars(events, "run/bytes_sent_per_step") == {
        summary["steps"]: pytest.approx(summary["bytes_sent_per_step"], rel=1e-6)}
    page = (Path(__file__).resolve().parents[1] / "docs" / "tensorboard.md").read_text(encoding="utf-8")
    assert set(events.Tags()["scalars"]) <= set(TAGS) and all(f"`{tag}`" in page for tag in TAGS)

    texts = _texts(events, "buckets/algorithms")
    assert min(texts) == 1 and len(summary["algorithms"]) > 1  # --bucket-cap-mb 0.05: several buckets
    assert _rows(texts[1]) == [(entry["bucket_nbytes"], "ring") for entry in summary["algorithms"]]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def _hook_loop(comm, folder: Path, all_ranks: bool, steps: int = 4, batch: int = 6):
    """A user's loop: DataParallel over ``comm``, the hook after each optimizer step; returns per step the
    transport bytes the test read around it and the seconds between the hook's steps, as the test saw them."""
    model = gradsync.DataParallel(_Net(), group=comm, algorithm="ring", bucket_cap_mb=200 / 2**20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(comm.rank)
    sent, outer_s = [], []
    with TensorBoardHook(model, folder, all_ranks=all_ranks) as hook:
        for _ in range(steps):
            before, started = comm.stats.bytes_sent, time.perf_counter()
            x, y = torch.randn(batch, 8, generator=generator), torch.randint(0, 3, (batch,), generator=generator)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            sent.append(comm.stats.bytes_sent - before)
            hook.step(loss=loss, samples=batch * comm.world_size)
            outer_s.append(time.perf_counter() - started)
        hook.evaluation(accuracy=0.5)
    return sent, outer_s, model.bucket_algorithms()


@pytest.mark.timeout(60)
def test_hook_in_a_two_rank_loop_writes_the_bytes_each_step_sent(tmp_path):
    """Rank 0 alone writes; bytes per step are the transport counters' differences; samples/s x wall = samples."""
    results = run_threads(2, lambda comm: _hook_loop(comm, tmp_path, all_ranks=False), timeout_s=40)
    sent, outer_s, algorithms = results[0]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # rank 1 wrote nothing
    events = _events(tmp_path)
    assert _scalars(events, "comm/bytes_sent") == dict(enumerate(map(float, sent), start=1))
    assert all(nbytes > 0 for nbytes in sent)
    wall = _scalars(events, "step/wall_s")
    assert all(wall[step] <= outer_s[step - 1] + 1e-6 for step in wall)  # inside what the test timed
    assert _scalars(events, "throughput/samples_per_s") == {
        step: pytest.approx(12 / seconds, rel=1e-5) for step, seconds in wall.items()}
    assert _scalars(events, "eval/accuracy") == {4: 0.5}
    assert _rows(_texts(events, "buckets/algorithms")[1]) == algorithms and len(algorithms) > 1


@pytest.mark.timeout(60)
def test_hook_all_ranks_writes_each_rank_into_its_own_run(tmp_path):
    results = run_threads(2, lambda comm: _hook_loop(comm, tmp_path, all_ranks=True, steps=2), timeout_s=40)
    for rank, (sent, _, _) in enumerate(results):
        assert _scalars(_events(tmp_path / f"rank-{rank}"), "comm/bytes_sent") == {1: sent[0], 2: sent[1]}


def test_an_unwritable_folder_is_refused_in_one_line_before_any_process(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for folder, said in ((blocker, "is a file, not a folder"), (blocker / "tb", "is not a writable folder")):
        result = run_cli(["train", "--nproc", "2", "--out", str(tmp_path / "run"), "--tensorboard", str(folder)],
                         capsys)
        assert result.returncode == 2
        assert result.stderr.strip() == f"gradsync train: error: --tensorboard {folder} {said}" + (
            ": Not a directory" if "writable" in said else "")
        assert not (tmp_path / "run").exists()  # nothing started, no run folder


def _hook_refusal(comm, folder, all_ranks: bool) -> str:
    """The one-line ValueError a rank's TensorBoardHook(model, folder) raised (the test fails if it raised none)."""
    model = gradsync.DataParallel(_Net(), group=comm, algorithm="ring")
    with pytest.raises(ValueError) as raised:
        TensorBoardHook(model, folder, all_ranks=all_ranks)
    return str(raised.value)


@pytest.mark.timeout(60)
def test_the_hook_refuses_a_bad_log_dir_on_every_rank_in_one_line(tmp_path, monkeypatch):
    """An empty, file or unwritable log_dir: every rank raises the same one-line ValueError at construction,
    as ``--tensorboard`` words it; with all_ranks, rank 1's bad folder is rank 0's error too."""
    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "rank-1").write_text("")  # all_ranks: rank 1's run folder is a file
    option = "TensorBoardHook log_dir"
    cases = [("", False, f"{option} needs a folder, got an empty string"),
             (blocker, False, f"{option} {blocker} is a file, not a folder"),
             (blocker / "tb", False, f"{option} {blocker / 'tb'} is not a writable folder: Not a directory"),
             (tmp_path / "tb", True, f"{option} {tmp_path / 'tb' / 'rank-1'} is a file, not a folder")]
    for folder, all_ranks, said in cases:
        messages = run_threads(2, lambda comm: _hook_refusal(comm, folder, all_ranks), timeout_s=40)
        assert messages == [said, said], folder
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file", "tb"]  # "" wrote nothing here
    assert not list(tmp_path.rglob("events.out.tfevents.*"))  # no rank opened an event file


def test_a_missing_extra_says_which_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails as if not installed
    result = run_cli(["train", "--out", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "tb")], capsys)
    assert result.returncode == 2  # refused before any process starts, as a bad option is
    assert result.stderr.count("\n") == 1
    assert "--tensorboard needs the 'tensorboard' extra" in result.stderr
    assert "pip install 'gradsync[tensorboard]'" in result.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "tb").exists()
    model = type("Model", (), {"comm": type("Comm", (), {"rank": 0})()})()
    with pytest.raises(MissingExtraError, match="TensorBoardHook needs the 'tensorboard' extra"):
        TensorBoardHook(model, tmp_path / "tb")


RUN_TAGS = {tag for tag in TAGS if tag.startswith("run/")}


def _elastic_async_lacks() -> set[str]:
    """The run/* tags docs/tensorboard.md's async bullet says an elastic async run does not write."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "tensorboard.md").read_text(encoding="utf-8")
    sentence = page.split("- **Async** runs", 1)[1].split("An elastic async run", 1)[1].split(". ", 1)[0]
    return {tag for tag in RUN_TAGS if f"`{tag}`" in sentence}


def test_an_elastic_async_summary_writes_no_nan_and_the_page_names_the_run_tags_it_lacks(tmp_path):
    """summary.json of ``--mode async --elastic`` has NaN communication totals (worker times are not kept
    across memberships): those run/* tags are left out, not written as NaN, and the page names them."""
    summary = {"steps": 150, "train_wall_s": 1.5, "samples_per_s": 3200.0, "communication_s": float("nan"),
               "exposed_communication_s": float("nan"), "bytes_sent_per_step": 60876.4,
               "final_test_accuracy": 0.32, "algorithms": [{"bucket_nbytes": 60800, "algorithm": "parameter_server"}]}
    from gradsync.train.tensorboard_events import EventWriter

    events = EventWriter(tmp_path)
    events.write_summary(summary)
    events.close()
    read = _events(tmp_path)
    written = {tag: _scalars(read, tag) for tag in RUN_TAGS & set(read.Tags()["scalars"])}
    assert written == {"run/samples_per_s": {150: 3200.0}, "run/bytes_sent_per_step": {150: pytest.approx(60876.4)},
                       "run/final_test_accuracy": {150: pytest.approx(0.32)}}
    assert _elastic_async_lacks() == RUN_TAGS - set(written)


MODES = {  # every mode and placement the loops serve besides the early job's (sync, static, local processes)
    "async": ["--mode", "async"],
    "async-elastic": ["--mode", "async", "--elastic"],
    "local-sgd": ["--mode", "local-sgd", "--sync-every", "2"],
    "deterministic-sharded": ["--deterministic", "--global-batch-size", "64", "--shard", "gradients"],
    "elastic": ["--elastic"],
    "hosts": ["--hosts", "2", "--nproc", "1"],
    "torchrun": [],
}
BASE = ["--model", "mlp", "--epochs", "2", "--num-samples", "400", "--batch-size", "32", "--timeout", "60",
        "--no-progress"]


def _run(tmp_path: Path, mode: str, capsys) -> None:
    """``gradsync train --tensorboard tmp_path/tb`` in ``mode`` (torchrun: a torchrun of 2 ranks)."""
    argv = [*BASE, "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--tensorboard",
            str(tmp_path / "tb")]
    if mode == "torchrun":
        env = {key: value for key, value in os.environ.items()
               if key not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "-m", "gradsync", "train", *argv]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    else:
        if mode == "hosts":
            from gradsync.hosts.netns import unavailable_reason

            if unavailable_reason():
                pytest.skip(unavailable_reason())
        result = run_cli(["train", "--nproc", "2", *argv, *MODES[mode]], capsys)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_writes_its_losses(tmp_path, capsys, mode):
    """Each mode's per-step loss scalars are its metrics.jsonl losses; accuracy at each evaluation; the
    algorithm text (a parameter server's 'parameter_server')."""
    _run(tmp_path, mode, capsys)
    records = read_metrics(tmp_path / "run" / METRICS_FILE)
    summary = json.loads((tmp_path / "run" / SUMMARY_FILE).read_text())
    events = _events(tmp_path / "tb")
    losses = {r["step"]: r["loss"] for r in records if r.get("kind") == "step"}
    assert len(losses) >= 4
    assert _scalars(events, "train/loss") == {step: pytest.approx(loss, rel=1e-6) for step, loss in losses.items()}
    accuracies = [r["test_accuracy"] for r in records if r.get("kind") == "epoch"]
    assert list(_scalars(events, "eval/accuracy").values()) == pytest.approx(accuracies, rel=1e-6)
    texts = _texts(events, "buckets/algorithms")
    assert all(entry["algorithm"] in texts[max(texts)] for entry in summary["algorithms"])
    run_tags = RUN_TAGS & set(events.Tags()["scalars"])
    if mode == "async-elastic":  # the totals the page says an elastic async run lacks, and only those
        assert RUN_TAGS - run_tags == _elastic_async_lacks()
    else:
        assert run_tags == RUN_TAGS
