"""An in-process transport that moves data when a real network may, to expose buffer races.

:class:`~gradsync.transport.thread.ThreadTransport` clones a tensor at
``isend`` and copies it out at ``wait``, so an algorithm that reuses a receive
buffer it has posted but not waited on, or that writes a send buffer before
waiting on the send, still passes there. Gloo and NCCL may fill a posted
receive buffer at any moment before ``wait`` and may read a send buffer at any
moment until the send completes. :class:`StrictWorld` plays both extremes, one
per ``mode``:

* ``"early"``: the data moves as soon as both sides have posted (a receive
  buffer fills before its ``wait``; a send buffer is read at once).
* ``"late"``: the data moves when the receiver waits, read straight from the
  sender's tensor (no clone), and the send completes only then.

Either way, a correct algorithm gives the same result as over ThreadTransport.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from gradsync.transport.base import PeerFailure, TransportStats

MODES = ("early", "late")


class _Transfer:
    """One message: the send's tensor, the receive's buffer, and how far it got."""

    def __init__(self):
        self.source: torch.Tensor | None = None
        self.target: torch.Tensor | None = None
        self.error = ""
        self.sent = threading.Event()  # the send is posted
        self.done = threading.Event()  # the data has moved

    def move(self) -> None:
        if self.source.numel() != self.target.numel() or self.source.dtype != self.target.dtype:
            self.error = (f"message of {self.source.numel()} x {self.source.dtype} does not fit the "
                          f"receive buffer of {self.target.numel()} x {self.target.dtype}")
        else:
            self.target.copy_(self.source.view_as(self.target))
        self.done.set()


class _Handle:
    """Waits until the data has moved; a late receive moves it itself once the send is posted."""

    def __init__(self, transfer: _Transfer, peer: int, moves_on_wait: bool = False):
        self._transfer = transfer
        self._peer = peer
        self._moves_on_wait = moves_on_wait

    def wait(self, timeout_s: float) -> None:
        transfer, timeout_s = self._transfer, max(timeout_s, 0.0)
        if self._moves_on_wait:  # "late" receive: only this wait ever moves the data
            if not transfer.sent.wait(timeout_s):
                raise PeerFailure(self._peer, "timed out waiting for it", True)
            if not transfer.done.is_set():
                transfer.move()
        elif not transfer.done.wait(timeout_s):
            raise PeerFailure(self._peer, "timed out waiting for it", True)
        if transfer.error:
            raise PeerFailure(self._peer, transfer.error, False)


class StrictWorld:
    """Shared matching queues of ``world_size`` in-process ranks; ``mode`` in ``MODES``."""

    def __init__(self, world_size: int, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.world_size = world_size
        self.mode = mode
        self.lock = threading.Lock()
        # (src, dst) -> transfers posted by one side only, in posting order (FIFO matching).
        self.unmatched_sends = {(s, d): deque() for s in range(world_size) for d in range(world_size)}
        self.unmatched_recvs = {(s, d): deque() for s in range(world_size) for d in range(world_size)}

    def transport(self, rank: int) -> "StrictTransport":
        return StrictTransport(self, rank)


class StrictTransport:
    """A :class:`~gradsync.transport.base.Transport` for one rank of a :class:`StrictWorld`."""

    def __init__(self, world: StrictWorld, rank: int):
        self._world = world
        self.rank = rank
        self.world_size = world.world_size
        self.stats = TransportStats()

    def isend(self, tensor: torch.Tensor, peer: int) -> _Handle:
        self.stats.record_send(tensor.numel() * tensor.element_size())
        return _Handle(self._post(tensor, (self.rank, peer), sending=True), peer)

    def irecv(self, tensor: torch.Tensor, peer: int) -> _Handle:
        self.stats.record_recv(tensor.numel() * tensor.element_size())
        transfer = self._post(tensor, (peer, self.rank), sending=False)
        return _Handle(transfer, peer, moves_on_wait=self._world.mode == "late")

    def _post(self, tensor: torch.Tensor, pair: tuple[int, int], sending: bool) -> _Transfer:
        """Match with the other side's oldest unmatched post of ``pair``, or queue this one."""
        world = self._world
        mine, theirs = ((world.unmatched_sends, world.unmatched_recvs) if sending
                        else (world.unmatched_recvs, world.unmatched_sends))
        with world.lock:
            if theirs[pair]:
                transfer = theirs[pair].popleft()
            else:
                transfer = _Transfer()
                mine[pair].append(transfer)
            if sending:
                transfer.source = tensor
                transfer.sent.set()
            else:
                transfer.target = tensor
            matched = transfer.source is not None and transfer.target is not None
        if matched and world.mode == "early":
            transfer.move()
        return transfer

    def backend_all_reduce(self, tensor: torch.Tensor, timeout_s: float) -> None:
        raise RuntimeError("StrictTransport checks point-to-point algorithms only")

    def backend_broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float) -> None:
        raise RuntimeError("StrictTransport checks point-to-point algorithms only")

    def backend_reduce_scatter(self, tensor: torch.Tensor, chunks, timeout_s: float) -> None:
        raise RuntimeError("StrictTransport checks point-to-point algorithms only")

    def backend_all_gather(self, tensor: torch.Tensor, chunks, timeout_s: float) -> None:
        raise RuntimeError("StrictTransport checks point-to-point algorithms only")
