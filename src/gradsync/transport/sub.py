"""A transport over a subset of another transport's ranks (a sub-communicator without new sockets).

Hierarchical AllReduce runs inner algorithms among the ranks of one node and
among the ranks that share a local rank. ``SubTransport(parent, members)``
renumbers ``members`` (parent ranks) as 0..len-1 and forwards each message
to the parent, so the inner algorithm's code is unchanged. Failures keep the
parent's rank numbers, so an error still names the real peer.

>>> from gradsync.transport.thread import ThreadWorld
>>> sub = SubTransport(ThreadWorld(4).transport(3), members=[1, 3])
>>> sub.rank, sub.world_size
(1, 2)
"""

from __future__ import annotations

from typing import Sequence

import torch

from gradsync.transport.base import Transport


class SubTransport:
    """A :class:`~gradsync.transport.base.Transport` for ``members`` of ``parent``'s group.

    Args:
        parent: the transport of the whole group.
        members: parent ranks in sub-rank order; must include ``parent.rank``.

    Raises:
        ValueError: ``parent.rank`` is not a member, or members repeat.
    """

    def __init__(self, parent: Transport, members: Sequence[int]):
        members = list(members)
        if parent.rank not in members or len(set(members)) != len(members):
            raise ValueError(f"members {members} must be distinct and include rank {parent.rank}")
        self.parent = parent
        self.members = members
        self.rank = members.index(parent.rank)
        self.world_size = len(members)
        self.stats = parent.stats  # traffic is the parent's traffic

    @property
    def call_tags(self) -> bool:
        return getattr(self.parent, "call_tags", False)

    @property
    def shared_memory_model(self):
        """The simulator's shared-memory formula (:mod:`gradsync.sim.transport`), None on a real transport."""
        return getattr(self.parent, "shared_memory_model", None)

    def isend(self, tensor: torch.Tensor, peer: int, **tag):
        return self.parent.isend(tensor, self.members[peer], **tag)

    def irecv(self, tensor: torch.Tensor, peer: int, **tag):
        return self.parent.irecv(tensor, self.members[peer], **tag)

    def backend_all_reduce(self, tensor: torch.Tensor, timeout_s: float) -> None:
        raise ValueError("the backend's native all_reduce needs a backend group; "
                         "use a point-to-point algorithm inside hierarchical")

    def backend_broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float) -> None:
        raise ValueError("the backend's native broadcast needs a backend group")

    def backend_reduce_scatter(self, tensor: torch.Tensor, chunks, timeout_s: float) -> None:
        raise ValueError("the backend's native reduce_scatter needs a backend group")

    def backend_all_gather(self, tensor: torch.Tensor, chunks, timeout_s: float) -> None:
        raise ValueError("the backend's native all_gather needs a backend group")
