"""What this process holds in memory, read from the kernel: a snapshot, the memory available, the measured peak.

``gradsync train`` takes a :func:`snapshot` at worker start, after the data
is loaded and before the model is built (the *baseline*), and at the end
measures the peak one rank reached above it (:func:`measured_peak`):

* in a memory cgroup of its own (``--memory-limit-mib``: the rank is the
  only process in it), the cgroup's maximum usage (v1
  ``memory.max_usage_in_bytes``, v2 ``memory.peak``) less its usage at the
  baseline: what the kernel charged the rank, and what its limit is held to;
* otherwise the process's peak resident set (``VmHWM``, the counter
  ``getrusage``'s ``ru_maxrss`` reads, kept across the preflight's resets:
  :mod:`gradsync.hosts.resident`) less its resident set at the baseline, less the pages of
  shared-memory segments it maps beyond its own share: a page of the shm
  arena that every rank of the host maps and reads is resident in each of
  them (``RssShmem``), but exists once; the rank keeps its proportional
  share (``Pss_Shmem`` of ``/proc/self/smaps_rollup``), as the cgroup charges
  a shared page once. The segments live until the group closes, so their
  excess at the end is their excess at the peak.

The file-backed pages the rank maps (torch's libraries, whose code is paged
in as kernels first run) are in the resident set but cost no memory of the
rank's own (the page cache holds them once for every process, and the
kernel drops them under pressure); their growth since the baseline is
reported beside the peak and not counted in it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gradsync.hosts import memory_cgroup
from gradsync.hosts.resident import ROLLUP, STATUS, kib_fields, peak_resident_bytes
from gradsync.parallel.preflight_fit import host_available_bytes


@dataclass(frozen=True)
class Snapshot:
    """One reading of this process's memory, in bytes.

    ``rss``: resident set (``VmRSS``); ``file``: its file-backed pages (``RssFile``); ``shmem``: its
    shared-memory pages (``RssShmem``); ``shmem_share``: the proportional share of them (``Pss_Shmem``);
    ``cgroup_usage``: its memory cgroup's usage when it is alone in that cgroup, else None.
    """

    rss: int
    file: int
    shmem: int
    shmem_share: int
    cgroup_usage: int | None

    @property
    def shared_excess(self) -> int:
        """Bytes of shared-memory pages resident here beyond this process's share of them."""
        return max(self.shmem - self.shmem_share, 0)


def alone_in_cgroup() -> bool:
    """Whether this process is the only one in its memory cgroup (a rank of ``--memory-limit-mib``)."""
    ctl = memory_cgroup.controller()
    if ctl is None:
        return False
    try:
        with open(os.path.join(ctl.directory, "cgroup.procs"), encoding="ascii") as file:
            procs = {int(line) for line in file if line.strip()}
    except (OSError, ValueError):
        return False
    return procs == {os.getpid()}


def snapshot() -> Snapshot:
    """This process's memory now (zeros where /proc does not say)."""
    status, rollup = kib_fields(STATUS), kib_fields(ROLLUP)
    usage = memory_cgroup.own_usage_bytes() if alone_in_cgroup() else None
    return Snapshot(rss=status.get("VmRSS", 0), file=status.get("RssFile", 0), shmem=status.get("RssShmem", 0),
                    shmem_share=rollup.get("Pss_Shmem", status.get("RssShmem", 0)), cgroup_usage=usage)


@dataclass(frozen=True)
class MeasuredPeak:
    """The most one rank held above its baseline, in bytes, and how it was measured.

    ``source``: ``"cgroup"`` (its own cgroup's maximum usage) or ``"rss"`` (peak resident set less the
    shared pages beyond its share); ``file_growth``: file-backed pages mapped since the baseline (in the
    resident set, not in ``bytes``).
    """

    bytes: int
    source: str
    file_growth: int


def measured_peak(before: Snapshot) -> MeasuredPeak:
    """The peak this process reached above ``before`` (see the module's docstring)."""
    now = snapshot()
    file_growth = max(now.file - before.file, 0)
    if before.cgroup_usage is not None and now.cgroup_usage is not None:
        peak = memory_cgroup.own_peak_bytes()
        if peak is not None:
            return MeasuredPeak(max(peak - before.cgroup_usage, 0), "cgroup", file_growth)
    shared = now.shared_excess - before.shared_excess
    return MeasuredPeak(max(peak_resident_bytes() - before.rss - shared - file_growth, 0), "rss", file_growth)


def own_growth(before: Snapshot, now: Snapshot) -> int:
    """Bytes this process's own pages grew from ``before`` to ``now``: its resident set, less the shared-memory
    pages beyond its share and the file-backed pages (see the module's docstring)."""
    shared = now.shared_excess - before.shared_excess
    return now.rss - before.rss - shared - max(now.file - before.file, 0)


def copied_bytes(before: Snapshot) -> int:
    """Bytes the kernel charged this process's own memory cgroup since ``before`` beyond its own growth;
    0 when it is not alone in a cgroup.

    A rank forked from gradsync's forkserver shares torch's imported modules with it (~230 MiB of
    anonymous pages, in its resident set from the start and charged to the forkserver's cgroup). Each
    page the rank writes (a reference count, a garbage collection) is copied, and the copy is charged
    to the rank's cgroup while its resident set does not grow: ~80 MiB once a gpt has run a forward,
    backward and step. Measured after the preflight's passes, which run that code, it joins the estimate
    (``MemoryEstimate.copied_bytes``), since the cgroup's limit holds it.
    """
    now = snapshot()
    if before.cgroup_usage is None or now.cgroup_usage is None:
        return 0
    return max(now.cgroup_usage - before.cgroup_usage - own_growth(before, now), 0)


def available_bytes(before: Snapshot, local_ranks: int) -> int | None:
    """The memory one rank may still use above ``before``, in bytes; None when nothing says.

    Alone in its cgroup (``--memory-limit-mib``): the cgroup's limit less its usage at ``before``.
    Otherwise the smaller of the cgroup's limit less its usage now and the host's ``MemAvailable``,
    shared evenly by the ``local_ranks`` ranks of this host, plus what this rank took since ``before``
    (which the estimate counts again).
    """
    limit = memory_cgroup.own_limit_bytes()
    if before.cgroup_usage is not None and limit is not None:
        return max(limit - before.cgroup_usage, 0)
    candidates = []
    usage = memory_cgroup.own_usage_bytes()
    if limit is not None and usage is not None:
        candidates.append(limit - usage)
    host = host_available_bytes()
    if host is not None:
        candidates.append(host)
    if not candidates:
        return None
    taken = max(snapshot().rss - before.rss, 0)
    return max(min(candidates), 0) // max(local_ranks, 1) + taken
