"""A group of ranks that collectives run on: a transport, a default timeout, scratch space."""

from __future__ import annotations

from gradsync.collectives.call import CollectiveCall, Workspace
from gradsync.transport.base import Transport, TransportStats

DEFAULT_TIMEOUT_S = 300.0


class Communicator:
    """What a collective needs to know about its group.

    Args:
        transport: point-to-point messaging for this rank
            (:class:`~gradsync.transport.torch_p2p.TorchP2PTransport` in real
            runs, :class:`~gradsync.transport.thread.ThreadTransport` in tests).
        timeout_s: default seconds a collective call may take.

    Raises:
        ValueError: ``timeout_s`` is not positive.
    """

    def __init__(self, transport: Transport, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not timeout_s > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout_s}")
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.workspace = Workspace()

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def stats(self) -> TransportStats:
        return self.transport.stats

    def new_call(self, op_name: str, algorithm: str, timeout_s: float | None = None) -> CollectiveCall:
        """Start a call bounded by ``timeout_s`` (the communicator's default when None)."""
        if timeout_s is None:
            timeout_s = self.timeout_s
        elif not timeout_s > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout_s}")
        return CollectiveCall(self.transport, op_name, algorithm, float(timeout_s), self.workspace)
