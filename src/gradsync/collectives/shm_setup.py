"""Setting up a group's shared memory for :mod:`gradsync.collectives.shm`: segment, state, barrier.

The segment, the options object that holds it (:class:`ShmState`) and the
barrier that names the rank waited for.

The segment is created at the first shm call of a group, which is
collective: from the group's locality (or, when it is not known, host ids
every rank sends to rank 0) rank 0 knows whether every rank shares its
host, creates the segment and sends its name to the others point-to-point;
every rank maps it and reports the outcome to rank 0, which tells every
rank: a rank that failed to map it (or rank 0 failing to create it) makes
every rank raise :class:`~gradsync.errors.ShmSetupError` naming that rank and why.
"""

from __future__ import annotations

import zlib

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.options import AlgorithmOptions, check_count
from gradsync.errors import CollectiveMismatchError, ShmSetupError
from gradsync.transport import shm_segment as shm_transport
from gradsync.transport.base import PeerFailure
from gradsync.transport.shm_segment import ShmPeerTimeout, ShmSegment, host_id

_NAME_BYTES = 64
LEAN_MAX_BYTES = 64 * 2**10  # an AllReduce up to this travels whole in the mailboxes, with its layout check
MAIL_DATA_OFFSET = 512       # a mailbox: the layout check's words and texts (check.py), then that data
MAILBOX_BYTES = MAIL_DATA_OFFSET + LEAN_MAX_BYTES
CELL_L2_MULTIPLE = 2  # measured here: 1-2 MiB cells fastest with a 1 MiB L2 (gradsync bench allreduce --shm-cells)
MIN_CELL_BYTES, FALLBACK_CELL_BYTES = 256 * 2**10, 2 * 2**20
_L2_SIZE = "/sys/devices/system/cpu/cpu0/cache/index2/size"


def default_cell_bytes(path: str = _L2_SIZE) -> int:
    """Bytes per rank of a pipelined AllReduce's cell (:mod:`~gradsync.collectives.shm_pipeline`):
    ``CELL_L2_MULTIPLE`` x this machine's L2 cache per core (sysfs, e.g. "1024K"), at least
    ``MIN_CELL_BYTES``; ``FALLBACK_CELL_BYTES`` when the size cannot be read."""
    try:
        with open(path, encoding="ascii") as file:
            text = file.read().strip().upper()
        l2 = int(text.rstrip("KMB")) * {"K": 2**10, "M": 2**20}.get(text.rstrip("B")[-1:], 1)
    except (OSError, ValueError):
        return FALLBACK_CELL_BYTES
    return max(MIN_CELL_BYTES, CELL_L2_MULTIPLE * l2)


DEFAULT_CELL_BYTES = default_cell_bytes()


class ShmState(AlgorithmOptions):
    """A group's segment and arenas: shm's options, created on first use and kept until :meth:`close`.

    ``region_bytes``, ``cell_bytes`` (None: the defaults, ``DEFAULT_CELL_BYTES``, from this machine's
    L2 cache) must be equal on every rank (the layout check compares them).

    Raises:
        TypeError: ``region_bytes`` or ``cell_bytes`` is not an int; ValueError: below 64, or
        ``region_bytes`` not a multiple of 64.

    ``available`` is None until the first shm call found out whether every
    rank is on one machine. ``region_bytes``: bytes per rank region of the
    segment (None: the transport's default). ``arenas``: the segments that
    :func:`allocate_shared` hands out disjoint ranges of; ``arena_used[i]``
    bytes of each rank's region of ``arenas[i]`` are taken (equal on every rank).
    """

    def __init__(self, region_bytes: int | None = None, cell_bytes: int | None = None):
        self.region_bytes = shm_transport.DEFAULT_REGION_BYTES if region_bytes is None else \
            check_count("region_bytes", region_bytes, minimum=64)
        if self.region_bytes % 64:
            raise ValueError(f"region_bytes must be a multiple of 64 (a cache line), got {self.region_bytes}")
        self.cell_bytes = DEFAULT_CELL_BYTES if cell_bytes is None else check_count("cell_bytes", cell_bytes,
                                                                                   minimum=64)
        self.segment: ShmSegment | None = None
        self.available: bool | None = None
        self.arenas: list[ShmSegment] = []
        self.arena_used: list[int] = []

    def compared(self) -> tuple[int, int]:
        """The settings every rank's calls must agree on (the layout check's options fingerprint)."""
        return self.region_bytes, self.cell_bytes

    def find(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """``(arena index, byte offset)`` of ``tensor``'s data in this rank's region of an arena, or None."""
        for index, arena in enumerate(self.arenas):
            offset = arena.offset_in_own_region(tensor)
            if offset is not None:
                return index, offset
        return None

    def close(self) -> None:
        """Drop the segments; tensors still viewing an arena keep its memory mapped until they are freed."""
        for segment in (self.segment, *self.arenas):
            if segment is not None:
                segment.close()
        self.segment = None
        self.arenas, self.arena_used = [], []


def usable(call: CollectiveCall) -> bool:
    """Whether every rank of the group is on one machine, setting the segment up if so (collective
    the first time; every rank learns the same answer)."""
    state = call.options(ShmState)
    if state.available is None:
        state.segment = create_segment(call, state.region_bytes, mailbox_bytes=MAILBOX_BYTES)
        state.available = state.segment is not None
    return state.available


def group_segment(call: CollectiveCall) -> ShmSegment:
    if not usable(call):
        raise ValueError("algorithm 'shm' needs every rank of the group on one machine; these ranks "
                         "report different hosts (boot id or /dev/shm)")
    return call.options(ShmState).segment


_REPORT_BYTES = 256  # a rank's setup outcome: b"" (done) or the error text
_NO_SHM, _NAMED, _CREATE_FAILED = 0, 1, 2  # the first byte of the name message


def _text(buffer: torch.Tensor) -> str:
    return bytes(buffer[buffer > 0].tolist()).decode(errors="replace")


def _encode(text: str, size: int, first: int | None = None) -> torch.Tensor:
    encoded = ((bytes([first]) if first is not None else b"") + text.encode())[:size]
    buffer = torch.zeros(size, dtype=torch.uint8)
    buffer[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    return buffer


def _one_host(call: CollectiveCall) -> bool:
    """Whether the call's ranks share a host: from the group's locality, else rank 0 asks every rank
    (collective; every rank learns the answer from the name message)."""
    if call.locality is not None:
        return call.locality.one_host
    if call.rank != 0:
        call.send(torch.tensor([host_id()], dtype=torch.int64), 0, "shm setup (host check)")
        return True  # rank 0 decides; the name message says
    hosts = torch.zeros(call.world_size, dtype=torch.int64)
    for peer in range(1, call.world_size):
        call.recv(hosts[peer:peer + 1], peer, "shm setup (host check)")
    return bool((hosts[1:] == host_id()).all())


def create_segment(call: CollectiveCall, region_bytes: int, sets: int = 2,
                   mailbox_bytes: int = 0) -> ShmSegment | None:
    """Rank 0 creates the segment if every rank is on its host, every rank maps it and reports the
    outcome to rank 0, which tells every rank; None when the ranks are on several hosts (collective).

    Raises:
        ShmSetupError: on every rank when creating or mapping failed on any, naming that rank and why.
    """
    one_host = _one_host(call)
    if call.rank == 0:
        return _create_as_root(call, region_bytes, sets, mailbox_bytes, one_host)
    name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    call.recv(name, 0, "shm setup (segment name)")
    if int(name[0]) == _NO_SHM:
        return None
    if int(name[0]) == _CREATE_FAILED:
        raise ShmSetupError(_setup_failure(call, f"rank 0 could not create the segment: {_text(name[1:])}"))
    segment, report, cause = None, "", None
    try:
        segment = ShmSegment.attach(_text(name[1:]), call.rank, call.world_size, region_bytes, sets, mailbox_bytes)
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised here as well
        report, cause = f"{type(exc).__name__}: {exc}", exc
    call.send(_encode(report, _REPORT_BYTES), 0, "shm setup (attach report)")
    verdict = torch.zeros(_REPORT_BYTES, dtype=torch.uint8)
    call.recv(verdict, 0, "shm setup (attach verdict)")
    if int(verdict[0]):
        if segment is not None:
            segment.close()
        raise ShmSetupError(_setup_failure(call, _text(verdict))) from cause
    return segment


def _create_as_root(call: CollectiveCall, region_bytes: int, sets: int, mailbox_bytes: int,
                    one_host: bool) -> ShmSegment | None:
    segment, failure = None, ""
    if one_host:
        try:
            segment = ShmSegment.create(call.world_size, region_bytes, sets, mailbox_bytes)
        except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised here as well
            failure = f"{type(exc).__name__}: {exc}"
    if failure:
        message = _encode(failure, _NAME_BYTES, _CREATE_FAILED)
    else:
        message = _encode(segment.name if segment is not None else "", _NAME_BYTES,
                          _NAMED if segment is not None else _NO_SHM)
    for peer in range(1, call.world_size):
        call.send(message, peer, "shm setup (segment name)")
    if failure:
        raise ShmSetupError(_setup_failure(call, f"rank 0 could not create the segment: {failure}"))
    if segment is None:
        return None
    failed = []
    try:
        for peer in range(1, call.world_size):
            report = torch.zeros(_REPORT_BYTES, dtype=torch.uint8)
            call.recv(report, peer, "shm setup (attach report)")
            if int(report[0]):
                failed.append(f"rank {peer} failed to attach the segment: {_text(report)}")
    finally:
        segment.unlink()  # every rank mapped it (or failed): the name is no longer needed
    verdict = _encode("; ".join(failed), _REPORT_BYTES)
    for peer in range(1, call.world_size):
        call.send(verdict, peer, "shm setup (attach verdict)")
    if failed:
        segment.close()
        raise ShmSetupError(_setup_failure(call, "; ".join(failed)))
    return segment


def _setup_failure(call: CollectiveCall, reason: str) -> str:
    rank, world_size = call.reported_rank
    return f"{call.op_name} (algorithm={call.algorithm}) on rank {rank} of {world_size}: shm setup failed: {reason}"


DATA_FLAG = 1 << 61  # mailbox word 0 of a data round (check words use the 61 bits below, rejections bit 62)
_MIX = 0x9E3779B97F4A7C15


def layout_digest(*parts) -> int:
    """A 61-bit digest of what a data round moves (collective, numel, dtype, ...): equal on every rank of
    a correct call."""
    text = repr(parts).encode()
    return ((zlib.crc32(text) << 30) ^ zlib.adler32(text)) & (DATA_FLAG - 1)


def data_barrier(segment: ShmSegment, call: CollectiveCall, step: str, digest: int) -> None:
    """A barrier of a data round that also proves every rank is in the same round of the same
    operation: each posts ``DATA_FLAG`` | (``digest`` mixed with the round's number) in its mailbox;
    a rank whose peers posted another word (a layout check, another collective or layout, another
    step) raises CollectiveMismatchError, as does that peer, instead of reading data not meant for it.

    Raises:
        CollectiveMismatchError: the ranks' rounds differ; CollectiveTimeoutError: a rank did not arrive.
    """
    words = segment.mail_words
    if words is None:  # a segment without mailboxes (an arena): its barriers cannot meet a layout check
        barrier(segment, call, step)
        return
    parity = segment.next_parity()
    word = DATA_FLAG | ((digest ^ (segment.next_round() * _MIX)) & (DATA_FLAG - 1))
    words[segment.mailbox_word_index(parity, segment.rank)] = word
    barrier(segment, call, step)
    for peer in range(call.world_size):
        if words[segment.mailbox_word_index(parity, peer)] != word:
            raise out_of_step(call, step, peer)


def out_of_step(call: CollectiveCall, step: str, peer: int) -> CollectiveMismatchError:
    rank, _ = call.reported_rank
    return CollectiveMismatchError(
        f"{call.op_name} on rank {rank}: the ranks' shared-memory rounds are out of step at {step}: rank "
        f"{peer} is in another collective, another layout or another step of it (every rank must issue the "
        f"same collectives in the same order; verify=False skips the layout check that would name the "
        f"difference)")


def barrier(segment: ShmSegment, call: CollectiveCall, step: str) -> None:
    try:
        segment.barrier(call.deadline)
    except ShmPeerTimeout as timeout:
        if timeout.gave_up is not None:  # a verdict of another rank's: no hang diagnosis here
            if timeout.peer == call.rank:
                peer, reason = timeout.gave_up, ("gave up waiting for this rank (it came too late) at an "
                                                 "earlier step of this group's shared memory")
            else:
                what = "died (its process is gone)" if timeout.died else "stopped responding"
                peer, reason = timeout.peer, (f"{what}: rank {timeout.gave_up} gave up waiting for it at an "
                                              f"earlier step of this group's shared memory")
            raise call.failure(PeerFailure(peer, reason, False), step) from None
        reason = ("left the group (it closed the shared memory)" if timeout.left
                  else "died (its process is gone)" if timeout.died else "timed out waiting for it")
        raise call.failure(PeerFailure(timeout.peer, reason, not timeout.died), step) from None
