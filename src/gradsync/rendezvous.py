"""Sockets of a local job listen on loopback only.

torch's TCPStore server binds every interface whatever host name it is
given, and Gloo's pair listeners bind the address the host name resolves to.
The store is unauthenticated and holds the Gloo peer addresses and the hang
detector's keys, so a job on one machine (``MASTER_ADDR`` a loopback
address, as ``gradsync train`` and the test worlds use) must not expose it.
Here the store's listening socket is bound to the loopback address first and
handed to the store (``master_listen_fd``), and Gloo is told to use the
loopback device. A job whose ``MASTER_ADDR`` is another machine's address is
reachable on that address by design (docs/training.md, "Security").
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import sys
import threading

import torch.distributed as dist

LOOPBACK_DEVICE = "lo"  # Linux's loopback interface (Gloo's GLOO_SOCKET_IFNAME)


def is_loopback(host: str) -> bool:
    """True for "localhost" and any 127.0.0.0/8 or ::1 address."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (port 0: any free port).

    Raises:
        OSError: the address is in use or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def loopback_store_server(host: str, port: int, world_size: int | None, timeout: datetime.timedelta,
                          wait_for_workers: bool = True) -> dist.TCPStore:
    """A TCPStore server listening on ``host:port`` only (``host`` a loopback address).

    Raises:
        ValueError: ``host`` is not a loopback address.
        OSError / RuntimeError: the port cannot be bound (in use).
    """
    if not is_loopback(host):
        raise ValueError(f"{host} is not a loopback address")
    sock = listening_socket("127.0.0.1" if host.lower() == "localhost" else host, port)
    port = sock.getsockname()[1]
    try:
        return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=wait_for_workers,
                             master_listen_fd=sock.detach())
    except BaseException:
        sock.close()
        raise


def bounded(make, seconds: float, what: str):
    """``make()``, given up after ``seconds`` (+ 1 s) with TimeoutError naming ``what``.

    A TCPStore client blocks forever, whatever its timeout, when the server's
    process is stopped (SIGSTOP, a debugger): the kernel still accepts the
    connection but nobody answers. The call then runs on a daemon thread
    that is left behind.
    """
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, make()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            outcome.append((False, exc))

    thread = threading.Thread(target=run, daemon=True, name="gradsync-store-connect")
    thread.start()
    thread.join(seconds + 1.0)
    if not outcome:
        raise TimeoutError(f"{what} did not answer within {seconds:g} s (its process is stopped or overloaded)")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def gloo_on_loopback(master_addr: str) -> None:
    """Make the process's Gloo groups listen on the loopback device when ``master_addr`` is loopback.

    Sets ``GLOO_SOCKET_IFNAME`` (read by Gloo when a group is created) unless
    the user set it; Linux only (elsewhere the device is named differently).
    """
    if ("GLOO_SOCKET_IFNAME" not in os.environ and is_loopback(master_addr)
            and sys.platform.startswith("linux") and os.path.exists(f"/sys/class/net/{LOOPBACK_DEVICE}")):
        os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK_DEVICE


LOOPBACK_BACKEND = "gradsync-loopback"  # the elastic rendezvous backend of ``gradsync train``
_STORE_READ_TIMEOUT = datetime.timedelta(seconds=60)  # as torch's c10d backend (read_timeout)


def register_loopback_backend() -> str:
    """Register (once) torch elastic's c10d rendezvous with both of its stores on loopback; returns its name.

    The c10d backend's own store (rendezvous state) and the store the agent
    shares with its workers (``MASTER_ADDR``/``MASTER_PORT``; torch makes it
    on every interface) are both made by :func:`loopback_store_server`. Use
    with a loopback ``rdzv_endpoint`` and ``local_addr``; one node only.
    """
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOOPBACK_BACKEND, _loopback_handler)
    return LOOPBACK_BACKEND


def _loopback_handler(params):
    """A ``DynamicRendezvousHandler`` over the c10d backend whose stores listen on the endpoint's loopback address."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    store = loopback_store_server(host, port, None, _STORE_READ_TIMEOUT, wait_for_workers=False)
    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return LOOPBACK_BACKEND

    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    # torch 2.13 makes the store it shares with the workers here (TCPStore on every interface)
    handler._create_tcp_store_server = lambda addr, server_port: loopback_store_server(
        host, server_port, None, _STORE_READ_TIMEOUT, wait_for_workers=False)
    return handler
