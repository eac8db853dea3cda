"""Local SGD: every worker steps its own optimizer; parameters are averaged every H steps.

Lin et al. 2018, "Don't use large mini-batches, use local SGD"; Stich 2019,
"Local SGD converges fast and communicates little". The middle ground
between synchronous data parallelism (H = 1: with SGD, plain or with
momentum, averaging the parameters after every step equals averaging the
gradients) and independent training. Torch's counterpart is
``PeriodicModelAverager`` / ``PostLocalSGDOptimizer``.

>>> import torch, gradsync
>>> from gradsync.transport.thread import ThreadWorld
>>> comm = gradsync.Communicator(ThreadWorld(1).transport(0))
>>> model = LocalSGD(torch.nn.Linear(2, 1), sync_every=4, group=comm)
>>> [model.step() for _ in range(4)]
[False, False, False, True]
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn

from gradsync import collectives
from gradsync.collectives.communicator import check_timeout
from gradsync.parallel.replica_check import ReplicaCheck, check_replicas
from gradsync.parallel.replicas import agree_on_arguments, broadcast_tensors, verify_parameters


class LocalSGD(nn.Module):
    """Wrap ``module`` for local SGD; call :meth:`step` after every ``optimizer.step()``.

    Gradients are never communicated: build the optimizer on
    ``model.parameters()`` as for a single process. Every ``sync_every``-th
    :meth:`step` replaces every rank's parameters (and floating-point
    buffers) by their average over the group, in one AllReduce per dtype.
    Optimizer state (momentum, Adam moments) stays per rank, as in Lin et al.

    Args:
        module: the model; rank 0's parameters and buffers are broadcast at construction.
        sync_every: H, optimizer steps between averages (int >= 1).
        group: None (the default group), a Communicator or a torch ProcessGroup.
        algorithm: the AllReduce algorithm of the averages (a name in ``gradsync.ALGORITHMS``).
        timeout: seconds an average may take (None: the group's timeout).

    Attributes:
        local_steps: steps since the last average (0 right after one).
        averages: averages done so far.
        comm_seconds: seconds spent averaging (the caller waits for all of it).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``group`` is not a group,
            ``timeout`` is not a number.
        ValueError: bad ``sync_every``, ``algorithm`` or ``timeout`` (finite, > 0).
        CollectiveMismatchError: parameter shapes or dtypes differ across ranks,
            ranks disagree on ``sync_every`` or ``algorithm``, or another rank
            was given a bad argument (at once, naming that rank and the
            argument; that rank raises its own TypeError/ValueError).
        CollectiveTimeoutError: (from ``step``/``average``) a peer did not take part in time.
    """

    def __init__(self, module: nn.Module, sync_every: int, group=None, algorithm: str = collectives.DEFAULT_ALGORITHM,
                 timeout: float | None = None):
        super().__init__()

        def check() -> None:
            if not isinstance(module, nn.Module):
                raise TypeError(f"LocalSGD wraps a torch.nn.Module, got {type(module).__name__}")
            if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
                raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
            collectives.validate_algorithm(algorithm)
            if timeout is not None:
                check_timeout(timeout)

        settings = {"sync_every": sync_every, "algorithm": algorithm}  # timeout may differ per rank
        self.comm = agree_on_arguments("LocalSGD", group, settings, check)
        self.module = module
        self.sync_every = sync_every
        self.algorithm = algorithm
        self.timeout = timeout
        tensors = list(module.named_parameters()) + list(module.named_buffers())
        verify_parameters(tensors, self.comm, owner="LocalSGD")
        broadcast_tensors([t.data for _, t in tensors], self.comm)
        self._groups: dict[tuple, list[torch.Tensor]] = {}  # (dtype, device) -> floating tensors averaged
        for _, tensor in tensors:
            if tensor.dtype.is_floating_point:
                self._groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        self._flat = {key: torch.empty(sum(t.numel() for t in members), dtype=key[0], device=key[1])
                      for key, members in self._groups.items()}  # one buffer per group, allocated once
        self.local_steps = 0
        self.averages = 0
        self.comm_seconds = 0.0

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def bucket_algorithms(self) -> list[tuple[int, str]]:
        """Per average (one per dtype and device): (bytes of its AllReduce, the algorithm that runs it,
        ``auto`` resolved as the collectives resolve it for that size)."""
        sizes = [flat.numel() * flat.element_size() for flat in self._flat.values()]
        return [(nbytes, collectives.resolve_algorithm(self.comm, nbytes, self.algorithm)) for nbytes in sizes]

    @property
    def exposed_comm_seconds(self) -> float:
        """All of ``comm_seconds``: an average blocks the step that calls it."""
        return self.comm_seconds

    @contextmanager
    def no_sync(self):
        """No-op (gradients are never synchronized); kept so loops written for DataParallel run unchanged."""
        yield

    def step(self) -> bool:
        """Count one local optimizer step; average the parameters if it was the H-th. Returns whether it did."""
        self.local_steps += 1
        if self.local_steps < self.sync_every:
            return False
        self.average()
        return True

    def check_replicas(self, *, buffers: bool = True, step: int | None = None,
                       timeout: float | None = None) -> ReplicaCheck:
        """Raise ReplicaDivergenceError on every rank unless the replicas are bitwise equal; call it
        right after an average (``step()`` returned True, or ``average()``), the only moment they
        must agree. Optimizer state is per rank in local SGD and is not compared. ``step`` (None:
        the number of averages so far) labels the error. See :func:`gradsync.check_replicas`.

        Raises:
            ValueError: ``local_steps`` is not 0 (steps taken since the last average).
        """
        rejection = None
        if self.local_steps:  # still takes part, so that a rank called right after an average is not left waiting
            rejection = ValueError(f"LocalSGD.check_replicas: replicas differ between averages by design; call it "
                                   f"right after an average (this rank took {self.local_steps} local steps since)")
        return check_replicas(self.module, buffers=buffers, group=self.comm, timeout=timeout,
                              step=self.averages if step is None else step, compare_step=step is not None,
                              _rejection=rejection)

    @torch.no_grad()
    def average(self) -> None:
        """Replace parameters and floating buffers by their mean over the group now (collective)."""
        started = time.perf_counter()
        for key, members in self._groups.items():
            flat = self._flat[key]
            offset = 0
            for tensor in members:
                flat[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
                offset += tensor.numel()
            collectives.all_reduce(flat, self.comm, op="avg", algorithm=self.algorithm, timeout=self.timeout,
                                   verify=self.averages == 0)
            offset = 0
            for tensor in members:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        self.local_steps = 0
        self.averages += 1
        self.comm_seconds += time.perf_counter() - started
