"""Checks of :class:`gradsync.parallel.data_parallel.DataParallel`'s constructor arguments.

Each raises the error that DataParallel's docstring names, before any rank
talks to another, so a bad value fails on the rank that passed it.
"""
from __future__ import annotations

import math

from gradsync.compression import COMPRESSIONS, Compressor
from gradsync.compression import make as make_compressor


def check_bucket_cap_mb(bucket_cap_mb) -> None:
    """Raise ValueError unless ``bucket_cap_mb`` is a finite number of MiB holding at least one byte."""
    ok = isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
    if not (ok and 0 < bucket_cap_mb < math.inf and int(bucket_cap_mb * 2**20) >= 1):
        raise ValueError(f"bucket_cap_mb must be a finite number of MiB, at least one byte "
                         f"(> {1 / 2**20:.1e}), got {bucket_cap_mb!r}")


def resolve_compression(compression) -> Compressor | None:
    """None, a name from ``COMPRESSIONS`` or a Compressor -> a Compressor or None; TypeError otherwise."""
    if isinstance(compression, str):
        compression = make_compressor(compression)
    if compression is None:
        return None
    if not isinstance(compression, Compressor):
        raise TypeError(f"compression must be None, a name ({', '.join(COMPRESSIONS)}) or a "
                        f"gradsync.compression.Compressor such as OneBit(), got {type(compression).__name__}")
    return compression
