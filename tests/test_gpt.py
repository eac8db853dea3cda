"""The gpt (``--model gpt``): its shapes, causality and parameter count, its corpus, its loss, and one CLI run.

The parameter count is checked against a formula written here from the
architecture (not read from the model), the corpus against facts about the
text that ``help()`` shows, and the CLI run's next-character accuracy
against the best guess without a model (the test split's most common byte).
"""

from __future__ import annotations

import json
import math
import socket
import sys

import pytest
import torch
import torch.nn.functional as F

from _cli import run_cli
from _early import early_job
from gradsync.train import corpus
from gradsync.train.data import load
from gradsync.train.gpt import GPT, GPT_BENCH, GPT_DEFAULT, VOCAB_SIZE
from gradsync.train.models import build_model
from gradsync.train.task import position_counts, sample_loss

TINY = {"width": 16, "depth": 2, "heads": 2, "context": 8}


def expected_parameters(width: int, depth: int, context: int, vocab: int = VOCAB_SIZE) -> int:
    """GPT-2's count with a tied head: per block LayerNorm (2W) + qkv (3W^2 + 3W) + projection (W^2 + W)
    + LayerNorm (2W) + MLP (W x 4W + 4W, 4W x W + W); token and position tables; final LayerNorm."""
    block = 2 * width + (3 * width * width + 3 * width) + (width * width + width) + 2 * width \
        + (4 * width * width + 4 * width) + (4 * width * width + width)
    return depth * block + vocab * width + context * width + 2 * width


@pytest.mark.parametrize("sizes", [TINY, {"width": 24, "depth": 3, "heads": 4, "context": 5}, GPT_DEFAULT])
def test_parameter_count_is_the_formula(sizes):
    model = build_model("gpt", **sizes)
    assert sum(p.numel() for p in model.parameters()) == expected_parameters(
        sizes["width"], sizes["depth"], sizes["context"])
    assert model.head.weight is model.token.weight  # tied: the head adds no parameters


def test_the_bench_size_is_a_transformer_people_shard():
    """The issue's floor for the benches: >= 20M parameters and >= 8 blocks."""
    assert GPT_BENCH["depth"] >= 8
    assert expected_parameters(GPT_BENCH["width"], GPT_BENCH["depth"], GPT_BENCH["context"]) >= 20_000_000
    assert GPT_BENCH["width"] % GPT_BENCH["heads"] == 0


def test_output_shape_and_a_too_long_input():
    torch.manual_seed(0)
    model = GPT(**TINY)
    assert model(torch.randint(0, VOCAB_SIZE, (3, 8))).shape == (3, 8, VOCAB_SIZE)
    assert model(torch.randint(0, VOCAB_SIZE, (2, 5))).shape == (2, 5, VOCAB_SIZE)
    with pytest.raises(ValueError, match="--gpt-context 8"):
        model(torch.randint(0, VOCAB_SIZE, (1, 9)))
    with pytest.raises(ValueError, match="--gpt-width 30 must be divisible by --gpt-heads 4"):
        GPT(width=30, heads=4)


def test_a_later_token_does_not_change_earlier_logits():
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    tokens = torch.randint(0, VOCAB_SIZE, (2, 8))
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % VOCAB_SIZE
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :5], after[:, :5])
    assert not torch.allclose(before[:, 5:], after[:, 5:])  # and the change does reach its own position on


def test_corpus_is_pythons_help_text_read_without_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the corpus tried to open a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.delitem(sys.modules, "pydoc_data.topics", raising=False)
    corpus.corpus_bytes.cache_clear()
    text = corpus.corpus_bytes()
    corpus.corpus_bytes.cache_clear()
    assert corpus.corpus_bytes() == text  # the same bytes on every read
    from pydoc_data.topics import topics

    assert text.startswith(b'The "assert" statement')  # the first topic in sorted order
    assert topics["with"].encode() in text
    assert 300_000 < len(text) < 3_000_000
    described = corpus.describe()
    assert described["bytes"] == len(text) and described["source"] == "pydoc_data.topics"


def test_splits_are_contiguous_windows_with_next_byte_targets(tmp_path):
    context = 256
    ids = torch.tensor(list(corpus.corpus_bytes()))
    cut = int(len(ids) * 0.9)
    splits = load(corpus.prepare(tmp_path, context))
    assert len(splits.x_train) == (cut - 1) // context == corpus.num_train_windows(context)
    assert len(splits.x_test) == (len(ids) - cut - 1) // context
    assert splits.x_train.dtype == splits.y_train.dtype == torch.int64
    assert torch.equal(splits.x_train.flatten(), ids[:len(splits.x_train) * context])
    assert torch.equal(splits.y_train.flatten(), ids[1:len(splits.x_train) * context + 1])
    assert torch.equal(splits.x_test[0], ids[cut:cut + context])  # the test split is the last tenth
    again = load(corpus.prepare(tmp_path, context))  # cached: the same arrays
    assert torch.equal(again.x_test, splits.x_test)
    x, y = corpus.batch(4, context, seed=1)
    assert x.shape == y.shape == (4, context) and torch.equal(x[:, 1:], y[:, :-1])


def test_a_sum_over_samples_counts_each_sample_once_whatever_its_length():
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    per_sample = torch.stack([F.cross_entropy(logits[b], targets[b]) for b in range(3)])
    assert torch.allclose(sample_loss(logits, targets, reduction="sum"), per_sample.sum())
    assert torch.allclose(sample_loss(logits, targets), per_sample.mean())
    flat_logits, flat_targets = torch.randn(6, 10), torch.randint(0, 10, (6,))  # a classifier: as before
    assert torch.allclose(sample_loss(flat_logits, flat_targets, reduction="sum"),
                          F.cross_entropy(flat_logits, flat_targets, reduction="sum"))
    loss, correct, count = position_counts(logits, targets)
    assert count == 15 and correct == int((logits.argmax(-1) == targets).sum())
    assert loss == pytest.approx(per_sample.sum().item() * 5, rel=1e-6)


@pytest.mark.parametrize("args, needle", [
    (["--gpt-width", "64"], "--gpt-width needs --model gpt"),
    (["--model", "gpt", "--num-samples", "400"], "--num-samples is not honoured with --model gpt"),
    (["--model", "gpt", "--gpt-heads", "0"], "--gpt-heads must be an int >= 1"),
])
def test_options_that_do_not_fit_the_model_are_refused_in_one_line(args, needle, tmp_path, capsys):
    result = run_cli(["train", *args, "--out", str(tmp_path / "run")], capsys)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("gradsync train: error: ") and needle in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


SIZES = {"width": 32, "depth": 1, "heads": 2, "context": 32}
GPT_RUN = early_job("cli-gpt-run", [
    "train", "--model", "gpt", "--nproc", "2", "--epochs", "1", "--gpt-width", "32", "--gpt-depth", "1",
    "--gpt-heads", "2", "--gpt-context", "32", "--data-dir", "{folder}/data", "--out", "{folder}/run",
    "--no-progress", "--timeout", "60"])


@pytest.mark.dist
@pytest.mark.early_job(GPT_RUN)
@pytest.mark.timeout(150)
def test_cli_gpt_run_predicts_the_next_character_better_than_the_commonest_byte(early):
    result = early.wait(140)
    assert result.returncode == 0, result.stderr
    summary = json.loads((early.folder / "run" / "summary.json").read_text())
    _, test = corpus.split_tokens()
    commonest = torch.bincount(test, minlength=VOCAB_SIZE).max().item() / len(test)  # a space, ~25%
    assert summary["final_test_accuracy"] > commonest + 0.03, (summary["final_test_accuracy"], commonest)
    assert summary["task"] == "language model"
    assert summary["final_test_perplexity"] == pytest.approx(math.exp(summary["final_test_loss"]))
    assert summary["final_test_loss"] < math.log(VOCAB_SIZE) - 1  # chance is ln 256 = 5.5 nats
    assert summary["num_parameters"] == expected_parameters(SIZES["width"], SIZES["depth"], SIZES["context"])
    windows = corpus.num_train_windows(SIZES["context"])
    assert summary["train_samples"] == windows
    assert summary["steps"] == -(-windows // 2) // 32  # per rank (padded to equal shares) / --batch-size 32
    assert summary["config"]["lr"] == 1e-3  # the gpt's default
    assert summary["corpus"]["sha256"] == corpus.describe()["sha256"]
