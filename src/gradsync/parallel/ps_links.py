"""How the parameter server and its workers move their messages: the group's transport, or shared memory.

A *link* carries the protocol of :mod:`~gradsync.parallel.ps_protocol` (a
request header with a push, a reply header with the parameters) between the
server and its workers:

* :class:`TcpServerLink` / :class:`TcpWorkerLink`: tagged point-to-point
  messages over the group's transport (Gloo's TCP pairs across hosts; threads
  in tests), the server receiving from whichever worker sends first;
* :class:`ShmServerLink` / :class:`ShmWorkerLink`: one shared-memory channel
  per worker (:mod:`gradsync.transport.shm_channels`) when the server and
  every worker share a host. A push is gathered straight into the worker's
  push region and the server steps its optimizer on views of that region (no
  copy); the parameters are copied once into the worker's region and once
  out of it; a doorbell wakes the waiting side. Bytes are counted in the
  group's transport stats as the TCP link counts them.

Choosing (:func:`wants_shared_memory`; ``shared_memory`` of the server and its
workers): every exchange starts over the transport. With shared memory
wanted, the server first takes every worker's first request (``PULL``), then
creates the segment and offers it to each (``SHM_OFFER``: its index, then the
segment's name on ``TAG_SHM``); each worker maps it and reports (``TAG_SHM``:
empty, or why it could not). All mapped: the server unlinks the name, says
``SHM_USE`` and answers the pulls through shared memory; otherwise (or when
the segment cannot be created) it answers them over the transport as it
always did, and ``fallback`` says why. Either way every worker uses one link
for the whole run, and the server never waits on two kinds of link at once.
"""

from __future__ import annotations

import time

import torch

from gradsync.parallel.ps_protocol import HEADER_NUMEL, TAG_GRADIENT, TAG_PARAMETERS, TAG_REPLY, TAG_REQUEST
from gradsync.transport.base import PeerFailure
from gradsync.transport.shm_channels import ShmClientChannel, ShmServerChannels
from gradsync.transport.shm_segment import ShmPeerTimeout

SHM_OFFER, SHM_USE = 5, 6   # server -> worker reply kinds of the set-up (ps_protocol's kinds are 1-4)
TAG_SHM = 105               # the segment's name, and each worker's report
NAME_BYTES, REPORT_BYTES = 64, 256
_HEADER_BYTES = HEADER_NUMEL * 8


def wants_shared_memory(comm, server_rank: int, workers: list[int], shared_memory: bool | None) -> bool:
    """Whether the server offers shared memory: ``shared_memory`` True, or None (auto) on a process group
    (not threads) whose locality puts the server and every worker on one host.

    Raises:
        ValueError: ``shared_memory`` is True but the group's locality puts a worker on another host.
    """
    if shared_memory is False:
        return False
    locality = comm.locality
    ranks = [server_rank, *workers]
    one_host = locality is not None and len({locality.hosts[r] for r in ranks}) == 1
    if shared_memory:
        if locality is not None and not one_host:
            raise ValueError(f"shared_memory=True needs the server and its workers on one host; the group's "
                             f"ranks are on {locality.describe()}")
        return True
    return one_host and getattr(comm.transport, "backend", None) == "gloo"


def _text(buffer: torch.Tensor) -> str:
    return bytes(buffer[buffer > 0].tolist()).decode(errors="replace")


def _encode(text: str, nbytes: int) -> torch.Tensor:
    encoded = text.encode()[:nbytes]
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    buffer[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    return buffer


def _shm_failure(error: ShmPeerTimeout, rank: int) -> PeerFailure:
    reason = ("left (it closed its shared memory)" if error.left else "died (its process is gone)")
    return PeerFailure(rank, reason, False)


# -------------------------------------------------------------------------------------------------- server


class TcpServerLink:
    """The server's messages over the group's transport (tagged; requests from any source)."""

    kind = "tcp"

    def __init__(self, comm, push_numel: int, dtype: torch.dtype, grad_views):
        self.transport = comm.transport
        self.push_buffer = torch.zeros(push_numel, dtype=dtype)
        self.grad_views = grad_views(self.push_buffer)

    def next_request(self, header: torch.Tensor, workers, timeout_s: float) -> int:
        """Receive the next request header into ``header`` from any of ``workers``; returns its rank.

        Raises:
            PeerFailure: nothing came within ``timeout_s`` (peer -1, timed out) or a connection failed.
        """
        handle = self.transport.irecv_any(header, TAG_REQUEST)
        handle.wait(timeout_s)
        return handle.source

    def receive_push(self, worker: int, timeout_s: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The push that follows ``worker``'s request header, and its gradients as views of the parameters' shapes."""
        self.transport.irecv_tagged(self.push_buffer, worker, TAG_GRADIENT).wait(timeout_s)
        return self.push_buffer, self.grad_views

    def reply(self, worker: int, header: torch.Tensor, flat: torch.Tensor | None, timeout_s: float) -> None:
        """Send ``header`` and, unless None, the parameters ``flat``; returns once both are sent (``flat`` may then change)."""
        handles = [self.transport.isend_tagged(header, worker, TAG_REPLY)]
        if flat is not None:
            handles.append(self.transport.isend_tagged(flat, worker, TAG_PARAMETERS))
        for handle in handles:
            handle.wait(timeout_s)

    def close(self) -> None:
        pass


class ShmServerLink:
    """The server's messages through one shared-memory channel per worker (the workers mapped it)."""

    kind = "shared_memory"

    def __init__(self, comm, channels: ShmServerChannels, workers: list[int], push_numel: int, dtype: torch.dtype,
                 flat_numel: int, grad_views):
        self.stats, self.channels = comm.transport.stats, channels
        self.index = {worker: index for index, worker in enumerate(workers)}
        self.workers = list(workers)
        self.push_numel, self.flat_numel, self.dtype = push_numel, flat_numel, dtype
        self.pushes = [channels.push_view(i, dtype, push_numel) for i in range(len(workers))]
        self.grad_views = [grad_views(push) for push in self.pushes]
        self.params = [channels.params_view(i, dtype, flat_numel) for i in range(len(workers))]

    def next_request(self, header: torch.Tensor, workers, timeout_s: float) -> int:
        try:
            found = self.channels.wait_request([self.index[w] for w in workers], time.monotonic() + timeout_s)
        except ShmPeerTimeout as error:
            raise _shm_failure(error, self.workers[error.peer]) from None
        if found is None:
            raise PeerFailure(-1, "timed out waiting for it", True)
        index, words = found
        header.copy_(torch.tensor(words, dtype=torch.int64))
        self.stats.record_recv(_HEADER_BYTES)
        return self.workers[index]

    def receive_push(self, worker: int, timeout_s: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        index = self.index[worker]
        self.stats.record_recv(self.pushes[index].nbytes)
        return self.pushes[index], self.grad_views[index]

    def reply(self, worker: int, header: torch.Tensor, flat: torch.Tensor | None, timeout_s: float) -> None:
        index = self.index[worker]
        if flat is not None:
            self.params[index].copy_(flat)
            self.stats.record_send(flat.nbytes)
        try:
            self.channels.reply(index, header.tolist())
        except ShmPeerTimeout as error:
            raise _shm_failure(error, worker) from None
        self.stats.record_send(_HEADER_BYTES)

    def close(self) -> None:
        self.channels.close()


def offer_shared_memory(comm, pulled: list[int], push_numel: int, dtype: torch.dtype, flat_numel: int,
                        grad_views, timeout_s: float):
    """The server's set-up (module docstring): offer a segment to every worker in ``pulled`` (each has
    sent its first request), collect their reports. Returns ``(ShmServerLink, None)`` once every worker
    mapped it (each was told ``SHM_USE``), else ``(None, why)``: answer them over the transport.

    Raises:
        PeerFailure: a worker's connection failed during the set-up.
    """
    itemsize = dtype.itemsize
    try:
        channels = ShmServerChannels.create(len(pulled), push_numel * itemsize, flat_numel * itemsize)
    except OSError as exc:
        return None, f"the server could not create the shared memory: {type(exc).__name__}: {exc}"
    transport, failures = comm.transport, []
    try:
        name = _encode(channels.name, NAME_BYTES)
        for index, worker in enumerate(pulled):
            offer = torch.tensor([SHM_OFFER, index, len(pulled), 0], dtype=torch.int64)
            for handle in (transport.isend_tagged(offer, worker, TAG_REPLY),
                           transport.isend_tagged(name, worker, TAG_SHM)):
                handle.wait(timeout_s)
        for worker in pulled:
            report = torch.zeros(REPORT_BYTES, dtype=torch.uint8)
            transport.irecv_tagged(report, worker, TAG_SHM).wait(timeout_s)
            if int(report.count_nonzero()):
                failures.append(f"rank {worker}: {_text(report)}")
    except BaseException:
        channels.close()
        raise
    channels.unlink()  # every worker mapped it (or failed): nothing under /dev/shm from here on
    if failures:
        channels.close()
        return None, "a worker could not map the shared memory: " + "; ".join(failures)
    use = torch.tensor([SHM_USE, 0, 0, 0], dtype=torch.int64)
    for worker in pulled:
        transport.isend_tagged(use, worker, TAG_REPLY).wait(timeout_s)
    return ShmServerLink(comm, channels, pulled, push_numel, dtype, flat_numel, grad_views), None


# -------------------------------------------------------------------------------------------------- worker


class TcpWorkerLink:
    """A worker's messages over the group's transport; ``send_buffer`` is where its push is gathered."""

    kind = "tcp"

    def __init__(self, comm, server_rank: int, push_numel: int, dtype: torch.dtype):
        self.transport, self.server = comm.transport, server_rank
        self.send_buffer = torch.zeros(push_numel, dtype=dtype)

    def request(self, header: torch.Tensor, with_push: bool) -> list:
        """Start sending ``header`` (and ``send_buffer``); returns what to finish with :meth:`finish`."""
        sends = [self.transport.isend_tagged(header, self.server, TAG_REQUEST)]
        if with_push:
            sends.append(self.transport.isend_tagged(self.send_buffer, self.server, TAG_GRADIENT))
        return sends

    def receive_header(self, reply: torch.Tensor, timeout_s: float) -> None:
        self.transport.irecv_tagged(reply, self.server, TAG_REPLY).wait(timeout_s)

    def receive_parameters(self, flat: torch.Tensor, timeout_s: float) -> None:
        self.transport.irecv_tagged(flat, self.server, TAG_PARAMETERS).wait(timeout_s)

    def finish(self, sends: list, timeout_s: float) -> None:
        for handle in sends:
            handle.wait(timeout_s)

    def close(self) -> None:
        pass


class ShmWorkerLink:
    """A worker's messages through its shared-memory channel; ``send_buffer`` is its push region."""

    kind = "shared_memory"

    def __init__(self, comm, channel: ShmClientChannel, server_rank: int, push_numel: int, dtype: torch.dtype,
                 flat_numel: int):
        self.stats, self.channel, self.server = comm.transport.stats, channel, server_rank
        self.send_buffer = channel.push_view(dtype, push_numel)
        self.params = channel.params_view(dtype, flat_numel)

    def request(self, header: torch.Tensor, with_push: bool) -> list:
        try:
            self.channel.request(header.tolist())
        except ShmPeerTimeout as error:
            raise _shm_failure(error, self.server) from None
        self.stats.record_send(_HEADER_BYTES + (self.send_buffer.nbytes if with_push else 0))
        return []

    def receive_header(self, reply: torch.Tensor, timeout_s: float) -> None:
        try:
            words = self.channel.wait_reply(time.monotonic() + timeout_s)
        except ShmPeerTimeout as error:
            raise _shm_failure(error, self.server) from None
        if words is None:
            raise PeerFailure(self.server, "timed out waiting for it", True)
        reply.copy_(torch.tensor(words, dtype=torch.int64))
        self.stats.record_recv(_HEADER_BYTES)

    def receive_parameters(self, flat: torch.Tensor, timeout_s: float) -> None:
        flat.copy_(self.params)
        self.stats.record_recv(flat.nbytes)

    def finish(self, sends: list, timeout_s: float) -> None:
        pass

    def close(self) -> None:
        self.channel.close()


def accept_offer(comm, server_rank: int, offer: torch.Tensor, push_numel: int, dtype: torch.dtype,
                 flat_numel: int, accept: bool, timeout_s: float) -> ShmWorkerLink | None:
    """A worker's side of the set-up, after the server's ``offer`` header (``[SHM_OFFER, index, clients, 0]``):
    receive the name, map it (unless ``accept`` is False), report, and read the verdict header into
    ``offer``: ``SHM_USE`` returns the shared-memory link; anything else (the answer to the pull, over the
    transport) returns None.

    Raises:
        PeerFailure: the server's connection failed or it did not answer within ``timeout_s``.
    """
    transport = comm.transport
    name = torch.zeros(NAME_BYTES, dtype=torch.uint8)
    transport.irecv_tagged(name, server_rank, TAG_SHM).wait(timeout_s)
    channel, report = None, "declined: the worker has shared_memory=False"
    if accept:
        itemsize = dtype.itemsize
        try:
            channel = ShmClientChannel.attach(_text(name), int(offer[1]), int(offer[2]), push_numel * itemsize,
                                              flat_numel * itemsize)
            report = ""
        except (OSError, ValueError) as exc:
            report = f"{type(exc).__name__}: {exc}"
    try:
        transport.isend_tagged(_encode(report, REPORT_BYTES), server_rank, TAG_SHM).wait(timeout_s)
        transport.irecv_tagged(offer, server_rank, TAG_REPLY).wait(timeout_s)
    except BaseException:
        if channel is not None:
            channel.close()
        raise
    if int(offer[0]) != SHM_USE:
        if channel is not None:
            channel.close()
        return None
    return ShmWorkerLink(comm, channel, server_rank, push_numel, dtype, flat_numel)
