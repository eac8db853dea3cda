"""1-bit compression with error feedback (Seide et al. 2014; Karimireddy et al. 2019; Tang et al. 2021).

Each chunk travels as its signs, packed 8 per byte, and one float32 scale,
the chunk's mean absolute value (the scale s minimising ||x - s·sign(x)||).
What the signs leave out is kept per rank and added to the next step's
gradient (error feedback), so no gradient is lost, only delayed. Because a
sum of signs is not a sign, the reduce has two phases, as 1-bit Adam's
(:mod:`~gradsync.compression.two_phase`): signs to each chunk's owner, which
averages, compresses again with its own server-side error feedback, and the
compressed averages are all-gathered. Bytes per rank: about 2(p-1)/p · n/8,
1/32 of a float32 ring.
"""

from __future__ import annotations

import numpy as np
import torch

from gradsync.collectives.call import Workspace
from gradsync.collectives.communicator import Communicator
from gradsync.compression import two_phase
from gradsync.compression.compressor import BucketLayout, Compressor
from gradsync.compression.error_feedback import ErrorFeedback

DEFAULT_BLOCK_NUMEL = 32   # elements per scale: 1 + 4/32 bits per element, 28.4x fewer than float32
_REF_NBYTES = 4            # float32: the chunk's largest block scale
_STEPS_PER_OCTAVE = 2      # 4-bit scale codes k: ref * 2^(-k/2), k = 0..14 (7 octaves); 15: zero
_ZERO_CODE = 15
_LEVELS = torch.cat([torch.exp2(-torch.arange(_ZERO_CODE, dtype=torch.float32) / _STEPS_PER_OCTAVE),
                     torch.zeros(1)])  # code -> fraction of ref
_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)  # most significant bit first
# row b: the 8 signs (+1 / -1) that byte value b stands for, MSB first
_SIGNS_OF_BYTE = ((torch.arange(256, dtype=torch.uint8).unsqueeze(1) >> _SHIFTS) & 1).to(torch.float32) * 2 - 1


def pack_signs(values: torch.Tensor, out: torch.Tensor) -> None:
    """Write bit k = (values[k] >= 0) of ``values`` (``(n,)``) into ``out`` (uint8, ``ceil(n/8)``), MSB first."""
    if values.device.type == "cpu":  # numpy's packbits is ~3x faster than the shift-and-sum below
        out.copy_(torch.from_numpy(np.packbits((values >= 0).numpy())))
        return
    numel = values.numel()
    padded = torch.zeros(-(-numel // 8) * 8, dtype=torch.uint8, device=values.device)
    padded[:numel] = values >= 0
    torch.sum(padded.view(-1, 8) << _SHIFTS.to(values.device), dim=1, dtype=torch.uint8, out=out)


def unpack_signs(packed: torch.Tensor, numel: int, out: torch.Tensor) -> None:
    """Write +1 / -1 for each of the ``numel`` bits of ``packed`` (1 = +1) into ``out`` (``(numel,)``)."""
    table = _SIGNS_OF_BYTE.to(device=out.device, dtype=out.dtype)  # (256, 8)
    whole = numel // 8
    torch.index_select(table, 0, packed[:whole].long(), out=out[:whole * 8].view(whole, 8))
    if numel > whole * 8:
        out[whole * 8:] = table[int(packed[whole])][:numel - whole * 8]


class SignCodec:
    """Signs with one scale per block of ``block_numel`` elements, the scales log-quantised to 4 bits.

    Payload: the chunk's largest block scale ``ref`` (float32), 4 bits per
    block (code k = 0..14: scale = ref · 2^(-k/2), within 19% of the
    block's mean |x| down to ref/128, and ref/128 for smaller non-zero
    blocks; 15: zero), then the packed signs. With 32-element
    blocks that is 1 + 4/32 = 1.125 bits per element, 28.4x fewer than
    float32. Measured on the MNIST-1D CNN, fine blocks matter more than
    exact scales: one float32 scale per 256 elements (same bytes) ended
    ~2 points of test accuracy below these 32-element blocks; error
    feedback absorbs the scales' rounding.

    Args:
        block_numel: elements per scale, a positive multiple of 8.
    """

    def __init__(self, block_numel: int = DEFAULT_BLOCK_NUMEL):
        if isinstance(block_numel, bool) or not isinstance(block_numel, int) or block_numel < 8 or block_numel % 8:
            raise ValueError(f"block_numel must be a positive multiple of 8, got {block_numel!r}")
        self.block_numel = block_numel
        self._scratch = Workspace()

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block_numel)

    def _code_nbytes(self, numel: int) -> int:
        return -(-self._blocks(numel) // 2)  # two 4-bit codes per byte

    def payload_nbytes(self, numel: int) -> int:
        return _REF_NBYTES + self._code_nbytes(numel) + -(-numel // 8)

    def encode(self, values: torch.Tensor, payload: torch.Tensor) -> None:
        numel, blocks = values.numel(), self._blocks(values.numel())
        code_end = _REF_NBYTES + self._code_nbytes(numel)
        scales = self._block_means(values)
        ref = scales.max() if blocks else values.new_zeros(())
        payload[:_REF_NBYTES].view(torch.float32)[0] = ref
        if blocks:
            steps = (torch.log2(ref / scales) * _STEPS_PER_OCTAVE).round_().clamp_(0, _ZERO_CODE - 1)
            codes = torch.full((2 * (code_end - _REF_NBYTES),), _ZERO_CODE, dtype=torch.uint8, device=values.device)
            codes[:blocks] = torch.where(scales > 0, steps, _ZERO_CODE)
            payload[_REF_NBYTES:code_end] = (codes[0::2] << 4) | codes[1::2]
        pack_signs(values, payload[code_end:code_end + -(-numel // 8)])

    def _block_means(self, values: torch.Tensor) -> torch.Tensor:
        numel, size = values.numel(), self.block_numel
        whole = numel // size
        magnitudes = self._scratch.get(numel, values.dtype, values.device)
        torch.abs(values, out=magnitudes)  # into a reused buffer: fresh memory costs a first touch
        means = magnitudes[:whole * size].view(whole, size).sum(dim=1).div_(size).float()
        if numel > whole * size:
            means = torch.cat([means, magnitudes[whole * size:].mean().float().view(1)])
        return means

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``(numel,)`` values, each +-its block's scale, written into ``out`` when given."""
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        blocks, size = self._blocks(numel), self.block_numel
        code_end = _REF_NBYTES + self._code_nbytes(numel)
        ref = payload[:_REF_NBYTES].view(torch.float32)[0]
        packed_codes = payload[_REF_NBYTES:code_end]
        codes = torch.stack([packed_codes >> 4, packed_codes & 15], dim=1).view(-1)[:blocks]
        scales = _LEVELS.to(out.device)[codes.long()] * ref
        unpack_signs(payload[code_end:code_end + -(-numel // 8)], numel, out)
        whole = numel // size
        out[:whole * size].view(whole, size).mul_(scales[:whole].unsqueeze(1).to(out.dtype))
        if numel > whole * size:
            out[whole * size:] *= scales[whole]
        return out


class OneBit(Compressor):
    """1-bit sign compression with worker- and server-side error feedback, ~32x fewer bytes than float32.

    State (:meth:`state_dict`): ``{"worker": {name: residual}, "server":
    {name: residual}}``, tensors shaped like the parameters; the server
    residual is non-zero only on the chunk this rank owns.

    Reference: Seide et al. 2014, "1-bit stochastic gradient descent ...";
    Karimireddy et al. 2019, "Error feedback fixes SignSGD ..."; Tang et al.
    2021, "1-bit Adam" (two-phase reduce with server-side error feedback).
    """

    name = "onebit"

    def __init__(self, block_numel: int = DEFAULT_BLOCK_NUMEL, warmup_steps: int = 0):
        super().__init__(warmup_steps)
        self.codec = SignCodec(block_numel)
        self.worker_feedback = ErrorFeedback()
        self.server_feedback = ErrorFeedback()

    def _reduce_float(self, flat: torch.Tensor, layout: BucketLayout, comm: Communicator, divisor: int,
                      algorithm: str) -> None:
        two_phase.reduce(flat, layout, comm, divisor, self.codec, self.worker_feedback, self.server_feedback)

    def __repr__(self) -> str:
        return f"OneBit(block_numel={self.codec.block_numel}, warmup_steps={self.warmup_steps})"

    def _state_dict(self) -> dict:
        return {"worker": self.worker_feedback.state_dict(), "server": self.server_feedback.state_dict()}

    def _load_state_dict(self, state: dict) -> None:
        self.worker_feedback.load_state_dict(state["worker"])
        self.server_feedback.load_state_dict(state["server"])

