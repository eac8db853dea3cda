"""The Transport protocol: the only thing a collective algorithm talks to.

A transport moves whole tensors between two ranks of one group. ``isend`` and
``irecv`` return a handle at once; ``handle.wait(timeout_s)`` blocks until the
transfer is complete or raises :class:`PeerFailure` naming the peer. The same
algorithm code therefore runs over torch.distributed (``torch_p2p.py``), over
in-process threads in tests (``thread.py``) and, later, over a simulator.

Messages between one ordered pair of ranks are matched in posting order
(FIFO), as in Gloo and MPI: algorithms rely on it instead of tags.
A transport whose ``call_tags`` is true (Gloo's) also takes ``tag=`` in
``isend``/``irecv``: the communicator then tags each call's messages with the
call's ordinal and kind (``Communicator._tags``, from 1024 up), so that ranks
out of step never pair one call's message with another's. Otherwise
collectives use tag 0. The parameter server's messages, whose order across
peers is not known in advance, travel on their own tags and are received with
:meth:`TaggedTransport.irecv_any` (a receive from whichever peer sends first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from gradsync.errors import PeerFailure  # re-exported: transports raise it


@dataclass
class TransportStats:
    """Bytes this rank put on and took off the wire, and message counts.

    ``bytes_*`` count payload; ``control_bytes_*`` count the small layout
    checks that guard collectives (moved there by the collective layer), so
    that payload bytes can be compared with an algorithm's formula.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    control_bytes_sent: int = 0
    control_bytes_received: int = 0

    def record_send(self, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.messages_sent += 1

    def record_recv(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        self.messages_received += 1

    def reclassify_as_control(self, bytes_sent: int, bytes_received: int, messages: tuple[int, int]) -> None:
        """Move traffic already recorded as payload into the control counters."""
        self.bytes_sent -= bytes_sent
        self.bytes_received -= bytes_received
        self.messages_sent -= messages[0]
        self.messages_received -= messages[1]
        self.control_bytes_sent += bytes_sent
        self.control_bytes_received += bytes_received

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class Handle(Protocol):
    """A transfer in flight."""

    def wait(self, timeout_s: float) -> None:
        """Block until done; raise :class:`PeerFailure` after ``timeout_s`` seconds."""


class Transport(Protocol):
    """Point-to-point messaging inside one group of ``world_size`` ranks.

    ``tensor`` arguments are contiguous; a receive buffer must have the same
    numel and dtype as the matching send. Peers are ranks within the group.
    """

    rank: int
    world_size: int
    stats: TransportStats

    def isend(self, tensor: torch.Tensor, peer: int) -> Handle:
        """Start sending ``tensor`` to ``peer``; the caller keeps it alive until waited."""

    def irecv(self, tensor: torch.Tensor, peer: int) -> Handle:
        """Start receiving from ``peer`` into ``tensor``."""

    def backend_all_reduce(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """Sum ``tensor`` in place over the group with the backend's own collective."""

    def backend_broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float) -> None:
        """Copy ``src``'s ``tensor`` into every rank's ``tensor`` with the backend's own call."""

    def backend_reduce_scatter(self, tensor: torch.Tensor, chunks: list[tuple[int, int]], timeout_s: float) -> None:
        """Sum ``tensor`` (``(numel,)``) over the group so that ``tensor[a:b]``, ``(a, b) = chunks[rank]``,
        holds the sum (the rest undefined afterwards), with the backend's own call."""

    def backend_all_gather(self, tensor: torch.Tensor, chunks: list[tuple[int, int]], timeout_s: float) -> None:
        """Fill every ``chunks[r]`` of ``tensor`` (``(numel,)``) from rank r, with the backend's own call."""


class AnySourceHandle(Protocol):
    """A receive from any peer in flight; ``source`` is the sender's rank once ``wait`` returned."""

    source: int

    def wait(self, timeout_s: float) -> None:
        """Block until a message arrived; raise :class:`PeerFailure` (peer -1) after ``timeout_s``."""


class TaggedTransport(Transport, Protocol):
    """A transport that also carries tagged messages and receives from any source.

    Messages match on (peer, tag), FIFO within each; a tag > 0 never matches
    the collectives' tag 0, so tagged traffic and collectives share a group.
    """

    def isend_tagged(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        """Start sending ``tensor`` to ``peer`` on ``tag``."""

    def irecv_tagged(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        """Start receiving ``peer``'s next message on ``tag`` into ``tensor``."""

    def irecv_any(self, tensor: torch.Tensor, tag: int) -> AnySourceHandle:
        """Start receiving the next message on ``tag`` from whichever peer sends first."""
