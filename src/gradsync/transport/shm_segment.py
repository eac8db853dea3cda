"""A shared-memory segment for ranks on one machine: regions to copy through, counters to wait on.

One segment (a POSIX shared-memory object, ``shm_open``) is created by rank 0 of the
group under an unpredictable name (``gradsync-<pid>-<random>``, ``secrets``),
mode 0600, and its name is sent to the other ranks over the group's
point-to-point transport. Every rank maps it, then rank 0 unlinks the name:
from then on the memory lives only as long as the mappings, so no
``/dev/shm`` entry survives any exit, a killed rank included. A creator
killed during that setup leaves its name behind; the next segment created
on the machine removes names whose creating process is gone
(:func:`remove_leftovers`).

Layout: a header of one 64-byte line per rank holding that rank's sequence
counter (int64), then two sets ("double buffering") of one region of
``region_bytes`` per rank. A barrier is "advance my counter, wait until
every counter reached it". Waits spin briefly, then ``os.sched_yield()``,
then sleep (growing to 1 ms), so a waiting rank never starves the rank it
waits for when ranks outnumber cores; every wait ends at the call's deadline
with the rank that did not arrive.

Lifetime: tensors viewing a segment (region views, the arena's zero-copy
buckets) are made with ``torch.frombuffer`` on the ``mmap`` and keep it
alive; :meth:`ShmSegment.close` only drops the segment's own references, so
the memory is unmapped when the last tensor viewing it is freed, never under
a live tensor (no segfault, and no later mapping at the same address).

Ordering: data is written before the counter that announces it and read
after the counter is seen, which x86-64's store and load ordering (TSO)
makes safe without explicit fences.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
import zlib

import _posixshmem

import torch

from gradsync.errors import GradsyncError
from gradsync.transport.locality import host_identity

LINE_BYTES = 64
DEFAULT_REGION_BYTES = 4 * 2**20   # per rank and set: messages go through in slices of this size
_SPINS = 100                       # counter checks (~0.2 µs each) before yielding the core
_YIELDS = 100                      # sched_yield calls before sleeping
_MAX_SLEEP_S = 1e-3
_LIVENESS_EVERY_S = 0.05           # how often a waiting rank checks that the laggard's process lives
_PID_WORD = 1                      # word 1 of each rank's counter line holds its process id
_GAVE_UP_WORD = 3                  # word 3: whom this rank gave up on, 1 + 2 * peer + died (0: never)
_LEFT_PID = -1                     # the pid word of a rank that closed the segment: it left the group


def _map(name: str, size: int | None = None) -> mmap.mmap:
    """Map the POSIX shared-memory object ``name``: created (mode 0600, ``size`` bytes, zeroed) when
    ``size`` is given, else opened at its current size. The descriptor is closed at once.

    Nothing ever calls ``close()`` on the returned map: tensors made from it by
    ``torch.frombuffer`` hold a reference to it (not a buffer export), so it is
    unmapped only when the last reference, tensor or segment, is gone.

    Raises:
        FileExistsError / FileNotFoundError / OSError: from ``shm_open``, ``ftruncate`` or ``mmap``.
    """
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0)
    fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
    try:
        if size is not None:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size if size is not None else os.fstat(fd).st_size)
    except BaseException:
        if size is not None:
            _posixshmem.shm_unlink("/" + name)
        raise
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a killed worker its launcher has not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as file:
            return file.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def remove_leftovers(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink this user's gradsync segments whose creating process is gone; return their names.

    A name is removed as soon as every rank mapped it, so leftovers only come
    from a creator killed during the millisecond of setup.
    """
    removed = []
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return removed
    for entry in entries:
        parts = entry.split("-")
        if len(parts) != 3 or parts[0] != "gradsync" or not parts[1].isdigit():
            continue
        path = os.path.join(shm_dir, entry)
        try:
            if os.stat(path).st_uid != os.getuid() or pid_alive(int(parts[1])):
                continue
            os.unlink(path)
            removed.append(entry)
        except OSError:
            continue
    return removed


class ShmPeerTimeout(GradsyncError, TimeoutError):
    """A rank did not reach a barrier in time (``peer`` is its rank), its process died (``died``), or
    it gave up on an earlier barrier of this segment (``gave_up``: it raised a timeout there)."""

    def __init__(self, peer: int, died: bool = False, gave_up: int | None = None, left: bool = False):
        super().__init__(f"peer rank {peer}" + (" left the group" if left else " died" if died else "")
                         + (f" (rank {gave_up} gave up on it)" if gave_up is not None else ""))
        self.peer = peer
        self.died = died or left
        self.left = left  # the peer closed its mapping (it shut down or left an elastic membership)
        self.gave_up = gave_up  # the rank that gave up on ``peer`` at an earlier barrier, or None


def host_id() -> int:
    """A 31-bit id of this host's identity (:func:`gradsync.transport.locality.host_identity`: boot
    id and ``/dev/shm``), to check that ranks can share a segment."""
    words = ",".join(map(str, host_identity()))
    return zlib.crc32(words.encode()) & 0x7FFFFFFF


def segment_bytes_for(world_size: int, region_bytes: int, sets: int = 2) -> int:
    header = -(-world_size * LINE_BYTES // 4096) * 4096
    return header + sets * world_size * region_bytes


class ShmSegment:
    """This rank's mapping of the group's segment.

    Args:
        mapping: the ``mmap`` of the shared-memory object named ``name``.
        rank, world_size: this rank and the group size.
        region_bytes: bytes of one rank's region in one set.
    """

    def __init__(self, mapping: mmap.mmap, name: str, rank: int, world_size: int, region_bytes: int,
                 sets: int = 2):
        self._name = name
        self.sets = sets
        self.rank = rank
        self.world_size = world_size
        self.region_bytes = region_bytes
        stride = LINE_BYTES // 8
        self._words = memoryview(mapping)[:world_size * LINE_BYTES].cast("q")  # int64; counter r at r * stride
        self._stride = stride
        self._header_bytes = segment_bytes_for(world_size, region_bytes, sets) - sets * world_size * region_bytes
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while any view lives
        self._views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._sequence = self._words[rank * stride]
        self._words[rank * stride + _PID_WORD] = os.getpid()  # so that peers see this process die
        self.slice_counter = 0  # slices sent through so far: picks the set, across calls

    @classmethod
    def create(cls, world_size: int, region_bytes: int, sets: int = 2) -> "ShmSegment":
        """Rank 0: a new zeroed segment with a random name (mode 0600)."""
        remove_leftovers()
        name = f"gradsync-{os.getpid()}-{secrets.token_hex(12)}"
        return cls(_map(name, segment_bytes_for(world_size, region_bytes, sets)), name, 0, world_size,
                   region_bytes, sets)

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int, region_bytes: int, sets: int = 2) -> "ShmSegment":
        return cls(_map(name), name, rank, world_size, region_bytes, sets)

    @property
    def name(self) -> str:
        return self._name

    def unlink(self) -> None:
        """Remove the name (rank 0, once every rank has mapped it); mappings stay valid."""
        try:
            _posixshmem.shm_unlink("/" + self._name)
        except FileNotFoundError:
            pass

    def region(self, set_index: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """``(numel,)`` view of ``rank``'s region in set ``set_index`` as ``dtype``."""
        key = (set_index, rank, dtype)
        whole = self._views.get(key)
        if whole is None:
            start = self._header_bytes + (set_index * self.world_size + rank) * self.region_bytes
            usable = self.region_bytes - self.region_bytes % dtype.itemsize
            whole = self._views[key] = self._bytes[start:start + usable].view(dtype)
        return whole[:numel]

    def offset_in_own_region(self, tensor: torch.Tensor) -> int | None:
        """Byte offset of ``tensor``'s data in this rank's set-0 region, or None if it lies elsewhere."""
        if self._bytes is None:
            return None
        base = self._bytes.data_ptr() + self._header_bytes + self.rank * self.region_bytes
        offset = tensor.data_ptr() - base
        end = offset + tensor.numel() * tensor.element_size()
        return offset if 0 <= offset and end <= self.region_bytes else None

    def at_offset(self, rank: int, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """``(numel,)`` of ``dtype`` at byte ``offset`` of ``rank``'s set-0 region."""
        start = self._header_bytes + rank * self.region_bytes + offset
        return self._bytes[start:start + numel * dtype.itemsize].view(dtype)

    def post(self, word: int, value: int) -> None:
        """Write int64 ``value`` into word ``word`` (2-7) of this rank's header line; peers read it with
        :meth:`posted` after the next barrier."""
        self._words[self.rank * self._stride + word] = value

    def posted(self, rank: int, word: int) -> int:
        return self._words[rank * self._stride + word]

    def region_numel(self, dtype: torch.dtype) -> int:
        return self.region_bytes // dtype.itemsize

    def barrier(self, deadline: float) -> None:
        """Advance this rank's counter and wait until every rank's counter reached it.

        Raises:
            ShmPeerTimeout: naming the first rank that had not arrived by ``deadline``
            (``time.monotonic()`` seconds).
        """
        self._sequence += 1
        words, stride = self._words, self._stride
        self._check_nobody_gave_up()
        words[self.rank * stride] = self._sequence
        target, checks, sleep_s = self._sequence, 0, 2e-5
        peer, next_liveness = 0, 0.0
        while True:
            while peer < self.world_size and words[peer * stride] >= target:
                peer += 1  # ranks that arrived stay arrived: resume from the first laggard
            if peer == self.world_size:
                return
            checks += 1
            if checks <= _SPINS:
                continue
            now = time.monotonic()
            if now > deadline:
                self._give_up(peer, died=False)
                raise ShmPeerTimeout(peer)
            if now > next_liveness:  # a killed peer never arrives: say so now, not at the deadline
                next_liveness = now + _LIVENESS_EVERY_S
                pid = words[peer * stride + _PID_WORD]
                if pid == _LEFT_PID or (pid > 0 and not pid_alive(pid)):
                    self._give_up(peer, died=True)
                    raise ShmPeerTimeout(peer, died=True, left=pid == _LEFT_PID)
                self._check_nobody_gave_up()
            if checks <= _SPINS + _YIELDS:
                os.sched_yield()
            else:
                time.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, _MAX_SLEEP_S)

    def _give_up(self, peer: int, died: bool) -> None:
        """Say in this rank's line that it left a barrier unfinished, waiting for ``peer``: a rank
        that arrives later must raise too (naming ``peer``), not finish a call its peers gave up on."""
        self._words[self.rank * self._stride + _GAVE_UP_WORD] = 1 + 2 * peer + int(died)

    def _check_nobody_gave_up(self) -> None:
        words, stride = self._words, self._stride
        for rank in range(self.world_size):
            code = words[rank * stride + _GAVE_UP_WORD] if rank != self.rank else 0
            if code:
                raise ShmPeerTimeout((code - 1) // 2, died=bool((code - 1) % 2), gave_up=rank)

    def close(self) -> None:
        """Drop this segment's references to the mapping (idempotent); tensors viewing it keep it mapped
        until they are freed, then it is unmapped. The segment is unusable afterwards."""
        self._bytes = None
        self._views.clear()
        if self._words is not None:
            # a peer still waiting in a barrier for this rank learns at once that it will not come
            self._words[self.rank * self._stride + _PID_WORD] = _LEFT_PID
            self._words.release()
            self._words = None
