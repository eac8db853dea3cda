"""``bench memory``'s models and their fixed batches: a decoder-only transformer (gpt) and bench train's MLP."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

DATA_SEED = 1234  # rank r draws its batch from DATA_SEED + r


class BenchModel(NamedTuple):
    """A bench model: ``name`` ("gpt" or "mlp"), its ``sizes`` and the sequences / samples per rank per step.

    gpt sizes: (vocabulary, context, width, depth, heads); mlp sizes: the layer widths.
    """

    name: str
    sizes: tuple[int, ...]
    batch_per_rank: int


MODELS = ("gpt", "mlp")
BENCH_MODELS = {"gpt": BenchModel("gpt", (256, 128, 512, 8, 8), 2),   # ~25.4M parameters, depth 8, bytes
                "mlp": BenchModel("mlp", (1024, 4096, 4096, 1024, 10), 64)}   # bench train's, ~25.2M


def build(spec: BenchModel) -> nn.Module:
    """The model of ``spec`` with fresh weights (seed the generator first for the same weights)."""
    if spec.name == "gpt":
        return _build_gpt(spec.sizes)
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(spec.sizes[:-1], spec.sizes[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def make_batch(spec: BenchModel, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed batch. gpt: token ids (B, context) int64 and the next tokens (B, context);
    mlp: inputs (B, widths[0]) float32 and labels (B,) int64. A step's speed does not depend on the values."""
    generator = torch.Generator().manual_seed(DATA_SEED + rank)
    if spec.name == "gpt":
        vocabulary, context = spec.sizes[:2]
        tokens = torch.randint(0, vocabulary, (spec.batch_per_rank, context + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]
    inputs = torch.randn(spec.batch_per_rank, spec.sizes[0], generator=generator)
    return inputs, torch.randint(0, spec.sizes[-1], (spec.batch_per_rank,), generator=generator)


def loss_of(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits (..., classes) against targets (...)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------- TEMPORARY placeholder gpt

def _build_gpt(sizes: tuple[int, ...]) -> nn.Module:
    """TEMPORARY: a nanoGPT-style decoder until ``gradsync train --model gpt``'s builder lands on main."""
    vocabulary, context, width, depth, heads = sizes

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):  # (B, T, width)
            q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
            q, k, v = (t.unflatten(-1, (heads, width // heads)).transpose(1, 2) for t in (q, k, v))  # (B, h, T, hs)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
            x = x + self.proj(attended)
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(vocabulary, width), nn.Embedding(context, width)
            self.blocks = nn.Sequential(*[Block() for _ in range(depth)])
            self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocabulary, bias=False)
            self.head.weight = self.tokens.weight  # tied, as GPT-2

        def forward(self, tokens):  # (B, T) int64 -> (B, T, vocabulary)
            x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))
            return self.head(self.ln(self.blocks(x)))

    return GPT()
