"""One collective call in flight: its deadline, its byte counts and its errors.

Algorithms move data through a :class:`CollectiveCall` rather than the raw
transport, so that every wait takes the time left until the call's deadline
and every failure becomes a :class:`~gradsync.errors.CollectiveTimeoutError`
naming the operation, algorithm, step, this rank and the peer.
"""

from __future__ import annotations

import time

import torch

from gradsync.errors import CollectiveTimeoutError
from gradsync.transport.base import PeerFailure, Transport


class Workspace:
    """Scratch buffers that grow once and are reused across calls.

    On these machines the first touch of fresh memory costs as much as the
    network, so receive buffers are never allocated per call.
    """

    def __init__(self):
        self._buffers: dict[tuple[torch.dtype, torch.device, str], torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device, purpose: str = "recv") -> torch.Tensor:
        """Return a ``(numel,)`` tensor of ``dtype`` on ``device`` (contents undefined)."""
        key = (dtype, torch.device(device), purpose)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel]


class CollectiveCall:
    """Deadline-bounded point-to-point helpers for one collective call.

    Args:
        transport: the group's transport.
        op_name: "all_reduce", "broadcast", ... (for error messages).
        algorithm: algorithm name (for error messages).
        timeout_s: seconds the whole call may take.
        workspace: scratch buffers to reuse.
    """

    def __init__(self, transport: Transport, op_name: str, algorithm: str,
                 timeout_s: float, workspace: Workspace):
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.op_name = op_name
        self.algorithm = algorithm
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.workspace = workspace

    def remaining_s(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def wait(self, handle, peer: int, step: str) -> None:
        """Wait for ``handle`` until the call's deadline."""
        try:
            handle.wait(self.remaining_s())
        except PeerFailure as failure:
            raise self.failure(failure, step) from failure

    def send(self, tensor: torch.Tensor, peer: int, step: str) -> None:
        if tensor.numel():
            self.wait(self.transport.isend(tensor, peer), peer, step)

    def recv(self, tensor: torch.Tensor, peer: int, step: str) -> None:
        if tensor.numel():
            self.wait(self.transport.irecv(tensor, peer), peer, step)

    def send_recv(self, send_tensor: torch.Tensor, dst: int,
                  recv_tensor: torch.Tensor, src: int, step: str) -> None:
        """Send to ``dst`` and receive from ``src`` concurrently; empty tensors are skipped."""
        send_handle = self.transport.isend(send_tensor, dst) if send_tensor.numel() else None
        recv_handle = self.transport.irecv(recv_tensor, src) if recv_tensor.numel() else None
        if recv_handle is not None:
            self.wait(recv_handle, src, step)
        if send_handle is not None:
            self.wait(send_handle, dst, step)

    def failure(self, failure: PeerFailure, step: str) -> CollectiveTimeoutError:
        """Build the error for a failed wait on ``failure.peer`` during ``step``."""
        peer = "an unknown peer" if failure.peer < 0 else f"peer rank {failure.peer}"
        message = (f"{self.op_name} (algorithm={self.algorithm}) on rank {self.rank} of "
                   f"{self.world_size}: {peer} {failure.reason} at {step} "
                   f"(timeout {self.timeout_s:g} s)")
        return CollectiveTimeoutError(message, op=self.op_name, algorithm=self.algorithm,
                                      rank=self.rank, peer=failure.peer, step=step)
