"""Per-rank memory cgroups: children of the run's own cgroup made with a limit, joined by each rank, removed after.

:class:`ChildCgroups` makes ``<own cgroup>/gradsync-<launcher pid>-<random>/rank-<r>`` for every rank with
a memory limit of M bytes (v1: ``memory.limit_in_bytes`` and, where the kernel has swap accounting,
``memory.memsw.limit_in_bytes`` = M so that swap cannot hide an overrun; v2: ``memory.max`` and
``memory.swap.max`` = 0), and removes them on exit, after the processes in them have exited (a cgroup
with tasks cannot be removed). Each rank moves itself in with :func:`join` before it builds anything;
its children (data loaders) inherit the cgroup. A launcher that is SIGKILLed cannot clean up: the next
:class:`ChildCgroups` of any gradsync run in the same cgroup removes ``gradsync-<pid>-*`` folders whose
launcher is gone and that hold no process (:func:`sweep_stale`).

Two promises: a process is only ever moved into a child of the cgroup it is in (never out of it into
an unrelated one), and only the ``gradsync-*`` folders these functions made are removed.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import signal
import sys
import threading
import time

from gradsync.hosts.memory_cgroup import MemoryController, controller, limit_bytes, read_bytes

RUN_PREFIX = "gradsync-"
RANK_PREFIX = "rank-"
REMOVE_TIMEOUT_S = 5.0  # how long removal waits for the ranks' processes to leave
# What a rank of gradsync train charges to its cgroup before its model exists (its data, torch's and the
# collectives' first allocations, Python objects): 15-25 MiB measured (--model mlp, a 2-block gpt). Below
# this the rank is OOM-killed before the preflight can run, so the preflight refuses it in the launcher.
MIN_RANK_MIB = 32
_RUN_NAME = re.compile(r"^gradsync-(\d+)-[0-9a-f]+$")
_RANK_NAME = re.compile(r"^rank-\d+$")


def physical_memory_bytes() -> int:
    """This machine's physical memory in bytes (``sysconf(_SC_PHYS_PAGES) * page size``)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def unavailable_reason(ctl: MemoryController | None = None) -> str | None:
    """Why per-rank memory cgroups cannot be made here (one line), or None when they can (as far as can be
    told without making one: v2's controller delegation is only known by trying)."""
    ctl = ctl or controller()
    if ctl is None:
        return ("this kernel offers no memory cgroup controller (no cgroup v1 memory hierarchy and no cgroup2 "
                "with memory in cgroup.controllers)")
    if not os.access(ctl.directory, os.W_OK) or not os.access(os.path.join(ctl.directory, "cgroup.procs"), os.W_OK):
        return (f"this process's memory cgroup {ctl.directory} is not writable by this user (child cgroups "
                f"need root or a delegated cgroup)")
    return None


def limit_problem(limit_mib, option: str = "--memory-limit-mib") -> str | None:
    """The one-line reason a per-rank limit of ``limit_mib`` MiB cannot be honoured here, or None.

    Refused: not an int ≥ 1; more than the machine's physical memory; more than the run's own cgroup
    allows (a child cannot have more than its parent); no memory controller, or one this user cannot write.
    """
    if not isinstance(limit_mib, int) or isinstance(limit_mib, bool) or limit_mib < 1:
        return f"{option} must be an int >= 1 (MiB per rank), got {limit_mib!r}"
    physical = physical_memory_bytes()
    if limit_mib * 2**20 > physical:
        return f"{option} {limit_mib} is more than this machine's physical memory ({physical // 2**20} MiB)"
    ctl = controller()
    reason = unavailable_reason(ctl)
    if reason:
        return f"{option} is refused: {reason}"
    own = limit_bytes(ctl)
    if own is not None and limit_mib * 2**20 > own:
        return (f"{option} {limit_mib} is more than this run's own memory cgroup allows ({own // 2**20} MiB "
                f"in {ctl.directory}): a child cannot have more than its parent")
    return None


def floor_problem(limit_mib: int, option: str = "--memory-limit-mib") -> str | None:
    """The preflight's one-line refusal of a per-rank limit under ``MIN_RANK_MIB`` (None at or above it):
    a rank needs that much before its model is built, so no model fits and the kernel would kill it first."""
    if limit_mib >= MIN_RANK_MIB:
        return None
    return (f"gradsync preflight: {option} {limit_mib} is below the {MIN_RANK_MIB} MiB a rank takes before "
            f"its model is built (its data, torch's and the collectives' first buffers, Python objects), so "
            f"nothing fits; give at least {MIN_RANK_MIB} (or --no-preflight to let the kernel's OOM killer decide)")


def _write(path: str, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


def _make(directory: str) -> None:
    try:
        os.mkdir(directory)
    except OSError as exc:
        raise ValueError(f"cannot create memory cgroup {directory}: {exc.strerror or exc}") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _procs(directory: str) -> list[int]:
    try:
        with open(os.path.join(directory, "cgroup.procs")) as handle:
            return [int(line) for line in handle.read().split()]
    except OSError:
        return []


def _rmdir(path: str) -> bool:
    """Remove the empty cgroup ``path`` (gone already counts); False while processes keep it busy."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
            raise
        return False
    return True


def _remove_run_folder(directory: str) -> bool:
    """rmdir each ``rank-*`` child then the run folder itself; False when one still holds processes."""
    try:
        names = [name for name in os.listdir(directory) if _RANK_NAME.match(name)]
    except FileNotFoundError:
        return True
    removed = all([_rmdir(os.path.join(directory, name)) for name in names])  # every child tried
    return removed and _rmdir(directory)


def sweep_stale(ctl: MemoryController, alive=_pid_alive) -> list[str]:
    """Remove the ``gradsync-<pid>-*`` folders in ``ctl``'s cgroup whose launcher ``pid`` is gone.

    What a SIGKILLed launcher left. A folder that still holds a process stays (its ranks are still
    exiting, or its launcher lives in another PID namespace); nothing else in the cgroup is touched.

    Returns:
        The folders removed.
    """
    removed = []
    for name in sorted(os.listdir(ctl.directory)):
        match = _RUN_NAME.match(name)
        path = os.path.join(ctl.directory, name)
        if match and os.path.isdir(path) and not alive(int(match.group(1))) and _remove_run_folder(path):
            removed.append(path)
    return removed


def join(directory: str) -> str:
    """Move this process (all its threads) into the cgroup ``directory``, a descendant of the one it is in.

    Raises:
        ValueError: ``directory`` is not below this process's own memory cgroup (a process is never moved
            out of its cgroup), or it cannot be written.
    """
    ctl = controller()
    target = os.path.normpath(directory)
    if ctl is None or not target.startswith(os.path.normpath(ctl.directory) + os.sep):
        raise ValueError(f"memory cgroup {directory} is not below this process's own "
                         f"({ctl.directory if ctl else 'none'}); a process only moves into its own cgroup's children")
    try:
        _write(os.path.join(target, "cgroup.procs"), str(os.getpid()))
    except OSError as exc:
        raise ValueError(f"cannot join memory cgroup {directory}: {exc.strerror or exc}") from None
    return target


def rank_cgroup(run_directory: str, rank: int) -> str:
    """Rank ``rank``'s cgroup folder in a run's folder (:attr:`ChildCgroups.directory`)."""
    return os.path.join(run_directory, f"{RANK_PREFIX}{rank}")


def usage_record(directory: str) -> dict:
    """What a rank reports about its cgroup (``summary.json``'s ``memory_cgroup``): ``directory``, the limit it
    ran under and the cgroup's peak usage, in MiB (None where the kernel does not say)."""
    ctl = controller()
    limit = None if ctl is None else limit_bytes(ctl, directory)
    peak = None if ctl is None else read_bytes(ctl.file("peak", directory))
    return {"directory": directory, "limit_mib": None if limit is None else limit / 2**20,
            "peak_mib": None if peak is None else peak / 2**20}


def oom_kills(directory: str) -> int:
    """How many processes the kernel's OOM killer killed in the cgroup ``directory`` (v1 ``memory.oom_control``,
    v2 ``memory.events``: their ``oom_kill`` line; 0 when the kernel does not count them)."""
    for name in ("memory.oom_control", "memory.events"):
        try:
            with open(os.path.join(directory, name)) as handle:
                for line in handle:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            continue
    return 0


class ChildCgroups:
    """``<own cgroup>/gradsync-<pid>-<random>/rank-<r>`` for ``r < ranks``, each limited to ``limit`` bytes.

    A context manager: entering sweeps stale folders (:func:`sweep_stale`) and makes the children;
    leaving removes them once their processes have exited (waits up to ``REMOVE_TIMEOUT_S``; a folder
    still busy then is left, with one line on stderr, for the next run's sweep). While inside, SIGTERM
    and SIGHUP raise SystemExit so that the removal runs (SIGINT already raises KeyboardInterrupt).

    Raises (on entering):
        ValueError: no writable memory controller, or (v2) the memory controller cannot be enabled for
            the children (cgroup v2's no-internal-processes rule), one line.
    """

    def __init__(self, ranks: int, limit: int, ctl: MemoryController | None = None):
        if ranks < 1 or limit < 1:
            raise ValueError(f"ChildCgroups needs ranks >= 1 and limit >= 1 byte, got {ranks} and {limit}")
        self.ranks, self.limit = ranks, limit
        self.ctl = ctl or controller()
        reason = unavailable_reason(self.ctl)
        if reason:
            raise ValueError(reason)
        self.directory = os.path.join(self.ctl.directory, f"{RUN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        self._handlers: dict[int, object] = {}

    def rank_directory(self, rank: int) -> str:
        """The cgroup folder of rank ``rank`` (what :func:`join` takes)."""
        return rank_cgroup(self.directory, rank)

    def __enter__(self) -> ChildCgroups:
        sweep_stale(self.ctl)
        self._catch_signals()
        try:
            _make(self.directory)
            if self.ctl.version == 2:
                self._enable_memory_v2()
            for rank in range(self.ranks):
                _make(self.rank_directory(rank))
                self._limit(self.rank_directory(rank))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _limit(self, directory: str) -> None:
        try:
            _write(self.ctl.file("limit", directory), str(self.limit))
            swap = self.ctl.file("swap", directory)
            if os.path.exists(swap):  # v1: memory+swap, at least the memory limit; v2: swap alone
                _write(swap, str(self.limit) if self.ctl.version == 1 else "0")
        except OSError as exc:
            raise ValueError(f"cannot set the memory limit of cgroup {directory}: {exc.strerror or exc}") from None

    def _enable_memory_v2(self) -> None:
        """cgroup v2: children have ``memory.max`` only where their parent's ``cgroup.subtree_control`` has
        ``memory``; a cgroup that holds processes cannot enable it (unless it is the root). Enabled in the
        run's own cgroup it stays enabled (other children may use it by then)."""
        for parent in (self.ctl.directory, self.directory):
            control = os.path.join(parent, "cgroup.subtree_control")
            with open(control) as handle:
                if "memory" in handle.read().split():
                    continue
            try:
                _write(control, "+memory")
            except OSError as exc:
                raise ValueError(f"cgroup v2: cannot enable the memory controller for the children of {parent} "
                                 f"({exc.strerror or exc}; a cgroup holding processes cannot, run gradsync in a "
                                 f"delegated cgroup of its own)") from None

    def remove(self, timeout_s: float = REMOVE_TIMEOUT_S) -> bool:
        """Remove the rank cgroups and the run's folder, waiting up to ``timeout_s`` for their processes to exit.

        Returns:
            True when nothing is left; False when a cgroup still held processes (left for the next sweep).
        """
        self._restore_signals()
        deadline = time.monotonic() + timeout_s
        while not _remove_run_folder(self.directory):
            if time.monotonic() >= deadline:
                pids = sorted({pid for rank in range(self.ranks) for pid in _procs(self.rank_directory(rank))})
                print(f"gradsync: memory cgroup {self.directory} still holds processes {pids}; left for the next "
                      f"run to remove", file=sys.stderr)
                return False
            time.sleep(0.05)
        return True

    def _catch_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                self._handlers[sig] = signal.signal(sig, _exit_on_signal)

    def _restore_signals(self) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers.clear()


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)
