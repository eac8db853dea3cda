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

from gradsync.parallel.ps_protocol import (PARAMS, PULL, PUSH, STOP, TAG_GRADIENT, TAG_PARAMETERS, TAG_REPLY,
                                           TAG_REQUEST, check_transport, flatten_into_views,
                                           gather_gradients, new_header, peer_error, shared_buffers,
                                           trainable_parameters)
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
            time the staleness bound holds this worker back (default: the group's timeout).

    Attributes:
        version: the version of the parameters in ``module``.
        step: the step the current gradient belongs to (None before ``pull`` and after stop).
        pushes: gradients pushed.
        wait_s: seconds spent waiting for replies (communication plus staleness-bound waits).

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
        self.params = trainable_parameters(module)
        self.params_numel = sum(p.numel() for p in self.params)
        self.flat = flatten_into_views(self.params + shared_buffers(module, self.params))
        self.send_buffer = torch.zeros(self.flat.numel() + 1, dtype=self.flat.dtype, device=self.flat.device)
        self.timeout_s = self.comm.timeout_s if timeout is None else float(timeout)
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}")
        self.version = -1
        self.step: int | None = None
        self.pushes = 0
        self.wait_s = 0.0
        self._stopped = False

    def pull(self) -> int | None:
        """First contact: receive the parameters and the first step (None: nothing to do)."""
        if self.version >= 0 or self._stopped:
            raise RuntimeError("pull() starts the exchange once; after it, push() returns the next step")
        header = torch.tensor([PULL, -1, -1, self.flat.numel()], dtype=torch.int64)
        return self._exchange(header, None)

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
        self.send_buffer[self.params_numel:-1].copy_(self.flat[self.params_numel:])  # buffers, for the server
        self.send_buffer[-1] = loss
        for param in self.params:
            param.grad = None
        header = torch.tensor([PUSH, self.version, self.step, 0], dtype=torch.int64)
        self.pushes += 1
        return self._exchange(header, self.send_buffer)

    def _exchange(self, header: torch.Tensor, gradient: torch.Tensor | None) -> int | None:
        transport, server = self.comm.transport, self.server_rank
        started = time.perf_counter()
        sends = [transport.isend_tagged(header, server, TAG_REQUEST)]
        if gradient is not None:
            sends.append(transport.isend_tagged(gradient, server, TAG_GRADIENT))
        reply = new_header()
        self._wait(transport.irecv_tagged(reply, server, TAG_REPLY), "receive reply")
        if reply[0] not in (PARAMS, STOP):
            raise ValueError(f"worker rank {self.rank}: unknown reply {reply.tolist()} from the server")
        self._wait(transport.irecv_tagged(self.flat, server, TAG_PARAMETERS), "receive parameters")
        for handle in sends:
            self._wait(handle, "send request")
        self.wait_s += time.perf_counter() - started
        self.version = int(reply[1])
        if reply[0] == STOP:  # the module now holds the final parameters
            self._stopped, self.step = True, None
            return None
        self.step = int(reply[2])
        return self.step

    def _wait(self, handle, what: str) -> None:
        try:
            handle.wait(self.timeout_s)
        except PeerFailure as failure:
            raise peer_error(failure, what, self.rank, self.world_size, self.timeout_s,
                             peer=self.server_rank) from None
