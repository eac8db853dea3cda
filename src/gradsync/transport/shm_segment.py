"""A shared-memory segment for ranks on one machine: regions to copy through, counters to wait on.

One segment (``multiprocessing.shared_memory``) is created by rank 0 of the
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

Ordering: data is written before the counter that announces it and read
after the counter is seen, which x86-64's store and load ordering (TSO)
makes safe without explicit fences.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
import zlib
from multiprocessing import resource_tracker, shared_memory

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


class _NoTracker:
    """Stands in for ``multiprocessing.resource_tracker``: gradsync unlinks its segments itself."""

    @staticmethod
    def register(name, rtype):
        pass

    @staticmethod
    def unregister(name, rtype):
        pass


_TRACKER_SWAP = threading.Lock()


class _SharedMemory(shared_memory.SharedMemory):
    """``SharedMemory`` without the resource tracker (a tracker shared by several ranks would unlink
    or double-count the segment), whose finalizer tolerates tensors still viewing the mapping."""

    def __init__(self, *args, **kwargs):
        with _TRACKER_SWAP:
            shared_memory.resource_tracker = _NoTracker
            try:
                super().__init__(*args, **kwargs)
            finally:
                shared_memory.resource_tracker = resource_tracker
        os.close(self._fd)  # the mapping keeps the memory; an open fd would outlive a dropped segment
        self._fd = -1

    def unlink(self):
        _posixshmem.shm_unlink(self._name)

    def __del__(self):
        try:
            self.close()
        except BufferError:
            pass


def _pid_alive(pid: int) -> bool:
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
            if os.stat(path).st_uid != os.getuid() or _pid_alive(int(parts[1])):
                continue
            os.unlink(path)
            removed.append(entry)
        except OSError:
            continue
    return removed


class ShmPeerTimeout(GradsyncError, TimeoutError):
    """A rank did not reach a barrier in time (``peer`` is its rank), or its process died (``died``)."""

    def __init__(self, peer: int, died: bool = False):
        super().__init__(f"peer rank {peer}" + (" died" if died else ""))
        self.peer = peer
        self.died = died


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
        shm: the attached ``SharedMemory``.
        rank, world_size: this rank and the group size.
        region_bytes: bytes of one rank's region in one set.
    """

    def __init__(self, shm: shared_memory.SharedMemory, rank: int, world_size: int, region_bytes: int,
                 sets: int = 2):
        self._shm = shm
        self.sets = sets
        self.rank = rank
        self.world_size = world_size
        self.region_bytes = region_bytes
        stride = LINE_BYTES // 8
        self._words = shm.buf[:world_size * LINE_BYTES].cast("q")  # int64 words; counter r at r * stride
        self._stride = stride
        self._header_bytes = segment_bytes_for(world_size, region_bytes, sets) - sets * world_size * region_bytes
        self._bytes = torch.frombuffer(shm.buf, dtype=torch.uint8)
        self._views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._sequence = self._words[rank * stride]
        self._words[rank * stride + _PID_WORD] = os.getpid()  # so that peers see this process die
        self.slice_counter = 0  # slices sent through so far: picks the set, across calls

    @classmethod
    def create(cls, world_size: int, region_bytes: int, sets: int = 2) -> "ShmSegment":
        """Rank 0: a new zeroed segment with a random name (mode 0600)."""
        remove_leftovers()
        name = f"gradsync-{os.getpid()}-{secrets.token_hex(12)}"
        shm = _SharedMemory(name=name, create=True, size=segment_bytes_for(world_size, region_bytes, sets))
        return cls(shm, 0, world_size, region_bytes, sets)

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int, region_bytes: int, sets: int = 2) -> "ShmSegment":
        return cls(_SharedMemory(name=name), rank, world_size, region_bytes, sets)

    @property
    def name(self) -> str:
        return self._shm.name

    def unlink(self) -> None:
        """Remove the name (rank 0, once every rank has mapped it); mappings stay valid."""
        try:
            self._shm.unlink()
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
                raise ShmPeerTimeout(peer)
            if now > next_liveness:  # a killed peer never arrives: say so now, not at the deadline
                next_liveness = now + _LIVENESS_EVERY_S
                pid = words[peer * stride + _PID_WORD]
                if pid and not _pid_alive(pid):
                    raise ShmPeerTimeout(peer, died=True)
            if checks <= _SPINS + _YIELDS:
                os.sched_yield()
            else:
                time.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, _MAX_SLEEP_S)

    def close(self) -> None:
        self._bytes = None
        self._views.clear()
        self._words.release()
        try:
            self._shm.close()
        except BufferError:  # a caller still holds a view; the mapping goes with the process
            pass
