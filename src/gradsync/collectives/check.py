"""Layout check: ranks agree on the call, or all raise before any payload moves.

Every rank contributes a fixed-size int64 descriptor and sends it straight
to every other rank; since every descriptor has the same size this exchange
cannot itself mismatch. Talking to every peer directly (rather than round a
ring) means a rank that is dead or never calls is named by every other rank,
not only by its neighbours, and the p-1 messages travel concurrently.

A descriptor holds the collective, op, the resolved algorithm (what "auto"
chose, never "auto" itself), a fingerprint of the options that algorithm
runs with (segment size, node layout, ...), the dtype, device type, src and
shape, and a *rejection*: the code of the problem this rank found with its
own arguments (bad timeout, op or algorithm, sparse, inference or meta
tensor, unsupported dtype, a failed staging allocation, ...), 0 if none.
Every rank compares all descriptors. If any rank rejected, the rejecting
ranks send their error text to every peer (a second fixed-size message, only
then); each rejecting rank raises its own TypeError/ValueError, every other
rank a :class:`~gradsync.errors.CollectiveMismatchError` naming the rank
and its reason ("rank 1 rejected the call: timeout must be ... (got -1)").
Otherwise a difference raises the same CollectiveMismatchError on every
rank. Either way no tensor is modified and the group stays in step.

Cost: (p-1) concurrent messages of ``DESCRIPTOR_NUMEL * 8`` bytes per rank
(plus ``REASON_BYTES`` per rejecting rank on failure). Callers that already
verified a fixed layout (the DataParallel buckets, checked once at
construction) pass ``verify=False``.

The channel belongs to the group, not to an algorithm: once the group has a
shared-memory segment (every rank on one machine, after its first ``shm``
call), every layout check of every collective goes through the segment's
mailboxes instead (:func:`post_check` / :func:`settle_check`): each rank
posts one word, a 62-bit digest of its descriptor mixed with the round's
barrier number (or, rejecting, a flag, the round and its cause, with its
error text beside it), one barrier, every rank compares the words. Only if
they differ and nobody rejected does a second round exchange the full
descriptors, so every rank raises the same detailed error. The shm
AllReduce of a small message carries its word in its data round
(:mod:`~gradsync.collectives.shm_lean`): a rank in another collective, or
rejecting, still meets it in that round.
"""

from __future__ import annotations

import zlib

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.dtypes import dtype_code, dtype_name
from gradsync.collectives.registry import ALGORITHMS
from gradsync.collectives.shm_setup import DATA_FLAG, MAIL_DATA_OFFSET, ShmState, barrier, out_of_step
from gradsync.errors import CollectiveMismatchError
from gradsync.transport.shm_segment import ShmSegment

DESCRIPTOR_NUMEL = 20
MAX_DIMS = 8
SHOWN_DIMS = MAX_DIMS - 2  # of a shape with more dims: these, then the last (see describe)
REASON_BYTES = 256  # a rejecting rank's error text, truncated
_MAGIC = 0x67726164  # "grad"
_FIELDS = ("magic", "collective", "op", "algorithm", "dtype", "src", "numel", "ndim",
           "rejected", "options", "device")
_HEAD = len(_FIELDS) + 1  # one spare word, then the dims
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "shared_buffer")
_OPS = ("none", "sum", "avg")
_DEVICES = ("cpu", "cuda", "meta")
# Why a rank rejects its own call (code = index; 0: it does not).
REJECTIONS = ("accepted", "a non-tensor argument", "an unsupported dtype", "a bad op", "a bad algorithm",
              "a bad src", "a bad timeout", "a sparse tensor", "an inference tensor", "an unsupported device",
              "a staging allocation failure", "a bad argument", "an algorithm this group cannot run",
              "a bad group", "overlapping memory")
_NOT_A_TENSOR = -2


def rejection_code(cause: str) -> int:
    """The code of ``cause`` (one of ``REJECTIONS``)."""
    return REJECTIONS.index(cause)


def _code(table, value) -> int:
    return table.index(value) if value in table else len(table) + zlib.crc32(str(value).encode())


def describe(tensor: torch.Tensor | None, collective: str, op: str, algorithm: str, src: int, *,
             rejected: int = 0, options: int = 0) -> torch.Tensor:
    """Encode a call as a ``(DESCRIPTOR_NUMEL,)`` int64 tensor (``tensor`` None: not a tensor)."""
    head = [_MAGIC, _code(_COLLECTIVES, collective), _code(_OPS, op), _code(ALGORITHMS, algorithm),
            _NOT_A_TENSOR, src, 0, 0, rejected, options & 0x7FFFFFFF, 0, 0]
    dims: list[int] = []
    if tensor is not None and not rejected:
        dims = list(tensor.shape)
        if len(dims) > MAX_DIMS:  # the first SHOWN_DIMS, the last, and a crc32 of those between
            dims = dims[:SHOWN_DIMS] + [dims[-1], zlib.crc32(repr(dims[SHOWN_DIMS:-1]).encode())]
        head[4], head[6], head[7] = dtype_code(tensor.dtype), tensor.numel(), tensor.dim()
        head[10] = _code(_DEVICES, tensor.device.type)
    return torch.tensor(head + dims + [0] * (DESCRIPTOR_NUMEL - _HEAD - len(dims)), dtype=torch.int64)


def verify_layout(call: CollectiveCall, tensor: torch.Tensor | None, *, collective: str,
                  op: str = "none", src: int = 0, algorithm: str | None = None,
                  rejection: tuple[int, Exception] | None = None, options: int = 0) -> None:
    """Raise CollectiveMismatchError on every rank unless all ranks describe the same call.

    ``rejection``: (code, error) when this rank rejects the call; then this
    function returns normally on this rank (the caller raises ``error``) once
    the others know. ``options``: the fingerprint of the algorithm's options.

    Collective: every rank must call this, whatever its arguments.
    """
    world_size = call.world_size
    if world_size == 1:
        return
    row = describe(tensor, collective, op, algorithm or call.algorithm, src,
                   rejected=rejection[0] if rejection else 0, options=options)
    segment = call.options(ShmState).segment
    if segment is not None:
        word = post_check(segment, rejection_word(segment, rejection[0]) if rejection else
                          check_word(segment, row_digest(row)), rejection[1] if rejection else None)
        barrier(segment, call, "layout check")
        settle_check(call, segment, word, lambda: row, collective)
        return
    table = torch.zeros(world_size, DESCRIPTOR_NUMEL, dtype=torch.int64)
    table[call.rank] = row
    call.exchange_with_every_peer(table, "layout check")
    rows = table.tolist()
    rejecting = [rank for rank, row in enumerate(rows) if row[8] and row[0] == _MAGIC]
    if rejecting:
        reasons = _exchange_reasons(call, rejecting, rejection[1] if rejection else None)
        if rejection is None:
            detail = "; ".join(f"rank {rank} rejected the call: {reasons[rank]} ({_cause(rows[rank][8])})"
                               for rank in rejecting)
            raise CollectiveMismatchError(f"{collective} on rank {call.rank}: {detail}")
        return
    problem = _first_difference(rows, tensor_shapes=[_shape_of(row) for row in rows])
    if problem:
        raise CollectiveMismatchError(f"{collective} on rank {call.rank}: ranks disagree on {problem}")


# A mailbox (bytes): word 0 the check word, word 1 the round its row was posted in; the error text of
# a rejecting rank; the full descriptor (second round only); then a small AllReduce's data.
_MAIL_ROUND_WORD = 1
MAIL_REASON_OFFSET = 64
MAIL_ROW_OFFSET = MAIL_REASON_OFFSET + REASON_BYTES
assert MAIL_ROW_OFFSET + 8 * DESCRIPTOR_NUMEL <= MAIL_DATA_OFFSET
_REJECTED = 1 << 62
_DIGEST_MASK = DATA_FLAG - 1  # bit 61 marks a data round's word (shm_setup.data_barrier)
_ROUND_MASK = 2**40 - 1
_MIX = 0x9E3779B97F4A7C15


def row_digest(row: torch.Tensor) -> int:
    """A 62-bit digest of a descriptor row (``(DESCRIPTOR_NUMEL,)`` int64)."""
    data = row.numpy().tobytes()
    return ((zlib.crc32(data) << 31) ^ zlib.adler32(data)) & _DIGEST_MASK


def check_word(segment: ShmSegment, digest: int) -> int:
    """The word an accepting rank posts for the round the next barrier ends: ``digest`` mixed with
    the round's number, so a word left from an earlier round never matches."""
    return (digest ^ ((segment.next_round() * _MIX) & _DIGEST_MASK)) & _DIGEST_MASK


def rejection_word(segment: ShmSegment, code: int) -> int:
    return _REJECTED | ((segment.next_round() & _ROUND_MASK) << 8) | code


def post_check(segment: ShmSegment, word: int, error: Exception | None = None) -> int:
    """Write this rank's ``word`` (and a rejecting rank's error text) into its mailbox of the coming
    round; return ``word``. The caller then passes the barrier and calls :func:`settle_check`."""
    parity = segment.next_parity()
    if error is not None:
        encoded = f"{type(error).__name__}: {error}".encode()[:REASON_BYTES - 1] + b"\0"
        reason = segment.mailboxes(parity)[segment.rank, MAIL_REASON_OFFSET:MAIL_REASON_OFFSET + len(encoded)]
        reason.copy_(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
    segment.mail_words[segment.mailbox_word_index(parity, segment.rank)] = word
    return word


def settle_check(call: CollectiveCall, segment: ShmSegment, word: int, row, collective: str) -> None:
    """After the round's barrier: return if every rank posted ``word``; a rejecting rank returns (its
    caller raises its own error); otherwise CollectiveMismatchError on every rank, naming the rejecting
    ranks and their reasons, or (a second round, the full descriptors from ``row()``) the difference."""
    parity = segment.last_parity()  # the round just ended
    words = segment.mail_words
    posted = [words[segment.mailbox_word_index(parity, peer)] for peer in range(call.world_size)]
    if posted.count(word) == len(posted) and not word & _REJECTED:
        return
    for peer, value in enumerate(posted):
        if value & DATA_FLAG and not value & _REJECTED and not word & _REJECTED:  # in a data round instead
            raise out_of_step(call, "layout check", peer)
    round_tag = (segment.next_round() - 1) & _ROUND_MASK
    rejecting = [peer for peer, value in enumerate(posted)
                 if value & _REJECTED and (value >> 8) & _ROUND_MASK == round_tag]
    if rejecting:
        if word & _REJECTED:
            return
        boxes = segment.mailboxes(parity)
        detail = "; ".join(f"rank {peer} rejected the call: {_text(boxes[peer, MAIL_REASON_OFFSET:MAIL_ROW_OFFSET])}"
                           f" ({_cause(posted[peer] & 0xFF)})" for peer in rejecting)
        raise CollectiveMismatchError(f"{collective} on rank {call.rank}: {detail}")
    rows = _exchange_rows(call, segment, row())
    problem = _first_difference(rows, tensor_shapes=[_shape_of(one) for one in rows])
    raise CollectiveMismatchError(f"{collective} on rank {call.rank}: ranks disagree on "
                                  f"{problem or 'the layout check (their words differ)'}")


def _exchange_rows(call: CollectiveCall, segment: ShmSegment, row: torch.Tensor) -> list[list[int]]:
    """The second round: every rank's full descriptor through the mailboxes (a row not posted in this
    round, by a rank in another operation, reads as no valid layout)."""
    parity, round_number = segment.next_parity(), segment.next_round()
    boxes = segment.mailboxes(parity, torch.int64)
    start = MAIL_ROW_OFFSET // 8
    boxes[segment.rank, start:start + DESCRIPTOR_NUMEL] = row
    index = segment.mailbox_word_index(parity, segment.rank)
    segment.mail_words[index] = DATA_FLAG  # not a layout check: a peer in one raises at once
    segment.mail_words[index + _MAIL_ROUND_WORD] = round_number
    barrier(segment, call, "layout check (descriptors)")
    rows = boxes[:, start:start + DESCRIPTOR_NUMEL].tolist()
    for peer in range(call.world_size):
        if segment.mail_words[segment.mailbox_word_index(parity, peer) + _MAIL_ROUND_WORD] != round_number:
            rows[peer][0] = 0
    return rows


def _text(buffer: torch.Tensor) -> str:
    return bytes(buffer.tolist()).split(b"\0", 1)[0].decode(errors="replace")


def _cause(code: int) -> str:
    return REJECTIONS[code] if 0 <= code < len(REJECTIONS) else "an unknown cause"


def _exchange_reasons(call: CollectiveCall, rejecting: list[int], error: Exception | None) -> dict[int, str]:
    """Every rejecting rank sends its error text to every peer; return rank -> text."""
    texts = torch.zeros(call.world_size, REASON_BYTES, dtype=torch.uint8)
    if error is not None:
        encoded = f"{type(error).__name__}: {error}".encode()[:REASON_BYTES]
        texts[call.rank, :len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    call.exchange_with_every_peer(texts, "rejection reasons", senders=rejecting)
    return {rank: bytes(texts[rank].tolist()).rstrip(b"\0").decode(errors="replace") for rank in rejecting}


def _shape_of(row: list[int]) -> tuple[int, ...]:
    """The shape words of a descriptor row (more than MAX_DIMS dims: folded, see describe)."""
    ndim = row[7]
    return tuple(row[_HEAD: _HEAD + min(ndim, MAX_DIMS)]) + ((ndim,) if ndim > MAX_DIMS else ())


def _render_shape(words: tuple[int, ...]) -> str:
    """``(2, 3)``; a folded shape: ``(1, 1, 1, 1, 1, 1, …, 3) with 27 dims`` (the middle dims not shown)."""
    if len(words) <= MAX_DIMS:
        return str(words)
    shown = ", ".join(map(str, words[:SHOWN_DIMS]))
    return f"({shown}, …, {words[SHOWN_DIMS]}) with {words[-1]} dims"


def _decode(field: str, value: int) -> str:
    if field == "dtype":
        return "no tensor" if value == _NOT_A_TENSOR else dtype_name(value)
    if field == "options":
        return f"options fingerprint {value:#010x}"
    tables = {"collective": _COLLECTIVES, "op": _OPS, "algorithm": ALGORITHMS, "device": _DEVICES}
    table = tables.get(field)
    if table is not None:
        return str(table[value]).replace("torch.", "") if 0 <= value < len(table) else "an unknown value"
    return str(value)


_COMPARED = ("collective", "op", "algorithm", "dtype", "src", "device", "options")


def _first_difference(rows: list[list[int]], tensor_shapes: list[tuple[int, ...]]) -> str:
    """Describe the first field on which ranks differ, grouping ranks by value ("" if none)."""
    if any(row[0] != _MAGIC for row in rows):
        bad = [rank for rank, row in enumerate(rows) if row[0] != _MAGIC]
        return f"the protocol: ranks {bad} sent no valid layout (they called another operation?)"
    for field in _COMPARED:
        index = _FIELDS.index(field)
        values = [_decode(field, row[index]) for row in rows]
        if len(set(values)) > 1:
            return f"{field}: " + _group_by_value(values)
    if len(set(tensor_shapes)) > 1:
        shapes = [_render_shape(shape) for shape in tensor_shapes]
        problem = "shape: " + _group_by_value(shapes)
        if len(set(shapes)) < len(set(tensor_shapes)):  # they differ where the rendering folds
            ndim = max(shape[-1] for shape in tensor_shapes if len(shape) > MAX_DIMS)
            problem += f"; dims {SHOWN_DIMS} to {ndim - 2} differ between ranks shown alike"
        return problem
    return ""


def _group_by_value(values: list[str]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    parts = []
    for value, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who} {'has' if len(ranks) == 1 else 'have'} {value}")
    return "; ".join(parts)


PAIR_WORDS = 4  # per peer: (numel, dtype code) sent to it, (numel, dtype code) received from it


def verify_pairs(call: CollectiveCall, sends: list[torch.Tensor], receives: list[torch.Tensor]) -> None:
    """all_to_all's size check: raise CollectiveMismatchError on every rank unless, for every pair of
    ranks (q, p), q's ``sends[p]`` has the numel and dtype of p's ``receives[q]``; nothing moves before.

    Every rank sends one row of ``PAIR_WORDS * world_size`` int64 (the same size on every rank) to
    every peer. The error names the first bad pair in (sender, receiver) order:
    "rank 1 sends 5 float32 elements to rank 0, which receives 4 float32".

    Collective: every rank calls it after an agreed layout check of all_to_all.
    """
    world_size = call.world_size
    rows = torch.zeros(world_size, PAIR_WORDS * world_size, dtype=torch.int64)
    rows[call.rank] = torch.tensor([value for send, receive in zip(sends, receives)
                                    for value in (send.numel(), dtype_code(send.dtype),
                                                  receive.numel(), dtype_code(receive.dtype))], dtype=torch.int64)
    if world_size > 1:
        call.exchange_with_every_peer(rows, "all_to_all size check")
    table = rows.tolist()
    for sender in range(world_size):
        for receiver in range(world_size):
            sent = table[sender][PAIR_WORDS * receiver: PAIR_WORDS * receiver + 2]
            expected = table[receiver][PAIR_WORDS * sender + 2: PAIR_WORDS * sender + 4]
            if sent != expected:
                raise CollectiveMismatchError(
                    f"all_to_all on rank {call.rank}: rank {sender} sends {sent[0]} {dtype_name(sent[1])} elements "
                    f"to rank {receiver}, which receives {expected[0]} {dtype_name(expected[1])}")
