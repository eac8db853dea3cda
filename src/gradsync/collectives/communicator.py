"""A group of ranks that collectives run on: a transport, a default timeout, scratch space."""

from __future__ import annotations

import math

from gradsync.collectives.call import CollectiveCall, Workspace
from gradsync.collectives.hierarchical import INTER_NODE_ALGORITHMS, INTRA_NODE_ALGORITHMS
from gradsync.collectives.shm import ShmState
from gradsync.transport.base import Transport, TransportStats

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_SEGMENT_BYTES = 4 * 2**20  # measured: 256 KiB halves ring busbw here, 4 MiB reaches native


def check_timeout(timeout_s: float) -> None:
    if not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout_s}")


class Communicator:
    """What a collective needs to know about its group.

    Args:
        transport: point-to-point messaging for this rank
            (:class:`~gradsync.transport.torch_p2p.TorchP2PTransport` in real
            runs, :class:`~gradsync.transport.thread.ThreadTransport` in tests).
        timeout_s: default seconds a collective call may take.
        segment_bytes: pipelining unit of ring and tree (bytes, > 0; equal on every rank).
        ranks_per_node: ranks per node for ``hierarchical`` (None: all ranks on one
            node; a smaller value lets one machine pretend to be several nodes).
            Ranks ``[k*ranks_per_node, (k+1)*ranks_per_node)`` form node k.
        intra_node_algorithm: what ``hierarchical`` runs inside a node: "ring"
            (reduce-scatter and all-gather over the transport) or "shm" (shared memory;
            the ranks of a node must share a machine).
        hang_detector: a :class:`~gradsync.fault.hang.HangDetector`; on a
            timeout, errors then name the rank that never reached the call
            (None: the peer this rank waited for).
        inter_node_algorithm: what ``hierarchical`` runs across nodes: "ring",
            "tree" or "halving_doubling".

    Raises:
        ValueError: ``timeout_s`` or ``segment_bytes`` is not positive, or
        ``ranks_per_node`` does not divide the world size, or
        ``inter_node_algorithm`` is unknown.
    """

    def __init__(self, transport: Transport, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, ranks_per_node: int | None = None,
                 inter_node_algorithm: str = "ring", intra_node_algorithm: str = "ring", hang_detector=None):
        check_timeout(timeout_s)
        if not segment_bytes > 0:
            raise ValueError(f"segment_bytes must be > 0, got {segment_bytes}")
        world_size = transport.world_size
        if ranks_per_node is not None and (ranks_per_node < 1 or world_size % ranks_per_node):
            raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 and divide the "
                             f"world size {world_size}")
        if inter_node_algorithm not in INTER_NODE_ALGORITHMS:
            raise ValueError(f"unknown inter_node_algorithm {inter_node_algorithm!r}; choose one of "
                             f"{', '.join(INTER_NODE_ALGORITHMS)}")
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.inter_node_algorithm = inter_node_algorithm
        if intra_node_algorithm not in INTRA_NODE_ALGORITHMS:
            raise ValueError(f"unknown intra_node_algorithm {intra_node_algorithm!r}; choose one of "
                             f"{', '.join(INTRA_NODE_ALGORITHMS)}")
        self.intra_node_algorithm = intra_node_algorithm
        self.node_shm_states: dict[tuple[int, ...], ShmState] = {}  # hierarchical's per-node segments
        self.segment_bytes = int(segment_bytes)
        self.ranks_per_node = ranks_per_node or world_size
        self.workspace = Workspace()
        self.shm_state = ShmState()
        self.hang_detector = hang_detector

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def stats(self) -> TransportStats:
        return self.transport.stats

    def new_call(self, op_name: str, algorithm: str, timeout_s: float | None = None) -> CollectiveCall:
        """Start a call bounded by ``timeout_s`` (the communicator's default when None)."""
        if timeout_s is None:
            timeout_s = self.timeout_s
        else:
            check_timeout(timeout_s)
        return CollectiveCall(self.transport, op_name, algorithm, float(timeout_s), self.workspace,
                              segment_bytes=self.segment_bytes, ranks_per_node=self.ranks_per_node,
                              inter_node_algorithm=self.inter_node_algorithm, shm_state=self.shm_state,
                              intra_node_algorithm=self.intra_node_algorithm,
                              node_shm_states=self.node_shm_states, hang_detector=self.hang_detector)

    def close(self) -> None:
        """Release the shared-memory segment, if any (its name is already gone from /dev/shm)."""
        self.shm_state.close()
        for state in self.node_shm_states.values():
            state.close()
