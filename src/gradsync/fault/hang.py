"""Naming the rank that hung, not the neighbour that waited for it.

When one rank stops (a hang, a long stall), the others block in the next
collective one after another: in a ring, rank r+1 waits for the hung rank r,
rank r+2 waits for rank r+1, and so on, so each rank's timeout names a
different peer. On a timeout every rank that is still alive says so in the
rendezvous store (``stuck/<rank>``) and waits briefly for the others to say
the same; the ranks that stay silent are the ones that stopped responding.
This is the idea of NCCL's and PyTorch's desync debugging, reduced to one
key per rank.

The store is torch.distributed's (the elastic agent's under ``gradsync
train`` and torchrun); its namespace is fresh for every group (see
``process_group``), so a restart never reads an old attempt's keys.
"""

from __future__ import annotations

import time

DEFAULT_GRACE_S = 1.5  # how long a timed-out rank waits for the others to report (seconds)
_POLL_S = 0.05


class HangDetector:
    """Find the ranks that did not reach a timed-out collective.

    Args:
        store: a ``torch.distributed.Store`` shared by the group's ranks
            (TCPStore, HashStore, or a PrefixStore over one).
        rank, world_size: this rank and the group size.
        grace_s: seconds to wait for the other ranks' reports (> 0); the
            diagnosis adds at most this much to a timeout.
    """

    def __init__(self, store, rank: int, world_size: int, grace_s: float = DEFAULT_GRACE_S):
        if not grace_s > 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.grace_s = grace_s

    def silent_ranks(self) -> list[int] | None:
        """Report this rank as stuck and return the ranks that did not report within the grace.

        Returns:
            The silent ranks (ascending; empty when every rank reported: a
            stall of the network, not of one rank), or None when the store
            could not be used (then nothing is known).
        """
        try:
            self.store.set(_key(self.rank), str(time.time()))
            pending = [rank for rank in range(self.world_size) if rank != self.rank]
            deadline = time.monotonic() + self.grace_s
            while pending and time.monotonic() < deadline:
                pending = [rank for rank in pending if not self.store.check([_key(rank)])]
                if pending:
                    time.sleep(_POLL_S)
            return pending
        except Exception:  # noqa: BLE001 - a broken store must not hide the original timeout
            return None


def _key(rank: int) -> str:
    return f"stuck/{rank}"

