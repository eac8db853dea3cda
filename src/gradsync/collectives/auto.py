"""``algorithm="auto"``: the algorithm the cost model predicts fastest for this message and group.

For every algorithm the group can run, :func:`gradsync.collectives.cost.formulas.predict_s`
predicts the call's time on the profile in use and the group's real topology
(hosts x ranks per host, from its locality); the fastest wins. The formulas
are the closed forms of the event simulation that runs the algorithms' own
code (:mod:`gradsync.sim`, see docs/simulator.md), priced with a profile measured by
``gradsync calibrate``. This replaced a table of thresholds
measured by hand on one machine.

The profile in use: the file or name in ``GRADSYNC_PROFILE``, else the
calibrated profile shipped for this machine class (``this-machine`` for a
group on one host, ``test-hosts`` for a group across hosts: the emulated
hosts of ``--hosts``; calibrate your own cluster and set ``GRADSYNC_PROFILE``).
Every rank must decide from the same numbers: the profile's digest is folded
into the layout check's options fingerprint of every ``auto`` call
(:mod:`~gradsync.collectives.validate`), so ranks with different profiles
raise CollectiveMismatchError instead of running different algorithms.

Candidates: ``shm`` when every rank shares one host and shared memory is not
known to be unavailable; ``ring``, ``tree``, ``double_binary_tree``, ``halving_doubling``; and
``hierarchical`` when the group spans hosts (or pretend nodes:
``HierarchicalOptions.ranks_per_node``, priced as nodes joined by the
intra-host link, each rank on its own port). The segment size is the group's
(``SegmentOptions``), not chosen per call. A reduce-scatter or an all-gather
is priced with its own formulas (one phase of each algorithm's AllReduce)
among the same candidates but the trees (``tree``, ``double_binary_tree``), which have neither.

>>> from gradsync.collectives.cost.profile import Link, Profile
>>> slow_start = Profile("example", "", Link(1e-3, 1e9), None, 1e-10, 1e-10, ranks_per_host=8)
>>> choose(4096, 8, 8, shm_available=False, profile=slow_start)  # latency-bound: 3 exchanges, not 14 ring hops
'halving_doubling'
>>> choose(2**30, 8, 8, shm_available=False, profile=slow_start)  # bandwidth-bound: the ring
'ring'
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence

from gradsync.collectives.cost import formulas
from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.cost.profiles import get_profile
from gradsync.collectives.cost.topology import Topology

PROFILE_ENV = "GRADSYNC_PROFILE"
FLAT = ("ring", "tree", "double_binary_tree", "halving_doubling")


def profile_in_use(several_hosts: bool) -> Profile:
    """The profile ``auto`` decides with (see the module docstring).

    Raises:
        ValueError: ``GRADSYNC_PROFILE`` names no profile.
    """
    return _profile(os.environ.get(PROFILE_ENV) or ("test-hosts" if several_hosts else "this-machine"))


def profile_digest(several_hosts: bool) -> str:
    """The digest of :func:`profile_in_use` (what the layout check of an ``auto`` call compares)."""
    return _digest(os.environ.get(PROFILE_ENV) or ("test-hosts" if several_hosts else "this-machine"))


def profiles_fingerprint() -> str:
    """Which numbers this process's ``auto`` decides with, on one host and across hosts (for settings
    that ranks compare once, such as DataParallel's)."""
    return f"{profile_digest(False)}/{profile_digest(True)}"


@functools.lru_cache(maxsize=8)
def _digest(name: str) -> str:
    return _profile(name).digest()


@functools.lru_cache(maxsize=8)
def _profile(name: str) -> Profile:
    try:
        return get_profile(name)
    except (ValueError, OSError) as error:
        raise ValueError(f"{PROFILE_ENV}={name!r}: {error}") from error


def choose(nbytes: int, world_size: int, ranks_per_node: int, shm_available: bool | None = None,
           host_sizes: Sequence[int] | None = None, profile: Profile | None = None,
           collective: str = "all_reduce") -> str:
    """Return the algorithm the model predicts fastest for a ``collective`` of ``nbytes`` bytes.

    Args:
        nbytes: message bytes (the whole flat buffer: a reduce-scatter's input, an all-gather's output).
        world_size: ranks in the group.
        ranks_per_node: ranks per node when nodes are equal blocks (pretend or real), else 1.
        shm_available: None (not known yet), True or False (the group's ranks
            are, or are not, all on one machine).
        host_sizes: ranks on each real host (the group's locality), None: not known or
            pretend nodes given explicitly.
        profile: the hardware numbers (None: :func:`profile_in_use`).
        collective: "all_reduce", "reduce_scatter" or "all_gather".

    Raises:
        ValueError: the profile has no link between hosts and the group spans hosts.
    """
    if world_size == 1:
        return "ring"
    several = host_sizes is not None and len(host_sizes) > 1
    profile = profile or profile_in_use(several)
    if several:
        sizes = tuple(host_sizes)
    elif 1 < ranks_per_node < world_size:  # pretend nodes on one machine
        sizes = (ranks_per_node,) * (world_size // ranks_per_node)
        profile = dataclasses.replace(profile, inter=profile.intra, nics_per_host=ranks_per_node)
    else:
        sizes = (world_size,)
    shm = not several and ranks_per_node >= world_size and shm_available is not False and profile.shm is not None
    return _fastest(nbytes, sizes, shm, profile, collective)


def _flat(collective: str) -> tuple[str, ...]:
    return FLAT if collective == "all_reduce" else tuple(name for name in FLAT if not name.endswith("tree"))


@functools.lru_cache(maxsize=4096)
def _fastest(nbytes: int, host_sizes: tuple[int, ...], shm: bool, profile: Profile,
             collective: str = "all_reduce") -> str:
    candidates = _flat(collective) + (("hierarchical",) if len(host_sizes) > 1 else ()) + (("shm",) if shm else ())
    topology = Topology(host_sizes)
    nbytes = nbytes - nbytes % 4
    times = {name: formulas.predict_s(name, profile, topology, nbytes, collective=collective) for name in candidates}
    return min(candidates, key=times.__getitem__)


def predicted_times(nbytes: int, world_size: int, host_sizes: Sequence[int] | None = None,
                    profile: Profile | None = None, collective: str = "all_reduce") -> dict[str, float]:
    """Every candidate's predicted seconds (what :func:`choose` compares), for reports and tests."""
    sizes = tuple(host_sizes) if host_sizes else (world_size,)
    profile = profile or profile_in_use(len(sizes) > 1)
    names = _flat(collective) + (("hierarchical",) if len(sizes) > 1 else ("shm",) if profile.shm is not None else ())
    return {name: formulas.predict_s(name, profile, Topology(sizes), nbytes - nbytes % 4, collective=collective)
            for name in names}
