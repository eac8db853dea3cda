"""One server and its clients on one host: requests and replies through shared memory, doorbells to wake.

The parameter server's transport between ranks of one host
(:mod:`gradsync.parallel.ps_links`); across hosts it talks over the group's
point-to-point transport instead. The server creates one segment (a POSIX
shared-memory object named ``gradsync-<pid>-<random>``, mode 0600, as
:mod:`gradsync.transport.shm_segment` does: the same cleanup of a killed
creator's name by :func:`~gradsync.transport.shm_segment.remove_leftovers`);
every client maps it and the server unlinks the name once all of them
reported (:meth:`ShmServerChannels.unlink`), so nothing under ``/dev/shm``
outlives the setup, whoever is killed afterwards.

Layout (64-byte lines, then regions at multiples of 64 bytes)::

    line 0              the server's: word 1 its pid (-1 once it closed)
    line 1 + 2c         client c's request line (the client writes): word 0 its request count,
                        word 1 its pid (-1 once it closed), words 2-5 the request header
    line 2 + 2c         client c's reply line (the server writes): word 0 the reply count, words 2-5 the header
    regions             per client: its push (``push_bytes``), then its parameters (``params_bytes``)

A message is written in full (region, then header words) before the count
that announces it, and read after the count is seen: x86-64's store and load
ordering (TSO) makes that safe without fences, as in ``shm_segment``. Each
side writes only its own lines, and a client writes its push region only
while it has no request outstanding, the server a client's parameter region
only while that client waits for the reply; so no copy ever races another.

Doorbells: each side also binds an abstract unix datagram socket (named after
the segment, so as unpredictable; it vanishes with its process, nothing to
clean up) and rings the other after announcing a message: a waiting side
blocks in ``recv`` instead of spinning or sleeping, which on a host whose
cores are all busy with training is what keeps a reply's latency at a wake-up.
The ring is a hint: the counts in the segment are the truth, so a spurious
or duplicate datagram is ignored. The server takes requests in the order
the rings arrived (the order a receive from any source would give).

Every wait ends at its deadline, or within ``LIVENESS_EVERY_S`` when the
awaited process died or closed its side (:class:`~gradsync.transport.shm_segment.ShmPeerTimeout`
naming the client index, or -1 for the server).
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import struct
import time
from collections import deque

import torch

from gradsync.transport.shm_segment import ShmPeerTimeout, _map, pid_alive, remove_leftovers

LINE_WORDS = 8
LINE_BYTES = 8 * LINE_WORDS
HEADER_WORDS = 4                 # the parameter server's header (ps_protocol.HEADER_NUMEL)
LIVENESS_EVERY_S = 0.05          # how often a waiting side checks that the awaited process lives
SERVER = -1                      # the index ShmPeerTimeout names for the server
_LEFT_PID = -1
_PID_WORD, _HEADER_WORD = 1, 2
_RING = struct.Struct("<i")      # a client's ring carries its index


def _align(nbytes: int) -> int:
    return -(-nbytes // LINE_BYTES) * LINE_BYTES


def segment_bytes(num_clients: int, push_bytes: int, params_bytes: int) -> int:
    """Bytes of a segment for ``num_clients`` with these region sizes (page-aligned header)."""
    header = -(-(1 + 2 * num_clients) * LINE_BYTES // 4096) * 4096
    return header + num_clients * (_align(push_bytes) + _align(params_bytes))


def _doorbell(name: str, who: str) -> str:
    return "\0" + name + "-" + who


def _sender() -> socket.socket:
    """An unbound, non-blocking datagram socket to ring with (the bound one has a receive timeout, under
    which Python would wait for room in a full queue)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    return sock


def _ring(sock: socket.socket, address: str, payload: bytes) -> bool:
    """Send one datagram without blocking; False when nobody is bound there (the peer closed or died).
    A full queue (rings left unread while the counts already told) drops it: the count still tells, and
    the waiting side wakes on the rings queued before it."""
    try:
        sock.sendto(payload, address)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except BlockingIOError:
        pass
    return True


class _Mapping:
    """The segment as words and regions, for either side."""

    def __init__(self, mapping: mmap.mmap, name: str, num_clients: int, push_bytes: int, params_bytes: int):
        self.name, self.num_clients = name, num_clients
        self.push_bytes, self.params_bytes = push_bytes, params_bytes
        self.words = memoryview(mapping)[:(1 + 2 * num_clients) * LINE_BYTES].cast("q")
        self.bytes = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping while views live
        self.header_bytes = segment_bytes(num_clients, 0, 0)

    def request_line(self, client: int) -> int:
        return (1 + 2 * client) * LINE_WORDS

    def reply_line(self, client: int) -> int:
        return (2 + 2 * client) * LINE_WORDS

    def region(self, client: int, which: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """``(numel,)`` view of ``client``'s push (``which`` 0) or parameter (1) region as ``dtype``."""
        stride = _align(self.push_bytes) + _align(self.params_bytes)
        start = self.header_bytes + client * stride + (_align(self.push_bytes) if which else 0)
        limit = self.params_bytes if which else self.push_bytes
        if numel * dtype.itemsize > limit:
            raise ValueError(f"{numel} elements of {dtype} do not fit the {limit}-byte region")
        return self.bytes[start:start + numel * dtype.itemsize].view(dtype)

    def read_header(self, line: int) -> list[int]:
        return [self.words[line + _HEADER_WORD + i] for i in range(HEADER_WORDS)]

    def write_header(self, line: int, header) -> None:
        for index, value in enumerate(header):
            self.words[line + _HEADER_WORD + index] = int(value)

    def release(self) -> None:
        self.bytes = None
        if self.words is not None:
            self.words.release()
            self.words = None


def _socket(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class _Waiter:
    """Block on a doorbell until ``ready()`` or the deadline, checking ``alive()`` every ``LIVENESS_EVERY_S``
    on a clock that runs across waits (a server whose other clients keep it busy still looks at them all)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.next_liveness = time.monotonic() + LIVENESS_EVERY_S

    def wait(self, ready, alive, deadline: float, on_ring=None):
        """``ready()`` -> a value or None; ``alive()`` raises ShmPeerTimeout for a peer that is gone with
        nothing left to read from it; returns the value, or None at ``deadline``."""
        while True:
            if on_ring is not None:  # rings already queued first: they order what ready() finds
                self._drain(on_ring)
            now = time.monotonic()
            if now >= self.next_liveness:
                self.next_liveness = now + LIVENESS_EVERY_S
                alive()
            found = ready()
            if found is not None:
                return found
            if now >= deadline:
                return None
            self.sock.settimeout(max(min(deadline, self.next_liveness) - now, 1e-4))
            try:
                data = self.sock.recv(64)
            except (TimeoutError, socket.timeout):
                continue
            if on_ring is not None:
                on_ring(data)

    def _drain(self, on_ring) -> None:
        self.sock.setblocking(False)
        try:
            while True:
                on_ring(self.sock.recv(64))
        except BlockingIOError:
            pass


class ShmServerChannels:
    """The server's side: one channel per client, created here (see the module docstring).

    Args: (use :meth:`create`) ``num_clients`` (>= 1); ``push_bytes`` and ``params_bytes``: the largest
    request and reply payloads in bytes.

    Raises:
        OSError: the segment or the doorbell could not be created (``/dev/shm`` full, no unix sockets).
    """

    def __init__(self, mapping: _Mapping, sock: socket.socket):
        self.map, self.sock = mapping, sock
        self.name, self.num_clients = mapping.name, mapping.num_clients
        self._seen = [0] * mapping.num_clients     # requests taken, per client
        self._replied = [0] * mapping.num_clients  # replies sent, per client
        self._rings: deque[int] = deque()          # clients in the order their rings arrived
        self._waiter, self._sender = _Waiter(sock), _sender()
        self.map.words[_PID_WORD] = os.getpid()

    @classmethod
    def create(cls, num_clients: int, push_bytes: int, params_bytes: int) -> "ShmServerChannels":
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        remove_leftovers()
        name = f"gradsync-{os.getpid()}-{secrets.token_hex(12)}"
        nbytes = segment_bytes(num_clients, push_bytes, params_bytes)
        mapping = _map(name, nbytes)
        try:
            _reserve(name, nbytes)
            sock = _socket(_doorbell(name, "s"))
        except OSError:
            _unlink(name)
            raise
        return cls(_Mapping(mapping, name, num_clients, push_bytes, params_bytes), sock)

    def unlink(self) -> None:
        """Remove the segment's name (every client mapped it, or the run ends); mappings stay valid."""
        _unlink(self.name)

    def push_view(self, client: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.map.region(client, 0, dtype, numel)

    def params_view(self, client: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.map.region(client, 1, dtype, numel)

    def wait_request(self, clients, deadline: float) -> tuple[int, list[int]] | None:
        """The next request of one of ``clients`` (indices), in ring order: ``(client, header)``; None at
        ``deadline`` (``time.monotonic()`` seconds).

        Raises:
            ShmPeerTimeout: one of ``clients`` died or closed its side (``peer`` is its index).
        """
        clients = set(clients)
        words, lines = self.map.words, [self.map.request_line(c) for c in range(self.num_clients)]

        def ready():
            for _ in range(len(self._rings)):  # oldest ring first; rings of others wait their turn
                client = self._rings.popleft()
                if client in clients and words[lines[client]] > self._seen[client]:
                    return self._take(client)
                if words[lines[client]] > self._seen[client]:
                    self._rings.append(client)
            for client in clients:  # a request whose ring was dropped (or not yet read)
                if words[lines[client]] > self._seen[client]:
                    return self._take(client)
            return None

        def alive():  # a request it announced before it went is still taken
            for client in clients:
                pid = words[lines[client] + _PID_WORD]
                gone = pid == _LEFT_PID or (pid > 0 and not pid_alive(pid))
                if gone and words[lines[client]] <= self._seen[client]:
                    raise ShmPeerTimeout(client, died=True, left=pid == _LEFT_PID)

        def on_ring(data: bytes):
            if len(data) == _RING.size:
                client = _RING.unpack(data)[0]
                if 0 <= client < self.num_clients and client not in self._rings:
                    self._rings.append(client)

        return self._waiter.wait(ready, alive, deadline, on_ring)

    def _take(self, client: int) -> tuple[int, list[int]]:
        line = self.map.request_line(client)
        self._seen[client] = self.map.words[line]
        return client, self.map.read_header(line)

    def reply(self, client: int, header) -> None:
        """Announce a reply (``header``; its payload, if any, already in the client's parameter region)
        and ring the client.

        Raises:
            ShmPeerTimeout: the client's doorbell is gone (it died or closed).
        """
        line = self.map.reply_line(client)
        self.map.write_header(line, header)
        self._replied[client] += 1
        self.map.words[line] = self._replied[client]
        if not _ring(self._sender, _doorbell(self.name, f"c{client}"), b"r"):
            raise ShmPeerTimeout(client, died=True)

    def close(self) -> None:
        """Unlink the name if still there, tell the clients this side is gone, drop the mapping (idempotent)."""
        if self.map.words is None:
            return
        self.unlink()
        self.map.words[_PID_WORD] = _LEFT_PID
        self.map.release()
        self.sock.close()
        self._sender.close()


class ShmClientChannel:
    """A client's side of its channel (see the module docstring); :meth:`attach` maps the segment.

    Raises:
        FileNotFoundError / OSError: the segment or a doorbell could not be mapped or bound.
    """

    def __init__(self, mapping: _Mapping, sock: socket.socket, client: int):
        self.map, self.sock, self.client = mapping, sock, client
        self.name = mapping.name
        self._request_line, self._reply_line = mapping.request_line(client), mapping.reply_line(client)
        self._requests = self._replies = 0
        self._waiter, self._sender = _Waiter(sock), _sender()
        self._server = _doorbell(mapping.name, "s")
        self._ring = _RING.pack(client)
        self.map.words[self._request_line + _PID_WORD] = os.getpid()

    @classmethod
    def attach(cls, name: str, client: int, num_clients: int, push_bytes: int,
               params_bytes: int) -> "ShmClientChannel":
        if not 0 <= client < num_clients:
            raise ValueError(f"client must be in 0..{num_clients - 1}, got {client}")
        mapping = _map(name)
        expected = segment_bytes(num_clients, push_bytes, params_bytes)
        if len(mapping) != expected:
            raise ValueError(f"segment {name} holds {len(mapping)} bytes, this layout needs {expected}")
        sock = _socket(_doorbell(name, f"c{client}"))
        return cls(_Mapping(mapping, name, num_clients, push_bytes, params_bytes), sock, client)

    def push_view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.map.region(self.client, 0, dtype, numel)

    def params_view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.map.region(self.client, 1, dtype, numel)

    def request(self, header) -> None:
        """Announce a request (``header``; its payload, if any, already in the push region); ring the server.

        Raises:
            ShmPeerTimeout: the server's doorbell is gone (it died or closed).
        """
        self.map.write_header(self._request_line, header)
        self._requests += 1
        self.map.words[self._request_line] = self._requests
        if not _ring(self._sender, self._server, self._ring):
            raise ShmPeerTimeout(SERVER, died=True)

    def wait_reply(self, deadline: float) -> list[int] | None:
        """The server's next reply header; None at ``deadline`` (``time.monotonic()`` seconds).

        Raises:
            ShmPeerTimeout: the server died or closed its side (``peer`` is -1).
        """
        words = self.map.words

        def ready():
            if words[self._reply_line] > self._replies:
                self._replies = words[self._reply_line]
                return self.map.read_header(self._reply_line)
            return None

        def alive():  # a reply it announced before it went (the last stop) is still taken
            pid = words[_PID_WORD]
            gone = pid == _LEFT_PID or (pid > 0 and not pid_alive(pid))
            if gone and words[self._reply_line] <= self._replies:
                raise ShmPeerTimeout(SERVER, died=True, left=pid == _LEFT_PID)

        return self._waiter.wait(ready, alive, deadline)

    def close(self) -> None:
        """Tell the server this client is gone and drop this side's references (idempotent); tensors
        viewing the regions keep the memory mapped until they are freed."""
        if self.map.words is None:
            return
        self.map.words[self._request_line + _PID_WORD] = _LEFT_PID
        self.map.release()
        self.sock.close()
        self._sender.close()


def _reserve(name: str, nbytes: int) -> None:
    """Allocate the segment's pages now: a ``/dev/shm`` too small for it (a container's 64 MiB) fails here
    with ``OSError`` (ENOSPC), which the caller can fall back from, instead of a SIGBUS at the first touch."""
    import _posixshmem

    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    import _posixshmem

    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass
