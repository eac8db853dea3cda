"""Test hosts: H emulated machines in Linux namespaces on one real one, joined by a bridge.

Each host is a process holding its own network, UTS (hostname), mount and PID
namespace, with a private ``/dev/shm`` (tmpfs) and ``/proc``: shared memory
cannot cross hosts by accident, and host identity
(:mod:`gradsync.transport.locality`) sees H machines. A "switch" namespace
holds a bridge with one veth per host and runs the rendezvous store, so that
any host, host 0 included, can be lost while the store lives on. Addresses
come from the benchmarking range 198.18.0.0/15 (RFC 2544) and exist only
inside these namespaces: host h is ``198.18.0.{h+1}``, the switch
``198.18.0.254``. Optional egress shaping per host: ``tc qdisc ... tbf``.

Nothing is added to the machine's own namespace. Every holder is started
with ``PR_SET_PDEATHSIG`` (``unshare --kill-child`` for the namespace's PID 1),
so a harness that exits, is interrupted or crashes takes every namespace,
interface, tmpfs and process with it: when a PID namespace's first process
dies the kernel kills the rest, and a network namespace without processes
is freed with its veth ends. Processes carry ``GRADSYNC_TESTHOSTS`` =
``run-id:owner-pid:owner-start-time`` in their environment; a new harness
kills holders whose owner is provably gone (:func:`sweep_stale`).

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN), ``unshare``, ``nsenter``, ``ip``
and ``tc`` (util-linux, iproute2); :func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

SUBNET = "198.18.0"
SWITCH_ADDR = f"{SUBNET}.254"
PREFIX_LEN = 24
MAX_HOSTS = 250
HOST_DEVICE = "eth0"  # the host's interface (Gloo's GLOO_SOCKET_IFNAME inside a host)
BRIDGE = "br0"
MARKER = "GRADSYNC_TESTHOSTS"
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,62})")  # an /etc/hosts name (aliases)
TOOLS = ("unshare", "nsenter", "ip", "tc")
_PR_SET_PDEATHSIG = 1
# $1: hostname, $2: /etc/hosts (every test host's name, as real machines resolve each other); the
# file lives on a tmpfs over /mnt of the private mount namespace, so it goes with it.
_HOLDER_SCRIPT = ('hostname "$1" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && '
                  'mount -t tmpfs -o size=1m tmpfs /mnt && printf "%s" "$2" > /mnt/hosts && '
                  'mount --bind /mnt/hosts /etc/hosts && '
                  '(mount -t sysfs sysfs /sys 2>/dev/null || true) && ip link set lo up && '
                  'echo ready && exec "$3" -I -c "$4"')
# PID 1 of a host's PID namespace: it adopts the orphans of killed agents and must reap them (a plain
# `sleep` left them as zombies until the host ended)
_REAPER = ("import os, time\n"
           "while True:\n"
           "    try:\n"
           "        os.wait()\n"
           "    except ChildProcessError:\n"
           "        time.sleep(0.2)\n")


MIN_INTER_HOST_GBIT = 0.001  # 1 Mbit/s: tc tbf needs a rate of whole bits, and slower links stall rendezvous
MAX_INTER_HOST_GBIT = 1000.0
MAX_JOIN_TIMEOUT_S = 24 * 3600.0


def link_options_problem(inter_host_gbit: float | None, join_timeout_s: float) -> str | None:
    """Why ``--inter-host-gbit`` / ``--join-timeout`` cannot be used (None: they can)."""
    if inter_host_gbit is not None and not MIN_INTER_HOST_GBIT <= inter_host_gbit <= MAX_INTER_HOST_GBIT:
        return (f"--inter-host-gbit must be in [{MIN_INTER_HOST_GBIT:g}, {MAX_INTER_HOST_GBIT:g}] Gbit/s, "
                f"got {inter_host_gbit}")
    if not 0 < join_timeout_s <= MAX_JOIN_TIMEOUT_S:
        return f"--join-timeout must be in (0, {MAX_JOIN_TIMEOUT_S:g}] seconds, got {join_timeout_s}"
    return None


def _kill_all_in(namespace: "Namespace") -> list[int]:
    """SIGKILL every process of ``namespace`` but its PID 1; returns their PIDs."""
    pids = namespace.processes()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass  # already gone
    return pids


def host_addr(index: int) -> str:
    """The address of host ``index`` (0-based): ``198.18.0.{index+1}``."""
    return f"{SUBNET}.{index + 1}"


def unavailable_reason() -> str | None:
    """Why test hosts cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "test hosts need Linux namespaces"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"test hosts need {', '.join(missing)} (util-linux, iproute2)"
    if os.geteuid() != 0:
        return "test hosts need root (CAP_SYS_ADMIN and CAP_NET_ADMIN to create namespaces)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "true"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"namespaces cannot be created here: {probe.stderr.strip() or probe.returncode}"
    return None


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks), or None if PID does not run."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as file:
            return file.read().rpartition(")")[2].split()[19]
    except OSError:
        return None


def _marker_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            for entry in file.read().split(b"\0"):
                if entry.startswith(MARKER.encode() + b"="):
                    return entry.split(b"=", 1)[1].decode(errors="replace")
    except OSError:
        return None
    return None


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def sweep_stale() -> list[int]:
    """Kill the namespace holders of earlier harnesses that are provably gone; returns their PIDs.

    A process is stale when its ``GRADSYNC_TESTHOSTS`` marker names an owner
    PID that no longer runs, or runs with another start time (a reused PID).
    Killing a holder frees its namespaces (and every process inside).
    """
    killed = []
    for pid in _pids():
        marker = _marker_of(pid)
        if marker is None or marker.count(":") != 2:
            continue
        _, owner, started = marker.split(":")
        if owner.isdigit() and _start_time(int(owner)) != started:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
    return killed


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"test hosts: {what} failed: {' '.join(argv)}: {done.stderr.strip()}")


@dataclass
class Namespace:
    """One holder: ``unshare`` (our child) and its child, PID 1 of the new namespaces."""

    name: str
    launcher: subprocess.Popen
    pid: int  # PID 1 of the namespaces, as seen from the machine

    def alive(self) -> bool:
        return self.launcher.poll() is None and _start_time(self.pid) is not None

    def nsenter(self, net_only: bool = False) -> list[str]:
        if net_only:
            return ["nsenter", "-t", str(self.pid), "-n"]
        return ["nsenter", "-t", str(self.pid), "-n", "-u", "-m", "-p", f"--wd={os.getcwd()}"]

    def ip(self, *args: str) -> None:
        _run(self.nsenter(net_only=True) + ["ip", *args], f"ip {' '.join(args)} in {self.name}")

    def processes(self) -> list[int]:
        """PIDs of every process in this namespace except its PID 1."""
        try:
            mine = os.readlink(f"/proc/{self.pid}/ns/pid")
        except OSError:
            return []
        found = []
        for pid in _pids():
            try:
                if pid != self.pid and os.readlink(f"/proc/{pid}/ns/pid") == mine:
                    found.append(pid)
            except OSError:
                continue
        return found

    def kill(self) -> None:
        """Kill the holder; the kernel then kills everything inside and frees the namespaces."""
        if self.launcher.poll() is None:
            self.launcher.kill()
        self.launcher.wait(timeout=30)


@dataclass
class TestHosts:
    """H test hosts on a switch; a context manager (``with TestHosts(2) as hosts: ...``).

    Args:
        count: number of hosts H (1..250).
        inter_host_gbit: egress rate of each host's link in Gbit/s (``tc tbf``); None: unshaped.
        run_id: names hostnames and bridge ports (a fresh one by default).
        aliases: more names per host index (``{0: ["node07"], 1: ["node11"]}``), written into every
            host's ``/etc/hosts`` only: they resolve inside the hosts, nowhere else (SLURM node names).

    Raises:
        RuntimeError: the namespaces cannot be made (:func:`unavailable_reason` says why).
        ValueError: a bad count or rate.
    """

    count: int
    inter_host_gbit: float | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    aliases: dict[int, list[str]] = field(default_factory=dict)
    switch: Namespace | None = None
    hosts: list[Namespace] = field(default_factory=list)
    started: list[subprocess.Popen] = field(default_factory=list)

    __test__ = False  # not a pytest test class

    def __post_init__(self):
        if not isinstance(self.count, int) or not 1 <= self.count <= MAX_HOSTS:
            raise ValueError(f"--hosts must be an integer in [1, {MAX_HOSTS}], got {self.count!r}")
        if self.inter_host_gbit is not None and not 0 < self.inter_host_gbit <= 1000:
            raise ValueError(f"--inter-host-gbit must be in (0, 1000] Gbit/s, got {self.inter_host_gbit}")
        for index, names in self.aliases.items():
            if not 0 <= index < self.count or not all(_HOSTNAME.fullmatch(name) for name in names):
                raise ValueError(f"aliases: host {index} must be in [0, {self.count}) and its names host names, "
                                 f"got {names!r}")

    def __enter__(self) -> "TestHosts":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def marker(self) -> str:
        return f"{self.run_id}:{os.getpid()}:{_start_time(os.getpid())}"

    def start(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        sweep_stale()
        self.switch = self._holder(self.hostname(None))
        self.switch.ip("link", "add", BRIDGE, "type", "bridge")
        self.switch.ip("addr", "add", f"{SWITCH_ADDR}/{PREFIX_LEN}", "dev", BRIDGE)
        self.switch.ip("link", "set", BRIDGE, "up")
        for index in range(self.count):
            self.hosts.append(self._make_host(index))

    def _holder(self, name: str) -> Namespace:
        env = dict(os.environ, **{MARKER: self.marker})
        launcher = subprocess.Popen(
            ["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
             "--", "sh", "-c", _HOLDER_SCRIPT, "holder", name, self.etc_hosts(), sys.executable, _REAPER],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            preexec_fn=_die_with_parent)
        line = launcher.stdout.readline().decode().strip()
        if line != "ready":
            launcher.kill()
            raise RuntimeError(f"test hosts: namespace {name} did not start: {launcher.stderr.read().decode()}")
        with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children", encoding="ascii") as file:
            pid = int(file.read().split()[0])
        return Namespace(name, launcher, pid)

    def hostname(self, index: int | None) -> str:
        """Host ``index``'s hostname (None: the switch's): ``gs-<run id>-h<index>``."""
        return f"gs-{self.run_id}-{'switch' if index is None else f'h{index}'}"

    def etc_hosts(self) -> str:
        lines = ["127.0.0.1 localhost", f"{SWITCH_ADDR} {self.hostname(None)}"]
        lines += [" ".join([host_addr(index), self.hostname(index), *self.aliases.get(index, ())])
                  for index in range(self.count)]
        return "\n".join(lines) + "\n"

    def _make_host(self, index: int) -> Namespace:
        host = self._holder(self.hostname(index))
        port = f"h{index}-{self.run_id}"[:15]
        self.switch.ip("link", "add", port, "type", "veth", "peer", "name", HOST_DEVICE, "netns", str(host.pid))
        self.switch.ip("link", "set", port, "master", BRIDGE, "up")
        host.ip("addr", "add", f"{host_addr(index)}/{PREFIX_LEN}", "dev", HOST_DEVICE)
        host.ip("link", "set", HOST_DEVICE, "up")
        if self.inter_host_gbit is not None:
            rate_bits = self.inter_host_gbit * 1e9
            # 1 ms at the rate, at least two GSO packets: a deeper bucket lets a call of a few hundred KB
            # pass at the unshaped rate (10 ms made a 512 KiB tree call 2x faster than the link allows)
            burst = max(int(rate_bits / 8 / 1000), 128 * 1024)
            _run(host.nsenter(net_only=True) + ["tc", "qdisc", "add", "dev", HOST_DEVICE, "root", "tbf",
                                                 "rate", f"{int(rate_bits)}bit", "burst", str(burst),
                                                 "latency", "100ms"], f"tc tbf on host {index}")
        return host

    def popen(self, index: int | None, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``index`` (None: the switch) in the current directory.

        ``env`` is the whole environment (default: this process's) plus the marker.
        """
        where = self.switch if index is None else self.hosts[index]
        full_env = dict(os.environ if env is None else env, **{MARKER: self.marker})
        cores = self.cores(index)

        def prepare() -> None:
            _die_with_parent()
            os.sched_setaffinity(0, cores)

        process = subprocess.Popen(where.nsenter() + ["--", *argv], env=full_env, preexec_fn=prepare, **kwargs)
        self.started.append(process)
        return process

    def cores(self, index: int | None) -> set[int]:
        """The CPUs host ``index`` runs on: this machine's cores split evenly among the hosts (host h
        gets core h mod n when there are more hosts than cores; the switch gets all), so that each
        host's workers size their thread pools (``torch.set_num_threads``) to their own share."""
        available = sorted(os.sched_getaffinity(0))
        if index is None:
            return set(available)
        if self.count >= len(available):
            return {available[index % len(available)]}
        share = len(available) // self.count
        return set(available[index * share:(index + 1) * share])

    def run(self, index: int | None, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``index`` to completion (output captured as text)."""
        where = self.switch if index is None else self.hosts[index]
        return subprocess.run(where.nsenter() + ["--", *argv], capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **{MARKER: self.marker}), **kwargs)

    def set_link(self, index: int, up: bool) -> None:
        """Set host ``index``'s interface up or down inside its namespace (a cut cable)."""
        self.hosts[index].ip("link", "set", HOST_DEVICE, "up" if up else "down")

    def kill_all(self) -> None:
        """SIGKILL every process in the switch and in every host (the namespaces stay): what ``popen``
        started there and their children, which the killed ``nsenter`` would leave running."""
        for namespace in [self.switch, *self.hosts]:
            _kill_all_in(namespace)

    def kill_host(self, index: int) -> list[int]:
        """SIGKILL every process running in host ``index`` (its namespaces stay); returns their PIDs."""
        return _kill_all_in(self.hosts[index])

    def tx_bytes(self, index: int) -> int:
        """Bytes host ``index``'s interface has sent (``/proc/PID/net/dev`` of its holder)."""
        with open(f"/proc/{self.hosts[index].pid}/net/dev", encoding="ascii") as file:
            for line in file:
                name, _, counters = line.partition(":")
                if name.strip() == HOST_DEVICE:
                    return int(counters.split()[8])
        raise RuntimeError(f"host {index} has no {HOST_DEVICE}")

    def close(self) -> None:
        """Stop everything: started processes, then every holder (frees namespaces and interfaces)."""
        for process in self.started:
            if process.poll() is None:
                process.kill()
        for namespace in [*self.hosts, *([self.switch] if self.switch else [])]:
            namespace.kill()
        for process in self.started:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while any(ns.processes() or _start_time(ns.pid) for ns in self.hosts) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.hosts.clear()
        self.switch = None
