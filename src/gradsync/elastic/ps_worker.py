"""A worker of an elastic asynchronous run: numbered pushes, kept until durable, replayed after a change.

The counterpart of :class:`~gradsync.elastic.ps_server.ElasticParameterServer`.
One object lives through every membership the worker takes part in:
:meth:`ElasticAsyncWorker.connect` enters a membership (it replays the pushes
the server's newest checkpoint does not hold, then asks for parameters),
:meth:`ElasticAsyncWorker.push` sends a gradient and returns the next step.
Both raise :class:`~gradsync.parallel.ps_protocol.MembershipChange` when the
server answers ``CHANGE``, and :class:`~gradsync.CollectiveTimeoutError` when
the server's connection closed (it died); either way the caller enters the
next membership and calls :meth:`connect` again.

Pushes of slot ``s`` in incarnation ``i`` are numbered ``(i << 32) + 1, + 2, ...``
(:func:`~gradsync.parallel.ps_ledger.incarnation_seq`), so a relaunched
worker numbers above its predecessor without asking. Memory: one copy of
the push (gradients, buffers, loss) per push kept, at most about
``checkpoint_every`` of them.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from gradsync.errors import CollectiveMismatchError
from gradsync.parallel.ps_ledger import incarnation_seq
from gradsync.parallel.ps_protocol import (CHANGE, PARAMS, PULL, PUSH, REJECT, REPLAY, STOP, TAG_GRADIENT,
                                           TAG_PARAMETERS, TAG_REPLY, TAG_REQUEST, MembershipChange, SharedModel,
                                           check_transport, gather_gradients, new_header, peer_error)
from gradsync.transport.base import PeerFailure


class ElasticAsyncWorker:
    """One worker slot's side of the elastic parameter-server protocol.

    Args:
        module: as :class:`~gradsync.parallel.async_worker.AsyncWorker`.
        incarnation: this process's incarnation of its slot (0, 1, ... as its launcher relaunches it).
        timeout: seconds to wait for a reply (including staleness-bound waits).

    Attributes:
        version, step, pushes, wait_s: as AsyncWorker. ``kept``: the pushes not yet durable, oldest
        first, as ``(header, payload)``. ``replayed``: pushes sent again. ``durable``: the highest
        sequence number of this slot the server's newest checkpoint holds.
    """

    def __init__(self, module: nn.Module, incarnation: int = 0, timeout: float = 30.0):
        if isinstance(incarnation, bool) or not isinstance(incarnation, int) or incarnation < 0:
            raise ValueError(f"incarnation must be an int >= 0, got {incarnation!r}")
        self.timeout_s = float(timeout)
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}")
        self.shared = SharedModel(module)
        self.params, self.flat = self.shared.params, self.shared.flat
        self.incarnation = incarnation
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.version, self.step, self.durable = -1, None, 0
        self.pushes = self.replayed = 0
        self.wait_s = 0.0
        self.comm, self.server_rank = None, -1
        self._reply = new_header()

    def connect(self, comm, server_rank: int, timeout: float | None = None) -> int | None:
        """Enter a membership whose group is ``comm`` and whose server has ``server_rank``: replay the
        kept pushes, then ask for parameters. Returns the first step, or None (the run is over: the
        module holds the final parameters).

        Raises:
            ValueError: ``server_rank`` is not another rank of ``comm``. See also the class docstring.
        """
        check_transport(comm)
        if not (isinstance(server_rank, int) and 0 <= server_rank < comm.world_size) or server_rank == comm.rank:
            raise ValueError(f"server_rank must be another rank of the group of {comm.world_size}, got {server_rank}")
        self.comm, self.server_rank, self.step = comm, server_rank, None
        timeout_s = self.timeout_s if timeout is None else float(timeout)
        try:
            for header, payload in self.kept:
                replay = header.clone()
                replay[0] = REPLAY
                self._send(replay, payload, timeout_s)
                self.replayed += 1
        except PeerFailure as failure:
            raise peer_error(failure, "replay", comm.rank, comm.world_size, timeout_s, peer=server_rank) from None
        numel, dtype_code, shapes_crc = self.shared.signature
        return self._exchange(torch.tensor([PULL, dtype_code, shapes_crc, numel], dtype=torch.int64), None,
                              timeout_s)

    def push(self, loss: float = math.nan) -> int | None:
        """Send the gradients in ``.grad`` (and ``loss``) for the current step; keep the push until the
        server reports it durable. Returns the next step, or None when the run is over.

        Raises:
            RuntimeError: no current step (before :meth:`connect`, after a stop, or after a failed exchange).
        """
        if self.step is None:
            raise RuntimeError("push() needs a step from connect() or the previous push()")
        payload = torch.empty(self.shared.push_numel, dtype=self.flat.dtype, device=self.flat.device)
        gather_gradients(self.params, payload)
        start, end = self.shared.params_numel, self.shared.params_numel + self.shared.buffers_numel
        payload[start:end].copy_(self.flat[start:end])
        payload[-1] = loss
        for param in self.params:
            param.grad = None
        self.pushes += 1
        seq = incarnation_seq(self.incarnation, self.pushes)
        header = torch.tensor([PUSH, self.version, self.step, seq], dtype=torch.int64)
        self.kept.append((header, payload))
        self.step = None  # until the reply names the next one
        return self._exchange(header, payload, self.timeout_s)

    def _send(self, header: torch.Tensor, payload: torch.Tensor, timeout_s: float) -> None:
        transport = self.comm.transport
        handles = [transport.isend_tagged(header, self.server_rank, TAG_REQUEST),
                   transport.isend_tagged(payload, self.server_rank, TAG_GRADIENT)]
        for handle in handles:
            handle.wait(timeout_s)

    def _exchange(self, header: torch.Tensor, payload: torch.Tensor | None, timeout_s: float) -> int | None:
        comm, server = self.comm, self.server_rank
        started = time.perf_counter()
        try:
            transport = comm.transport
            sends = [transport.isend_tagged(header, server, TAG_REQUEST)]
            if payload is not None:
                sends.append(transport.isend_tagged(payload, server, TAG_GRADIENT))
            reply = self._reply
            transport.irecv_tagged(reply, server, TAG_REPLY).wait(timeout_s)
            kind = int(reply[0])
            if kind in (PARAMS, STOP):
                transport.irecv_tagged(self.flat, server, TAG_PARAMETERS).wait(timeout_s)
            for handle in sends:
                handle.wait(timeout_s)
        except PeerFailure as failure:
            raise peer_error(failure, "exchange", comm.rank, comm.world_size, timeout_s, peer=server) from None
        if payload is not None:
            self.wait_s += time.perf_counter() - started
        return self._take_reply(kind, reply)

    def _take_reply(self, kind: int, reply: torch.Tensor) -> int | None:
        if kind == CHANGE:
            raise MembershipChange(f"worker rank {self.comm.rank}: the parameter server closed this membership")
        if kind == REJECT:
            raise CollectiveMismatchError(f"worker rank {self.comm.rank}: the parameter server rejected this "
                                          f"worker: its model differs from the server's (see the server's error)")
        if kind not in (PARAMS, STOP):
            raise CollectiveMismatchError(f"worker rank {self.comm.rank}: unknown reply {reply.tolist()}")
        self.version, self.durable = int(reply[1]), int(reply[3])
        self.kept = [(h, p) for h, p in self.kept if int(h[3]) > self.durable]
        if kind == STOP:
            return None
        self.step = int(reply[2])
        return self.step
