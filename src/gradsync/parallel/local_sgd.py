"""Local SGD: every worker steps its own optimizer; parameters are averaged every H steps, or DiLoCo's outer step.

Lin et al. 2018, "Don't use large mini-batches, use local SGD"; Stich 2019,
"Local SGD converges fast and communicates little". The middle ground
between synchronous data parallelism (H = 1: with SGD, plain or with
momentum, averaging the parameters after every step equals averaging the
gradients) and independent training. Torch's counterpart is
``PeriodicModelAverager`` / ``PostLocalSGDOptimizer``.

With an outer optimizer (``outer_optimizer="nesterov"``: DiLoCo, Douillard et
al. 2023), compressed outer deltas (``outer_compression``, with error
feedback) or fragments (Streaming DiLoCo, Douillard et al. 2025), the
average is replaced by :class:`~gradsync.parallel.outer_sync.OuterSync`'s
rounds; :class:`~gradsync.parallel.diloco.DiLoCo` is this class with the
paper's defaults.

>>> import torch, gradsync
>>> from gradsync.transport.thread import ThreadWorld
>>> comm = gradsync.Communicator(ThreadWorld(1).transport(0))
>>> model = LocalSGD(torch.nn.Linear(2, 1), sync_every=4, group=comm)
>>> [model.step() for _ in range(4)]
[False, False, False, True]
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn

from gradsync import collectives
from gradsync.collectives.communicator import check_timeout
from gradsync.parallel.fragments import check_fragments
from gradsync.parallel.outer_optimizer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM, make_outer_optimizer
from gradsync.parallel.outer_sync import OuterSync, make_codec
from gradsync.parallel.replica_check import ReplicaCheck, check_replicas
from gradsync.parallel.replicas import agree_on_arguments, broadcast_tensors, verify_parameters


class LocalSGD(nn.Module):
    """Wrap ``module`` for local SGD; call :meth:`step` after every ``optimizer.step()``.

    Gradients are never communicated: build the optimizer on
    ``model.parameters()`` as for a single process. Every ``sync_every``-th
    :meth:`step` replaces every rank's parameters (and floating-point
    buffers) by their average over the group, in one AllReduce per dtype.
    Optimizer state (momentum, Adam moments) stays per rank, as in Lin et al.

    Args:
        module: the model; rank 0's parameters and buffers are broadcast at construction.
        sync_every: H, optimizer steps between averages (int >= 1).
        group: None (the default group), a Communicator or a torch ProcessGroup.
        algorithm: the AllReduce algorithm of the averages (a name in ``gradsync.ALGORITHMS``).
        timeout: seconds an average may take (None: the group's timeout).
        outer_optimizer: "none" (the average: plain local SGD) or "nesterov" (DiLoCo's outer step on
            the averaged pseudo-gradient, :mod:`~gradsync.parallel.outer_optimizer`).
        outer_lr, outer_momentum: Nesterov's (None: the DiLoCo paper's 0.7 and 0.9); with
            ``outer_optimizer="none"`` leave them None (a value would be ignored: ValueError).
        outer_compression: how the outer deltas travel: "fp32" (exact, ``algorithm``), "bf16", "fp16" or
            "int8" (two-phase exchange with error feedback; int8 with one absmax scale per chunk).
        outer_fragments: F, Streaming DiLoCo's fragments (divides ``sync_every``, at most the parameter tensors).
        outer_delay: τ, inner steps a fragment's AllReduce overlaps before it is applied (None: 1 with
            fragments, else 0; 0 <= τ < ``sync_every``).

    Attributes:
        local_steps: steps since the last average (0 right after one); with an outer round, steps into
            the current H-step round.
        averages: averages done so far (with an outer round: fragment rounds applied).
        comm_seconds: seconds spent averaging (plain averages: the caller waits for all of it).
        payload_nbytes: bytes of the AllReduce payloads sent so far (encoded), per rank.
        outer: the :class:`~gradsync.parallel.outer_sync.OuterSync` (None for plain averaging in fp32
            without fragments).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``group`` is not a group,
            ``timeout`` is not a number.
        ValueError: bad ``sync_every``, ``algorithm`` or ``timeout`` (finite, > 0), or a bad ``outer_*`` option
            (named by its keyword; ``outer_lr`` / ``outer_momentum`` given with ``outer_optimizer="none"``).
        CollectiveMismatchError: parameter shapes or dtypes differ across ranks,
            ranks disagree on ``sync_every`` or ``algorithm``, or another rank
            was given a bad argument (at once, naming that rank and the
            argument; that rank raises its own TypeError/ValueError).
        CollectiveTimeoutError: (from ``step``/``average``) a peer did not take part in time.
    """

    def __init__(self, module: nn.Module, sync_every: int, group=None, algorithm: str = collectives.DEFAULT_ALGORITHM,
                 timeout: float | None = None, *, outer_optimizer: str = "none", outer_lr: float | None = None,
                 outer_momentum: float | None = None, outer_compression: str = "fp32", outer_fragments: int = 1,
                 outer_delay: int | None = None):
        super().__init__()
        fragments = outer_fragments
        delay = (1 if fragments != 1 else 0) if outer_delay is None else outer_delay
        rounds = (outer_optimizer, outer_compression, fragments, delay) != ("none", "fp32", 1, 0)

        def check() -> None:
            if not isinstance(module, nn.Module):
                raise TypeError(f"LocalSGD wraps a torch.nn.Module, got {type(module).__name__}")
            if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
                raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
            collectives.validate_algorithm(algorithm)
            if timeout is not None:
                check_timeout(timeout)
            make_outer_optimizer(outer_optimizer, outer_lr, outer_momentum)
            make_codec(outer_compression)
            if rounds:
                check_fragments(fragments, sync_every, len(_floating_parameters(module)))
            if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < sync_every:
                raise ValueError(f"outer_delay must be an int in [0, sync_every) = [0, {sync_every}), got {delay!r}")

        settings = {"sync_every": sync_every, "algorithm": algorithm,  # timeout may differ per rank
                    "outer_optimizer": outer_optimizer,
                    "outer_lr": DILOCO_OUTER_LR if outer_lr is None else outer_lr,
                    "outer_momentum": DILOCO_OUTER_MOMENTUM if outer_momentum is None else outer_momentum,
                    "outer_compression": outer_compression, "outer_fragments": fragments, "outer_delay": delay}
        self.comm = agree_on_arguments("LocalSGD", group, settings, check)
        self.module = module
        self.sync_every = sync_every
        self.algorithm = algorithm
        self.timeout = timeout
        tensors = list(module.named_parameters()) + list(module.named_buffers())
        verify_parameters(tensors, self.comm, owner="LocalSGD")
        broadcast_tensors([t.data for _, t in tensors], self.comm)
        self.outer = None
        if rounds:
            self.outer = OuterSync(_floating_parameters(module), self.comm, sync_every=sync_every,
                                   outer=make_outer_optimizer(outer_optimizer, outer_lr, outer_momentum),
                                   compression=outer_compression, fragments=fragments, delay=delay,
                                   algorithm=algorithm, timeout=timeout)
            tensors = list(module.named_buffers())  # the parameters are the outer rounds'
        self.settings = settings
        self._groups: dict[tuple, list[torch.Tensor]] = {}  # (dtype, device) -> floating tensors averaged
        for _, tensor in tensors:
            if tensor.dtype.is_floating_point:
                self._groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        self._flat = {key: torch.empty(sum(t.numel() for t in members), dtype=key[0], device=key[1])
                      for key, members in self._groups.items()}  # one buffer per group, allocated once
        self.local_steps = 0
        self.averages = 0
        self.payload_nbytes = 0
        self._plain_seconds = 0.0
        self._verified = False  # the averages' layouts compared by every rank

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def bucket_algorithms(self) -> list[tuple[int, str]]:
        """Per average (one per dtype and device; with outer rounds, one per fragment): (bytes of its
        AllReduce payload, the algorithm that runs it, ``auto`` resolved as the collectives resolve it
        for that size; ``two_phase:<compression>`` for compressed outer deltas)."""
        if self.outer is not None and self.outer.codec is not None:
            return [(self.outer.fragment_payload_nbytes(f), f"two_phase:{self.outer.compression}")
                    for f in self.outer.fragments]
        if self.outer is not None:
            sizes = [self.outer.fragment_payload_nbytes(f) for f in self.outer.fragments]
        else:
            sizes = [flat.numel() * flat.element_size() for flat in self._flat.values()]
        return [(nbytes, collectives.resolve_algorithm(self.comm, nbytes, self.algorithm)) for nbytes in sizes]

    @property
    def exposed_comm_seconds(self) -> float:
        """Seconds the training thread waited for communication: every plain average, and the outer
        rounds' waits (an overlapped fragment's AllReduce is hidden while inner steps run)."""
        return self._plain_seconds + (self.outer.exposed_comm_seconds if self.outer is not None else 0.0)

    @property
    def comm_seconds(self) -> float:
        """Seconds spent communicating (the outer rounds' on the communication thread included)."""
        return self._plain_seconds + (self.outer.comm_seconds if self.outer is not None else 0.0)

    @comm_seconds.setter
    def comm_seconds(self, seconds: float) -> None:
        self._plain_seconds = seconds

    @contextmanager
    def no_sync(self):
        """No-op (gradients are never synchronized); kept so loops written for DataParallel run unchanged."""
        yield

    def step(self) -> bool:
        """Count one local optimizer step; average the parameters if it was the H-th (with outer rounds:
        send and apply the fragments whose turn it is). Returns whether the parameters were synced
        (with outer rounds: whether a fragment's global parameters changed)."""
        if self.outer is None:
            self.local_steps += 1
            if self.local_steps < self.sync_every:
                return False
            self.average()
            return True
        applied = self.outer.after_step()
        self.local_steps = self.outer.cycle
        if self.local_steps == 0 and self._groups:  # the round's end: buffers are averaged plainly
            self._average_groups()
        self.averages = self.outer.rounds
        return applied

    def check_replicas(self, *, buffers: bool = True, step: int | None = None,
                       timeout: float | None = None) -> ReplicaCheck:
        """Raise ReplicaDivergenceError on every rank unless the replicas are bitwise equal; call it
        right after an average (``step()`` returned True, or ``average()``), the only moment they
        must agree. Optimizer state is per rank in local SGD and is not compared. ``step`` (None:
        the number of averages so far) labels the error. See :func:`gradsync.check_replicas`.
        With outer rounds what must agree at every step is compared instead: each fragment's global
        parameters and the outer optimizer's momentum (``buffers`` is then not used).

        Raises:
            ValueError: ``local_steps`` is not 0 (steps taken since the last average; plain averaging only).
        """
        step_kwargs = {"step": self.averages if step is None else step, "compare_step": step is not None}
        if self.outer is not None:
            return check_replicas(self.outer.shared_state_module(), buffers=True, group=self.comm,
                                  timeout=timeout, **step_kwargs)
        rejection = None
        if self.local_steps:  # still takes part, so that a rank called right after an average is not left waiting
            rejection = ValueError(f"LocalSGD.check_replicas: replicas differ between averages by design; call it "
                                   f"right after an average (this rank took {self.local_steps} local steps since)")
        return check_replicas(self.module, buffers=buffers, group=self.comm, timeout=timeout,
                              _rejection=rejection, **step_kwargs)

    @torch.no_grad()
    def average(self) -> None:
        """Replace parameters and floating buffers by their mean over the group now (collective). With
        outer rounds: apply those in flight, then one outer round of every fragment stepped since it was
        sent, blocking (the end of training), and average the buffers."""
        if self.outer is not None:
            self.outer.sync_all()
            self.averages = self.outer.rounds
        if self._groups:
            self._average_groups()
        if self.outer is None:
            self.local_steps = 0
            self.averages += 1

    def _average_groups(self) -> None:
        started = time.perf_counter()
        for key, members in self._groups.items():
            flat = self._flat[key]
            offset = 0
            for tensor in members:
                flat[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
                offset += tensor.numel()
            collectives.all_reduce(flat, self.comm, op="avg", algorithm=self.algorithm, timeout=self.timeout,
                                   verify=not self._verified)
            self.payload_nbytes += flat.numel() * flat.element_size()
            offset = 0
            for tensor in members:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        self._verified = True
        self._plain_seconds += time.perf_counter() - started

    @property
    def sent_payload_nbytes(self) -> int:
        """Bytes of every AllReduce payload this rank sent so far (plain averages and outer rounds)."""
        return self.payload_nbytes + (self.outer.payload_nbytes if self.outer is not None else 0)

    @contextmanager
    def evaluation(self, final: bool = False):
        """The replica to evaluate inside the block (collective). Plain local SGD: the average (taken now
        if steps were made since the last, as Lin et al. evaluate). Outer rounds: the global parameters
        θ_g (the same on every rank; no communication), or with ``final`` (the end of training) the
        module after :meth:`average` (every step's progress in it)."""
        if self.outer is None or final:
            if self.local_steps or (self.outer is not None and final):
                self.average()
            yield self.module
            return
        with torch.no_grad():
            saved = self.outer.load_global_into_module()
        try:
            yield self.module
        finally:
            with torch.no_grad():
                self.outer.restore_local(saved)

    def sync_state_dict(self) -> dict:
        """This rank's averaging state for a checkpoint: counters, and the outer rounds' state (θ_g, the
        outer momentum, the error-feedback residuals, AllReduces not yet applied)."""
        return {"local_steps": self.local_steps, "averages": self.averages, "payload_nbytes": self.payload_nbytes,
                "outer": self.outer.state_dict() if self.outer is not None else None}

    def load_sync_state_dict(self, state: dict) -> None:
        """Put :meth:`sync_state_dict`'s output back. ValueError: outer state without outer rounds or the reverse."""
        if (state.get("outer") is None) != (self.outer is None):
            raise ValueError("the checkpoint's local-SGD state is " + ("plain averaging" if state.get("outer") is None
                             else "DiLoCo's outer rounds") + ", this model's is not (another --outer-* option?)")
        self.local_steps = int(state["local_steps"])
        self.averages = int(state["averages"])
        self.payload_nbytes = int(state["payload_nbytes"])
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])

    def summary_fields(self) -> dict:
        """What ``summary.json`` says of the averaging: the outer options, rounds and payload bytes per rank."""
        outer = self.outer
        return {"outer_optimizer": self.settings["outer_optimizer"],
                "outer_compression": self.settings["outer_compression"], "outer_fragments": self.settings["outer_fragments"],
                "outer_delay": self.settings["outer_delay"], "averages": self.averages,
                "sync_payload_nbytes": self.sent_payload_nbytes,
                **({"outer_lr": self.settings["outer_lr"], "outer_momentum": self.settings["outer_momentum"]}
                   if self.settings["outer_optimizer"] != "none" else {}),
                **({} if outer is None else {"outer_rounds": outer.rounds})}


def _floating_parameters(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's floating-point parameters, by name (what outer rounds synchronise)."""
    return [(name, p) for name, p in module.named_parameters() if p.dtype.is_floating_point]
