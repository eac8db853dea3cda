"""Int8 codec: each value in 8 bits with one float32 absmax scale per payload (4x fewer bytes than float32).

The scale maps the payload's largest magnitude to 127 (``scale = max|x| /
127``); each value is sent as ``round(x / scale)`` in [-127, 127] (symmetric,
-128 unused) and decoded as ``q * scale``, so the rounding error is at most
``scale / 2`` per element. OpenDiLoCo / INTELLECT-1 (Jaghouar et al. 2024)
send their outer pseudo-gradients in int8 this way; an error-feedback
residual (:mod:`~gradsync.compression.error_feedback`) keeps what the
rounding leaves out for the next round. A sum of int8 payloads with
different scales is not an int8 payload, so the codec travels in
:mod:`~gradsync.compression.two_phase`'s exchange: with its chunks, one scale
per chunk (the fragment cut into ``world_size`` chunks).

A payload whose values are not all finite carries a NaN scale: every decoded
value is then NaN, so the caller sees the overflow rather than a silent clamp.
"""

from __future__ import annotations

import math

import torch

from gradsync.collectives.call import Workspace

_HEADER_NBYTES = 4  # float32 scale
INT8_LEVEL = 127    # the largest code: symmetric around 0, so -x encodes as -(code of x)


class Int8Codec:
    """Payload: float32 scale, then one int8 code per value."""

    header_nbytes = _HEADER_NBYTES

    def __init__(self):
        self._scratch = Workspace()

    def payload_nbytes(self, numel: int) -> int:
        return _HEADER_NBYTES + numel

    def encode(self, values: torch.Tensor, payload: torch.Tensor) -> None:
        """Write ``values`` (``(numel,)`` float) into ``payload[:payload_nbytes(numel)]`` (uint8)."""
        numel = values.numel()
        scale = absmax_scale(values)
        payload[:_HEADER_NBYTES].view(torch.float32)[0] = scale
        codes = payload[_HEADER_NBYTES:_HEADER_NBYTES + numel].view(torch.int8)
        if numel == 0:
            return
        if not scale > 0:  # all zeros (scale 0) or non-finite (scale NaN): the codes are not read
            codes.zero_()
            return
        scaled = self._scratch.get(numel, torch.float32, values.device)
        torch.div(values, scale, out=scaled)
        codes.copy_(scaled.round_().clamp_(-INT8_LEVEL, INT8_LEVEL))

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``(numel,)`` values ``payload`` stands for, written into ``out`` when given (float32 otherwise)."""
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        out.copy_(payload[_HEADER_NBYTES:_HEADER_NBYTES + numel].view(torch.int8))
        out *= payload[:_HEADER_NBYTES].view(torch.float32)[0]
        return out


def absmax_scale(values: torch.Tensor) -> float:
    """``max |values| / 127`` (0.0 for an empty or all-zero tensor, NaN when a value is not finite)."""
    if values.numel() == 0:
        return 0.0
    low, high = (float(bound) for bound in torch.aminmax(values))  # one pass, no |x| copy
    if not (math.isfinite(low) and math.isfinite(high)):
        return math.nan
    # rounded to float32 here, so that encoding divides by the very scale the payload carries
    return float(torch.tensor(max(-low, high) / INT8_LEVEL, dtype=torch.float32))
