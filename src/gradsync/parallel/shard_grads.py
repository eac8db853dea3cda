"""ZeRO-1/2 gradients: each bucket reduce-scattered as backward runs, this rank's chunk kept as its shard.

The reducer hands every bucket to :meth:`ShardGradients.reduce` on the
communication thread instead of an AllReduce: the bucket's gradients (zero
padded to equal chunks, :mod:`~gradsync.parallel.shard_layout`) are
reduce-scattered with the bucket's algorithm (or by a compressor that can,
fp16 and bf16), and this rank's chunk, divided once by the contributing
ranks, is written into (or, when the optimizer has not consumed the last one,
added to) a persistent shard buffer that the optimizer's pieces take as
``.grad``. The last bucket's used flags and status slots, which every rank
needs whole, are summed by a separate small AllReduce.
"""

from __future__ import annotations

import torch

from gradsync.collectives import ops as collectives
from gradsync.collectives.scatter_gather import reduce_scatter_flat
from gradsync.parallel.shard_layout import ShardLayout


class ShardGradients:
    """This rank's averaged gradient chunk of every bucket, and the pieces' ``.grad`` views of it.

    Args:
        layout: the buckets; ``pieces`` / ``piece_tensors``: this rank's (``FlatParameters``'s).
        comm: the group; ``algorithm``: the reduce-scatter's.
        compression: a compressor with ``can_reduce_scatter`` (fp16, bf16), or None.
        layouts: the compressor's per-bucket ``BucketLayout`` (names keyed state), given with ``compression``.
    """

    def __init__(self, layout: ShardLayout, pieces, piece_tensors, comm, algorithm: str, compression=None,
                 layouts=None, dtypes: list[torch.dtype] | None = None):
        self.layout, self.comm, self.algorithm = layout, comm, algorithm
        self.compression, self.layouts = compression, layouts
        self.pieces, self.piece_tensors = pieces, piece_tensors
        self.dtypes = dtypes or [torch.float32] * len(layout.chunk_numel)
        # allocated when a bucket's first chunk arrives, dropped once none of its pieces holds a gradient
        self.buffers: list[torch.Tensor | None] = [None] * len(layout.chunk_numel)
        self.by_bucket: list[list[int]] = [[] for _ in layout.chunk_numel]  # piece indices per bucket
        for k, piece in enumerate(pieces):
            self.by_bucket[piece.bucket].append(k)

    def _buffer(self, bucket: int) -> torch.Tensor:
        if self.buffers[bucket] is None:
            self.buffers[bucket] = torch.zeros(self.layout.chunk_numel[bucket], dtype=self.dtypes[bucket])
        return self.buffers[bucket]

    def grad_view(self, k: int) -> torch.Tensor:
        """Piece ``k``'s gradient: its 1-D view of its bucket's shard buffer (allocated on first use)."""
        piece = self.pieces[k]
        start = self.layout.chunk(piece.bucket, self.comm.rank)[0]
        return self._buffer(piece.bucket)[piece.flat_start - start:piece.flat_stop - start]

    def release(self) -> None:
        """Drop the shard buffers none of whose pieces holds a gradient (after ``zero_grad(set_to_none)``)."""
        for bucket, members in enumerate(self.by_bucket):
            if all(self.piece_tensors[k].grad is None for k in members):
                self.buffers[bucket] = None

    def reduce(self, flat: torch.Tensor, bucket: int, divisor: int) -> None:
        """Reduce-scatter bucket ``bucket``'s ``flat`` (gradients, padding, then any flags) and keep this
        rank's chunk divided by ``divisor``; flags after the padding are summed whole (an AllReduce).

        Collective: every rank calls it for the same buckets in the same order.
        """
        padded = self.layout.padded_numel[bucket]
        grads, flags = flat[:padded], flat[padded:]
        if self.compression is not None:
            start, stop = self.compression.reduce_scatter(grads, self.layouts[bucket], self.comm, divisor,
                                                          self.algorithm)
            chunk = grads[start:stop]
        else:
            start, stop = reduce_scatter_flat(grads, self.comm, algorithm=self.algorithm)
            chunk = grads[start:stop]
            chunk.div_(divisor)
        self._keep(bucket, chunk)
        if flags.numel():
            counts = flags.to(torch.int32)
            collectives.all_reduce(counts, self.comm, op="sum", algorithm=self.algorithm, verify=False)
            flags.copy_(counts)

    def _keep(self, bucket: int, chunk: torch.Tensor) -> None:
        """Write ``chunk`` into the bucket's shard, or add it where a piece still holds an unconsumed
        gradient (two synchronised backwards without a ``zero_grad`` in between accumulate, as ``.grad`` does)."""
        members = self.by_bucket[bucket]
        if not any(self.piece_tensors[k].grad is not None for k in members):
            self._buffer(bucket).copy_(chunk)
        else:
            start = self.layout.chunk(bucket, self.comm.rank)[0]
            for k in members:
                piece, tensor = self.pieces[k], self.piece_tensors[k]
                part = chunk[piece.flat_start - start:piece.flat_stop - start]
                if tensor.grad is None:
                    self.grad_view(k).copy_(part)
                else:
                    self.grad_view(k).add_(part)
        for k in members:
            self.piece_tensors[k].grad = self.grad_view(k)

    def drop_unused(self, used_anywhere: list[bool], fresh: list[bool]) -> None:
        """Pieces of parameters no rank had a gradient for: ``.grad`` None again where it was None before the
        round (``fresh``, by piece), so that the optimizer skips them as it skips an unsharded ``.grad = None``."""
        for k, piece in enumerate(self.pieces):
            if not used_anywhere[piece.param] and fresh[k]:
                self.piece_tensors[k].grad = None

    def fresh(self) -> list[bool]:
        """Per piece, whether its ``.grad`` is None now (before a round)."""
        return [tensor.grad is None for tensor in self.piece_tensors]
