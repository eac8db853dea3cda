"""The one dtype table: what collectives accept, and the codes ranks exchange to compare dtypes."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
FLOAT32_ACCUMULATED = (torch.float16, torch.bfloat16)  # summed in float32 by every algorithm
_CODED = SUPPORTED_DTYPES + (torch.bool,)  # codes of layout checks (bool: buffers, masks)
OTHER_DTYPE_CODE = len(_CODED)


def dtype_code(dtype: torch.dtype) -> int:
    """A small int naming ``dtype`` the same way on every rank (``OTHER_DTYPE_CODE`` if not in the table)."""
    return _CODED.index(dtype) if dtype in _CODED else OTHER_DTYPE_CODE


def dtype_name(code: int) -> str:
    """The dtype name (``"float32"``) for a :func:`dtype_code`, ``"other dtype"`` outside the table."""
    return str(_CODED[code]).replace("torch.", "") if 0 <= code < len(_CODED) else "other dtype"
