"""``algorithm="auto"``: pick an AllReduce algorithm from message size and world size.

Thresholds measured with ``gradsync bench allreduce`` on a 2-core machine,
Gloo over loopback, one thread per rank (tables in the README):

* 2 ranks, up to ``PAIR_SMALL_MESSAGE_BYTES`` (1 MiB): ``halving_doubling``,
  whose short path is a single exchange of the whole vector (1.3-2.3x the
  native call at 64 KiB-1 MiB); above it the ring.
* 3 or more ranks, up to ``SMALL_MESSAGE_BYTES`` (4 MiB): ``tree``, whose
  2·log2(p) hops beat the ring's 2(p-1) wake-ups (1.4-2x native, 3x ring at
  ws=4); above it the pipelined ring, which matches native from 16 MiB.
* ranks spread over several nodes (``ranks_per_node`` < world size) and a
  large message: ``hierarchical``, so that only 1/L of the data crosses the
  slower links between nodes. (On one machine with pretend nodes it is no
  faster than the ring; the rule is for real clusters.)
* all ranks on one node (``ranks_per_node`` = world size) and shared memory
  not known to be unavailable: ``shm``, whose copies through one segment beat
  every loopback-TCP path at every size (README tables). If the ranks turn
  out to be on several hosts, ``shm_available`` becomes False and the rules
  above apply.

``ranks_per_node`` and ``shm_available`` come from the group's locality,
learnt from host identities every rank exchanged
(:mod:`gradsync.transport.locality`; an explicit
``HierarchicalOptions(ranks_per_node=...)`` wins), so every rank makes the
same choice; the choice, not "auto", goes into the layout check, so ranks
that still chose differently all raise CollectiveMismatchError.

>>> choose(4096, world_size=2, ranks_per_node=2)
'shm'
>>> choose(4096, world_size=2, ranks_per_node=2, shm_available=False)
'halving_doubling'
>>> choose(4096, world_size=4, ranks_per_node=4, shm_available=False)
'tree'
>>> choose(64 * 2**20, world_size=4, ranks_per_node=4, shm_available=False)
'ring'
>>> choose(64 * 2**20, world_size=8, ranks_per_node=4)
'hierarchical'
"""

from __future__ import annotations

PAIR_SMALL_MESSAGE_BYTES = 2**20
SMALL_MESSAGE_BYTES = 4 * 2**20


def choose(nbytes: int, world_size: int, ranks_per_node: int, shm_available: bool | None = None) -> str:
    """Return the algorithm name for an AllReduce of ``nbytes`` bytes over ``world_size`` ranks.

    ``shm_available``: None (not known yet), True or False (the group's ranks
    are, or are not, all on one machine).
    """
    if world_size == 1:
        return "ring"
    if ranks_per_node >= world_size and shm_available is not False:
        return "shm"
    if world_size == 2:
        return "halving_doubling" if nbytes <= PAIR_SMALL_MESSAGE_BYTES else "ring"
    if nbytes <= SMALL_MESSAGE_BYTES:
        return "tree"
    if 1 < ranks_per_node < world_size:
        return "hierarchical"
    return "ring"
