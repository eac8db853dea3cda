"""FP16 and BF16 compression: send each value in 16 bits, accumulate in float32 (2x fewer bytes).

As PyTorch's ``fp16_compress_hook`` and Horovod's ``Compression.fp16``, but
the 16-bit values only travel: the reduce is the two-phase one of
:mod:`~gradsync.compression.two_phase`, so every sum is formed in float32
by the chunk's owner and rounding to 16 bits happens twice (once on the way
in, once on the way out), never once per hop.

float16 has 5 exponent bits (largest 65504, smallest subnormal 2^-24), so
every fp16 payload carries a power-of-two scale chosen from its largest
magnitude: the largest value maps below 2^15, neither overflowing nor
flushing small gradients to zero; scaling by a power of two is exact.
bfloat16 has float32's exponent range and needs no scale.
"""

from __future__ import annotations

import math

import torch

from gradsync.collectives.call import Workspace
from gradsync.collectives.communicator import Communicator
from gradsync.compression import two_phase
from gradsync.compression.compressor import BucketLayout, Compressor

_HEADER_NBYTES = 4          # float32 scale (fp16 only)
_FP16_TOP_EXPONENT = 15     # the largest magnitude is scaled below 2^15 < 65504
_SCALE_EXPONENT_LIMIT = 120  # keeps the scale itself a finite float32


class CastCodec:
    """Payload: [float32 power-of-two scale], then the values in ``dtype``."""

    def __init__(self, dtype: torch.dtype, scaled: bool):
        self.dtype = dtype
        self.header_nbytes = _HEADER_NBYTES if scaled else 0
        self._scratch = Workspace()

    def payload_nbytes(self, numel: int) -> int:
        return self.header_nbytes + numel * self.dtype.itemsize

    def encode(self, values: torch.Tensor, payload: torch.Tensor) -> None:
        data = payload[self.header_nbytes:self.payload_nbytes(values.numel())].view(self.dtype)
        if not self.header_nbytes:
            data.copy_(values)
            return
        scale = fp16_scale(values)
        payload[:_HEADER_NBYTES].view(torch.float32)[0] = scale
        scaled = self._scratch.get(values.numel(), values.dtype, values.device)
        torch.mul(values, scale, out=scaled)  # in float32 first: exact (a power of two), then round once
        data.copy_(scaled)

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``(numel,)`` values, written into ``out`` when given (float32 otherwise)."""
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        out.copy_(payload[self.header_nbytes:self.payload_nbytes(numel)].view(self.dtype))
        if self.header_nbytes:
            out /= payload[:_HEADER_NBYTES].view(torch.float32)[0]
        return out


def fp16_scale(values: torch.Tensor) -> float:
    """The power of two that maps ``max |values|`` into [2^14, 2^15) (1.0 for empty, zero or non-finite)."""
    if values.numel() == 0:
        return 1.0
    low, high = (float(bound) for bound in torch.aminmax(values))  # one pass, no |x| copy
    if not (math.isfinite(low) and math.isfinite(high)) or low == high == 0:
        return 1.0
    largest = max(-low, high)
    exponent = math.frexp(largest)[1]  # largest < 2^exponent
    shift = max(-_SCALE_EXPONENT_LIMIT, min(_SCALE_EXPONENT_LIMIT, _FP16_TOP_EXPONENT - exponent))
    return math.ldexp(1.0, shift)


class FP16(Compressor):
    """Send gradients as scaled float16, sum in float32: 2x fewer bytes, no state.

    Reference: Micikevicius et al. 2018, "Mixed precision training" (scaling
    into fp16's range); PyTorch ``fp16_compress_hook``; Horovod ``Compression.fp16``.
    """

    name = "fp16"
    can_reduce_scatter = True

    def __init__(self, warmup_steps: int = 0):
        super().__init__(warmup_steps)
        self.codec = CastCodec(torch.float16, scaled=True)

    def _reduce_float(self, flat: torch.Tensor, layout: BucketLayout, comm: Communicator, divisor: int,
                      algorithm: str) -> None:
        two_phase.reduce(flat, layout, comm, divisor, self.codec)

    def _reduce_scatter_float(self, flat: torch.Tensor, layout: BucketLayout, comm: Communicator,
                              divisor: int) -> tuple[int, int]:
        return two_phase.reduce_scatter(flat, layout, comm, divisor, self.codec)


class BF16(FP16):
    """Send gradients as bfloat16 (float32's exponent range, 8 bits of mantissa), sum in float32.

    Reference: Kalamkar et al. 2019, "A study of BFLOAT16 for deep learning
    training"; PyTorch ``bf16_compress_hook``.
    """

    name = "bf16"

    def __init__(self, warmup_steps: int = 0):
        Compressor.__init__(self, warmup_steps)
        self.codec = CastCodec(torch.bfloat16, scaled=False)
