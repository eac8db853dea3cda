"""This process's memory cgroup (v1 or v2): its limit, usage and peak; per-rank child cgroups with a limit.

The reading half answers "how much memory may this process use, and how much
has it used": :func:`controller` finds the memory cgroup of this process from
``/proc/self/cgroup`` and the mounts in ``/proc/self/mountinfo`` (cgroup v1's
``memory`` hierarchy, or the cgroup2 unified hierarchy when its
``cgroup.controllers`` lists ``memory``); :func:`own_limit_bytes`,
:func:`own_usage_bytes` and :func:`own_peak_bytes` read its files. The
creating half (:class:`~gradsync.hosts.memory_children.ChildCgroups`) makes
one child per rank below the run's own cgroup.

Kernel documentation: ``Documentation/admin-guide/cgroup-v1/memory.rst`` and
``Documentation/admin-guide/cgroup-v2.rst`` (``memory.max``, ``memory.peak``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

UNLIMITED_FROM = 2**62  # v1 writes "no limit" as PAGE_COUNTER_MAX * page size (~2**63); anything above is none
PROC_CGROUP = "/proc/self/cgroup"
PROC_MOUNTINFO = "/proc/self/mountinfo"

# file names per version: limit, usage, peak, swap limit (v1: memory+swap together; v2: swap alone)
_FILES = {
    1: {"limit": "memory.limit_in_bytes", "usage": "memory.usage_in_bytes", "peak": "memory.max_usage_in_bytes",
        "swap": "memory.memsw.limit_in_bytes"},
    2: {"limit": "memory.max", "usage": "memory.current", "peak": "memory.peak", "swap": "memory.swap.max"},
}


@dataclass(frozen=True)
class MemoryController:
    """Where this process's memory cgroup lives.

    Attributes:
        version: 1 (the v1 ``memory`` hierarchy) or 2 (the unified hierarchy).
        mount: the hierarchy's mount point as this process sees it (e.g. ``/sys/fs/cgroup/memory``).
        directory: this process's own cgroup directory under ``mount``.
    """

    version: int
    mount: str
    directory: str

    def file(self, kind: str, directory: str | None = None) -> str:
        """Path of the ``kind`` file ("limit", "usage", "peak", "swap") in ``directory`` (default: own)."""
        return os.path.join(directory or self.directory, _FILES[self.version][kind])


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1:i + 4]) == 3 and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts(mountinfo_text: str) -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fstype, super options) of each cgroup or cgroup2 mount in mountinfo's text."""
    mounts = []
    for line in mountinfo_text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype = fields[sep + 1]
        if fstype in ("cgroup", "cgroup2") and len(fields) > sep + 3:
            mounts.append((_unescape(fields[3]), _unescape(fields[4]), fstype, set(fields[sep + 3].split(","))))
    return mounts


def _under(mount: str, root: str, cgroup_path: str) -> str | None:
    """The directory of ``cgroup_path`` under a mount whose root is ``root``; None when it is outside it."""
    root = root.rstrip("/")
    if root and cgroup_path != root and not cgroup_path.startswith(root + "/"):
        return None
    return os.path.join(mount, cgroup_path[len(root):].lstrip("/")).rstrip("/") or "/"


def find_controller(cgroup_text: str, mountinfo_text: str, exists=os.path.isdir,
                    read=None) -> MemoryController | None:
    """The memory controller described by ``/proc/<pid>/cgroup`` and ``/proc/<pid>/mountinfo`` texts.

    v1 when a ``N:memory:/path`` line names a mounted ``cgroup`` hierarchy with the ``memory`` option
    (a hybrid machine puts the memory controller there); otherwise v2 when the ``0::/path`` line names
    a mounted ``cgroup2`` whose root ``cgroup.controllers`` lists ``memory``. None when neither is found
    or the directory does not exist. ``exists`` and ``read`` are seams for tests.
    """
    read = read or _read_text
    paths = {}
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else [""]:
                paths[name] = parts[2]
    mounts = _mounts(mountinfo_text)
    if "memory" in paths:
        for root, point, fstype, options in mounts:
            if fstype == "cgroup" and "memory" in options:
                directory = _under(point, root, paths["memory"])
                if directory and exists(directory):
                    return MemoryController(1, point, directory)
    if "" in paths:
        for root, point, fstype, _ in mounts:
            if fstype != "cgroup2":
                continue
            directory = _under(point, root, paths[""])
            controllers = read(os.path.join(point, "cgroup.controllers")) or ""
            if directory and exists(directory) and "memory" in controllers.split():
                return MemoryController(2, point, directory)
    return None


def _read_text(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


def controller(pid: int | str = "self") -> MemoryController | None:
    """This process's (or ``pid``'s) memory cgroup, or None when the kernel offers no memory controller.

    Returns:
        ``MemoryController(version, mount, directory)``; None when ``/proc`` or the hierarchy is missing.
    """
    cgroup_text = _read_text(f"/proc/{pid}/cgroup")
    mountinfo_text = _read_text(f"/proc/{pid}/mountinfo")
    if cgroup_text is None or mountinfo_text is None:
        return None
    return find_controller(cgroup_text, mountinfo_text)


def read_bytes(path: str) -> int | None:
    """A cgroup memory file as bytes; None when missing, unreadable, ``max`` or ≥ 2**62 (no limit)."""
    text = _read_text(path)
    if text is None or text.strip() in ("", "max"):
        return None
    value = int(text.split()[0])
    return None if value >= UNLIMITED_FROM else value


def limit_bytes(ctl: MemoryController, directory: str | None = None) -> int | None:
    """The tightest memory limit on ``directory`` (default: own) and its ancestors up to the mount, in bytes.

    A parent's limit caps its children too (v1 with ``use_hierarchy``, always in v2), so a rank in a child
    with 2 GiB under a parent with 1 GiB runs under 1 GiB. None when no cgroup on the way has a limit.
    """
    directory = os.path.normpath(directory or ctl.directory)
    mount = os.path.normpath(ctl.mount)
    limits = []
    while True:
        value = read_bytes(ctl.file("limit", directory))
        if value is not None:
            limits.append(value)
        if directory == mount or not directory.startswith(mount + os.sep):
            break
        directory = os.path.dirname(directory)
    return min(limits) if limits else None


def own_limit_bytes() -> int | None:
    """The memory limit this process runs under, in bytes (its cgroup's or a tighter ancestor's).

    None when unlimited (v1 ≥ 2**62, v2 ``max``) or when there is no memory controller.
    """
    ctl = controller()
    return None if ctl is None else limit_bytes(ctl)


def own_usage_bytes() -> int | None:
    """This process's cgroup's current usage in bytes (v1 ``memory.usage_in_bytes``, v2 ``memory.current``).

    The whole cgroup's: every process in it, and page cache charged to it. None without a controller.
    """
    ctl = controller()
    return None if ctl is None else read_bytes(ctl.file("usage"))


def own_peak_bytes() -> int | None:
    """This process's cgroup's maximum usage so far in bytes (v1 ``memory.max_usage_in_bytes``, v2
    ``memory.peak`` where the kernel has it, ≥ 5.19); None otherwise."""
    ctl = controller()
    return None if ctl is None else read_bytes(ctl.file("peak"))
