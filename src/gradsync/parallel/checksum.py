"""A position-weighted checksum of a tensor's bits: what replica checks compare across ranks.

A float sum cannot tell replicas apart: two swapped elements keep it, and
rounding hides a flipped low bit. This checksum works on the bits. The
tensor's bytes are read as 64-bit words ``a_i`` (viewed, not copied, where
the size allows) and arranged as a ``(rows, K)`` matrix; the checksum is
the pair

    c1 = sum_i (2 j(i) + 1) a_i + M sum_i (2 r(i) + 1) a_i        (mod 2**64)
    c2 = the same sum over the words' upper halves ``a_i >> 32``

with ``j(i)``, ``r(i)`` the column and row of word ``i`` and ``M = 2 K``:
the weight of word ``i`` is an odd number that grows with ``i``, yet only
two sums over the matrix (its column and row sums, which run at memory
speed) are needed, never a multiplication per element.

What it detects with certainty (any tensor under 2**30 words): a single
flipped bit anywhere (the change is ``2**k`` times an odd weight, never a
multiple of ``2**64``), and any two swapped elements of different value
(the change is their difference times ``2 (i1 - i2)``; the one case in which
that is a multiple of ``2**64`` — the difference sits only in the upper
halves of the words — is what ``c2`` exists for). Other differences are
missed with probability about ``2**-64`` for arbitrary changes, not zero:
it is a checksum, not a cryptographic hash. Compare the idea of position
weighting with the Fletcher and Adler checksums.
"""

from __future__ import annotations

import torch

ROW_WORDS = 4096  # K: the row length of the matrix (columns)
CHUNK_ROWS = 16  # rows whose upper halves are shifted at a time: 512 KiB, in cache (see _upper_sum)
SMALL_WORDS = 1 << 16  # tensors under this many words are checksummed together by fingerprint()
_MASK64 = (1 << 64) - 1


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat int64 tensor (a view when its size is a multiple of 8 bytes)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    aligned = flat.storage_offset() * flat.element_size() % 8 == 0  # a view into a flat buffer may start anywhere
    if nbytes % 8 == 0 and flat.is_contiguous() and aligned:
        return flat.view(torch.int64) if flat.element_size() == 8 else flat.view(torch.uint8).view(torch.int64)
    padded = torch.zeros((nbytes + 7) // 8 * 8, dtype=torch.uint8, device=flat.device)
    padded[:nbytes] = flat.contiguous().view(torch.uint8)
    return padded.view(torch.int64)


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(count: int, device: torch.device) -> torch.Tensor:
    """``1, 3, 5, ...`` (``count`` odd int64 weights); those of one row are kept per device."""
    if count > ROW_WORDS:
        return torch.arange(1, 2 * count + 1, 2, dtype=torch.int64, device=device)
    if device not in _WEIGHTS:
        _WEIGHTS[device] = torch.arange(1, 2 * ROW_WORDS + 1, 2, dtype=torch.int64, device=device)
    return _WEIGHTS[device][:count]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor (a view of a contiguous tensor)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.contiguous().view(torch.uint8)


def _combine(column_sums: torch.Tensor, row_sums: torch.Tensor) -> int:
    """``sum_j (2j+1) C_j + 2K sum_r (2r+1) R_r mod 2**64`` (int64 products wrap, as the sums did)."""
    columns = int((column_sums * _weights(column_sums.numel(), column_sums.device)).sum())
    rows = int((row_sums * _weights(row_sums.numel(), row_sums.device)).sum())
    return (columns + 2 * ROW_WORDS * rows) & _MASK64


def _as_matrices(words: torch.Tensor) -> list[torch.Tensor]:
    """``words`` as ``(rows, ROW_WORDS)`` in place, and its tail as one zero-padded row (zeros add
    nothing to the sums); the row sums of the list, concatenated, are the rows in order."""
    rows, tail = divmod(words.numel(), ROW_WORDS)
    matrices = [words[:rows * ROW_WORDS].view(rows, ROW_WORDS)] if rows else []
    if tail:
        last = torch.zeros(1, ROW_WORDS, dtype=torch.int64, device=words.device)
        last[0, :tail] = words[rows * ROW_WORDS:]
        matrices.append(last)
    return matrices


def _sums(matrices: list[torch.Tensor], sums) -> int:
    """Fold ``sums(matrix)`` (column sums, row sums) over ``matrices`` into one checksum."""
    parts = [sums(matrix) for matrix in matrices]
    columns = parts[0][0] if len(parts) == 1 else parts[0][0] + parts[1][0]
    return _combine(columns, torch.cat([rows for _, rows in parts]))


def _upper_sums(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column and row sums of ``matrix >> 32``, shifted a few rows at a time into one reused
    buffer: a whole-matrix shift would write a fresh tensor as large as the input, and the
    first touch of fresh memory costs more than the sums themselves."""
    rows = matrix.shape[0]
    if rows <= CHUNK_ROWS:
        upper = matrix >> 32
        return upper.sum(0), upper.sum(1)
    buffer = torch.empty(CHUNK_ROWS, ROW_WORDS, dtype=torch.int64, device=matrix.device)
    columns = torch.zeros(ROW_WORDS, dtype=torch.int64, device=matrix.device)
    row_sums = torch.empty(rows, dtype=torch.int64, device=matrix.device)
    for start in range(0, rows, CHUNK_ROWS):
        chunk = matrix[start:start + CHUNK_ROWS]
        upper = buffer[:chunk.shape[0]]
        torch.bitwise_right_shift(chunk, 32, out=upper)
        columns += upper.sum(0)
        torch.sum(upper, 1, out=row_sums[start:start + chunk.shape[0]])
    return columns, row_sums


def _small(words: torch.Tensor) -> tuple[int, int]:
    """:func:`checksum` of up to ``CHUNK_ROWS`` rows in a handful of torch calls (small tensors are
    common and each call costs microseconds): both sums of both word sets at once."""
    rows = -(-words.numel() // ROW_WORDS)
    if words.numel() != rows * ROW_WORDS:
        padded = torch.zeros(rows * ROW_WORDS, dtype=torch.int64, device=words.device)
        padded[:words.numel()] = words
        words = padded
    matrix = words.view(rows, ROW_WORDS)
    both = torch.stack([matrix, matrix >> 32])  # (2, rows, K)
    columns = (both.sum(1) * _weights(ROW_WORDS, words.device)).sum(1).tolist()
    row_sums = (both.sum(2) * _weights(rows, words.device)).sum(1).tolist()
    return tuple((columns[k] + 2 * ROW_WORDS * row_sums[k]) & _MASK64 for k in (0, 1))


def checksum(tensor: torch.Tensor) -> tuple[int, int]:
    """The pair ``(c1, c2)`` of unsigned 64-bit checksums of ``tensor``'s bits (see the module docstring).

    Args:
        tensor: any dense tensor, any shape, dtype and device; contiguous
            tensors whose size is a multiple of 8 bytes are read in place.

    Returns:
        two ints in ``[0, 2**64)``; equal tensors (bitwise: same bits; ``-0.0``
        differs from ``0.0``, NaNs by payload) give equal pairs. Shape and
        dtype are not part of it: compare them separately.

    Raises:
        TypeError: a sparse or quantized tensor (it has no plain bits to compare).
    """
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"checksum needs a dense tensor, got a {tensor.layout} tensor of dtype {tensor.dtype}")
    words = _words(tensor)
    if words.numel() == 0:
        return 0, 0
    if words.numel() <= CHUNK_ROWS * ROW_WORDS:
        return _small(words)
    matrices = _as_matrices(words)
    return _sums(matrices, lambda matrix: (matrix.sum(0), matrix.sum(1))), _sums(matrices, _upper_sums)


def fingerprint(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """One ``(c1, c2)`` pair for a list of tensors: each large tensor's :func:`checksum`, and one
    for the small ones' words laid end to end (per device), folded with odd weights by position.

    A difference inside one tensor always changes the fingerprint (an odd
    weight is invertible modulo ``2**64``); differences in two tensors that
    cancel each other are possible but need a coincidence of about ``2**-64``.
    Name the differing tensor afterwards with per-tensor :func:`checksum`.
    """
    parts: list[tuple[int, int]] = []
    small: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise TypeError(f"fingerprint needs dense tensors, got a {tensor.layout} tensor of dtype {tensor.dtype}")
        if tensor.numel() * tensor.element_size() >= 8 * SMALL_WORDS:
            parts.append(checksum(tensor))
        elif tensor.numel():
            small.setdefault(tensor.device, []).append(_bytes(tensor))
    parts += [checksum(torch.cat(group)) for group in small.values()]  # their bytes, end to end
    folded = [sum((2 * index + 1) * part[k] for index, part in enumerate(parts)) & _MASK64 for k in (0, 1)]
    return folded[0], folded[1]
