"""``algorithm="auto"``: pick an AllReduce algorithm from message size, world size and hosts.

Thresholds measured with ``gradsync bench allreduce`` on a 2-core machine,
Gloo over loopback, one thread per rank (tables in the README):

* 2 ranks, up to ``PAIR_SMALL_MESSAGE_BYTES`` (1 MiB): ``halving_doubling``,
  whose short path is a single exchange of the whole vector (1.3-2.3x the
  native call at 64 KiB-1 MiB); above it the ring.
* 3 or more ranks, up to ``SMALL_MESSAGE_BYTES`` (4 MiB): ``tree``, whose
  2·log2(p) hops beat the ring's 2(p-1) wake-ups (1.4-2x native, 3x ring at
  ws=4); above it the pipelined ring, which matches native from 16 MiB.
* ranks on several real hosts (``host_sizes`` has more than one entry), some
  host holding more than one rank, and at least ``HIERARCHICAL_MIN_BYTES``:
  ``hierarchical`` (equal hosts or not), so that each host sends
  2(H-1)/H · n over its link instead of a flat ring's 2(p-1)/p · n (n against
  1.5·n at 2 hosts x 2 ranks); with halving_doubling across 2 hosts it
  also has the fewest latency steps, so the threshold (measured on 2 x 2
  test hosts) is small; below it the flat rules above.
* ranks on several hosts, one rank each, 3 or more ranks, at least
  ``CROSS_HOST_RING_MIN_BYTES``: ``ring``, whose 2(p-1)/p · n per link is the
  least any flat algorithm sends (``tree`` sends 2·n over some links: half the
  ring's speed at 1-4 MiB on 4 x 1 test hosts at 1 Gbit/s).
* pretend nodes (``ranks_per_node`` < world size, no ``host_sizes``) and a
  message above ``SMALL_MESSAGE_BYTES``: ``hierarchical`` too. (On one machine
  it is no faster than the ring; the rule keeps pretend nodes exercised.)
* all ranks on one node (``ranks_per_node`` = world size) and shared memory
  not known to be unavailable: ``shm``, whose copies through one segment beat
  every loopback-TCP path at every size (README tables). Never across hosts:
  there ``shm_available`` is False.

``ranks_per_node``, ``host_sizes`` and ``shm_available`` come from the
group's locality, learnt from host identities every rank exchanged
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
>>> choose(2**20, world_size=3, ranks_per_node=1, shm_available=False, host_sizes=(2, 1))
'hierarchical'
>>> choose(1024, world_size=3, ranks_per_node=1, shm_available=False, host_sizes=(2, 1))
'tree'
>>> choose(2**20, world_size=2, ranks_per_node=1, shm_available=False, host_sizes=(1, 1))
'halving_doubling'
>>> choose(2**20, world_size=4, ranks_per_node=1, shm_available=False, host_sizes=(1, 1, 1, 1))
'ring'
"""

from __future__ import annotations

from typing import Sequence

PAIR_SMALL_MESSAGE_BYTES = 2**20
SMALL_MESSAGE_BYTES = 4 * 2**20
# Across real hosts (test hosts, 1 Gbit/s links, one core per host; `gradsync bench allreduce --hosts 2
# --nproc 2 --inter-host-gbit 1`, docs/benchmarks.md). 2 x 2: hierarchical (halving_doubling across) took
# 3.7 ms at 4 KiB, 3.9 at 64 KiB, 6.6 at 512 KiB, against tree's 4.0, 4.8 and 13.9; from 1 MiB it leads by
# the bytes it keeps off the links. 4 x 1 (no host of two): tree 4.2 ms at 64 KiB, ring 8.6; at 512 KiB
# ring 13.3, tree 16.3, and from 1 MiB tree is half the ring's speed (it sends 2n over some links).
HIERARCHICAL_MIN_BYTES = 4 * 2**10
CROSS_HOST_RING_MIN_BYTES = 512 * 2**10


def choose(nbytes: int, world_size: int, ranks_per_node: int, shm_available: bool | None = None,
           host_sizes: Sequence[int] | None = None) -> str:
    """Return the algorithm name for an AllReduce of ``nbytes`` bytes over ``world_size`` ranks.

    Args:
        nbytes: message bytes (after any upcast).
        world_size: ranks in the group.
        ranks_per_node: ranks per node when nodes are equal blocks (pretend or real), else 1.
        shm_available: None (not known yet), True or False (the group's ranks
            are, or are not, all on one machine).
        host_sizes: ranks on each real host (the group's locality), None: not known or
            pretend nodes given explicitly.
    """
    if world_size == 1:
        return "ring"
    if ranks_per_node >= world_size and shm_available is not False:
        return "shm"
    if host_sizes is not None and len(host_sizes) > 1:
        if max(host_sizes) > 1 and nbytes >= HIERARCHICAL_MIN_BYTES:
            return "hierarchical"
        if max(host_sizes) == 1 and world_size > 2 and nbytes >= CROSS_HOST_RING_MIN_BYTES:
            return "ring"  # one rank per host: the links, not the hops, bound; the ring sends least across
    if world_size == 2:
        return "halving_doubling" if nbytes <= PAIR_SMALL_MESSAGE_BYTES else "ring"
    if nbytes <= SMALL_MESSAGE_BYTES:
        return "tree"
    if 1 < ranks_per_node < world_size:
        return "hierarchical"
    return "ring"
