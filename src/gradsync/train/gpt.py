"""The gpt: a small decoder-only transformer over bytes (GPT-2's layout, Radford et al. 2019; nanoGPT's code shape).

Token and learned position embeddings, ``depth`` pre-LayerNorm blocks of
causal multi-head self-attention (``torch.nn.functional.scaled_dot_product_attention``
with ``is_causal=True``) and a GELU MLP of 4 x ``width``, a final LayerNorm
and a linear head whose weight is the token embedding's (tied, as GPT-2; so
the head adds no parameters). No dropout: a step computes the same bits
whatever the run, which ``--deterministic`` needs. Initialisation is
GPT-2's: N(0, 0.02) weights, zero biases, the residual projections scaled by
1 / sqrt(2 x depth).

Parameters: ``depth x (12 W^2 + 13 W) + (V + T) x W + 2 W`` for width W,
context T and V tokens (each block: qkv 3W^2 + 3W, projection W^2 + W, MLP
8W^2 + 5W, two LayerNorms 4W; then the embeddings and the final LayerNorm).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 256  # byte-level: a token is one byte of the UTF-8 text (gradsync.train.corpus)
GPT_DEFAULT = {"width": 128, "depth": 4, "heads": 4, "context": 64}  # gradsync train --model gpt: ~0.8M
GPT_BENCH = {"width": 512, "depth": 8, "heads": 8, "context": 128}  # the benches' transformer: ~25.4M
INIT_STD = 0.02
MAX_CONTEXT = 4096  # the corpus's test split (~46k bytes) still holds 11 windows


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t only."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, W) -> (B, T, W)
        batch, length, width = h.shape
        q, k, v = self.qkv(h).split(width, dim=2)  # each (B, T, W)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, W / heads)
        return self.proj(out.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``h + attn(ln(h))``, then ``h + mlp(ln(h))``."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, W) -> (B, T, W)
        h = h + self.attn(self.ln1(h))
        return h + self.proj(F.gelu(self.fc(self.ln2(h))))


class GPT(nn.Module):
    """Decoder-only transformer: int64 token ids ``(B, T)``, T <= ``context`` -> float32 logits ``(B, T, vocab_size)``.

    Raises:
        ValueError: a size < 1, or ``width`` not divisible by ``heads`` (the message names the option).
    """

    def __init__(self, width: int = GPT_DEFAULT["width"], depth: int = GPT_DEFAULT["depth"],
                 heads: int = GPT_DEFAULT["heads"], context: int = GPT_DEFAULT["context"],
                 vocab_size: int = VOCAB_SIZE):
        super().__init__()
        problem = size_problem(width, depth, heads, context)
        if problem:
            raise ValueError(problem)
        self.context = context
        self.token = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.token.weight  # tied: one (V, W) matrix embeds and reads out
        self._init_weights(depth)

    def _init_weights(self, depth: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:  # GPT-2: residual branches scaled by depth
            for proj in (block.attn.proj, block.proj):
                nn.init.normal_(proj.weight, 0.0, INIT_STD / math.sqrt(2 * depth))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) int64 -> (B, T, V)
        length = tokens.shape[1]
        if length > self.context:
            raise ValueError(f"the gpt reads at most --gpt-context {self.context} tokens, got {length}")
        positions = torch.arange(length, device=tokens.device)
        h = self.token(tokens) + self.position(positions)  # (B, T, W)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def size_problem(width: int, depth: int, heads: int, context: int) -> str | None:
    """The one-line reason these gpt sizes are invalid (naming the option), or None."""
    for name, value in (("width", width), ("depth", depth), ("heads", heads), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"--gpt-{name} must be an int >= 1, got {value!r}"
    if context > MAX_CONTEXT:
        return f"--gpt-context must be <= {MAX_CONTEXT} (the corpus's test split must hold windows), got {context}"
    if width % heads:
        return f"--gpt-width {width} must be divisible by --gpt-heads {heads} (each head takes width / heads)"
    return None
