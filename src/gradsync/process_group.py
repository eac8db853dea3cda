"""Joining and leaving the group of workers: ``init``, ``rank``, ``world_size``, ``shutdown``.

``init`` reads the variables torch's elastic launcher (``torchrun``,
``gradsync train``) sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK), starts torch.distributed with Gloo on CPU or NCCL when CUDA is
available, and makes the default :class:`~gradsync.collectives.Communicator`
that collectives use when no ``group`` is given. Like torch.distributed,
this default group is the one piece of process-wide state.
"""

from __future__ import annotations

import datetime
import errno
import math
import os

import torch
import torch.distributed as dist

from gradsync.collectives.communicator import DEFAULT_TIMEOUT_S, Communicator
from gradsync.collectives.validate import reject_call
from gradsync.collectives.recording import run_recorded
from gradsync.errors import CollectiveTimeoutError, NotInitializedError
from gradsync.fault.hang import HangDetector
from gradsync import slurm
from gradsync.rendezvous import bounded, gloo_on_loopback, is_loopback, loopback_store_server
from gradsync.transport.torch_p2p import TorchP2PTransport

BACKENDS = ("auto", "gloo", "nccl")
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Joining the group (store, connections) may take longer than a collective is
# allowed to: a short collective timeout must not make start-up fail.
MIN_STARTUP_TIMEOUT_S = 60.0


class _Default:
    communicator: Communicator | None = None
    owns_process_group = False
    by_group: dict[int, Communicator] = {}
    # The rendezvous store outlives shutdown(): a rank that re-inits before
    # rank 0 has torn down the old group must meet it in a fresh namespace of
    # the same store, not in a half-closed old store (see init_generation).
    store = None
    store_key: tuple | None = None
    init_generation = 0


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def init(backend: str = "auto", timeout: float = DEFAULT_TIMEOUT_S) -> Communicator:
    """Join the group described by the launcher's environment variables.

    Without any of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, a
    one-process group is made (rank 0 of 1), so the same script runs alone.

    Under SLURM's ``srun`` (one worker per task; RANK and WORLD_SIZE not set)
    the group is read from SLURM_PROCID (rank), SLURM_NTASKS (world size),
    SLURM_LOCALID (local rank), SLURM_NODELIST (its first node, expanded by
    python-hostlist, hosts the rendezvous) and SLURM_JOB_ID (the port: its
    last four digits + 15000, as Lightning's ``SLURMEnvironment``);
    MASTER_ADDR / MASTER_PORT, when set, take precedence. torchrun's
    variables win when both are set (:mod:`gradsync.slurm`, docs/slurm.md).

    Args:
        backend: "auto" (NCCL if CUDA is available, else Gloo), "gloo" or "nccl".
        timeout: default seconds any collective may take (> 0).

    Returns:
        The default communicator.

    Raises:
        RuntimeError: already initialized (call ``shutdown`` first).
        ValueError: bad backend, timeout, or environment variables
        (a partial set names the missing ones, SLURM's too); a SLURM
        rendezvous node whose name does not resolve; a second process
        claiming this rank (a duplicate SLURM_PROCID or RANK).
        OSError: rank 0 cannot host the store (its port is taken; one line
        naming host:port and the likely causes).
        CollectiveTimeoutError: the rendezvous store (host:port named) or a
        rank could not be reached within the start-up timeout.
    """
    if _Default.communicator is not None:
        raise RuntimeError("gradsync.init() was already called; call gradsync.shutdown() first")
    if not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}")
    backend = _resolve_backend(backend)
    store = None
    if not dist.is_initialized():
        store = _init_torch_distributed(backend, timeout)
        _Default.owns_process_group = True
        if backend == "gloo":
            # Joining used the longer start-up timeout. From now on Gloo's own collectives (the
            # native algorithm) must give up with ours: a pending one blocks process exit until
            # Gloo's timeout, so a hang would hold the job long after it was detected.
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout))
    if backend == "nccl":
        torch.cuda.set_device(_local_rank())
    return _make_default(store, timeout)


def _local_rank() -> int:
    """This worker's rank on its machine: SLURM_LOCALID under srun, else LOCAL_RANK (default 0)."""
    return slurm.read().local_rank if slurm.under_srun() else int(os.environ.get("LOCAL_RANK", "0"))


def init_from_store(store, rank: int, world_size: int, backend: str = "auto",
                    timeout: float = DEFAULT_TIMEOUT_S) -> Communicator:
    """Join a group whose members meet in ``store`` (a namespace of their own, e.g. a ``PrefixStore``).

    What an elastic run (:mod:`gradsync.elastic`) calls once per membership: the members agreed on
    ``rank`` and ``world_size`` elsewhere, and a fresh namespace per membership keeps one group's
    addresses from being read by the next. Collective over the ``world_size`` members.

    Raises:
        RuntimeError: already initialized; ValueError: bad rank, world_size, backend or timeout.
    """
    if _Default.communicator is not None or dist.is_initialized():
        raise RuntimeError("gradsync.init() was already called; call gradsync.shutdown() first")
    if not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
    backend = _resolve_backend(backend)
    startup_s = max(timeout, MIN_STARTUP_TIMEOUT_S)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=startup_s))
    _Default.owns_process_group = True
    if backend == "gloo":
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout))
    return _make_default(_detector_store(dist.PrefixStore("gradsync/hang", store)) if world_size > 1 else None,
                         timeout)


def _make_default(store, timeout: float) -> Communicator:
    """The default communicator over torch's default group; ``store`` feeds the hang detector (or None)."""
    transport = TorchP2PTransport(None)
    detector = HangDetector(store, transport.rank, transport.world_size) if store is not None else None
    communicator = Communicator(transport, timeout_s=timeout, hang_detector=detector)
    _learn_locality(communicator, timeout)
    _Default.communicator = communicator
    return _Default.communicator


def _learn_locality(communicator: Communicator, timeout: float) -> None:
    """Exchange host identities now, at group creation (collective): "auto", "hierarchical" and "shm"
    then follow the hosts the ranks really run on, never a launcher variable (LOCAL_WORLD_SIZE may
    differ between nodes)."""
    def exchange() -> None:
        call = communicator.new_call("init", "host identity exchange", max(timeout, MIN_STARTUP_TIMEOUT_S))
        communicator.learn_locality(call)

    run_recorded(communicator, exchange)


def _init_torch_distributed(backend: str, timeout: float):
    """Start torch.distributed; returns this group's store namespace (None for a one-process group)."""
    if slurm.under_srun():
        task = slurm.read()
        slurm.check_resolves(task)
        rank, world_size, address = task.rank, task.world_size, (task.master_addr, task.master_port, "tcp")
    else:
        present = [name for name in _REQUIRED_ENV if name in os.environ]
        if not present:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=timeout))
            return None
        missing = [name for name in _REQUIRED_ENV if name not in os.environ]
        if missing:
            raise ValueError(f"environment variables {', '.join(missing)} are not set "
                             f"(set all of {', '.join(_REQUIRED_ENV)} or none, or launch with torchrun)")
        rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
        address = (os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"), "env")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world_size})")
    store = _rendezvous_store(rank, world_size, timeout, address)
    _Default.init_generation += 1
    # The elastic agent's store outlives a restart: a new attempt must not read the last one's addresses.
    # A store of rank 0's own (no agent store, e.g. torchrun across hosts with
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) is new for every attempt, and the agents' restart counts differ
    # once one host's agent was replaced: there every rank must use the same namespace.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent_store else "0"
    generation_store = dist.PrefixStore(f"gradsync/attempt{attempt}/init{_Default.init_generation}", store)
    startup_s = max(timeout, MIN_STARTUP_TIMEOUT_S)
    _wait_for_every_rank(generation_store, rank, world_size, startup_s)
    dist.init_process_group(backend, store=generation_store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=startup_s))
    return _detector_store(dist.PrefixStore("gradsync/hang", generation_store))


_NEVER_JOINED_HINT = ("a rank may have failed before joining (e.g. a bad argument to gradsync.init, a crash, or "
                      "two processes given the same rank: a duplicate SLURM_PROCID or RANK); see that rank's own "
                      "error")


def _wait_for_every_rank(store, rank: int, world_size: int, seconds: float) -> None:
    """Check in, then wait until every rank has (start-up barrier on the store).

    Raises:
        ValueError: another process already checked in as ``rank`` (a duplicate rank), at once.
        CollectiveTimeoutError: some ranks did not check in within ``seconds``; names them.
    """
    if store.add(f"joined/{rank}", 1) > 1:  # a counter: a second process claiming this rank finds 2
        raise ValueError(f"gradsync.init: another process already joined as rank {rank} of {world_size}: two "
                         f"processes claim the same rank (a duplicate SLURM_PROCID or RANK in the launch)")
    keys = [f"joined/{peer}" for peer in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except (RuntimeError, TimeoutError) as exc:  # torch's DistStoreError is a RuntimeError
        missing = [peer for peer, key in enumerate(keys) if not _has_key(store, key)]
        who = ", ".join(map(str, missing)) if missing else "some ranks"
        raise CollectiveTimeoutError(f"gradsync.init on rank {rank}: rank{'s' if len(missing) != 1 else ''} "
                                     f"{who} of {world_size} never joined the group within {seconds:g} s; "
                                     f"{_NEVER_JOINED_HINT}", op="init", rank=rank,
                                     peer=missing[0] if missing else None, step="start-up") from exc


def _has_key(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False


def _detector_store(store):
    """A second connection to ``store`` for the hang detector, so that a diagnosis stuck on a
    frozen store host never holds the connection torch.distributed uses (shutdown, new groups)."""
    try:
        return bounded(store.clone, 5.0, "the rendezvous store (a second connection)")
    except (RuntimeError, NotImplementedError, TimeoutError):
        return store


def _rendezvous_store(rank: int, world_size: int, timeout: float, address: tuple[str, int, str]):
    """The store at ``address`` = (host, port, "env" | "tcp"): rank 0's, or the elastic agent's
    ("env": torchrun's variables), made once per address and kept."""
    host, port, _ = address
    key = (host, str(port), rank, world_size)
    if _Default.store is None or _Default.store_key != key:
        startup = datetime.timedelta(seconds=max(timeout, MIN_STARTUP_TIMEOUT_S))
        try:
            store = _connect_store(rank, world_size, startup, address)
        except (OSError, RuntimeError) as exc:  # torch's DistStoreError / DistNetworkError, a bind error
            if rank == 0 and _in_use(exc):
                raise OSError(errno.EADDRINUSE, f"gradsync.init on rank 0: cannot host the rendezvous store on "
                                                f"{host}:{port}: address already in use; "
                                                f"{_port_in_use_hint(address)}") from None
            if not isinstance(exc, (RuntimeError, TimeoutError)):
                raise
            if rank == 0 or isinstance(exc, CollectiveTimeoutError):
                raise
            cause = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]  # one line
            raise CollectiveTimeoutError(
                f"gradsync.init on rank {rank}: could not reach the rendezvous store at "
                f"{host}:{port} within {startup.total_seconds():g} s "
                f"({cause}); if rank 0 hosts it, {_NEVER_JOINED_HINT}", op="init",
                rank=rank, peer=0, step="start-up") from exc
        _Default.store, _Default.store_key, _Default.init_generation = store, key, 0
    return _Default.store


def _in_use(exc: BaseException) -> bool:
    """Whether ``exc`` says the address to listen on is taken (a bind error, or torch's store server's)."""
    return ((isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE)
            or "address already in use" in str(exc).lower())


def _port_in_use_hint(address: tuple[str, int, str]) -> str:
    """What may hold the port and what to do: SLURM's causes under srun ("tcp"), else MASTER_PORT's."""
    if address[2] == "tcp":
        return slurm.port_in_use_hint(slurm.read())
    return "another process uses it (a second rank 0, or another job): set MASTER_PORT to a free port"


def _connect_store(rank: int, world_size: int, startup: datetime.timedelta, address: tuple[str, int, str]):
    """The store at ``address`` (host, port, "env" | "tcp"); rank 0 hosts it on the loopback address only
    when the host is loopback."""
    host, port, scheme = address
    gloo_on_loopback(host)
    agent_store = scheme == "env" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if rank == 0 and not agent_store and is_loopback(host):
        # No wait for the clients here: _wait_for_every_rank names the ranks that never come.
        return loopback_store_server(host, port, world_size, startup, wait_for_workers=False)
    if not is_loopback(host):  # another machine's address: torch's own store (every interface)
        url = "env://" if scheme == "env" else f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
        make = lambda: next(dist.rendezvous(url, rank, world_size, timeout=startup))[0]  # noqa: E731
    else:
        make = lambda: dist.TCPStore(host, port, world_size, False, startup)  # noqa: E731
    return bounded(make, startup.total_seconds(), f"rank {rank}: the rendezvous store at {host}:{port}")


def shutdown() -> None:
    """Leave the group; ``init`` may be called again afterwards. A no-op if not initialized."""
    for communicator in [_Default.communicator, *_Default.by_group.values()]:
        if communicator is not None:
            communicator.close()
    _Default.communicator = None
    _Default.by_group.clear()
    if _Default.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _Default.owns_process_group = False


def is_initialized() -> bool:
    return _Default.communicator is not None


def default_communicator() -> Communicator:
    if _Default.communicator is None:
        raise NotInitializedError("gradsync is not initialized: call gradsync.init() first")
    return _Default.communicator


def rank() -> int:
    """This process's rank in the default group."""
    return default_communicator().rank


def world_size() -> int:
    """The number of ranks in the default group."""
    return default_communicator().world_size


def _is_default_process_group(group) -> bool:
    """Whether ``group`` is torch's default group (``dist.group.WORLD``), the one the default communicator uses."""
    return dist.is_initialized() and (group is dist.group.WORLD
                                      or group is dist.distributed_c10d._get_default_group())


def resolve_group(group) -> Communicator:
    """Map ``group`` (None, a Communicator, or a torch ProcessGroup) to a Communicator.

    None and torch's default group (``dist.group.WORLD``) both mean the default communicator, so
    that ranks naming the default group either way share one communicator and its state.

    Raises:
        TypeError: ``group`` is none of these; NotInitializedError: None without ``gradsync.init``.
    """
    if group is None:
        return default_communicator()
    if isinstance(group, Communicator):
        return group
    if isinstance(group, dist.ProcessGroup):
        if _Default.communicator is not None and _is_default_process_group(group):
            return _Default.communicator
        key = id(group)
        if key not in _Default.by_group:
            timeout_s = default_communicator().timeout_s if _Default.communicator else DEFAULT_TIMEOUT_S
            communicator = Communicator(TorchP2PTransport(group), timeout_s=timeout_s)
            _learn_locality(communicator, timeout_s)  # the first collective on this group: every rank is here
            _Default.by_group[key] = communicator
        return _Default.by_group[key]
    raise TypeError(f"group must be None, a gradsync Communicator or a torch ProcessGroup, "
                    f"got {type(group).__name__}")


def resolve_group_or_reject(group, what: str) -> Communicator:
    """:func:`resolve_group` for the collective ``what`` (e.g. "all_reduce"), that keeps the ranks in step.

    When ``group`` cannot be resolved on this rank (TypeError) and a default group exists, this rank
    first takes part in ``what``'s layout check on the default communicator with a rejection, then
    raises the TypeError: peers that called ``what`` on the default group raise
    CollectiveMismatchError ("rank 1 rejected the call: group must be ...") instead of pairing
    their call with this rank's next one. Without a default group it just raises.

    Collective (on the default group) only when it raises.
    """
    try:
        return resolve_group(group)
    except TypeError as exc:
        try:
            fallback = default_communicator()
        except NotInitializedError:
            raise exc from None
        reject_call(fallback, what, exc, cause="a bad group")
        raise
