"""The parameter server of an elastic asynchronous run: its state outlives memberships and restarts.

:class:`ElasticParameterServer` keeps the parameters, the optimizer and
scheduler, the step and sequence ledger (:class:`~gradsync.parallel.ps_ledger.Ledger`)
and the staleness record across memberships: :meth:`ElasticParameterServer.serve`
runs one membership over its communicator and returns when the run is over,
or raises :class:`~gradsync.parallel.ps_protocol.MembershipChange` when the
membership must re-form (a worker died, joins, or the quorum asked); the
caller then serves the next membership with the same object. Workers are
named by *slot* (stable across relaunches), never by rank.

Protocol (workers: :class:`~gradsync.elastic.ps_worker.ElasticAsyncWorker`):

* a membership starts with a *barrier*: every worker first replays the
  pushes it keeps (``REPLAY``) and then asks for parameters (``PULL``); the
  server hands out no step before every worker asked, then applies the
  replays by the version they were computed on (the order they were first
  applied in, exactly so under ``max_staleness=0``: a restart leaves the
  trajectory unchanged), then hands out again every step that was assigned
  and not replayed (its worker died);
* a push carries ``(slot, seq)``; the server applies it unless ``seq`` is at
  or below the slot's highest applied number (a replay of an applied push:
  dropped, counted in ``ledger.duplicates``);
* every ``checkpoint_every`` applied updates, at the start of each
  membership (once its replays are applied) and before the final stops, the
  whole state is written atomically (:mod:`gradsync.fault.checkpoint`); each
  reply tells the worker the highest ``seq`` of its slot that the newest
  checkpoint holds ("durable"), and a worker keeps every push above it, so a
  server restarted from that checkpoint gets back, by replay, everything it
  had applied after it;
* to leave a membership the server answers each live worker's next request
  with ``CHANGE`` (a push is applied first), so no push is left half-sent.

One membership's exchange is :class:`~gradsync.elastic.ps_session.Session`. It talks over the
membership group's transport (Gloo's TCP pairs), never offers the static server's shared memory
(:mod:`~gradsync.parallel.ps_links`): each membership is a new group whose workers may come and go
mid-way, which TCP's closed connections already report.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from torch import nn

from gradsync.fault import checkpoint as ckpt
from gradsync.elastic.ps_session import Session
from gradsync.parallel.parameter_server import _check_optimizer, optimizer_step
from gradsync.parallel.ps_ledger import Ledger
from gradsync.parallel.ps_protocol import SharedModel, check_transport
from gradsync.parallel.staleness import StalenessGate, StalenessStats

CHECKPOINT_KIND = "gradsync.parameter_server"
_ONE_RANK = SimpleNamespace(rank=0, world_size=1)  # checkpoint.save's group: the server writes alone


class ElasticParameterServer:
    """Parameters, optimizer and bookkeeping of an elastic async run, served one membership at a time.

    Args:
        module, optimizer, total_steps, max_staleness, staleness_aware_lr, scheduler: as
            :class:`~gradsync.parallel.parameter_server.ParameterServer`.
        checkpoint_dir: where checkpoints go (``step-<version>`` folders).
        checkpoint_every: applied updates between checkpoints (>= 1).
        keep: complete checkpoints kept (>= 1).
        timeout: seconds a worker may take between a reply and its next request.

    Attributes:
        version, staleness, losses: as ParameterServer. ``applied_per_slot``:
        ``{slot: updates applied}``. ``ledger``: steps and sequence numbers.
        ``durable_seq``: ``{slot: seq}`` the newest checkpoint holds.
        ``user_state``: a dict the caller fills (epoch records ...), checkpointed too.
        ``restored_from``: the checkpoint loaded by :meth:`restore` (None: a fresh start).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, total_steps: int,
                 checkpoint_dir: str | Path, checkpoint_every: int, keep: int = 2, max_staleness: int | None = None,
                 staleness_aware_lr: bool = False, scheduler=None, timeout: float = 30.0):
        for name, value in (("checkpoint_every", checkpoint_every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 < float(timeout) < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}")
        self.module, self.shared = module, SharedModel(module)
        self.params, self.flat = self.shared.params, self.shared.flat
        _check_optimizer(optimizer, self.params)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.total_steps, self.ledger = total_steps, Ledger(total_steps)
        self.gate, self.staleness_aware_lr = StalenessGate(max_staleness), staleness_aware_lr
        self.checkpoint_dir, self.checkpoint_every, self.keep = Path(checkpoint_dir), checkpoint_every, keep
        self.timeout_s = float(timeout)
        self.version, self.staleness, self.losses = 0, StalenessStats(), []
        self.applied_per_slot: dict[int, int] = {}
        self.durable_seq: dict[int, int] = {}
        self.checkpointed_version: int | None = None
        self.user_state: dict = {}
        self.restored_from: Path | None = None
        self.last_lr = math.nan
        self.memberships = 0
        self.bytes_sent = self.bytes_received = 0

    # -- state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a restarted server needs (tensors, numbers, lists, dicts: ``weights_only`` loads it)."""
        return {"kind": CHECKPOINT_KIND, "version": self.version, "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "ledger": self.ledger.state_dict(), "staleness_histogram": list(self.staleness.histogram),
                "applied_per_slot": dict(self.applied_per_slot),
                "losses": torch.tensor(self.losses, dtype=torch.float64), "user_state": self.user_state}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (the module's tensors are copied in place: views stay views).

        Raises:
            ValueError: not a parameter server's checkpoint, or one of another run length.
        """
        if state.get("kind") != CHECKPOINT_KIND:
            raise ValueError(f"not a parameter-server checkpoint (kind {state.get('kind')!r})")
        self.ledger.load_state_dict(state["ledger"])
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        self.staleness = StalenessStats()
        self.staleness.histogram = [int(n) for n in state["staleness_histogram"]]
        self.applied_per_slot = {int(k): int(v) for k, v in state["applied_per_slot"].items()}
        self.losses = [float(v) for v in state["losses"].tolist()]
        self.user_state = dict(state["user_state"])
        self.durable_seq = dict(self.ledger.applied_seq)
        self.checkpointed_version = self.version

    def checkpoint(self) -> Path:
        """Write the state now (atomically; the manifest last); later replies report it durable."""
        folder = ckpt.save(self.checkpoint_dir, self.version, self.state_dict(), {}, _ONE_RANK, keep=self.keep)
        self.durable_seq = dict(self.ledger.applied_seq)
        self.checkpointed_version = self.version
        return folder

    def restore(self, check: Callable[[dict, Path], None] | None = None) -> bool:
        """Load the newest complete checkpoint in ``checkpoint_dir``, if there is one; returns whether.

        ``check(user_state, folder)``, if given, sees the checkpoint's ``user_state`` first (and raises
        to refuse it, e.g. a checkpoint of another job).
        """
        found = ckpt.latest(self.checkpoint_dir)
        if found is None:
            return False
        state = found.load_shared()
        if check is not None:
            check(dict(state.get("user_state", {})), found.folder)
        self.load_state_dict(state)
        self.restored_from = found.folder
        return True

    # -- applying ---------------------------------------------------------------------------------

    def apply(self, slot: int, header: torch.Tensor, push: torch.Tensor,
              on_update: Callable | None = None) -> bool:
        """Apply one push (``header`` = ``[PUSH or REPLAY, version_read, step, seq]``) unless it is a
        duplicate; returns whether it was applied. Checkpoints every ``checkpoint_every`` updates."""
        version_read, step, seq = int(header[1]), int(header[2]), int(header[3])
        if not self.ledger.accept(slot, seq) or not self.ledger.pending(step):
            return False
        self.ledger.complete(step, slot, seq)
        staleness = max(0, self.version - version_read)  # a replay may come from a newer, lost version
        start, end = self.shared.params_numel, self.shared.params_numel + self.shared.buffers_numel
        self.flat[start:end].copy_(push[start:end])
        grads, offset = [], 0
        for param in self.params:
            grads.append(push[offset:offset + param.numel()].view_as(param))
            offset += param.numel()
        scale = 1.0 / staleness if self.staleness_aware_lr and staleness > 1 else 1.0
        self.last_lr = optimizer_step(self.optimizer, self.scheduler, self.params, grads, scale)
        self.staleness.record(staleness)
        self.applied_per_slot[slot] = self.applied_per_slot.get(slot, 0) + 1
        loss = float(push[-1])
        self.losses.append(loss)
        self.version += 1
        if on_update is not None:
            on_update(slot, self.version, loss, staleness)
        if self.version % self.checkpoint_every == 0:
            self.checkpoint()
        return True

    @property
    def finished(self) -> bool:
        return self.version >= self.total_steps

    def serve(self, comm, slots: list[int], should_close: Callable[[], bool] = lambda: False,
              on_update: Callable | None = None) -> None:
        """Serve one membership: ``comm`` is its group, ``slots[rank]`` each rank's slot (the server's too).

        Returns when every update is applied and every worker of the membership was told to stop.

        Raises:
            MembershipChange: ``should_close()`` became true or a worker's connection closed; every
                live worker was told ``CHANGE`` first.
            CollectiveTimeoutError: a worker sent nothing within ``timeout`` (``peer`` names its rank;
                timed_out is true); the other workers were told ``CHANGE`` first.
            ValueError: a worker's model differs (it was sent ``REJECT``), or it broke the protocol.
        """
        check_transport(comm)
        self.memberships += 1
        session = Session(self, comm, slots, should_close, on_update)
        try:
            session.run()
        finally:
            session.end()
            self.bytes_sent += comm.transport.stats.bytes_sent
            self.bytes_received += comm.transport.stats.bytes_received
