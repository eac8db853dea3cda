"""``bench memory``'s models and their fixed batches: ``gradsync train``'s gpt at the benches' size, bench train's MLP."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.train import corpus
from gradsync.train.gpt import GPT_BENCH, VOCAB_SIZE
from gradsync.train.models import build_model

DATA_SEED = 1234  # rank r draws its batch from DATA_SEED + r


class BenchModel(NamedTuple):
    """A bench model: ``name`` ("gpt" or "mlp"), its ``sizes`` and the sequences / samples per rank per step.

    gpt sizes: (vocabulary, context, width, depth, heads); mlp sizes: the layer widths.
    """

    name: str
    sizes: tuple[int, ...]
    batch_per_rank: int


MODELS = ("gpt", "mlp")
BENCH_MODELS = {  # the gpt: ~25.4M parameters, depth 8, over bytes; the MLP: bench train's, ~25.2M
    "gpt": BenchModel("gpt", (VOCAB_SIZE, GPT_BENCH["context"], GPT_BENCH["width"], GPT_BENCH["depth"],
                              GPT_BENCH["heads"]), 2),
    "mlp": BenchModel("mlp", (1024, 4096, 4096, 1024, 10), 64)}


def build(spec: BenchModel) -> nn.Module:
    """The model of ``spec`` with fresh weights (seed the generator first for the same weights): the gpt
    of ``gradsync train --model gpt`` (:class:`gradsync.train.gpt.GPT`) or an MLP with ReLUs between layers."""
    if spec.name == "gpt":
        vocabulary, context, width, depth, heads = spec.sizes
        return build_model("gpt", width=width, depth=depth, heads=heads, context=context, vocab_size=vocabulary)
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(spec.sizes[:-1], spec.sizes[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def make_batch(spec: BenchModel, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed batch. gpt: windows of the gpt's corpus (:mod:`gradsync.train.corpus`, Python's help
    texts as bytes) at seeded random places, token ids (B, context) int64 and the next tokens (B, context);
    mlp: random inputs (B, widths[0]) float32 and labels (B,) int64."""
    generator = torch.Generator().manual_seed(DATA_SEED + rank)
    if spec.name == "gpt":
        context = spec.sizes[1]
        text = corpus.tokens()
        starts = torch.randint(0, text.numel() - context - 1, (spec.batch_per_rank,), generator=generator)
        windows = torch.stack([text[start:start + context + 1] for start in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]
    inputs = torch.randn(spec.batch_per_rank, spec.sizes[0], generator=generator)
    return inputs, torch.randint(0, spec.sizes[-1], (spec.batch_per_rank,), generator=generator)


def loss_of(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits (..., classes) against targets (...)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
