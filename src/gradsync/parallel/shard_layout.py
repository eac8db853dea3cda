"""Where each rank's shard lies: buckets padded to a multiple of the world size, cut into equal chunks.

ZeRO (Rajbhandari et al. 2020) splits what data parallelism replicates:
stage 1 the optimizer state, stage 2 the gradients too, stage 3 the
parameters. gradsync shards by *bucket*, as DeepSpeed's flat partitions and
FSDP1's flat parameters do: bucket ``b`` holds its parameters back to back
(DataParallel's gradient buckets, the same order and offsets), is padded with
zeros to ``padded_numel = world_size * chunk_numel`` (odd element counts are
padded, never truncated), and rank ``r`` owns the chunk ``[r * chunk_numel,
(r + 1) * chunk_numel)`` of every bucket, the ``torch.tensor_split`` chunk of
the padded buffer, so reduce-scatter hands it exactly its own gradient.

A *piece* is the part of one parameter inside one rank's chunk (at most one
per parameter and rank, since a chunk is contiguous; a parameter may be cut
between ranks, and a rank may hold no piece of a small parameter).

>>> layout = ShardLayout([5, 3], [[1, 0]], world_size=3)
>>> layout.padded_numel, layout.chunk_numel
([9], [3])
>>> [(p.param, p.param_start, p.param_stop) for p in layout.pieces(0)]
[(1, 0, 3)]
>>> [(p.param, p.param_start, p.param_stop) for p in layout.pieces(2)]
[(0, 3, 5)]
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.collectives.registry import ALL_REDUCE, AUTO, REDUCE_SCATTER, refusal
from gradsync.parallel.bucketing import padded_numel

SHARD_LEVELS = ("none", "optimizer", "gradients", "parameters")
"""DataParallel's ``shard=``: nothing sharded, ZeRO-1 (optimizer state), ZeRO-2 (+ gradients), ZeRO-3 (+ parameters)."""
IMPLEMENTED_LEVELS = SHARD_LEVELS


def check_shard(shard) -> str:
    """Return ``shard`` if it names a level gradsync implements.

    Raises:
        TypeError: not a string; ValueError: unknown.
    """
    if not isinstance(shard, str):
        raise TypeError(f"shard must be one of {', '.join(SHARD_LEVELS)}, got {type(shard).__name__}")
    if shard not in SHARD_LEVELS:
        raise ValueError(f"unknown shard level {shard!r}; choose one of {', '.join(IMPLEMENTED_LEVELS)}")
    return shard


@dataclass(frozen=True)
class Piece:
    """One parameter's part of one rank's chunk.

    ``param``: its index in the sharded parameter list; ``bucket``: its bucket; ``flat_start``/``flat_stop``:
    its bounds in the bucket's flat buffer; ``param_start``/``param_stop``: the same elements' bounds in
    the parameter's own flattened view (``param.view(-1)[param_start:param_stop]``).
    """

    param: int
    bucket: int
    flat_start: int
    flat_stop: int
    param_start: int
    param_stop: int

    @property
    def numel(self) -> int:
        return self.flat_stop - self.flat_start


class ShardLayout:
    """Offsets, padding and chunks of sharded buckets.

    Args:
        numels: element count of each parameter (index = parameter index).
        assignment: parameter indices per bucket, in bucket order (each index exactly once).
        world_size: ranks sharing the buckets (>= 1).

    Attributes:
        offsets: per bucket, ``{parameter index: offset of its first element in the bucket}``.
        grad_numel, padded_numel, chunk_numel: per bucket, elements of the parameters, after padding, per rank.
    """

    def __init__(self, numels: list[int], assignment: list[list[int]], world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.numels, self.assignment, self.world_size = list(numels), [list(b) for b in assignment], world_size
        self.offsets: list[dict[int, int]] = []
        self.grad_numel, self.padded_numel, self.chunk_numel = [], [], []
        for indices in self.assignment:
            offsets, offset = {}, 0
            for index in indices:
                offsets[index] = offset
                offset += self.numels[index]
            padded = padded_numel(offset, world_size)
            self.offsets.append(offsets)
            self.grad_numel.append(offset)
            self.chunk_numel.append(padded // world_size)
            self.padded_numel.append(padded)

    def chunk(self, bucket: int, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of ``rank``'s chunk of ``bucket``'s padded flat buffer."""
        size = self.chunk_numel[bucket]
        return rank * size, (rank + 1) * size

    def pieces(self, rank: int) -> list[Piece]:
        """``rank``'s pieces, bucket by bucket, in bucket order."""
        found = []
        for bucket, offsets in enumerate(self.offsets):
            start, stop = self.chunk(bucket, rank)
            for index, offset in offsets.items():
                low, high = max(start, offset), min(stop, offset + self.numels[index])
                if low < high:
                    found.append(Piece(index, bucket, low, high, low - offset, high - offset))
        return found

    def owners(self, param: int) -> list[tuple[int, int, int]]:
        """``(rank, param_start, param_stop)`` of every piece of parameter ``param``, in element order."""
        bucket = next(b for b, offsets in enumerate(self.offsets) if param in offsets)
        offset, numel = self.offsets[bucket][param], self.numels[param]
        owned = []
        for rank in range(self.world_size):
            start, stop = self.chunk(bucket, rank)
            low, high = max(start, offset), min(stop, offset + numel)
            if low < high:
                owned.append((rank, low - offset, high - offset))
        return owned


def sharding_algorithm_problem(algorithm: str) -> str | None:
    """Why sharding cannot run over ``algorithm`` (it carries no reduce-scatter), or None."""
    if algorithm == AUTO or algorithm in REDUCE_SCATTER or algorithm not in ALL_REDUCE:
        return None  # an unknown name is reported by the algorithm check itself
    return f"the buckets are reduce-scattered, and {refusal('reduce_scatter', algorithm)}"


def check_sharding(shard, compression, gradient_as_bucket_view: bool, algorithm: str = AUTO) -> None:
    """Refuse what sharding cannot honour, in one line.

    Raises:
        TypeError / ValueError: see :func:`check_shard`; a compressor whose messages cannot be summed
        chunk-wise (one-bit, top-k, PowerSGD); ``gradient_as_bucket_view`` (a sharded bucket keeps only
        this rank's chunk of the average, so a gradient viewing it would be wrong elsewhere).
    """
    check_shard(shard)
    if shard == "none":
        return
    problem = sharding_algorithm_problem(algorithm)
    if problem is not None:
        raise ValueError(f"shard={shard!r} cannot run over algorithm {algorithm!r}: {problem}")
    if compression is not None and not compression.can_reduce_scatter:
        raise ValueError(f"compression {compression.name!r} cannot combine with shard={shard!r}: a reduce-scatter "
                         f"sums each chunk of the bucket, and {compression.name} messages are not summable; "
                         f"use compression none, fp16 or bf16")
    if gradient_as_bucket_view:
        raise ValueError(f"gradient_as_bucket_view cannot combine with shard={shard!r}: the reduce-scatter leaves "
                         f"only this rank's chunk of each bucket averaged (the gradients live in the optimizer's "
                         f"pieces)")
