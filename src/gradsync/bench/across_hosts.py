"""Benchmarks across test hosts (:mod:`gradsync.hosts`): option checks, the relaunch, the link counter.

With ``--hosts H`` a bench validates its options, then runs itself again as
``gradsync bench <name> ...`` under one ``torchrun`` per test host
(:func:`gradsync.hosts.torchrun.run_on_hosts`). The workers see torchrun's
``RANK``/``WORLD_SIZE`` and run the bench's worker directly; rank 0 (on host 0)
prints the table, relayed to this terminal, and writes the JSON rows to the
file the outer process then reads back.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from gradsync.hosts.netns import HOST_DEVICE, MAX_HOSTS, link_options_problem

NET_DEV = "/proc/net/dev"


def check_host_options(hosts: int | None, inter_host_gbit: float | None, join_timeout_s: float) -> None:
    """Reject bad ``--hosts``/``--inter-host-gbit``/``--join-timeout`` before anything starts.

    Raises:
        ValueError: ``hosts`` not in [1, MAX_HOSTS], a shaping rate outside
        [MIN_INTER_HOST_GBIT, MAX_INTER_HOST_GBIT] or without ``--hosts``, a join timeout outside
        (0, MAX_JOIN_TIMEOUT_S].
    """
    if hosts is None:
        if inter_host_gbit is not None:
            raise ValueError("--inter-host-gbit shapes the links between test hosts: give --hosts too")
        return
    if not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"--hosts must be an integer in [1, {MAX_HOSTS}], got {hosts!r}")
    problem = link_options_problem(inter_host_gbit, join_timeout_s)
    if problem:
        raise ValueError(problem)


def world_layout() -> tuple[int, int]:
    """(hosts, ranks per host) of this torchrun worker, from ``WORLD_SIZE``/``LOCAL_WORLD_SIZE``."""
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return max(world // max(local, 1), 1), local


def tx_bytes(device: str = HOST_DEVICE) -> int | None:
    """Bytes this network namespace's ``device`` has sent (headers included); None without it.

    ``/proc/net/dev``: after "name:", field 9 is transmitted bytes.
    """
    try:
        with open(NET_DEV, encoding="ascii") as file:
            for line in file:
                name, _, counters = line.partition(":")
                if name.strip() == device:
                    return int(counters.split()[8])
    except OSError:
        return None
    return None


class LinkMeter:
    """Sums the bytes this host's interface sent and the seconds of the timed calls of each row."""

    def __init__(self):
        self.bytes: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._start: tuple[int, float] | None = None

    def start(self) -> None:
        sent = tx_bytes()
        self._start = None if sent is None else (sent, time.perf_counter())

    def stop(self, name: str) -> None:
        sent = tx_bytes()
        if self._start is None or sent is None:
            return
        self.bytes[name] = self.bytes.get(name, 0) + sent - self._start[0]
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - self._start[1]

    def gbps(self, name: str) -> float | None:
        """Gbit/s the link carried during ``name``'s timed calls (None: not measured)."""
        if not self.seconds.get(name):
            return None
        return self.bytes[name] * 8 / self.seconds[name] / 1e9


def run_bench_on_hosts(hosts: int, nproc: int, argv: list[str], *, inter_host_gbit: float | None,
                       join_timeout_s: float, json_path: str | None) -> list[dict]:
    """Run ``gradsync <argv> --json F`` on ``hosts`` test hosts of ``nproc`` ranks; returns rank 0's rows.

    ``argv`` is the bench command without ``--json``; the rows go to ``json_path``
    (or a temporary file, removed here). Raises HostsFailedError as run_on_hosts does.
    """
    from gradsync.hosts.torchrun import remove_log_dir, run_on_hosts

    own = json_path is None
    path = Path(tempfile.mkstemp(prefix="gradsync-bench-", suffix=".json")[1]) if own else Path(json_path)
    try:
        job = run_on_hosts(hosts, nproc, [*argv, "--json", str(path.resolve())],
                           inter_host_gbit=inter_host_gbit, join_timeout_s=join_timeout_s)
        remove_log_dir(job)  # kept (and named in the error) when the job fails
        return json.loads(path.read_text(encoding="utf-8") or "[]")
    finally:
        if own:
            path.unlink(missing_ok=True)


def print_rank0_rows(header: str, table: str, rows: list[dict], json_path: str | None) -> None:
    """What rank 0 of a bench under torchrun does with its rows: print the header and table, write the JSON."""
    from gradsync.bench.output import write_json

    print(header, flush=True)
    print(table, flush=True)
    if json_path:
        write_json(json_path, rows)
