"""Two-phase compressed AllReduce: compressed all-to-all, average per chunk, compressed all-gather.

A sum of compressed messages is not itself compressed (a sum of signs is not
a sign), so a ring cannot add compressed segments hop by hop. Instead, as in
1-bit Adam (Tang et al. 2021) and 1-bit SGD's parameter-server variant (Seide
et al. 2014), the bucket is cut into ``world_size`` chunks
(:func:`~gradsync.collectives.chunking.chunk_bounds`) and rank i acts as the
server of chunk i:

1. every rank encodes each chunk and sends chunk i's payload to rank i (all-to-all);
2. rank i decodes the ``world_size`` payloads of its chunk, adds them in rank
   order and divides by the number of contributing ranks (the only division);
3. rank i encodes the average and the payloads are all-gathered; every rank
   decodes the same bytes, so the result is bitwise equal on every rank.

Each rank sends 2(p-1)/p of the encoded bucket, the ring's volume at the
encoded size: with 1 bit per element that is 1/32 of a float32 ring.
A payload is a uint8 row; rows are padded to a multiple of 4 bytes so that a
codec may keep a float32 header first.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gradsync.collectives import ops as collectives
from gradsync.collectives.chunking import chunk_bounds
from gradsync.collectives.communicator import Communicator
from gradsync.compression.compressor import BucketLayout
from gradsync.compression.error_feedback import ErrorFeedback


class Codec(Protocol):
    """Encodes a ``(numel,)`` float tensor into a uint8 payload and back."""

    def payload_nbytes(self, numel: int) -> int:
        """Bytes that :meth:`encode` writes for ``numel`` elements."""

    def encode(self, values: torch.Tensor, payload: torch.Tensor) -> None:
        """Write ``values`` into ``payload[:payload_nbytes(numel)]`` (uint8)."""

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Return the ``(numel,)`` values ``payload`` stands for (written into ``out`` when given)."""


def row_nbytes(codec: Codec, numel: int) -> int:
    """Payload row size for chunks of at most ``numel`` elements (multiple of 4 bytes)."""
    return -(-codec.payload_nbytes(numel) // 4) * 4


def reduce(flat: torch.Tensor, layout: BucketLayout, comm: Communicator, divisor: int, codec: Codec,
           worker_feedback: ErrorFeedback | None = None, server_feedback: ErrorFeedback | None = None,
           timeout: float | None = None) -> None:
    """Average ``flat`` (``(numel,)`` float, in place) over ranks in two compressed phases.

    ``worker_feedback`` keeps each rank's residual of phase 1 (whole bucket),
    ``server_feedback`` the chunk owner's residual of phase 3 (its chunk only);
    ``timeout``: seconds each phase's collective may take (None: the communicator's).
    """
    chunks, average, sends = _scatter_phase(flat, layout, comm, divisor, codec, worker_feedback, timeout)
    start = chunks[comm.rank][0]
    mine = sends[0]  # phase 1 is over: reuse its buffer for the outgoing row
    if server_feedback is None:
        codec.encode(average, mine)
    else:
        server_feedback.step(layout, average, lambda values: codec.decode(_encoded(codec, values, mine),
                                                                          values.numel()), start)
    gathered = collectives.all_gather(mine, comm, verify=False, timeout=timeout)
    for row, (start, stop) in zip(gathered, chunks):
        codec.decode(row, stop - start, out=flat[start:stop])


def reduce_scatter(flat: torch.Tensor, layout: BucketLayout, comm: Communicator, divisor: int,
                   codec: Codec) -> tuple[int, int]:
    """Phases 1 and 2 only (a compressed reduce-scatter, for ZeRO's sharded gradients): this rank's chunk of
    ``flat`` (``torch.tensor_split`` bounds, returned) holds the average over the ranks, summed in float32
    from the decoded payloads; the rest of ``flat`` is left as it was. The average is not re-encoded.

    Collective: every rank calls it for the same buckets in the same order.
    """
    chunks, average, _ = _scatter_phase(flat, layout, comm, divisor, codec, None)
    start, stop = chunks[comm.rank]
    flat[start:stop].copy_(average)
    return start, stop


def _scatter_phase(flat: torch.Tensor, layout: BucketLayout, comm: Communicator, divisor: int, codec: Codec,
                   worker_feedback: ErrorFeedback | None, timeout: float | None = None):
    """Phases 1-2: encode every chunk, all-to-all, decode and average this rank's chunk.
    Returns (chunks, this rank's average (a workspace buffer), the send rows)."""
    world_size, rank = comm.world_size, comm.rank
    chunks = chunk_bounds(flat.numel(), world_size)
    nbytes = row_nbytes(codec, chunks[0][1] - chunks[0][0])
    space = comm.workspace
    sends = space.get(world_size * nbytes, torch.uint8, flat.device, "compress-send").view(world_size, nbytes)
    receives = space.get(world_size * nbytes, torch.uint8, flat.device, "compress-recv").view(world_size, nbytes)
    decoded = space.get(flat.numel(), flat.dtype, flat.device, "compress-decoded")

    def encode_chunks(values: torch.Tensor) -> torch.Tensor:
        for row, (start, stop) in zip(sends, chunks):
            codec.encode(values[start:stop], row)
            codec.decode(row, stop - start, out=decoded[start:stop])
        return decoded

    if worker_feedback is None:
        for row, (start, stop) in zip(sends, chunks):
            codec.encode(flat[start:stop], row)
    else:
        worker_feedback.step(layout, flat, encode_chunks)
    collectives.all_to_all(list(sends), list(receives), comm, verify=False,  # sizes from the agreed layout
                           timeout=timeout)
    start, stop = chunks[rank]
    average = space.get(stop - start, flat.dtype, flat.device, "compress-average").zero_()
    part = space.get(stop - start, flat.dtype, flat.device, "compress-part")
    for row in receives:  # rank order: the same sum on every run
        average += codec.decode(row, stop - start, out=part)
    average /= divisor
    return chunks, average, sends


def _encoded(codec: Codec, values: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    codec.encode(values, payload)
    return payload
