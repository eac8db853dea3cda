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
counter (int64), then (group segments) ``MAILBOX_SLOTS`` mailboxes per rank of
``mailbox_bytes`` each, then two sets ("double buffering") of one region of
``region_bytes`` per rank. A barrier is "advance my counter, wait until
every counter reached it". The mailbox a round uses is the parity of the
barrier that ends it (:meth:`ShmSegment.next_parity`): written before that
barrier, read after it and before the next one, so a rank one round ahead
never overwrites what a slower rank still reads, whatever ran in between.

Waiting: while the ranks of this machine's groups have a core each, a
waiting rank spins on the counters (``SPIN_S``), then ``os.sched_yield()``
for a while (``YIELD_S``), then sleeps (growing to ``_MAX_SLEEP_S``); when
ranks outnumber cores, or are threads of one process (one GIL), it yields
from the start, so it never starves the rank it waits for. Every wait ends
at the call's deadline with the rank that did not arrive.

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
SPIN_S = 100e-6                    # spin this long before yielding (only when every rank has a core)
YIELD_S = 2e-3                     # then sched_yield this long before sleeping
_CHECKS_PER_CLOCK = 32             # counter checks (~50 ns each) between clock reads
_FIRST_SLEEP_S = 50e-6
_MAX_SLEEP_S = 500e-6
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


MAILBOX_SLOTS = 2  # measured: 8 slots in rotation cost 46-57 us at 64 KiB against 28 (cold lines cost more)


def _header_bytes(world_size: int, mailbox_bytes: int) -> int:
    return -(-world_size * (LINE_BYTES + MAILBOX_SLOTS * mailbox_bytes) // 4096) * 4096


def segment_bytes_for(world_size: int, region_bytes: int, sets: int = 2, mailbox_bytes: int = 0) -> int:
    return _header_bytes(world_size, mailbox_bytes) + sets * world_size * region_bytes


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ShmSegment:
    """This rank's mapping of the group's segment.

    Args:
        mapping: the ``mmap`` of the shared-memory object named ``name``.
        rank, world_size: this rank and the group size.
        region_bytes: bytes of one rank's region in one set.
        sets: region sets (2: double buffering; arenas have 1).
        mailbox_bytes: bytes of each of a rank's ``MAILBOX_SLOTS`` mailboxes (0: none; a multiple of 64).
    """

    def __init__(self, mapping: mmap.mmap, name: str, rank: int, world_size: int, region_bytes: int,
                 sets: int = 2, mailbox_bytes: int = 0):
        self._name = name
        self.sets = sets
        self.rank = rank
        self.world_size = world_size
        self.region_bytes = region_bytes
        self.mailbox_bytes = mailbox_bytes
        stride = LINE_BYTES // 8
        self._words = memoryview(mapping)[:world_size * LINE_BYTES].cast("q")  # int64; counter r at r * stride
        self._stride = stride
        self._counters = [rank * stride for rank in range(world_size)]
        self._gave_up_words = [rank * stride + _GAVE_UP_WORD for rank in range(world_size)]
        self._mail_start = world_size * LINE_BYTES
        self.mail_slots = MAILBOX_SLOTS
        mail_end = self._mail_start + MAILBOX_SLOTS * world_size * mailbox_bytes
        self.mail_words = memoryview(mapping)[self._mail_start:mail_end].cast("q") if mailbox_bytes else None
        self._header_bytes = _header_bytes(world_size, mailbox_bytes)
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while any view lives
        self._views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._sequence = self._words[rank * stride]
        self._words[rank * stride + _PID_WORD] = os.getpid()  # so that peers see this process die
        self._spin_s: float | None = None  # known after the first barrier (are the ranks threads?)
        self.slice_counter = 0  # slices sent through so far: picks the set, across calls

    @classmethod
    def create(cls, world_size: int, region_bytes: int, sets: int = 2, mailbox_bytes: int = 0) -> "ShmSegment":
        """Rank 0: a new zeroed segment with a random name (mode 0600)."""
        remove_leftovers()
        name = f"gradsync-{os.getpid()}-{secrets.token_hex(12)}"
        return cls(_map(name, segment_bytes_for(world_size, region_bytes, sets, mailbox_bytes)), name, 0,
                   world_size, region_bytes, sets, mailbox_bytes)

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int, region_bytes: int, sets: int = 2,
               mailbox_bytes: int = 0) -> "ShmSegment":
        return cls(_map(name), name, rank, world_size, region_bytes, sets, mailbox_bytes)

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

    def regions(self, set_index: int, dtype: torch.dtype) -> torch.Tensor:
        """``(world_size, region_bytes // itemsize)`` view of every rank's region of set ``set_index``
        (row r: rank r's), for one reduction over the ranks."""
        key = (set_index, -1, dtype)
        every_rank = self._views.get(key)
        if every_rank is None:
            start = self._header_bytes + set_index * self.world_size * self.region_bytes
            every_rank = self._bytes[start:start + self.world_size * self.region_bytes].view(dtype)
            every_rank = self._views[key] = every_rank.view(self.world_size, -1)
        return every_rank

    def next_round(self) -> int:
        """The number of the round the next :meth:`barrier` ends (equal on every rank in step)."""
        return self._sequence + 1

    def next_parity(self) -> int:
        """The mailbox parity of the round the next :meth:`barrier` ends."""
        return (self._sequence + 1) % self.mail_slots

    def last_parity(self) -> int:
        """The mailbox parity of the round the last :meth:`barrier` ended."""
        return self._sequence % self.mail_slots

    def mailbox_word_index(self, parity: int, rank: int) -> int:
        """Index in :attr:`mail_words` of word 0 of ``rank``'s mailbox ``parity``."""
        return (parity * self.world_size + rank) * self.mailbox_bytes // 8

    def mailboxes(self, parity: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """``(world_size, mailbox_bytes // itemsize)`` view of every rank's mailbox ``parity``."""
        start = self._mail_start + parity * self.world_size * self.mailbox_bytes
        return self._bytes[start:start + self.world_size * self.mailbox_bytes].view(dtype).view(self.world_size, -1)

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

    def _learn_spin(self) -> float:
        """How long to spin before yielding: ``SPIN_S`` when every rank has a core and the ranks are
        processes; 0 when ranks outnumber cores or are threads of this process (they share its GIL)."""
        words, stride, me = self._words, self._stride, os.getpid()
        threads = any(words[peer * stride + _PID_WORD] == me for peer in range(self.world_size)
                      if peer != self.rank)
        self._spin_s = 0.0 if threads or self.world_size > _cores() else SPIN_S
        return self._spin_s

    def barrier(self, deadline: float) -> None:
        """Advance this rank's counter and wait until every rank's counter reached it.

        Raises:
            ShmPeerTimeout: naming the first rank that had not arrived by ``deadline``
            (``time.monotonic()`` seconds).
        """
        self._sequence = target = self._sequence + 1
        words = self._words
        for index in self._gave_up_words:
            if words[index]:
                self._check_nobody_gave_up()
        words[self._counters[self.rank]] = target
        for peer, index in enumerate(self._counters):
            if words[index] < target:
                self._wait(peer, target, deadline)
                return

    def _wait(self, peer: int, target: int, deadline: float) -> None:
        words, stride, world_size = self._words, self._stride, self.world_size
        spin_s = self._spin_s if self._spin_s is not None else self._learn_spin()
        started = time.monotonic()
        next_liveness, sleep_s, checks = started + _LIVENESS_EVERY_S, _FIRST_SLEEP_S, 0
        while True:
            while peer < world_size and words[peer * stride] >= target:
                peer += 1  # ranks that arrived stay arrived: resume from the first laggard
            if peer == world_size:
                return
            checks += 1
            if checks % _CHECKS_PER_CLOCK:
                continue
            now = time.monotonic()
            waited = now - started
            if waited < spin_s:
                continue
            if now > deadline:
                self._give_up(peer, died=False)
                raise ShmPeerTimeout(peer)
            if now > next_liveness:  # a killed peer never arrives: say so now, not at the deadline
                next_liveness = now + _LIVENESS_EVERY_S
                self._check_nobody_gave_up()  # first: a peer that gave up on a dead rank names it
                pid = words[peer * stride + _PID_WORD]
                if pid == _LEFT_PID or (pid > 0 and not pid_alive(pid)):
                    self._give_up(peer, died=True)
                    raise ShmPeerTimeout(peer, died=True, left=pid == _LEFT_PID)
            if waited < spin_s + YIELD_S:
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
        for rank in range(self.world_size):  # this rank too: a group it gave up on stays broken
            code = words[rank * stride + _GAVE_UP_WORD]
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
