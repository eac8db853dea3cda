"""Adopting the torch.distributed group a framework set up (Lightning, Fabric, Ray Train): its backend, one timeout.

Lightning's strategies and Ray Train's ``TorchConfig`` initialise ``torch.distributed`` themselves; gradsync
then adopts that group (``gradsync.init`` over an initialised default group). Two things must agree with it:

* the backend: gradsync is told the one torch's group runs (``"gloo"``/``"nccl"``), never ``"auto"``, so a
  Gloo group on a machine with CUDA is not taken for NCCL (which would also select a CUDA device);
* the timeout: gradsync has one collective timeout per group, set by ``gradsync.init``; a later integration
  call asking for another is refused on every rank (:func:`agree_on_timeout`), never silently ignored.
"""

from __future__ import annotations

import gradsync
from gradsync.collectives.communicator import DEFAULT_TIMEOUT_S
from gradsync.parallel.replicas import agree_on_arguments
from gradsync.process_group import default_communicator


def torch_backend() -> str:
    """gradsync's name for the backend of torch.distributed's (initialised) default group: ``"gloo"`` or
    ``"nccl"``; ``"auto"`` for any other (e.g. a per-device ``"cpu:gloo,cuda:nccl"``)."""
    import torch.distributed as dist

    backend = str(dist.get_backend())
    return backend if backend in ("gloo", "nccl") else "auto"


def adopt_torch_group(timeout_s: float | None, owner: str, option: str, remedy: str) -> None:
    """Initialise gradsync over torch.distributed's default group (once per process), with that group's backend
    and ``timeout_s`` (None: gradsync's default, 300 s), then :func:`agree_on_timeout`. Collective.

    Raises:
        ValueError / CollectiveMismatchError: gradsync is already initialised with another timeout.
    """
    if not gradsync.is_initialized():
        gradsync.init(backend=torch_backend(), timeout=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    agree_on_timeout(default_communicator(), timeout_s, owner, option, remedy)


def agree_on_timeout(comm, timeout_s: float | None, owner: str = "prepare_model", option: str = "timeout_s",
                     remedy: str = "pass it to the first prepare_model call or to gradsync.init(timeout=...)") -> None:
    """Refuse a ``timeout_s`` (seconds; None: the group's, never refused) other than ``comm.timeout_s``, on every
    rank; ``owner(option=...)`` names the call in the message, ``remedy`` says what to do instead.

    gradsync has one collective timeout per group, set by ``gradsync.init``: a later call cannot change it, so
    asking for another is refused, not ignored. Collective (a settings check): the ranks also agree on the
    timeout, so a rank that asks for another one raises ValueError and its peers CollectiveMismatchError naming
    it, instead of waiting for it.

    Raises:
        ValueError: ``timeout_s`` differs from the group's, in one line.
        CollectiveMismatchError: another rank refused, or asked for another timeout.
    """
    wanted = comm.timeout_s if timeout_s is None else float(timeout_s)

    def check() -> None:
        if wanted != comm.timeout_s:
            raise ValueError(f"gradsync is already initialised with timeout {comm.timeout_s:g} s; "
                             f"{owner}({option}={timeout_s:g}) cannot change it: {remedy}")

    agree_on_arguments(owner, comm, {option: repr(wanted)}, check)
