"""A training step's compute: when each gradient is ready, from a FLOP count, a per-layer time or a timing here.

A :class:`StepCompute` holds a model's parameters (shapes and dtypes only:
meta tensors for a model that does not fit here) and, in seconds, its
forward, its backward, the moment in backward each parameter's gradient is
ready (``ready_s[i]``, from backward's start, registration index i) and the
optimizer step. Three sources:

* :func:`flops_compute`: the dense-transformer rule compute = 6·P·T / (F·MFU)
  (Kaplan et al. 2020, "Scaling laws for neural language models", §2.1:
  2·P FLOPs per token forward, 4·P backward; Chowdhery et al. 2022, PaLM,
  appendix B, for MFU), with P parameters, T tokens (or samples) per GPU
  per step, F the GPU's peak FLOP/s (:data:`PEAK_TFLOPS`) and a stated MFU.
  Forward is 1/3 of it, backward 2/3, spread over the parameters in
  proportion to their element counts (a dense layer's FLOPs are
  proportional to its weights), in reverse registration order.
* :func:`layer_compute`: a given forward + backward time per layer, split 1 : 2.
* :func:`measure_compute` (:mod:`gradsync.sim.measure`): forward, backward
  (each gradient's moment from ``register_post_accumulate_grad_hook``) and
  an SGD step timed on one process here.

The optimizer of the first two: a fused Adam update reads parameter,
gradient and both moments and writes parameter and moments, 28 bytes per
float32 parameter, at the GPU's memory bandwidth (``2 / profile.copy_s_per_byte``:
a copy moves each byte twice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from gradsync.collectives.cost.profile import Profile

# Dense BF16 tensor-core peak (no sparsity), TFLOP/s, from the vendors' datasheets.
PEAK_TFLOPS = {
    "h100-ib": 989.0,   # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM5: BF16 1979 TFLOPS "with sparsity"
    "h200-ib": 989.0,   # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BF16 1979 TFLOPS "with sparsity"
    "a100-ib": 312.0,   # NVIDIA A100 Tensor Core GPU datasheet, A100 SXM4: BF16 312 TFLOPS (624 sparse)
}
ADAM_BYTES_PER_PARAM = 28  # fused Adam: read p, g, m, v (4 x 4 B), write p, m, v (3 x 4 B)
# Per-GPU training state under pure data parallelism with mixed precision and Adam (Rajbhandari et al.
# 2020, ZeRO, §3.1: 2 + 2 + 12 = 16 bytes per parameter: fp16/bf16 weights and gradients, fp32 master
# weights, momentum and variance; torch AMP's fp32 weights and gradients + two fp32 moments is also 16).
STATE_BYTES_PER_PARAM = 16
BUCKET_COPY_BYTES_PER_PARAM = 4  # gradsync's float32 buckets beside .grad (gradient_as_bucket_view=False)


@dataclass(frozen=True)
class StepCompute:
    """A model's step on one GPU, without communication.

    ``params``: tensors in registration order (shapes, dtypes; any device);
    ``ready_s[i]``: seconds from backward's start until parameter i's gradient is
    ready (``<= backward_s``); ``source``: how the times were obtained.
    """

    params: tuple[torch.Tensor, ...]
    forward_s: float
    backward_s: float
    ready_s: tuple[float, ...]
    optimizer_s: float
    source: str

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


BLOCK_SHAPES = ((3, 1), (1, 1), (4, 1), (1, 4))  # a transformer block's weights, in units of d: qkv, out, up, down


def layered_params(num_params: int, layers: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Meta tensors for ``--params N --layers L``: L transformer blocks of four weights each,
    (3d, d), (d, d), (4d, d), (d, 4d) with 12·d² ≈ N / L (attention's qkv and output projection,
    the MLP's up and down projections; biases, norms and embeddings are left out), the sizes DDP's
    bucketing sees in such a model. The remainder of N goes into the first tensor.

    Raises:
        ValueError: no layer, or fewer than 12 parameters per layer.
    """
    if layers < 1 or num_params < 12 * layers:
        raise ValueError(f"need layers >= 1 and params >= 12 per layer, got params {num_params}, layers {layers}")
    d = math.isqrt(num_params // (12 * layers))
    tensors = [torch.empty(rows * d, cols * d, dtype=dtype, device="meta")
               for _ in range(layers) for rows, cols in BLOCK_SHAPES]
    rest = num_params - 12 * d * d * layers
    tensors[0] = torch.empty(tensors[0].numel() + rest, dtype=dtype, device="meta")
    return tensors


def _spread(params: Sequence[torch.Tensor], forward_s: float, backward_s: float, optimizer_s: float,
            source: str) -> StepCompute:
    """Backward over the parameters in reverse registration order, each taking its share of elements."""
    total = sum(p.numel() for p in params) or 1
    ready, done = [0.0] * len(params), 0
    for index in reversed(range(len(params))):
        done += params[index].numel()
        ready[index] = backward_s * done / total
    return StepCompute(tuple(params), forward_s, backward_s, tuple(ready), optimizer_s, source)


def adam_s(num_params: int, profile: Profile) -> float:
    """Seconds of a fused Adam step over ``num_params`` float32 parameters at the profile's memory bandwidth."""
    return ADAM_BYTES_PER_PARAM * num_params * profile.copy_s_per_byte / 2


def peak_flops(profile: Profile, peak_tflops: float | None = None) -> float:
    """FLOP/s of one of the profile's GPUs: ``peak_tflops`` if given, else :data:`PEAK_TFLOPS`.

    Raises:
        ValueError: no peak is known for the profile and none was given.
    """
    if peak_tflops is None:
        if profile.name not in PEAK_TFLOPS:
            raise ValueError(f"no peak FLOP/s known for profile {profile.name!r} (known: "
                             f"{', '.join(PEAK_TFLOPS)}): give --peak-tflops")
        peak_tflops = PEAK_TFLOPS[profile.name]
    if not peak_tflops > 0:
        raise ValueError(f"--peak-tflops must be > 0, got {peak_tflops}")
    return peak_tflops * 1e12


def flops_compute(params: Sequence[torch.Tensor], tokens_per_gpu: float, flops_per_s: float, mfu: float,
                  profile: Profile) -> StepCompute:
    """compute = 6·P·T / (F·MFU) seconds, forward 1/3, backward 2/3; Adam at memory bandwidth.

    Raises:
        ValueError: tokens <= 0, MFU outside (0, 1], F <= 0.
    """
    if not tokens_per_gpu > 0:
        raise ValueError(f"tokens (samples) per GPU must be > 0, got {tokens_per_gpu}")
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {mfu}")
    if not flops_per_s > 0:
        raise ValueError(f"peak FLOP/s must be > 0, got {flops_per_s}")
    num = sum(p.numel() for p in params)
    total = 6 * num * tokens_per_gpu / (flops_per_s * mfu)
    return _spread(params, total / 3, 2 * total / 3, adam_s(num, profile),
                   f"6*P*T/(F*MFU): P={num:.3g}, T={tokens_per_gpu:g}, F={flops_per_s / 1e12:g} TFLOP/s, "
                   f"MFU={mfu:g}")


def layer_compute(params: Sequence[torch.Tensor], layers: int, layer_s: float, profile: Profile) -> StepCompute:
    """``layers`` layers of ``layer_s`` seconds forward + backward each (1 : 2), spread over ``params`` in
    proportion to their elements (equal layers, as :func:`layered_params` makes them); Adam at memory
    bandwidth.

    Raises:
        ValueError: ``layer_s`` < 0.
    """
    if not layer_s >= 0 or math.isinf(layer_s):
        raise ValueError(f"--layer-ms must be a finite time >= 0, got {layer_s * 1e3}")
    total = layers * layer_s
    return _spread(params, total / 3, 2 * total / 3, adam_s(sum(p.numel() for p in params), profile),
                   f"{layers} layers x {layer_s * 1e3:g} ms")


def memory_per_gpu_bytes(num_params: int, bucket_copy: bool = True) -> dict[str, float]:
    """Bytes per GPU of the training state under pure data parallelism (activations excluded).

    ``state``: :data:`STATE_BYTES_PER_PARAM` per parameter; ``buckets``: gradsync's flat
    float32 buckets when ``.grad`` is not a view of them.
    """
    state = STATE_BYTES_PER_PARAM * num_params
    buckets = BUCKET_COPY_BYTES_PER_PARAM * num_params if bucket_copy else 0
    return {"state": state, "buckets": buckets, "total": state + buckets}


def scaled(compute: StepCompute, factor: float) -> StepCompute:
    """``compute`` with every time ``factor`` times longer (ranks that outnumber the cores wait for one)."""
    return StepCompute(compute.params, compute.forward_s * factor, compute.backward_s * factor,
                       tuple(t * factor for t in compute.ready_s), compute.optimizer_s * factor,
                       compute.source + (f", x{factor:g} for shared cores" if factor != 1 else ""))
