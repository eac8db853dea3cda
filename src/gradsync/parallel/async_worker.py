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
from gradsync.parallel.ps_protocol import (PARAMS, PULL, PUSH, REJECT, STOP, TAG_GRADIENT, TAG_PARAMETERS, TAG_REPLY,
                                           TAG_REQUEST, SharedModel, check_transport, gather_gradients,
                                           new_header, peer_error)
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

    Attributes:
        version: the version of the parameters in ``module``.
        step: the step the current gradient belongs to (None before ``pull`` and after stop).
        pushes: gradients pushed.
        wait_s: seconds spent waiting for replies to pushes (communication plus
            staleness-bound waits; the first pull's wait for the server to start is not counted).

    Raises:
        ValueError: ``server_rank`` is this rank or outside the group; bad module.
        CollectiveTimeoutError: (from ``pull``/``push``) the server did not
            reply within ``timeout`` or its connection failed ("peer rank N").
    """

    def __init__(self, module: nn.Module, group=None, server_rank: int = 0, timeout: float | None = None):
        self.comm = resolve_group(group)
        check_transport(self.comm)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        if not (isinstance(server_rank, int) and 0 <= server_rank < self.world_size) or server_rank == self.rank:
            raise ValueError(f"server_rank must be another rank of the group of {self.world_size}, "
                             f"got {server_rank} on rank {self.rank}")
        self.server_rank = server_rank
        self.shared = SharedModel(module)
        self.params, self.flat = self.shared.params, self.shared.flat
        self.send_buffer = torch.zeros(self.shared.push_numel, dtype=self.flat.dtype, device=self.flat.device)
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
        return self._exchange(header, None, self.timeout_s if timeout is None else float(timeout))

    def push(self, loss: float = math.nan) -> int | None:
        """Send the gradients in ``.grad`` (and ``loss``); return the next step, or None when done
        (then the module holds the server's final parameters).

        ``.grad`` is reset to None afterwards; parameters without a gradient
        count as zero. On return the module holds the new parameters.
        """
        if self.step is None:
            raise RuntimeError("push() needs a step from pull() or the previous push(); "
                               + ("the server said stop" if self._stopped else "call pull() first"))
        gather_gradients(self.params, self.send_buffer)
        start, end = self.shared.params_numel, self.shared.params_numel + self.shared.buffers_numel
        self.send_buffer[start:end].copy_(self.flat[start:end])  # this worker's buffers, for the server
        self.send_buffer[-1] = loss
        for param in self.params:
            param.grad = None
        header = self._push_header  # reused: _exchange waits for its sends before returning
        header[1], header[2] = self.version, self.step
        self.pushes += 1
        return self._exchange(header, self.send_buffer)

    def _exchange(self, header: torch.Tensor, gradient: torch.Tensor | None,
                  timeout_s: float | None = None) -> int | None:
        """One request and its reply; a transfer that cannot even be started (the server's connection
        is closed) is a CollectiveTimeoutError naming the server, as a failed wait is."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return self._exchange_once(header, gradient, timeout_s)
        except PeerFailure as failure:
            raise peer_error(failure, "exchange", self.rank, self.world_size, timeout_s,
                             peer=self.server_rank) from None

    def _exchange_once(self, header: torch.Tensor, gradient: torch.Tensor | None, timeout_s: float) -> int | None:
        transport, server = self.comm.transport, self.server_rank
        started = time.perf_counter()
        sends = [transport.isend_tagged(header, server, TAG_REQUEST)]
        if gradient is not None:
            sends.append(transport.isend_tagged(gradient, server, TAG_GRADIENT))
        reply = self._reply
        self._wait(transport.irecv_tagged(reply, server, TAG_REPLY), "receive reply", timeout_s)
        if reply[0] == REJECT:
            raise CollectiveMismatchError(f"worker rank {self.rank}: the parameter server (rank {server}) rejected "
                                          f"this worker: its model differs from the server's (see the server's error)")
        if reply[0] not in (PARAMS, STOP):
            raise CollectiveMismatchError(f"worker rank {self.rank}: unknown reply {reply.tolist()} from the server")
        self._wait(transport.irecv_tagged(self.flat, server, TAG_PARAMETERS), "receive parameters", timeout_s)
        for handle in sends:
            self._wait(handle, "send request", timeout_s)
        if gradient is not None:  # the first pull waits for the server to start: not communication
            self.wait_s += time.perf_counter() - started
        self.version = int(reply[1])
        if reply[0] == STOP:  # the module now holds the final parameters
            self._stopped, self.step = True, None
            return None
        self.step = int(reply[2])
        return self.step

    def _wait(self, handle, what: str, timeout_s: float) -> None:
        try:
            handle.wait(timeout_s)
        except PeerFailure as failure:
            raise peer_error(failure, what, self.rank, self.world_size, timeout_s, peer=self.server_rank) from None
