"""The parameter server of asynchronous data parallelism (Dean et al. 2012, Downpour SGD).

One rank holds the parameters and the optimizer. Each worker pulls the
current parameters, computes a gradient on the step the server assigned, and
pushes it; the server applies every gradient as it arrives, without waiting
for the other workers, and replies with fresh parameters and the next step.
Staleness is bounded by :class:`~gradsync.parallel.staleness.StalenessGate`
(``max_staleness``) and recorded for every applied gradient.

Run :meth:`ParameterServer.serve` on the server rank and
:class:`~gradsync.parallel.async_worker.AsyncWorker` on every other rank::

    if gradsync.rank() == server_rank:
        server = ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=1000)
        server.serve()                      # returns when every step was applied
    else:
        worker = AsyncWorker(model, server_rank=server_rank)
        step = worker.pull()
        while step is not None:
            loss = loss_fn(model(x[step]), y[step]); loss.backward()
            step = worker.push(loss.item())
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

import torch
from torch import nn

from gradsync.parallel.ps_links import TcpServerLink, offer_shared_memory, wants_shared_memory
from gradsync.parallel.ps_protocol import (PARAMS, PULL, PUSH, REJECT, STOP, TAG_REPLY, SharedModel, check_transport,
                                           new_header, peer_error)
from gradsync.parallel.staleness import StalenessGate, StalenessStats
from gradsync.process_group import resolve_group
from gradsync.transport.base import PeerFailure


def _check_optimizer(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = sum(id(p) not in stepped for p in params)
    if missing:
        raise ValueError(f"the optimizer does not hold {missing} of the module's {len(params)} trainable "
                         f"parameters: build it on module.parameters()")


def optimizer_step(optimizer, scheduler, params: list, grad_views: list[torch.Tensor], scale: float) -> float:
    """One optimizer step with ``grad_views`` as the gradients and the lr times ``scale`` for this step
    only; then the scheduler's step. Returns the lr applied (of the first group)."""
    groups = optimizer.param_groups
    scheduled = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = group["lr"] * scale
    applied = groups[0]["lr"]
    for param, grad in zip(params, grad_views):  # zero_grad(set_to_none) may have dropped them
        param.grad = grad
    optimizer.step()
    for group, lr in zip(groups, scheduled):
        group["lr"] = lr
    if scheduler is not None:
        scheduler.step()
    return applied


class ParameterServer:
    """Holds the trainable parameters and the optimizer; applies each worker's gradient on arrival.

    Args:
        module: the model; its trainable parameters (one floating dtype) and
            its buffers of that dtype become views into one flat buffer that is
            sent to workers as is. Buffers (BatchNorm statistics) follow the
            latest worker to push, as DataParallel's follow rank 0; frozen
            parameters are not sent (each rank keeps its own).
        optimizer: built on ``module``'s parameters; stepped once per applied gradient.
        total_steps: gradients to apply in all (>= 0); steps ``0 .. total_steps-1``
            are handed to workers in order, each exactly once.
        group: the group of the server and its workers (None: the default group).
        workers: worker ranks (default: every other rank of the group).
        max_staleness: bound on the staleness of applied gradients, in versions
            (None: unbounded). See :class:`~gradsync.parallel.staleness.StalenessGate`.
        staleness_aware_lr: divide the learning rate by the gradient's staleness
            (when > 1) for its update (Zhang et al. 2016).
        scheduler: an lr scheduler stepped after every applied gradient.
        timeout: seconds a worker may take between receiving parameters and
            pushing its gradient (default: the group's timeout); time the
            server itself spends applying gradients or in ``on_update`` is not
            held against a worker whose request is already waiting.
        shared_memory: move pushes and parameters through shared memory
            (:mod:`~gradsync.parallel.ps_links`): None (default) when the
            group is a process group whose locality puts the server and every
            worker on one host, else over the group's transport; True also over
            threads (ValueError when the locality says several hosts); False
            never. The server then first waits for every worker's first
            request; a worker that cannot map the segment makes every worker
            use the transport (``link_fallback`` says why).

    Attributes:
        version: gradients applied so far (the parameters' version).
        staleness: a :class:`~gradsync.parallel.staleness.StalenessStats`.
        link: ``"shared_memory"`` or ``"tcp"``: how pushes and parameters travel (known once ``serve`` set up).
        link_fallback: why shared memory was wanted but not used, else None.
        applied_per_worker: ``{worker rank: gradients applied}``.
        losses: the loss each worker sent with each applied gradient, in order.

    Raises:
        ValueError: bad arguments; the optimizer misses a trainable parameter;
            (from ``serve``) a worker's model differs from the server's in
            element count, dtype or shapes.
        CollectiveTimeoutError: (from ``serve``) a worker sent nothing within
            ``timeout`` after it was given work, or its connection failed;
            the message names it ("peer rank 3").
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, total_steps: int, group=None,
                 workers: list[int] | None = None, max_staleness: int | None = None,
                 staleness_aware_lr: bool = False, scheduler=None, timeout: float | None = None,
                 shared_memory: bool | None = None):
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise ValueError(f"total_steps must be an int >= 0, got {total_steps!r}")
        self.comm = resolve_group(group)
        check_transport(self.comm)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.workers = self._check_workers(workers)
        self.shared = SharedModel(module)
        self.params, self.flat = self.shared.params, self.shared.flat
        names = {id(param): name for name, param in module.named_parameters()}
        self.named_params = [(names[id(param)], param) for param in self.params]
        _check_optimizer(optimizer, self.params)
        self._request, self._reply_header = new_header(), new_header()  # reused: each exchange finishes first
        self._link = TcpServerLink(self.comm, self.shared.push_numel, self.flat.dtype, self._grad_views)
        self._shared_memory = wants_shared_memory(self.comm, self.rank, self.workers, shared_memory)
        self.link_fallback: str | None = None
        self.optimizer, self.scheduler = optimizer, scheduler
        self.last_lr = math.nan  # the lr of the last applied gradient (after any staleness scaling)
        self.total_steps = total_steps
        self.gate = StalenessGate(max_staleness)
        self.staleness_aware_lr = staleness_aware_lr
        self.timeout_s = self.comm.timeout_s if timeout is None else float(timeout)
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}")
        self.version = 0
        self.next_step = 0
        self.staleness = StalenessStats()
        self.applied_per_worker = {w: 0 for w in self.workers}
        self.losses: list[float] = []
        self._waiting: deque[int] = deque()   # workers whose next parameters the gate holds back
        # A worker's timeout runs from the server's reply, minus the time the server then spent busy
        # (optimizer steps, on_update): a busy server never blames a worker whose request is queued.
        self._busy_s = 0.0
        self._replied_at: dict[int, tuple[float, float]] = {}  # worker -> (monotonic time, _busy_s) of reply
        self._stopped: set[int] = set()
        self._served = False

    def _check_workers(self, workers: list[int] | None) -> list[int]:
        if workers is None:
            return [r for r in range(self.world_size) if r != self.rank]
        workers = list(workers)
        bad = [w for w in workers if not (isinstance(w, int) and 0 <= w < self.world_size and w != self.rank)]
        if bad or len(set(workers)) != len(workers) or not workers:
            raise ValueError(f"workers must be distinct ranks of the group other than the server's "
                             f"({self.rank}), got {workers}")
        return workers

    @property
    def link(self) -> str:
        return self._link.kind

    def _grad_views(self, push: torch.Tensor) -> list[torch.Tensor]:
        views, offset = [], 0
        for param in self.params:
            views.append(push[offset:offset + param.numel()].view_as(param))
            offset += param.numel()
        return views

    def serve(self, on_update: Callable[[int, int, float, int], None] | None = None) -> dict[str, torch.Tensor]:
        """Answer workers until all ``total_steps`` gradients are applied and every worker was told to stop.

        Workers that ask for work once none is left wait until the last
        gradient is applied; then each gets the final parameters with its stop.

        Args:
            on_update: called after each applied gradient as
                ``on_update(worker, version, loss, staleness)`` (e.g. to evaluate every epoch).

        Returns:
            The final trainable parameters by name (copies; ``module`` holds them too).

        Raises:
            RuntimeError: called a second time.
        """
        if self._served:
            raise RuntimeError("serve() runs once: its workers were told to stop")
        self._served = True
        self._replied_at = {w: (time.monotonic(), self._busy_s) for w in self.workers}
        try:
            if self._shared_memory:
                self._start_shared_memory()
            self._serve(on_update)
        except PeerFailure as failure:  # a transfer that could not even start: a worker's connection is closed
            raise peer_error(failure, "serve", self.rank, self.world_size, self.timeout_s) from None
        finally:
            self._link.close()  # workers still waiting learn at once that the server is gone
        return {name: param.detach().clone() for name, param in self.named_params}

    def _start_shared_memory(self) -> None:
        """Take every worker's first request over the transport, then offer them shared memory
        (:func:`~gradsync.parallel.ps_links.offer_shared_memory`); the pulls wait in ``_waiting``."""
        while len(self._waiting) < len(self.workers):
            worker, header = self._next_request()
            if header[0] != PULL or worker in self._waiting:
                raise ValueError(f"parameter server: worker rank {worker} sent {header.tolist()} before "
                                 f"its first request was answered")
            self._admit(worker, header[1:].tolist())
            self._waiting.append(worker)
        link, self.link_fallback = offer_shared_memory(
            self.comm, list(self._waiting), self.shared.push_numel, self.flat.dtype, self.flat.numel(),
            self._grad_views, self.timeout_s)
        if link is not None:
            self._link = link

    def _serve(self, on_update) -> None:
        self._answer_waiting()
        while len(self._stopped) < len(self.workers):
            worker, header = self._next_request()
            if header[0] == PULL:
                self._admit(worker, header[1:].tolist())
            elif header[0] == PUSH:
                started = time.monotonic()
                staleness, loss = self._apply(worker, int(header[1]))
                if on_update is not None:
                    on_update(worker, self.version, loss, staleness)
                self._busy_s += time.monotonic() - started
            else:
                raise ValueError(f"parameter server: worker rank {worker} sent unknown request {header.tolist()}")
            self._waiting.append(worker)
            self._answer_waiting()

    def _admit(self, worker: int, signature: list[int]) -> None:
        """Check a new worker's model; a differing one is told (so it need not time out) and named."""
        try:
            self.shared.check_peer([signature[2], signature[0], signature[1]], worker)
        except ValueError:
            reject = torch.tensor([REJECT, 0, 0, 0], dtype=torch.int64)
            handle = self.comm.transport.isend_tagged(reject, worker, TAG_REPLY)
            try:
                handle.wait(min(self.timeout_s, 5.0))
            except PeerFailure:
                pass  # it is gone anyway; the ValueError below says why it was refused
            raise

    def _next_request(self) -> tuple[int, torch.Tensor]:
        """Receive the next header from whichever worker sends first, within the earliest worker's timeout."""
        now = time.monotonic()
        left_s = {w: self.timeout_s - (now - at) + (self._busy_s - busy_at)
                  for w, (at, busy_at) in self._replied_at.items() if w not in self._stopped and w not in self._waiting}
        late = min(left_s, key=left_s.get)
        silent = PeerFailure(late, "sent no request in time: it died, hangs or is slower than the timeout", True)
        if left_s[late] <= 0:  # even while the other workers keep pushing
            raise peer_error(silent, "serve", self.rank, self.world_size, self.timeout_s)
        header = self._request
        try:
            worker = self._link.next_request(header, list(left_s), left_s[late])
        except PeerFailure as failure:
            failure = silent if failure.timed_out else failure  # a failed any-source receive names no peer
            raise peer_error(failure, "serve", self.rank, self.world_size, self.timeout_s) from None
        if worker not in left_s:
            raise ValueError(f"parameter server: unexpected request from rank {worker} "
                             f"({'already stopped' if worker in self._stopped else 'not a worker'})")
        return worker, header

    def _apply(self, worker: int, version_read: int) -> tuple[int, float]:
        """Receive ``worker``'s gradient and take one optimizer step with it."""
        if worker not in self.gate.in_flight:
            raise ValueError(f"parameter server: worker rank {worker} pushed a gradient it was not asked for")
        try:
            push, grad_views = self._link.receive_push(worker, self.timeout_s)
        except PeerFailure as failure:
            raise peer_error(failure, "receive gradient", self.rank, self.world_size, self.timeout_s,
                             peer=worker) from None
        expected = self.gate.finish(worker)
        if version_read != expected:
            raise ValueError(f"parameter server: worker rank {worker} computed on version {version_read}, "
                             f"it was sent version {expected}")
        staleness = self.version - version_read
        start, end = self.shared.params_numel, self.shared.params_numel + self.shared.buffers_numel
        self.flat[start:end].copy_(push[start:end])  # the pusher's buffers
        self._step(staleness, grad_views)
        self.staleness.record(staleness)
        self.applied_per_worker[worker] += 1
        loss = float(push[-1])
        self.losses.append(loss)
        self.version += 1
        return staleness, loss

    def _step(self, staleness: int, grad_views: list[torch.Tensor]) -> None:
        scale = 1.0 / staleness if self.staleness_aware_lr and staleness > 1 else 1.0
        self.last_lr = optimizer_step(self.optimizer, self.scheduler, self.params, grad_views, scale)

    def _answer_waiting(self) -> None:
        """Give parameters (or stop) to waiting workers, oldest first, as far as the gate allows."""
        while self._waiting:
            worker = self._waiting[0]
            if self.next_step >= self.total_steps:
                if self.gate.in_flight:  # the final parameters are not final yet
                    return
                self._reply(worker, STOP)
                self._stopped.add(worker)
            elif self.gate.may_start(self.version):
                self.gate.start(worker, self.version)
                self._reply(worker, PARAMS)
                self.next_step += 1
            else:
                return
            self._waiting.popleft()

    def _reply(self, worker: int, kind: int) -> None:
        """Send ``kind`` and the parameters (to compute on, or the final ones with STOP)."""
        header = self._reply_header
        header[0], header[1], header[2] = kind, self.version, self.next_step
        try:  # the parameters change with the next gradient: the link has sent them when this returns
            self._link.reply(worker, header, self.flat, self.timeout_s)
        except PeerFailure as failure:
            raise peer_error(failure, "send parameters", self.rank, self.world_size, self.timeout_s,
                             peer=worker) from None
        self._replied_at[worker] = (time.monotonic(), self._busy_s)
