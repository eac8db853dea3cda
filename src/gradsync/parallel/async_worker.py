"""A worker of asynchronous data parallelism: pull parameters, compute a gradient, push it.

The counterpart of :class:`~gradsync.parallel.parameter_server.ParameterServer`
(Dean et al. 2012). A push and the next pull are one round trip: the
server's reply to a gradient carries the parameters to compute the next one
on, or tells the worker to stop.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from gradsync.errors import CollectiveMismatchError
from gradsync.parallel.ps_links import SHM_OFFER, TcpWorkerLink, accept_offer
from gradsync.parallel.ps_protocol import (PARAMS, PULL, PUSH, REJECT, STOP, SharedModel, check_transport,
                                           gather_gradients, new_header, peer_error)
from gradsync.process_group import resolve_group
from gradsync.transport.base import PeerFailure


class AsyncWorker:
    """One worker's side of the parameter-server protocol.

    Args:
        module: the same architecture as the server's; its trainable parameters
            and floating-point buffers of their dtype become views into one flat
            buffer that the server's replies are received into. Pushes carry
            the buffers too (BatchNorm statistics), so every worker continues
            from the latest pusher's; frozen parameters stay this worker's own.
        group: the group of the server and its workers (None: the default group).
        server_rank: the server's rank in ``group``.
        timeout: seconds to wait for the server's reply, which includes any
            time the staleness bound holds this worker back (default: the group's
            timeout).
        shared_memory: accept the server's offer of shared memory (True or None,
            the default; the server decides, see :class:`~gradsync.parallel.parameter_server.ParameterServer`);
            False declines it (then every worker of the server uses the transport).

    Attributes:
        version: the version of the parameters in ``module``.
        step: the step the current gradient belongs to (None before ``pull`` and after stop).
        pushes: gradients pushed.
        wait_s: seconds spent waiting for replies to pushes (communication plus
            staleness-bound waits; the first pull's wait for the server to start is not counted).
        link: ``"shared_memory"`` or ``"tcp"`` (after ``pull``): how pushes and parameters travel.

    Raises:
        ValueError: ``server_rank`` is this rank or outside the group; bad module.
        CollectiveTimeoutError: (from ``pull``/``push``) the server did not
            reply within ``timeout`` or its connection failed ("peer rank N").
    """

    def __init__(self, module: nn.Module, group=None, server_rank: int = 0, timeout: float | None = None,
                 shared_memory: bool | None = None):
        self.comm = resolve_group(group)
        check_transport(self.comm)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        if not (isinstance(server_rank, int) and 0 <= server_rank < self.world_size) or server_rank == self.rank:
            raise ValueError(f"server_rank must be another rank of the group of {self.world_size}, "
                             f"got {server_rank} on rank {self.rank}")
        self.server_rank = server_rank
        self.shared = SharedModel(module)
        self.params, self.flat = self.shared.params, self.shared.flat
        self._link = TcpWorkerLink(self.comm, server_rank, self.shared.push_numel, self.flat.dtype)
        self._accept_shared_memory = shared_memory is not False
        self.timeout_s = self.comm.timeout_s if timeout is None else float(timeout)
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}")
        self._push_header = torch.tensor([PUSH, 0, 0, 0], dtype=torch.int64)
        self._reply = new_header()
        self.version = -1
        self.step: int | None = None
        self.pushes = 0
        self.wait_s = 0.0
        self._stopped = False

    @property
    def link(self) -> str:
        return self._link.kind

    def pull(self, timeout: float | None = None) -> int | None:
        """First contact: receive the parameters and the first step (None: nothing to do).

        Args:
            timeout: seconds to wait for the server this once (default: the
                worker's ``timeout``); give more when the server may still be
                starting, as ``gradsync train`` does (60 s at least, as ``gradsync.init``).

        Raises:
            RuntimeError: called twice. CollectiveMismatchError (a ValueError): the server rejected this
            worker (its model differs). CollectiveTimeoutError: no answer in time.
        """
        if self.version >= 0 or self._stopped:
            raise RuntimeError("pull() starts the exchange once; after it, push() returns the next step")
        numel, dtype_code, shapes_crc = self.shared.signature
        header = torch.tensor([PULL, dtype_code, shapes_crc, numel], dtype=torch.int64)
        return self._exchange(header, False, self.timeout_s if timeout is None else float(timeout))

    def push(self, loss: float = math.nan) -> int | None:
        """Send the gradients in ``.grad`` (and ``loss``); return the next step, or None when done
        (then the module holds the server's final parameters).

        ``.grad`` is reset to None afterwards; parameters without a gradient
        count as zero. On return the module holds the new parameters.
        """
        if self.step is None:
            raise RuntimeError("push() needs a step from pull() or the previous push(); "
                               + ("the server said stop" if self._stopped else "call pull() first"))
        send_buffer = self._link.send_buffer  # shared memory: the server reads it there
        gather_gradients(self.params, send_buffer)
        start, end = self.shared.params_numel, self.shared.params_numel + self.shared.buffers_numel
        send_buffer[start:end].copy_(self.flat[start:end])  # this worker's buffers, for the server
        send_buffer[-1] = loss
        for param in self.params:
            param.grad = None
        header = self._push_header  # reused: _exchange waits for its sends before returning
        header[1], header[2] = self.version, self.step
        self.pushes += 1
        return self._exchange(header, True)

    def close(self) -> None:
        """Let go of the shared memory, if any (idempotent; done on the stop and on a failed exchange)."""
        self._link.close()

    def _exchange(self, header: torch.Tensor, with_push: bool, timeout_s: float | None = None) -> int | None:
        """One request and its reply; a transfer that cannot even be started (the server's connection
        is closed) is a CollectiveTimeoutError naming the server, as a failed wait is."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return self._exchange_once(header, with_push, timeout_s)
        except PeerFailure as failure:
            self.close()
            raise peer_error(failure, "exchange", self.rank, self.world_size, timeout_s,
                             peer=self.server_rank) from None

    def _exchange_once(self, header: torch.Tensor, with_push: bool, timeout_s: float) -> int | None:
        link, server = self._link, self.server_rank
        started = time.perf_counter()
        sends = link.request(header, with_push)
        reply = self._reply
        link.receive_header(reply, timeout_s)
        if reply[0] == SHM_OFFER:  # the answer to the first pull: the server offers shared memory
            shm = accept_offer(self.comm, server, reply, self.shared.push_numel, self.flat.dtype,
                               self.flat.numel(), self._accept_shared_memory, timeout_s)
            if shm is not None:
                link.finish(sends, timeout_s)
                self._link = link = shm
                sends = []
                link.receive_header(reply, timeout_s)
        if reply[0] == REJECT:
            raise CollectiveMismatchError(f"worker rank {self.rank}: the parameter server (rank {server}) rejected "
                                          f"this worker: its model differs from the server's (see the server's error)")
        if reply[0] not in (PARAMS, STOP):
            raise CollectiveMismatchError(f"worker rank {self.rank}: unknown reply {reply.tolist()} from the server")
        link.receive_parameters(self.flat, timeout_s)
        link.finish(sends, timeout_s)
        if with_push:  # the first pull waits for the server to start: not communication
            self.wait_s += time.perf_counter() - started
        self.version = int(reply[1])
        if reply[0] == STOP:  # the module now holds the final parameters
            self._stopped, self.step = True, None
            self.close()
            return None
        self.step = int(reply[2])
        return self.step
