"""Transport over torch.distributed point-to-point calls (Gloo on CPU, NCCL on GPU).

This is the only module of gradsync that calls torch.distributed
point-to-point (``isend``/``irecv``). Every wait is bounded: Gloo's
``Work.wait(timeout)`` raises once the time is up, and a peer that died shows
up as a closed connection; both become :class:`PeerFailure` naming the peer.
After such a failure Gloo has closed the pair, so the group must be rebuilt.
"""

from __future__ import annotations

import datetime
import re

import torch
import torch.distributed as dist

from gradsync.transport.base import PeerFailure, TransportStats


def _timedelta(timeout_s: float) -> datetime.timedelta:
    # Gloo treats a zero timeout as "use the default"; keep a positive floor.
    return datetime.timedelta(seconds=max(timeout_s, 0.001))


def _classify(exc: Exception) -> tuple[str, bool]:
    text = str(exc)
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
        return "timed out waiting for it", True
    if "closed" in text or "reset" in text or "Broken pipe" in text:
        return "connection closed (the peer process died or left)", False
    first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"transfer failed: {first_line}", False


def _failure(peer: int, exc: Exception) -> PeerFailure:
    reason, timed_out = _classify(exc)
    return PeerFailure(peer, reason, timed_out)


def _post(start, tensor: torch.Tensor, peer: int, **kwargs):
    """Start a transfer; Gloo raises at once when the pair to ``peer`` is already closed."""
    try:
        return start(tensor, **kwargs)
    except RuntimeError as exc:
        raise _failure(peer, exc) from exc


class _WorkHandle:
    __slots__ = ("_work", "_peer")

    def __init__(self, work, peer: int):
        self._work = work
        self._peer = peer

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait(timeout=_timedelta(timeout_s))
        except RuntimeError as exc:
            reason, timed_out = _classify(exc)
            raise PeerFailure(self._peer, reason, timed_out) from exc


class _AnySourceHandle:
    """Gloo's receive from any source (``irecv`` without ``src``); the sender is known after ``wait``."""

    def __init__(self, work):
        self._work = work
        self.source = -1

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait(timeout=_timedelta(timeout_s))
        except RuntimeError as exc:
            reason, timed_out = _classify(exc)
            raise PeerFailure(-1, reason, timed_out) from exc
        self.source = self._work._source_rank()


class TorchP2PTransport:
    """A :class:`~gradsync.transport.base.Transport` over one torch.distributed group.

    Args:
        group: a ``torch.distributed`` process group, or None for the default group.
    """

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        # Gloo matches messages by (peer, tag): collectives tag each call (Communicator._tags)
        self.call_tags = self.backend == "gloo"
        self.stats = TransportStats()

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> _WorkHandle:
        """Start sending ``tensor`` (contiguous) to group rank ``peer`` on ``tag``.

        Through ``dist.isend`` on the group, not a reference to its ProcessGroup kept here: a kept
        reference would keep a destroyed group's Gloo pairs open (an elastic member that left), so a
        peer waiting on them would wait for its timeout instead of seeing the connection close."""
        work = _post(dist.isend, tensor, peer, group=self.group, group_dst=peer, tag=tag)
        self.stats.record_send(tensor.nbytes)
        return _WorkHandle(work, peer)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> _WorkHandle:
        """Start receiving group rank ``peer``'s next message on ``tag`` into ``tensor`` (contiguous)."""
        work = _post(dist.irecv, tensor, peer, group=self.group, group_src=peer, tag=tag)
        self.stats.record_recv(tensor.nbytes)
        return _WorkHandle(work, peer)

    def isend_tagged(self, tensor: torch.Tensor, peer: int, tag: int) -> _WorkHandle:
        work = _post(dist.isend, tensor, peer, group=self.group, group_dst=peer, tag=tag)
        self.stats.record_send(tensor.numel() * tensor.element_size())
        return _WorkHandle(work, peer)

    def irecv_tagged(self, tensor: torch.Tensor, peer: int, tag: int) -> _WorkHandle:
        work = _post(dist.irecv, tensor, peer, group=self.group, group_src=peer, tag=tag)
        self.stats.record_recv(tensor.numel() * tensor.element_size())
        return _WorkHandle(work, peer)

    def irecv_any(self, tensor: torch.Tensor, tag: int) -> _AnySourceHandle:
        if self.group is not None:
            raise ValueError("a receive from any source needs the default group")
        work = _post(dist.irecv, tensor, -1, tag=tag)
        self.stats.record_recv(tensor.numel() * tensor.element_size())
        return _AnySourceHandle(work)

    def backend_all_reduce(self, tensor: torch.Tensor, timeout_s: float) -> None:
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        self._wait_backend(work, "all_reduce", timeout_s)

    def backend_broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float) -> None:
        work = dist.broadcast(tensor, group=self.group, group_src=src, async_op=True)
        self._wait_backend(work, "broadcast", timeout_s)

    def backend_reduce_scatter(self, tensor: torch.Tensor, chunks: list[tuple[int, int]], timeout_s: float) -> None:
        """Sum ``tensor`` (``(numel,)``, contiguous) over the group so that ``tensor[a:b]``, ``(a, b) =
        chunks[rank]``, holds the sum (the rest is undefined), with the backend's own call.

        Gloo (torch 2.13) has ``reduce_scatter``, but computes it as an all_reduce of a copy of the
        whole input that then keeps the chunk (ProcessGroupGloo's ``reduce_scatter_tensor_coalesced``;
        measured here, 16 MiB float32 over 2 ranks, medians of 7: ``all_reduce`` 16 ms,
        ``reduce_scatter_single`` 38 ms, the list form that takes unequal chunks 27 ms). So over Gloo
        this is the backend's ``all_reduce`` in place: the same bytes and sums, without the copy. Other
        backends (NCCL) run ``dist.reduce_scatter`` with the chunks as its input list.
        """
        if self.backend == "gloo":
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
            self._wait_backend(work, "reduce_scatter (all_reduce)", timeout_s)
            return
        start, stop = chunks[self.rank]
        output = torch.empty_like(tensor[start:stop])
        work = dist.reduce_scatter(output, [tensor[a:b] for a, b in chunks], group=self.group, async_op=True)
        self._wait_backend(work, "reduce_scatter", timeout_s)
        tensor[start:stop] = output

    def backend_all_gather(self, tensor: torch.Tensor, chunks: list[tuple[int, int]], timeout_s: float) -> None:
        """Fill every chunk of ``tensor`` (``(numel,)``, contiguous) from the rank that owns it
        (``chunks[r]``: rank r's ``(start, stop)``; its own chunk is valid), with the backend's all_gather.

        The backend gathers equal parts (Gloo refuses a list of unequal ones), so chunks of unequal
        sizes (``torch.tensor_split``'s differ by one) travel padded to the largest and are compacted
        after; equal adjacent chunks are gathered straight into ``tensor``.
        """
        part = max(b - a for a, b in chunks)
        start, stop = chunks[self.rank]
        equal = all(b - a == part and a == index * part for index, (a, b) in enumerate(chunks))
        output = tensor[:part * self.world_size] if equal else tensor.new_empty(part * self.world_size)
        mine = tensor.new_zeros(part)
        mine[:stop - start] = tensor[start:stop]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(output, mine, group=self.group, async_op=True)
        self._wait_backend(work, "all_gather", timeout_s)
        if not equal:
            for index, (a, b) in enumerate(chunks):
                tensor[a:b] = output[index * part:index * part + b - a]

    @property
    def can_make_subgroups(self) -> bool:
        """Whether :meth:`backend_subgroups` works: this group holds every rank of the default group
        (``dist.new_group`` must be called by all of those)."""
        return dist.get_world_size(self.group) == dist.get_world_size()

    def backend_subgroups(self, member_lists: list[list[int]], timeout_s: float) -> list["TorchP2PTransport | None"]:
        """Make one backend group per list of ``member_lists`` (ranks of this group), in list order.

        Collective over the default group: every rank calls it with equal lists. Subgroup rank i
        is ``members[i]`` (``sort_ranks=False``).

        Returns:
            Per list, a transport over its subgroup where this rank is a member, else None.

        Raises:
            ValueError: :attr:`can_make_subgroups` is false; PeerFailure: the creation failed or timed out.
        """
        if not self.can_make_subgroups:
            raise ValueError("backend subgroups need a group that holds every rank of the default group")
        made = []
        for members in member_lists:
            ranks = [rank if self.group is None else dist.get_global_rank(self.group, rank) for rank in members]
            try:
                group = dist.new_group(ranks, timeout=_timedelta(timeout_s), sort_ranks=False)
            except RuntimeError as exc:
                reason, timed_out = _classify(exc)
                raise PeerFailure(-1, f"backend new_group {reason}", timed_out) from exc
            made.append(TorchP2PTransport(group) if self.rank in members else None)
        return made

    def _wait_backend(self, work, what: str, timeout_s: float) -> None:
        try:
            work.wait(timeout=_timedelta(timeout_s))
        except RuntimeError as exc:
            reason, timed_out = _classify(exc)
            # The backend does not say which peer was late; -1 means "unknown".
            raise PeerFailure(_guess_peer(exc), f"backend {what} {reason}", timed_out) from exc


def _guess_peer(exc: Exception) -> int:
    """Return the peer rank Gloo names in ``exc`` ("rank 3"), else -1."""
    match = re.search(r"rank[ :=]+(\d+)", str(exc))
    return int(match.group(1)) if match else -1
