"""``algorithm="auto"``: pick an AllReduce algorithm from message size and world size.

The thresholds come from ``gradsync bench allreduce`` on a 2-core machine
with Gloo over loopback (see README, "Choosing an algorithm"): below
``SMALL_MESSAGE_BYTES`` latency dominates and recursive doubling's log2(p)
exchanges win; above it the pipelined ring's bandwidth wins. When ranks span
several nodes (``ranks_per_node`` < world size) large messages go
hierarchical so that only 1/L of the data crosses between nodes.

>>> choose(4096, world_size=4, ranks_per_node=4)
'halving_doubling'
>>> choose(64 * 2**20, world_size=4, ranks_per_node=4)
'ring'
>>> choose(64 * 2**20, world_size=8, ranks_per_node=4)
'hierarchical'
"""

from __future__ import annotations

SMALL_MESSAGE_BYTES = 256 * 2**10


def choose(nbytes: int, world_size: int, ranks_per_node: int) -> str:
    """Return the algorithm name for an AllReduce of ``nbytes`` bytes over ``world_size`` ranks."""
    if world_size <= 2 or nbytes <= SMALL_MESSAGE_BYTES:
        return "halving_doubling" if world_size > 2 else "ring"
    if 1 < ranks_per_node < world_size:
        return "hierarchical"
    return "ring"
