"""What a run learns, chosen by ``--model``: MNIST-1D's ten classes, or the gpt's next character of its corpus.

A :class:`Task` gives the job its data (the cached arrays every worker
loads, and the training-sample count checked before any process starts),
the model's size options and its own ``summary.json`` fields. The loss and
the metric are one formula for both tasks, written over positions: logits
``(..., C)`` against integer targets ``(...)`` -- a classifier's ``(B, 10)``
against ``(B,)``, the gpt's ``(B, T, 256)`` against ``(B, T)``. A sample's
loss is the mean cross-entropy over its positions (one for a classifier),
so a batch's mean is the mean over all positions and a sum over samples
(``--global-batch-size``, ``--deterministic``) counts each sample once,
whatever its length; the accuracy counts positions whose argmax is the
target (the gpt's: next-character accuracy on the test split).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.train import corpus, data
from gradsync.train.models import MODELS, build_model


def sample_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` ``(B, ..., C)`` against int64 ``targets`` ``(B, ...)``: ``"mean"`` over all
    positions, or ``"sum"`` over samples of each sample's mean over its positions (a scalar, float32)."""
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)
    return flat / math.prod(targets.shape[1:]) if reduction == "sum" else flat


def position_counts(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, int, int]:
    """``(loss sum, correct, positions)`` over every position of a test batch (loss in nats, summed)."""
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    loss = F.cross_entropy(flat_logits, flat_targets, reduction="sum").item()
    correct = int((flat_logits.argmax(-1) == flat_targets).sum().item())
    return loss, correct, flat_targets.numel()


class Task:
    """One kind of run: its data, its model sizes, its summary fields (the base: MNIST-1D classification)."""

    name = "classification"
    metric = "test accuracy (MNIST-1D, ten classes)"

    def prepare(self, config) -> Path:
        """Cache the data if needed (on this machine, once per job) and return the ``.npz`` every worker loads."""
        return data.prepare(config.data_dir, config.num_samples)

    def num_train(self, config) -> int:
        """Training samples the job will have (before any data is made)."""
        return data.num_train_samples(config.num_samples)

    def sizes(self, config) -> dict:
        """``config``'s size options as :func:`~gradsync.train.models.build_model`'s keywords."""
        return {}

    def summary_fields(self, epochs: list[dict]) -> dict:
        """What this task adds to ``summary.json``: its name and what ``test_accuracy`` counts."""
        return {"task": self.name, "metric": self.metric}


class LanguageModel(Task):
    """The gpt on :mod:`~gradsync.train.corpus`: windows of ``--gpt-context`` bytes, next-character targets."""

    name = "language model"
    metric = "next-character accuracy on the corpus's test split"

    def prepare(self, config) -> Path:
        return corpus.prepare(config.data_dir, config.gpt_context)

    def num_train(self, config) -> int:
        return corpus.num_train_windows(config.gpt_context)

    def sizes(self, config) -> dict:
        return {"width": config.gpt_width, "depth": config.gpt_depth, "heads": config.gpt_heads,
                "context": config.gpt_context}

    def summary_fields(self, epochs: list[dict]) -> dict:
        loss = epochs[-1]["test_loss"] if epochs else math.nan
        return {**super().summary_fields(epochs), "final_test_perplexity": math.exp(min(loss, 709.0)),
                "corpus": corpus.describe()}


CLASSIFICATION, LANGUAGE_MODEL = Task(), LanguageModel()
TASKS = {name: LANGUAGE_MODEL if name == "gpt" else CLASSIFICATION for name in MODELS}


def task_for(model: str) -> Task:
    """The task of ``--model`` (ValueError listing the models if unknown)."""
    if model not in TASKS:
        raise ValueError(f"unknown --model {model!r}; choose one of {', '.join(MODELS)}")
    return TASKS[model]


def make_model(config) -> nn.Module:
    """A fresh model as ``config`` names it, at its size options (seed the RNG first for the same init)."""
    return build_model(config.model, **task_for(config.model).sizes(config))


def prepare_data(config) -> Path:
    """The ``.npz`` of ``config``'s task (made and cached once); what every worker of the job loads."""
    return task_for(config.model).prepare(config)


def num_train(config) -> int:
    """Training samples of ``config``'s task (MNIST-1D examples, or the gpt's windows)."""
    return task_for(config.model).num_train(config)
