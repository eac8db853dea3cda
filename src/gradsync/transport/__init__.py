"""Point-to-point transports that collective algorithms run over."""

from gradsync.transport.base import Handle, PeerFailure, Transport, TransportStats

__all__ = ["Handle", "PeerFailure", "Transport", "TransportStats"]
