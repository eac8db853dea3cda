"""A group of ranks that collectives run on: a transport, a default timeout, scratch space, options.

The communicator sits below the algorithms, as Gloo's context does: it holds
each algorithm's options object (:mod:`~gradsync.collectives.options`) by
type without importing any algorithm, and hands them to every call.

>>> from gradsync.collectives.chunking import SegmentOptions
>>> from gradsync.collectives.hierarchical import HierarchicalOptions
>>> from gradsync.transport.thread import ThreadWorld
>>> comm = Communicator(ThreadWorld(4).transport(0), 60.0, options=[
...     SegmentOptions(segment_bytes=4096), HierarchicalOptions(ranks_per_node=2, inter_node_algorithm="tree")])
>>> comm.options(HierarchicalOptions).inter_node_algorithm
'tree'
>>> comm.new_call("all_reduce", "ring").sub([0, 2], "tree").options(SegmentOptions).segment_bytes
4096
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from gradsync.collectives.call import TAG_BASE, TAG_KINDS, TAG_ORDINALS, CollectiveCall, Workspace
from gradsync.collectives.lane import Lane
from gradsync.collectives.options import AlgorithmOptions, OptionStore, T
from gradsync.debug.flight import FlightRecorder
from gradsync.errors import GroupClosedError
from gradsync.transport.base import Transport, TransportStats
from gradsync.transport.locality import IDENTITY_WORDS, Locality, derive, host_identity

DEFAULT_TIMEOUT_S = 300.0


_TAG_KIND = {"all_reduce": 1, "broadcast": 2, "all_gather": 3, "reduce_scatter": 4, "all_to_all": 5,
             "shared_buffer": 6}

def check_timeout(timeout_s: float) -> None:
    """Raise TypeError unless ``timeout_s`` is a real number, ValueError unless it is finite and > 0."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout_s).__name__} {timeout_s!r}")
    if not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout_s}")


class Communicator:
    """What a collective needs to know about its group.

    Args:
        transport: point-to-point messaging for this rank
            (:class:`~gradsync.transport.torch_p2p.TorchP2PTransport` in real
            runs, :class:`~gradsync.transport.thread.ThreadTransport` in tests).
        timeout_s: default seconds a collective call may take.
        options: per-algorithm settings, at most one of each class, equal on
            every rank: ``SegmentOptions`` (ring and tree), ``HierarchicalOptions``
            (node layout, inner algorithms), ... An algorithm whose class is
            not given uses its defaults.
        hang_detector: a :class:`~gradsync.fault.hang.HangDetector`; on a
            timeout, errors then name the rank that never reached the call
            (None: the peer this rank waited for).

    Locality (which ranks share a host, :attr:`locality`) decides "auto",
    "hierarchical"'s nodes and whether "shm" can work. A transport that knows
    it (``ThreadTransport``: one host) gives it at once; otherwise the ranks
    exchange host identities (:mod:`gradsync.transport.locality`):
    ``gradsync.init`` and ``resolve_group`` call :meth:`learn_locality` when
    they make the group, a hand-built communicator does it in its first
    collective call (every rank's first call, so every rank takes part).

    Every call started is kept in :attr:`flight`, the group's
    :class:`~gradsync.debug.flight.FlightRecorder` on this rank (its last
    ``GRADSYNC_FLIGHT_ENTRIES`` calls), written out when a collective times
    out or the ranks disagree.

    Raises:
        ValueError: ``timeout_s`` is not positive, an option does not fit the
        world size (e.g. ``ranks_per_node`` does not divide it), two options
        of one class, or a bad ``GRADSYNC_FLIGHT_ENTRIES``. TypeError: an
        option is not an ``AlgorithmOptions``.
    """

    def __init__(self, transport: Transport, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 options: Iterable[AlgorithmOptions] = (), hang_detector=None):
        check_timeout(timeout_s)
        self._options = OptionStore(options)
        self._options.check(transport.world_size)
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.workspace = Workspace()
        self.hang_detector = hang_detector
        self.calls_started = 0  # every rank starts its calls in the same order: their ordinal is a tag
        self.flight = FlightRecorder(transport.rank, transport.world_size)
        self.lane = Lane()  # the communication thread that keeps collectives in issue order
        self.plans: dict = {}  # checked layouts -> their plans (collectives.plans)
        self.decisions: dict = {}  # auto's picks by message (collectives.validate.resolve_algorithm)
        self.closed = False
        self.locality: Locality | None = getattr(transport, "locality", None)
        if self.locality is None and transport.world_size == 1:
            self.locality = Locality.single_host(1)

    def learn_locality(self, call: CollectiveCall | None = None) -> Locality:
        """Which ranks share a host, from identities every rank exchanges (once; collective then).

        ``call``: the call to exchange them in (its deadline and error names; None: a call of its own).
        """
        if self.locality is None:
            call = call or self.new_call("host identity exchange", "direct")
            rows = torch.zeros(self.world_size, IDENTITY_WORDS, dtype=torch.int64)
            rows[self.rank] = torch.tensor(host_identity(), dtype=torch.int64)
            call.exchange_with_every_peer(rows, "host identity exchange")
            self.locality = derive(rows.tolist())
        if call is not None:
            call.locality = self.locality
        return self.locality

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def stats(self) -> TransportStats:
        return self.transport.stats

    def options(self, kind: type[T]) -> T:
        """This group's ``kind`` options; a default one is made on first use and kept."""
        return self._options.get(kind)

    def new_call(self, op_name: str, algorithm: str, timeout_s: float | None = None) -> CollectiveCall:
        """Start a call bounded by ``timeout_s`` (the communicator's default when None), kept in :attr:`flight`.

        Its record ends done or failed when the public collective that started it returns or raises
        (:mod:`~gradsync.collectives.recording`).

        Raises:
            GroupClosedError: the communicator was closed (``gradsync.shutdown()``).
        """
        if self.closed:
            raise GroupClosedError(f"{op_name} on rank {self.rank}: this group was shut down; "
                                   f"use the group made by the next gradsync.init()")
        if timeout_s is None:
            timeout_s = self.timeout_s
        else:
            check_timeout(timeout_s)
        self.calls_started += 1
        call = CollectiveCall(self.transport, op_name, algorithm, float(timeout_s), self.workspace,
                              options=self._options, hang_detector=self.hang_detector, locality=self.locality,
                              tags=self._tags(op_name), ordinal=self.calls_started)
        self.flight.enter(call)
        return call

    def _tags(self, op_name: str) -> tuple[int, int] | None:
        """(payload, control) tags of the next call, on transports that match messages by tag.

        Each call's messages carry its ordinal, and its payload also the kind of
        collective, so a rank one call ahead, or in another collective (one extra
        buffer broadcast against the peers' bucket AllReduce), never pairs its
        messages with the peers': it times out, where a message of another size
        would abort the process in Gloo and one of the same size would be summed in.
        :meth:`CollectiveCall.refine_tag` adds the call's algorithm and layout once resolved.
        Layout checks use the control tag, so that ranks in different collectives
        still compare descriptors and raise CollectiveMismatchError.
        """
        if not getattr(self.transport, "call_tags", False):
            return None
        base = TAG_BASE + (self.calls_started % TAG_ORDINALS) * TAG_KINDS
        return base + _TAG_KIND.get(op_name, TAG_KINDS - 1), base

    def close(self) -> None:
        """Release what the options hold (shared-memory segments; their names are already gone) and
        the communication thread; later calls raise GroupClosedError."""
        self.closed = True
        self.plans.clear()
        self.decisions.clear()
        self.lane.close()
        self._options.close()
