"""The reducer's bucket plan: which parameter's gradient sits in which bucket, and where.

A :class:`BucketPlan` owns the buckets (:class:`~gradsync.parallel.bucketing.Bucket`),
each gradient's view into its bucket, and the layout the compressors key
their state by. It starts from the default assignment (reverse registration
order), is rebuilt once after the first synchronised backward
(:mod:`~gradsync.parallel.rebuild`) or adopts a saved layout, and copies
gradients in and averages out. Buckets an algorithm can reduce without
copying in live in the storage it allocated
(:func:`~gradsync.collectives.ops.zero_copy_plan`).
"""

from __future__ import annotations

import torch

from gradsync.collectives import ops as collectives
from gradsync.compression.compressor import BucketLayout
from gradsync.errors import GradsyncError
from gradsync.parallel import rebuild
from gradsync.parallel.bucketing import (DEFAULT_FIRST_BUCKET_CAP_BYTES, Bucket, assign_buckets, check_assignment,
                                        padded_numel)


class BucketPlan:
    """Buckets, views and layout of one module's gradients.

    Args:
        names, params: the trainable parameters, registration order.
        comm: the group (a Communicator; rebuilds and zero-copy storage are collective on it).
        algorithm: the AllReduce algorithm name (where zero-copy buckets live).
        bucket_cap_bytes: cap per bucket (bytes).
        gradient_as_bucket_view: make ``.grad`` a view of the bucket (no second copy).
        num_flags: elements after the last bucket's gradients (used flags, status slots).
        zero_copy: place buckets in the algorithm's own storage where it offers some (False: never,
            as under compression, which does not reduce the bucket itself).
        sharded: ZeRO-1/2 buckets: padded to a multiple of the world size, laid out once (no rebuild:
            the shards and the optimizer state follow the layout), and each ``.grad`` released (None) once
            copied in, since the bucket's reduce-scatter leaves only this rank's chunk of the average.
        slabs: ZeRO-2: > 0 buckets share this many bucket-sized slabs in turn (bucket ``b`` lives in slab
            ``b % slabs``) instead of one buffer each; gradients are then copied in when the bucket is
            launched (``deferred``), once the bucket ``slabs`` before it has left the slab.
        assignment: parameter indices per bucket instead of the cap's (ZeRO-3: one bucket per unit and dtype).
    """

    def __init__(self, names: list[str], params: list[torch.Tensor], comm, algorithm: str,
                 bucket_cap_bytes: int, gradient_as_bucket_view: bool, num_flags: int, zero_copy: bool,
                 sharded: bool = False, slabs: int = 0, assignment: list[list[int]] | None = None):
        self.names, self.params = names, params
        self.comm = comm
        self.algorithm = algorithm
        self.bucket_cap_bytes = bucket_cap_bytes
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.num_flags = num_flags
        self.zero_copy = zero_copy and not sharded
        self.sharded = sharded
        self.slabs = slabs if sharded else 0
        self.deferred = self.slabs > 0  # copy in at launch (the slab may still hold an earlier bucket)
        self.rebuilt = sharded  # rebuilt after the first synchronised backward, or given a saved layout
        self._zeros: dict[int, torch.Tensor] = {}
        self.build(assignment if assignment is not None else
                   assign_buckets(params, bucket_cap_bytes, DEFAULT_FIRST_BUCKET_CAP_BYTES))

    def build(self, assignment: list[list[int]]) -> None:
        """Lay the buckets out as ``assignment`` (parameter indices per bucket); ``.grad`` values survive."""
        self.assignment = assignment
        last = len(assignment) - 1
        grads = [None if param.grad is None else param.grad.clone() for param in self.params]
        storages = self._storages(assignment)
        pad_to = self.comm.world_size if self.sharded else 1
        self.buckets = [Bucket(b, indices, [self.params[i] for i in indices],
                               self.num_flags if b == last else 0, storages[b], pad_to)
                        for b, indices in enumerate(assignment)]
        self.bucket_of = [0] * len(self.params)  # parameter index -> bucket index
        self.views: list[torch.Tensor] = [None] * len(self.params)  # parameter index -> its slice
        for bucket in self.buckets:
            bucket.shared = bucket.shared and not self.slabs  # a slab is no bucket's own buffer
            for index, view in zip(bucket.param_indices, bucket.views):
                self.bucket_of[index] = bucket.index
                self.views[index] = view
        self.layouts = [BucketLayout(tuple(self.names[i] for i in indices),
                                     tuple(self.params[i].shape for i in indices)) for indices in assignment]
        if self.gradient_as_bucket_view:  # from copies: new views may overlap the old ones
            for index, param in enumerate(self.params):
                if grads[index] is not None:
                    self.views[index].copy_(grads[index])
                    param.grad = self.views[index]
        self._zeros.clear()

    def _storages(self, assignment: list[list[int]]) -> list[torch.Tensor | None]:
        """Zero-copy buckets: where the algorithm reduces a bucket in place in its own shared storage, the
        bucket lives there, so the gradients' copy into the bucket is the only copy (with bucket views,
        not even that). Each call (construction, a rebuild) takes fresh storage; earlier storage stays
        reserved until the group is closed (see ``shared_buffer``)."""
        if self.slabs:
            return self._slab_storages(assignment)
        if not self.zero_copy:
            return [None] * len(assignment)
        last = len(assignment) - 1
        buckets = []
        for b, indices in enumerate(assignment):
            first = self.params[indices[0]]
            numel = sum(self.params[i].numel() for i in indices) + (self.num_flags if b == last else 0)
            buckets.append((numel, first.dtype, first.device))
        return collectives.zero_copy_plan(self.comm, buckets, self.algorithm)

    def _slab_storages(self, assignment: list[list[int]]) -> list[torch.Tensor]:
        """ZeRO-2: ``slabs`` uint8 buffers of the largest bucket's bytes; bucket ``b`` gets slab ``b % slabs``."""
        last, world_size = len(assignment) - 1, self.comm.world_size
        nbytes = []
        for b, indices in enumerate(assignment):
            first = self.params[indices[0]]
            numel = padded_numel(sum(self.params[i].numel() for i in indices), world_size)
            nbytes.append((numel + (self.num_flags if b == last else 0)) * first.element_size())
        slabs = [torch.zeros(max(nbytes), dtype=torch.uint8, device=self.params[0].device)
                 for _ in range(min(self.slabs, len(assignment)))]
        return [slabs[b % len(slabs)] for b in range(len(assignment))]

    def rebuild(self, observed: list[int], ready_s: list[float]) -> None:
        """Re-bucket as rank 0 observed backward (``observed``: parameter indices in ready order,
        ``ready_s``: when each became ready; see :mod:`~gradsync.parallel.rebuild`).

        Collective: every rank calls it once.
        """
        self.rebuilt = True
        plan = rebuild.observed_plan(self.params, observed, ready_s)
        if self.comm.world_size > 1:
            collectives.broadcast(plan, self.comm, src=0, verify=False)
        assignment = rebuild.rebuilt_assignment(self.params, self.bucket_cap_bytes, plan)
        if assignment != self.assignment:
            self.build(assignment)

    def adopt(self, assignment: list[list[int]]) -> None:
        """Use a saved layout and skip the rebuild (every rank must pass the same one).

        Raises:
            ValueError: ``assignment`` is not a partition of the parameter indices.
        """
        check_assignment(self.params, assignment)
        self.rebuilt = True
        if assignment != self.assignment:
            self.build(assignment)

    def copy_in(self, index: int) -> bool:
        """Put parameter ``index``'s gradient into its bucket slice (zeros if none); return whether it had one."""
        param, view = self.params[index], self.views[index]
        grad = param.grad
        if grad is None:
            view.zero_()
            return False
        if grad.is_sparse:
            raise GradsyncError(f"DataParallel: parameter {self.names[index]!r} has a sparse gradient; "
                                f"only dense gradients are supported")
        if grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            if self.gradient_as_bucket_view:
                param.grad = view
        if self.sharded:
            param.grad = None
        return True

    def copy_out(self, index: int, divisor: int = 1) -> None:
        """Make parameter ``index``'s ``.grad`` hold its bucket slice divided by ``divisor`` (the average:
        1 where the bucket holds it already; a copy's divisor only, never a bucket view's)."""
        param, view = self.params[index], self.views[index]
        if divisor != 1 and self.gradient_as_bucket_view:
            raise ValueError("a bucket view's gradient is averaged in its bucket, not divided on copy-out")
        if param.grad is None:
            param.grad = view if self.gradient_as_bucket_view else (
                view.clone() if divisor == 1 else torch.div(view, divisor))
        elif param.grad.data_ptr() != view.data_ptr():
            if divisor == 1:
                param.grad.copy_(view)
            else:
                torch.div(view, divisor, out=param.grad)

    def zeros(self, bucket: Bucket) -> torch.Tensor:
        """A zeroed buffer shaped like ``bucket.flat``, for a round this rank joins without data (join).
        A zero-copy bucket is its own buffer: the algorithm reads the peers' data where it lies."""
        zeros = bucket.flat if bucket.shared else self._zeros.get(bucket.index)
        if zeros is None:
            zeros = self._zeros[bucket.index] = torch.zeros_like(bucket.flat)
        return zeros.zero_()

    @property
    def bucket_numels(self) -> list[int]:
        return [bucket.grad_numel for bucket in self.buckets]

    @property
    def bucket_nbytes(self) -> list[int]:
        """Bytes of each bucket's AllReduce (the last one carries the flags)."""
        return [bucket.flat.numel() * bucket.flat.element_size() for bucket in self.buckets]
