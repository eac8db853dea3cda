"""Which ranks share a host: the one place that decides whether shared memory can work.

A rank's host identity is what two processes must have in common for a
``/dev/shm`` segment made by one to be mapped by the other: the kernel they
run on (``/proc/sys/kernel/random/boot_id``) and the ``/dev/shm`` they see
(``os.stat("/dev/shm")``: device and inode; containers on one kernel with
private ``/dev/shm`` mounts differ here even when they share a hostname).
The hostname is deliberately not part of it, nor is any launcher variable
(``LOCAL_WORLD_SIZE`` is per rank and may differ between nodes).

The ranks of a group exchange identities once (``gradsync.init``,
``resolve_group``; lazily at the first call of a hand-built
``Communicator``) and :func:`derive` turns the list into a
:class:`Locality`, equal on every rank:

>>> a, b = (1, 2, 3, 4), (5, 6, 3, 4)
>>> derive([a, a, b, b]).ranks_per_node
2
>>> derive([a, a, b]).ranks_per_node is None  # unequal hosts: no equal blocks
True
>>> derive([a, b, a]).members  # hierarchical's nodes: the ranks of each host
((0, 2), (1,))
>>> derive([a, b, a]).host_sizes
(2, 1)
>>> derive([a, a, a]).one_host
True
"""

from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass
from typing import Sequence

IDENTITY_WORDS = 4  # boot id (two words), /dev/shm st_dev, /dev/shm st_ino
SHM_DIR = "/dev/shm"


def _signed64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def host_identity() -> tuple[int, ...]:
    """This process's host identity: ``IDENTITY_WORDS`` int64-range ints.

    Words 0-1: the 128-bit boot id (without one, as off Linux, a crc32 of the
    hostname stands in); words 2-3: ``st_dev`` and ``st_ino`` of ``/dev/shm``
    (0, 0 where it does not exist).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            boot = int(file.read().strip().replace("-", ""), 16)
    except (OSError, ValueError):
        boot = zlib.crc32(socket.gethostname().encode())
    try:
        status = os.stat(SHM_DIR)
        shm = (status.st_dev, status.st_ino)
    except OSError:
        shm = (0, 0)
    return (_signed64(boot >> 64), _signed64(boot), _signed64(shm[0]), _signed64(shm[1]))


@dataclass(frozen=True)
class Locality:
    """The host of every rank of a group: ``hosts[r]`` numbers rank r's host (0 = rank 0's host,
    the others in order of first appearance)."""

    hosts: tuple[int, ...]

    @classmethod
    def single_host(cls, world_size: int) -> "Locality":
        """Every rank on one host (threads of one process)."""
        return cls((0,) * world_size)

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def one_host(self) -> bool:
        """Whether every rank shares one host (shared memory can work)."""
        return len(set(self.hosts)) <= 1

    @property
    def ranks_per_node(self) -> int | None:
        """L when the hosts hold equal contiguous blocks of ranks ([k·L, (k+1)·L) on host k), else None."""
        if not self.hosts:
            return None
        size = self.hosts.count(self.hosts[0])
        expected = tuple(rank // size for rank in range(self.world_size))
        return size if self.world_size % size == 0 and self.hosts == expected else None

    @property
    def members(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each host, sorted, hosts in the order of their numbers (``hosts`` (0, 1, 0) ->
        ((0, 2), (1,))): ``hierarchical``'s nodes; a rank's index in its host's tuple is its local rank."""
        groups: dict[int, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            groups.setdefault(host, []).append(rank)
        return tuple(tuple(groups[host]) for host in sorted(groups))

    @property
    def host_sizes(self) -> tuple[int, ...]:
        """Ranks on each host, in the order of :attr:`members`."""
        return tuple(len(ranks) for ranks in self.members)

    def sub(self, members: Sequence[int]) -> "Locality":
        """The locality of the sub-group ``members`` (ranks of this group)."""
        return derive([(self.hosts[member],) for member in members])

    def describe(self) -> str:
        """``"host 0: ranks [0, 1]; host 1: ranks [2]"``."""
        groups: dict[int, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            groups.setdefault(host, []).append(rank)
        return "; ".join(f"host {host}: ranks {ranks}" for host, ranks in groups.items())


def derive(identities: Sequence[Sequence[int]]) -> Locality:
    """The :class:`Locality` of ranks whose host identities are ``identities`` (index = rank)."""
    numbers: dict[tuple[int, ...], int] = {}
    return Locality(tuple(numbers.setdefault(tuple(identity), len(numbers)) for identity in identities))
