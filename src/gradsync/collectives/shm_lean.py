"""The small-message shm AllReduce: one barrier, the layout check in the same round, nothing built per call.

Up to ``LEAN_MAX_BYTES`` (in the working dtype) a call goes through the
group segment's mailboxes (:mod:`~gradsync.transport.shm_segment`): every
rank copies its tensor into its mailbox of the round (converting fp16/bf16 to
float32 and reading any strides in that one copy) and posts its layout
check word beside it (:func:`~gradsync.collectives.check.check_word`); one
barrier; every rank compares the words and, when they agree, sums every
rank's mailbox itself, in cache, in rank order (the same additions on the
same bytes on every rank, so the results are bitwise equal). A rank in another collective, or
one that rejects its call, meets this round through the same channel and
every rank raises (:func:`~gradsync.collectives.check.settle_check`).

A :class:`LeanPlan` holds what one tensor layout needs: the views of both
parities' mailboxes, the word indices and the descriptor digest. The
communicator keeps plans by layout (:mod:`~gradsync.collectives.plans`), so a
repeated call checks its arguments, resolves its algorithm and fingerprints
its options once (:func:`gradsync.collectives.ops.all_reduce`); :func:`plan` is
what ``registry.ONE_HOST`` offers the generic entry.
"""

from __future__ import annotations

import torch

from gradsync.collectives.call import CollectiveCall
from gradsync.collectives.check import check_word, row_digest, settle_check
from gradsync.collectives.plans import plan_key  # noqa: F401 (bench.latency reads it here)
from gradsync.collectives.shm_pipeline import sum_rows
from gradsync.collectives.shm_setup import LEAN_MAX_BYTES, MAIL_DATA_OFFSET, ShmState, barrier
from gradsync.transport.shm_segment import ShmSegment


def eligible(state: ShmState, numel: int, work_dtype: torch.dtype, world_size: int) -> bool:
    """Whether an AllReduce of ``numel`` elements reduced in ``work_dtype`` takes the lean path now."""
    return (state.segment is not None and world_size > 1 and
            0 < numel * work_dtype.itemsize <= LEAN_MAX_BYTES)


class LeanPlan:
    """One layout's lean AllReduce on one group segment.

    Args:
        segment: the group's segment (with mailboxes).
        tensor: a tensor of the layout (shape, strides, dtype); not kept.
        work_dtype: the dtype the sum is taken in (float32 for fp16/bf16).
        avg: divide by world_size after the sum (``op="avg"``).
        row: this rank's layout descriptor (``check.describe``), for the detailed error of a mismatch.
        label, layout: the call's algorithm label and layout key (flight records, errors).
    """

    def __init__(self, segment: ShmSegment, tensor: torch.Tensor, work_dtype: torch.dtype, avg: bool,
                 row: torch.Tensor, label: str, layout: str):
        numel, shape, rank = tensor.numel(), tensor.shape, segment.rank
        offset = MAIL_DATA_OFFSET // work_dtype.itemsize
        parities = range(segment.mail_slots)
        boxes = [segment.mailboxes(parity, work_dtype)[:, offset:offset + numel] for parity in parities]
        self.segment = segment
        self.inputs = [box[rank].view(shape) for box in boxes]
        self.every_rank = [[row.view(shape) for row in box] for box in boxes]  # per parity, rank order
        self.word_index = [segment.mailbox_word_index(parity, rank) for parity in parities]
        self.peer_words = [[segment.mailbox_word_index(parity, peer) for peer in range(segment.world_size)]
                           for parity in parities]
        self.work_dtype = work_dtype
        self.direct = tensor.dtype == work_dtype  # summed straight into the caller's tensor
        self.scratch = None if self.direct else torch.empty(shape, dtype=work_dtype)
        self.avg = avg
        self.row = row
        self.digest = row_digest(row)
        self.label, self.layout = label, layout
        self.dtype, self.shape = tensor.dtype, shape

    def run(self, tensor: torch.Tensor, call: CollectiveCall) -> None:
        """Sum ``tensor`` (this plan's layout) over the ranks, in place (see the module docstring).

        Raises:
            CollectiveMismatchError: the ranks' words differ (another layout, collective, algorithm or
            options; a rank that rejected its call). CollectiveTimeoutError: a rank did not arrive.
        """
        segment = self.segment
        call.layout, call.dtype, call.shape = self.layout, self.dtype, self.shape
        parity = segment.next_parity()
        self.inputs[parity].copy_(tensor)
        word = check_word(segment, self.digest)
        words = segment.mail_words
        words[self.word_index[parity]] = word
        barrier(segment, call, "shm all_reduce (mailboxes)")
        for index in self.peer_words[parity]:
            if words[index] != word:
                settle_check(call, segment, word, lambda: self.row, "all_reduce")  # raises
        if self.direct:
            sum_rows(self.every_rank[parity], tensor)
            if self.avg:
                tensor.div_(segment.world_size)
            return
        sum_rows(self.every_rank[parity], self.scratch)
        if self.avg:
            self.scratch.div_(segment.world_size)
        tensor.copy_(self.scratch)


def plan(comm, tensor: torch.Tensor, work_dtype: torch.dtype, avg: bool, describe_row,
         call: CollectiveCall) -> LeanPlan | None:
    """The lean plan of this AllReduce on ``comm`` (a Communicator), or None when it does not take that
    path (``describe_row()``: the call's layout descriptor, built only for a plan)."""
    state = comm.options(ShmState)
    if not eligible(state, tensor.numel(), work_dtype, comm.world_size):
        return None
    return LeanPlan(state.segment, tensor, work_dtype, avg, describe_row(), call.algorithm, call.layout)
