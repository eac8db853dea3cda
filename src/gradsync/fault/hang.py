"""Naming the rank that hung, not the neighbour that waited for it.

When one rank stops (a hang, a long stall), the others block in the next
collective one after another: in a ring, rank r+1 waits for the hung rank r,
rank r+2 waits for rank r+1, and so on, so each rank's timeout names a
different peer. On a timeout every rank that is still alive says so in the
rendezvous store (``stuck/<rank>``) and waits briefly for the others to say
the same; the ranks that stay silent are the ones that stopped responding.
This is the idea of NCCL's and PyTorch's desync debugging, reduced to one
key per rank.

The store may itself be frozen: under a plain ``MASTER_ADDR`` launch it lives
in rank 0, and a stopped rank 0 (SIGSTOP, a debugger) never answers, while a
TCPStore ``check`` ignores the store's timeout. So the store calls run on a
daemon thread that is waited for at most ``grace_s`` + ``STORE_SLACK_S``; a
store that does not answer in that time means nothing is known (None), and
the timeout is raised at most ``grace_s`` + ``STORE_SLACK_S`` late. A thread
still stuck in the store makes later diagnoses give None at once.

A silent rank may also be dead. Each rank records its process
(``proc/<rank>``: its machine and PID namespace, and its PID) when the
detector is made; a silent rank whose process is gone from this machine is
listed in :attr:`HangDetector.dead`, so the error says it died rather than
that it never reached the call.

The store is torch.distributed's (the elastic agent's under ``gradsync
train`` and torchrun); its namespace is fresh for every group (see
``process_group``), so a restart never reads an old attempt's keys.
"""

from __future__ import annotations

import os
import threading
import time

from gradsync.transport.shm_segment import pid_alive

DEFAULT_GRACE_S = 1.5  # how long a timed-out rank waits for the others to report (seconds)
_POLL_S = 0.05
STORE_SLACK_S = 0.25  # beyond the grace, how long an unanswered store call is waited for (seconds)


class HangDetector:
    """Find the ranks that did not reach a timed-out collective.

    Args:
        store: a ``torch.distributed.Store`` shared by the group's ranks
            (TCPStore, HashStore, or a PrefixStore over one).
        rank, world_size: this rank and the group size.
        grace_s: seconds to wait for the other ranks' reports (> 0); the
            diagnosis adds at most this much to a timeout.
    """

    def __init__(self, store, rank: int, world_size: int, grace_s: float = DEFAULT_GRACE_S):
        if not grace_s > 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.grace_s = grace_s
        self._stuck: threading.Thread | None = None  # a diagnosis still waiting for the store
        self.dead: list[int] = []  # of the last diagnosis's silent ranks, those whose process is gone
        self.elsewhere: dict[int, str] = {}  # ranks the last diagnosis found stuck in another call
        try:
            store.set(_proc_key(rank), f"{_machine()} {os.getpid()}")
        except Exception:  # noqa: BLE001 - without the record a death reads as a hang
            pass

    @property
    def store_unanswered(self) -> bool:
        """Whether the store has not answered a diagnosis yet (its host may be the stopped rank)."""
        return self._stuck is not None and self._stuck.is_alive()

    def silent_ranks(self, where: str = "") -> list[int] | None:
        """Report this rank as stuck (in ``where``, e.g. "broadcast #12") and return the ranks that
        did not report within the grace. Ranks that reported being stuck somewhere else are left in
        :attr:`elsewhere` (``{rank: where}``): the ranks are out of step, not hung.

        Returns within ``grace_s`` + ``STORE_SLACK_S`` seconds whatever the store does.

        Returns:
            The silent ranks (ascending; empty when every rank reported: a
            stall of the network, not of one rank), or None when the store
            could not be used or did not answer in time (then nothing is known).
        """
        self.dead, self.elsewhere = [], {}
        if self.store_unanswered:
            return None
        found: list = []
        thread = threading.Thread(target=lambda: found.append(self._ask_store(where)), daemon=True,
                                  name=f"gradsync-hang-detector-rank{self.rank}")
        thread.start()
        thread.join(self.grace_s + STORE_SLACK_S)
        if thread.is_alive():
            self._stuck = thread
            return None
        if not found or found[0] is None:
            return None
        silent, self.dead, self.elsewhere = found[0]
        return silent

    def _ask_store(self, where: str) -> tuple[list[int], list[int], dict[int, str]] | None:
        """The store round of :meth:`silent_ranks`: (silent ranks, those of them dead, where the
        others are stuck if not in ``where``); unbounded if the store hangs."""
        try:
            self.store.set(_key(self.rank), f"{time.time()} {where}")
            peers = [rank for rank in range(self.world_size) if rank != self.rank]
            pending = list(peers)
            deadline = time.monotonic() + self.grace_s
            while pending and time.monotonic() < deadline:
                pending = [rank for rank in pending if not self.store.check([_key(rank)])]
                if pending:
                    time.sleep(_POLL_S)
            reported = {rank: self.store.get(_key(rank)).decode().partition(" ")[2]
                        for rank in peers if rank not in pending} if where else {}
            elsewhere = {rank: place for rank, place in reported.items() if place and place != where}
            return pending, [rank for rank in pending if self._process_gone(rank)], elsewhere
        except Exception:  # noqa: BLE001 - a broken store must not hide the original timeout
            return None


    def _process_gone(self, rank: int) -> bool:
        """Whether ``rank`` recorded a process on this machine (and PID namespace) that no longer runs."""
        if not self.store.check([_proc_key(rank)]):
            return False
        machine, _, pid = self.store.get(_proc_key(rank)).decode().rpartition(" ")
        return machine == _machine() and pid.isdigit() and not pid_alive(int(pid))


def _key(rank: int) -> str:
    return f"stuck/{rank}"


def _proc_key(rank: int) -> str:
    return f"proc/{rank}"


def _machine() -> str:
    """This machine's boot and PID namespace: PIDs compare only between processes with the same one."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            boot = file.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"unknown-{os.getpid()}"  # never equal to another process's: no death is claimed

