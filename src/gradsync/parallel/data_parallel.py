"""DataParallel: a module wrapper whose backward leaves averaged gradients (PyTorch DDP's contract).

At construction the replicas are checked (same parameter names, shapes and
dtypes on every rank) and made identical (rank 0's parameters and buffers
are broadcast). Gradients are packed into buckets of at most
``bucket_cap_mb``; after ``loss.backward()`` outside ``no_sync()`` each
parameter's ``.grad`` holds the average of every rank's gradient, bitwise
equal on every rank. A parameter that got no gradient on a rank counts as
zero. Synchronisation runs in an end-of-backward callback that a parameter's
post-accumulate-grad hook queues, so user code needs no extra call; this
version reduces the buckets one after another once backward ends (overlap
with backward is a later step).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn

from gradsync.collectives import api as collectives
from gradsync.parallel.bucketing import assign_buckets
from gradsync.parallel.replicas import broadcast_tensors, verify_parameters
from gradsync.process_group import resolve_group


class _Bucket:
    """A fixed flat buffer and the parameters whose gradients it carries."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        numel = sum(param.numel() for param in params)
        self.flat = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.offsets = []
        offset = 0
        for param in params:
            self.offsets.append(offset)
            offset += param.numel()

    def gather_grads(self) -> None:
        for param, offset in zip(self.params, self.offsets):
            view = self.flat[offset:offset + param.numel()]
            if param.grad is None:
                view.zero_()
            else:
                view.copy_(param.grad.reshape(-1))

    def scatter_grads(self) -> None:
        for param, offset in zip(self.params, self.offsets):
            averaged = self.flat[offset:offset + param.numel()].view_as(param)
            if param.grad is None:
                param.grad = averaged.clone()
            else:
                param.grad.copy_(averaged)


class DataParallel(nn.Module):
    """Synchronous data parallelism over gradsync collectives.

    Args:
        module: the model; every rank must build the same architecture.
        bucket_cap_mb: most megabytes (MiB) of gradients per bucket (> 0).
        algorithm: the AllReduce algorithm, a name in ``gradsync.ALGORITHMS``.
        compression: reserved for gradient compressors; only None is accepted.
        broadcast_buffers: copy rank 0's buffers (BatchNorm statistics) to
            every rank before each forward, as DDP does.
        group: None (the default group), a Communicator or a torch ProcessGroup.

    Raises:
        ValueError: bad ``bucket_cap_mb``, unknown ``algorithm``, or a compressor.
        CollectiveMismatchError: replicas differ (on every rank, naming the
            first differing parameter).

    Example::

        model = gradsync.DataParallel(Net())
        loss_fn(model(x), y).backward()   # .grad is now the average over ranks
        optimizer.step()
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, algorithm: str = "ring",
                 compression=None, broadcast_buffers: bool = True, group=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps a torch.nn.Module, got {type(module).__name__}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        collectives.validate_algorithm(algorithm)
        if compression is not None:
            raise ValueError("DataParallel: gradient compression is not available in this version; "
                             "pass compression=None")
        self.module = module
        self.algorithm = algorithm
        self.broadcast_buffers = broadcast_buffers
        self.comm = resolve_group(group)
        self.comm_seconds = 0.0  # time spent reducing gradients, summed over steps
        self._sync_disabled = 0
        self._callback_queued = False
        named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
        verify_parameters(named, self.comm)
        broadcast_tensors([param.data for param in module.parameters()] + list(module.buffers()),
                          self.comm)
        params = [param for _, param in named]
        bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self._buckets = [_Bucket([params[i] for i in indices])
                         for indices in assign_buckets(params, bucket_cap_bytes)]
        self._hooks = [param.register_post_accumulate_grad_hook(self._on_grad_ready) for param in params]

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.comm.world_size > 1:
            buffers = list(self.module.buffers())
            if buffers:  # layout verified by the broadcast at construction
                broadcast_tensors(buffers, self.comm, verify=False)
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally: backward inside this block does not communicate.

        The next backward outside the block synchronises everything
        accumulated, including parameters used only inside the block.
        """
        self._sync_disabled += 1
        try:
            yield
        finally:
            self._sync_disabled -= 1

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self._sync_disabled or self._callback_queued:
            return
        self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._sync_gradients)

    def _sync_gradients(self) -> None:
        self._callback_queued = False
        started = time.perf_counter()
        with torch.no_grad():
            for bucket in self._buckets:
                bucket.gather_grads()
                collectives.all_reduce(bucket.flat, self.comm, op="avg",
                                       algorithm=self.algorithm, verify=False)
                bucket.scatter_grads()
        self.comm_seconds += time.perf_counter() - started

    @property
    def bucket_numels(self) -> list[int]:
        """Elements per bucket, in the order buckets are reduced."""
        return [bucket.flat.numel() for bucket in self._buckets]
