"""In-process transport: ranks are threads, messages go through queues.

Runs the very same algorithm code as the real transport, in milliseconds, so
tests can sweep world sizes and element counts that would take minutes with
processes. A rank that never calls is a silent peer: waits on it time out.

>>> world = ThreadWorld(2)
>>> world.transport(0).world_size
2
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from gradsync.transport.base import PeerFailure, TransportStats
from gradsync.transport.locality import Locality


class ThreadWorld:
    """The shared mailboxes of ``world_size`` in-process ranks."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._mailboxes = {(src, dst): queue.Queue()
                           for src in range(world_size) for dst in range(world_size)}
        # tagged messages: (dst, tag) -> [(src, tensor), ...] in arrival order
        self._tagged: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}
        self._tagged_arrival = threading.Condition()

    def transport(self, rank: int) -> "ThreadTransport":
        return ThreadTransport(self, rank)

    def mailbox(self, src: int, dst: int) -> queue.Queue:
        return self._mailboxes[(src, dst)]

    def put_tagged(self, src: int, dst: int, tag: int, tensor: torch.Tensor) -> None:
        with self._tagged_arrival:
            self._tagged.setdefault((dst, tag), []).append((src, tensor))
            self._tagged_arrival.notify_all()

    def take_tagged(self, dst: int, tag: int, src: int | None, timeout_s: float) -> tuple[int, torch.Tensor]:
        """Remove and return the first ``(src, tensor)`` on (dst, tag), from ``src`` or any source."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        with self._tagged_arrival:
            while True:
                waiting = self._tagged.get((dst, tag), [])
                for index, (sender, tensor) in enumerate(waiting):
                    if src is None or sender == src:
                        return waiting.pop(index)
                left = deadline - time.monotonic()
                if left <= 0 or not self._tagged_arrival.wait(left):
                    raise PeerFailure(-1 if src is None else src, "timed out waiting for it", True)


class _Done:
    def wait(self, timeout_s: float) -> None:
        return None


class _RecvHandle:
    def __init__(self, mailbox: queue.Queue, tensor: torch.Tensor, peer: int):
        self._mailbox = mailbox
        self._tensor = tensor
        self._peer = peer
        self._done = False

    def wait(self, timeout_s: float) -> None:
        if self._done:
            return
        try:
            payload = self._mailbox.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            raise PeerFailure(self._peer, "timed out waiting for it", True) from None
        _check_fits(payload, self._tensor, self._peer)
        self._tensor.copy_(payload.view_as(self._tensor))
        self._done = True


def _check_fits(payload: torch.Tensor, tensor: torch.Tensor, peer: int) -> None:
    if payload.numel() != tensor.numel() or payload.dtype != tensor.dtype:
        raise PeerFailure(peer, f"message of {payload.numel()} x {payload.dtype} does not "
                          f"fit the receive buffer of {tensor.numel()} x {tensor.dtype}", False)


class _TaggedRecvHandle:
    def __init__(self, world: ThreadWorld, dst: int, tag: int, tensor: torch.Tensor, src: int | None):
        self._world, self._dst, self._tag, self._tensor, self._src = world, dst, tag, tensor, src
        self.source = -1

    def wait(self, timeout_s: float) -> None:
        if self.source >= 0:
            return
        sender, payload = self._world.take_tagged(self._dst, self._tag, self._src, timeout_s)
        _check_fits(payload, self._tensor, sender)
        self._tensor.copy_(payload.view_as(self._tensor))
        self.source = sender


class ThreadTransport:
    """A :class:`~gradsync.transport.base.Transport` for one thread-rank of a :class:`ThreadWorld`."""

    def __init__(self, world: ThreadWorld, rank: int):
        if not 0 <= rank < world.world_size:
            raise ValueError(f"rank {rank} is outside world of size {world.world_size}")
        self._world = world
        self.rank = rank
        self.world_size = world.world_size
        self.stats = TransportStats()

    @property
    def locality(self) -> Locality:
        """Every thread-rank runs in this process: one host (pretend nodes are explicit options)."""
        return Locality.single_host(self.world_size)

    def isend(self, tensor: torch.Tensor, peer: int) -> _Done:
        self._world.mailbox(self.rank, peer).put(tensor.detach().clone())
        self.stats.record_send(tensor.numel() * tensor.element_size())
        return _Done()

    def irecv(self, tensor: torch.Tensor, peer: int) -> _RecvHandle:
        self.stats.record_recv(tensor.numel() * tensor.element_size())
        return _RecvHandle(self._world.mailbox(peer, self.rank), tensor, peer)

    def isend_tagged(self, tensor: torch.Tensor, peer: int, tag: int) -> _Done:
        self._world.put_tagged(self.rank, peer, tag, tensor.detach().clone())
        self.stats.record_send(tensor.numel() * tensor.element_size())
        return _Done()

    def irecv_tagged(self, tensor: torch.Tensor, peer: int, tag: int) -> _TaggedRecvHandle:
        self.stats.record_recv(tensor.numel() * tensor.element_size())
        return _TaggedRecvHandle(self._world, self.rank, tag, tensor, peer)

    def irecv_any(self, tensor: torch.Tensor, tag: int) -> _TaggedRecvHandle:
        self.stats.record_recv(tensor.numel() * tensor.element_size())
        return _TaggedRecvHandle(self._world, self.rank, tag, tensor, None)

    def backend_all_reduce(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """Sum by exchanging whole tensors with every peer, adding in rank order."""
        contributions = self._exchange_with_all(tensor, timeout_s)
        total = contributions[0].clone()
        for part in contributions[1:]:
            total += part
        tensor.copy_(total)

    def backend_reduce_scatter(self, tensor: torch.Tensor, chunks: list[tuple[int, int]], timeout_s: float) -> None:
        """Sum by exchanging whole tensors with every peer, adding this rank's chunk in rank order."""
        contributions = self._exchange_with_all(tensor, timeout_s)
        start, stop = chunks[self.rank]
        total = contributions[0][start:stop].clone()
        for part in contributions[1:]:
            total += part[start:stop]
        tensor[start:stop] = total

    def backend_all_gather(self, tensor: torch.Tensor, chunks: list[tuple[int, int]], timeout_s: float) -> None:
        """Send this rank's chunk to every peer and receive each peer's chunk in its place."""
        start, stop = chunks[self.rank]
        for peer in range(self.world_size):
            if peer != self.rank:
                self.isend(tensor[start:stop], peer)
        for peer, (a, b) in enumerate(chunks):
            if peer != self.rank:
                self.irecv(tensor[a:b], peer).wait(timeout_s)

    def backend_broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float) -> None:
        if self.rank == src:
            for peer in range(self.world_size):
                if peer != src:
                    self.isend(tensor, peer)
        else:
            self.irecv(tensor, src).wait(timeout_s)

    def _exchange_with_all(self, tensor: torch.Tensor, timeout_s: float) -> list[torch.Tensor]:
        for peer in range(self.world_size):
            if peer != self.rank:
                self.isend(tensor, peer)
        parts = []
        for peer in range(self.world_size):
            if peer == self.rank:
                parts.append(tensor.clone())
            else:
                buffer = torch.empty_like(tensor)
                self.irecv(buffer, peer).wait(timeout_s)
                parts.append(buffer)
        return parts
