"""Top-k sparsification with error feedback (Lin et al. 2018, Deep Gradient Compression; Stich et al. 2018).

Each rank sends only the k = ceil(ratio · numel) entries of its bucket with
the largest magnitude, as (value, index) pairs, and keeps everything else in
its error-feedback residual for the next step. The ranks' index sets differ,
so the pairs are exchanged with an all-gather and every rank scatters all of
them, in rank order, into a zero bucket and divides by the number of ranks:
the same sum, bitwise, everywhere. Bytes per rank: (p-1) · 8k, i.e.
ratio · p of a float32 ring's 2(p-1)/p · 4 · numel.
"""

from __future__ import annotations

import math

import torch

from gradsync.collectives import ops as collectives
from gradsync.collectives.call import Workspace
from gradsync.collectives.communicator import Communicator
from gradsync.compression.compressor import BucketLayout, Compressor
from gradsync.compression.error_feedback import ErrorFeedback


SAMPLE_EVERY = 64   # threshold estimated from every 64th magnitude
OVERSAMPLE = 1.5    # candidates aimed at: 1.5 k, so that at least k pass the threshold


def top_indices(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest of ``magnitudes`` (``(n,)``, unordered), as ``torch.topk`` gives them.

    For large tensors, a threshold is first estimated from a strided sample
    (Lin et al. 2018 sample too) so that ~1.5 k candidates pass it, and the
    exact top-k is taken among the candidates: ~3x faster than ``topk`` over
    25M elements. Too few candidates fall back to the full ``topk``.
    """
    numel = magnitudes.numel()
    if numel < 64 * SAMPLE_EVERY or k * 4 > numel:
        return magnitudes.topk(k, sorted=False).indices
    sample = magnitudes[::SAMPLE_EVERY]
    wanted = min(sample.numel(), max(1, int(k * OVERSAMPLE * sample.numel() / numel)))
    threshold = sample.topk(wanted, sorted=False).values.min()
    candidates = (magnitudes >= threshold).nonzero().view(-1)
    if candidates.numel() < k:
        return magnitudes.topk(k, sorted=False).indices
    return candidates[magnitudes[candidates].topk(k, sorted=False).indices]


class TopK(Compressor):
    """Send the ``ratio`` largest-magnitude fraction of each bucket; error feedback keeps the rest.

    Args:
        ratio: fraction of each bucket's elements sent, in (0, 1]; at least
            one element per bucket.

    Raises:
        ValueError: ``ratio`` outside (0, 1].

    State (:meth:`state_dict`): ``{"residual": {name: tensor shaped like the parameter}}``.
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01, warmup_steps: int = 0):
        super().__init__(warmup_steps)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"TopK ratio must be a number in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        self.feedback = ErrorFeedback()
        self._scratch = Workspace()

    def k_for(self, numel: int) -> int:
        """Elements sent for a bucket of ``numel`` elements."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def _reduce_float(self, flat: torch.Tensor, layout: BucketLayout, comm: Communicator, divisor: int,
                      algorithm: str) -> None:
        k = self.k_for(flat.numel())
        payload = torch.empty(2 * k, dtype=torch.int32, device=flat.device)

        def transmit(values: torch.Tensor) -> torch.Tensor:
            magnitudes = torch.abs(values, out=self._scratch.get(values.numel(), values.dtype, values.device))
            indices = top_indices(magnitudes, k)
            kept = values[indices].to(torch.float32)
            payload[:k] = kept.view(torch.int32)
            payload[k:] = indices.to(torch.int32)
            transmitted = magnitudes.zero_()  # the scratch is free again: no bucket-sized allocation per step
            transmitted[indices] = kept.to(values.dtype)
            return transmitted

        self.feedback.step(layout, flat, transmit)
        gathered = collectives.all_gather(payload, comm, verify=False)
        flat.zero_()
        for part in gathered:  # rank order: the same sum everywhere
            flat.index_add_(0, part[k:].long(), part[:k].view(torch.float32).to(flat.dtype))
        flat /= divisor

    def _state_dict(self) -> dict:
        return {"residual": self.feedback.state_dict()}

    def _load_state_dict(self, state: dict) -> None:
        self.feedback.load_state_dict(state["residual"])

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio!r}, warmup_steps={self.warmup_steps})"  # exact: settings compare it
