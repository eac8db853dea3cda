"""Gradient compression for DataParallel: fewer bytes on the wire, error feedback keeps accuracy.

One compressor per module: :class:`FP16` / :class:`BF16` (16-bit values,
float32 sums), :class:`OneBit` (signs + scale, two-phase reduce, error
feedback), :class:`TopK` (largest entries, error feedback), :class:`PowerSGD`
(low rank, error feedback). Pass an instance as
``DataParallel(..., compression=OneBit())``; its ``state_dict()`` holds this
rank's residuals keyed by parameter name, for checkpoints.
"""

from __future__ import annotations

from gradsync.compression.compressor import BucketLayout, Compressor
from gradsync.compression.error_feedback import ErrorFeedback
from gradsync.compression.low_precision import BF16, FP16
from gradsync.compression.onebit import OneBit
from gradsync.compression.powersgd import PowerSGD
from gradsync.compression.topk import TopK

COMPRESSIONS = ("none", "fp16", "bf16", "onebit", "topk", "powersgd")


def make(name: str, topk_ratio: float = 0.01, powersgd_rank: int = 2, warmup_steps: int = 0) -> Compressor | None:
    """The compressor called ``name`` (one of ``COMPRESSIONS``; "none" gives None).

    Raises:
        ValueError: unknown name (listing the choices), bad ratio or rank.
    """
    factories = {"none": lambda: None, "fp16": lambda: FP16(warmup_steps=warmup_steps),
                 "bf16": lambda: BF16(warmup_steps=warmup_steps), "onebit": lambda: OneBit(warmup_steps=warmup_steps),
                 "topk": lambda: TopK(topk_ratio, warmup_steps=warmup_steps),
                 "powersgd": lambda: PowerSGD(powersgd_rank, warmup_steps=warmup_steps)}
    if name not in factories:
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(COMPRESSIONS)}")
    return factories[name]()


def resolve(compression) -> Compressor | None:
    """DataParallel's ``compression`` argument: None, a name from ``COMPRESSIONS`` or a Compressor ->
    a Compressor or None.

    Raises:
        TypeError: anything else; ValueError: an unknown name.
    """
    if isinstance(compression, str):
        compression = make(compression)
    if compression is None:
        return None
    if not isinstance(compression, Compressor):
        raise TypeError(f"compression must be None, a name ({', '.join(COMPRESSIONS)}) or a "
                        f"gradsync.compression.Compressor such as OneBit(), got {type(compression).__name__}")
    return compression


__all__ = ["BF16", "COMPRESSIONS", "BucketLayout", "Compressor", "ErrorFeedback", "FP16", "OneBit", "PowerSGD",
           "TopK", "make", "resolve"]
