"""DiLoCo's outer round for LocalSGD: per fragment, the pseudo-gradient is compressed, AllReduced and outer-stepped.

DiLoCo (Douillard et al. 2023): every worker keeps the global parameters of
the last sync, θ_g. After its inner steps, worker i sends the pseudo-gradient
Δ_i = θ_g - θ_i; the average Δ = mean_i Δ_i steps θ_g with the outer
optimizer (:mod:`~gradsync.parallel.outer_optimizer`), and every worker
continues from the new θ_g. Streaming DiLoCo (Douillard et al. 2025) cuts the
parameters into F fragments (:mod:`~gradsync.parallel.fragments`), each
synced once per H inner steps at its own staggered step, and lets the
AllReduce overlap the next inner steps.

How a fragment's round goes here (all ranks alike, so it is deterministic):

1. after inner step s (the fragment's offset in the H-step round) this rank
   computes Δ_i (float32) and hands its AllReduce to the communicator's lane
   (the communication thread, :mod:`~gradsync.collectives.lane`): fp32 is a
   gradsync ``all_reduce(op="avg")`` with ``algorithm``; bf16, fp16 and int8
   travel in the compressors' two-phase exchange
   (:mod:`~gradsync.compression.two_phase`: a sum of int8 payloads with
   different scales is no int8 payload, so no ring can add them hop by hop),
   with error feedback on both phases: what the encoding leaves out of Δ_i
   is added to this rank's next Δ of that fragment;
2. training goes on for ``delay`` more inner steps (τ of the paper; 0
   without streaming, 1 with fragments by default) while the AllReduce runs;
3. after inner step s + τ the rank waits for the result (if it is not done),
   steps θ_g with the outer optimizer and sets the fragment's local
   parameters to θ_g plus the local progress made since step s
   (``θ_i ← θ_i + θ_g' - θ_g + Δ_i``). With τ = 0 that is θ_g' itself (every
   replica equal); with τ > 0 no inner step is lost: the τ overlapped steps
   enter the fragment's next pseudo-gradient. (The paper mixes instead,
   ``α·θ_i + (1-α)·θ_g'``; torchft's default α = 0 drops the τ steps.)

Floating-point buffers (batch-norm statistics) are no outer parameters: they
are averaged plainly, blocking, at the end of each H-step round.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from gradsync import collectives
from gradsync.collectives.communicator import Communicator
from gradsync.compression import two_phase
from gradsync.compression.compressor import BucketLayout
from gradsync.compression.error_feedback import ErrorFeedback
from gradsync.compression.int8 import Int8Codec
from gradsync.compression.low_precision import CastCodec
from gradsync.parallel.fragments import launch_offsets, plan_fragments
from gradsync.parallel.option_names import KEYWORDS, Spelling

OUTER_COMPRESSIONS = ("fp32", "bf16", "fp16", "int8")


def make_codec(compression: str, *, spelling: Spelling = KEYWORDS):
    """The two-phase codec of ``compression`` (None for fp32). ValueError on an unknown name (named as
    ``spelling`` does: ``outer_compression``, or the CLI's flag)."""
    codecs = {"fp32": lambda: None, "bf16": lambda: CastCodec(torch.bfloat16, scaled=False),
              "fp16": lambda: CastCodec(torch.float16, scaled=True), "int8": Int8Codec}
    if compression not in codecs:
        raise ValueError(f"unknown {spelling.setting('outer_compression', compression)}; "
                         f"choose one of {', '.join(OUTER_COMPRESSIONS)}")
    return codecs[compression]()


@dataclass
class Fragment:
    """One fragment: its parameters (the module's own tensors), their layout and its global copy."""

    key: int
    params: list[torch.Tensor]
    layout: BucketLayout
    offset: int                  # inner step of each H-step round (1..H) after which it is sent
    global_params: torch.Tensor  # (numel,) float32: θ_g, the same on every rank
    dirty: bool = False          # inner steps taken since it was last sent

    def flat_local(self) -> torch.Tensor:
        """The fragment's current local parameters, ``(numel,)`` float32 (a copy)."""
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.params])

    def write_local(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


@dataclass
class Pending:
    """A fragment's AllReduce launched after inner step ``launched_at``, applied after ``apply_at``."""

    key: int
    launched_at: int
    apply_at: int
    own_delta: torch.Tensor  # (numel,) float32: this rank's Δ_i before encoding
    averaged: torch.Tensor   # (numel,) float32: Δ_i, then (once done) the average Δ
    future: Future | None = None


class OuterSync:
    """The outer loop of :class:`~gradsync.LocalSGD` with an outer optimizer, compression or fragments.

    Args:
        named_params: the module's ``(name, parameter)`` pairs (floating point, one device).
        comm: the group. sync_every: H. outer: an outer optimizer (``step(key, params, delta)``).
        compression: one of ``OUTER_COMPRESSIONS``. fragments: F (divides H, at most the tensors).
        delay: τ, inner steps between a fragment's launch and its application (0 <= τ < H).
        algorithm, timeout: the fp32 AllReduce's.

    Attributes (stats): ``rounds`` fragment AllReduces applied, ``payload_nbytes`` bytes of their
    payloads as sent (encoded, scales included), ``comm_seconds`` seconds they ran on the lane,
    ``exposed_comm_seconds`` seconds the training thread waited for them.
    """

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], comm: Communicator, *, sync_every: int, outer,
                 compression: str, fragments: int, delay: int, algorithm: str, timeout: float | None):
        self.comm, self.sync_every, self.outer, self.delay = comm, sync_every, outer, delay
        self.compression, self.algorithm, self.timeout = compression, algorithm, timeout
        self.codec = make_codec(compression)
        self.worker_feedback = ErrorFeedback() if self.codec is not None else None
        self.server_feedback = ErrorFeedback() if self.codec is not None else None
        bounds = plan_fragments([p.numel() for _, p in named_params], fragments)
        offsets = launch_offsets(sync_every, fragments)
        self.fragments = []
        for key, ((start, stop), offset) in enumerate(zip(bounds, offsets)):
            members = named_params[start:stop]
            layout = BucketLayout(tuple(n for n, _ in members), tuple(p.shape for _, p in members))
            fragment = Fragment(key, [p for _, p in members], layout, offset, torch.empty(0))
            fragment.global_params = fragment.flat_local()
            self.fragments.append(fragment)
        self.steps = 0          # inner steps taken
        self.pending: list[Pending] = []
        self.rounds = self.payload_nbytes = 0
        self.comm_seconds = self.exposed_comm_seconds = 0.0
        self._hold: int | None = None
        self._verified: set[int] = set()  # fragments whose fp32 layout every rank has compared

    @property
    def cycle(self) -> int:
        """Inner steps into the current H-step round (0 right after a round's end)."""
        return self.steps % self.sync_every

    def after_step(self) -> bool:
        """Count one inner step; apply the fragments due, send those whose turn it is. Returns whether a
        fragment was applied (the global parameters changed).

        Collective: every rank calls it after every inner step.
        """
        self.steps += 1
        for fragment in self.fragments:
            fragment.dirty = True
        applied = self._apply_due()
        position = self.cycle or self.sync_every
        for fragment in self.fragments:
            if fragment.offset == position:
                self.launch(fragment)
        return self._apply_due() or applied

    def launch(self, fragment: Fragment) -> None:
        """Compute Δ_i of ``fragment`` and start its AllReduce on the lane (returns at once unless τ = 0)."""
        own = fragment.global_params - fragment.flat_local()
        pending = Pending(fragment.key, self.steps, self.steps + self.delay, own, own.clone())
        fragment.dirty = False
        if self.comm.world_size > 1 and self.delay > 0:
            if self._hold is None:
                self._hold = self.comm.lane.hold(lambda: None)  # public collectives queue behind it
            pending.future = self.comm.lane.submit(self._exchange, fragment, pending.averaged)
        else:
            started = time.perf_counter()
            self._exchange(fragment, pending.averaged)
            self.exposed_comm_seconds += time.perf_counter() - started
        self.pending.append(pending)

    def _exchange(self, fragment: Fragment, values: torch.Tensor) -> None:
        """Replace ``values`` (this rank's Δ_i) by the average over the ranks of what they sent (on the lane)."""
        started = time.perf_counter()
        if self.codec is None:
            collectives.all_reduce(values, self.comm, op="avg", algorithm=self.algorithm, timeout=self.timeout,
                                   verify=fragment.key not in self._verified)
            self._verified.add(fragment.key)
        else:
            two_phase.reduce(values, fragment.layout, self.comm, self.comm.world_size, self.codec,
                             worker_feedback=self.worker_feedback, server_feedback=self.server_feedback,
                             timeout=self.timeout)
        self.payload_nbytes += self.fragment_payload_nbytes(fragment)
        self.comm_seconds += time.perf_counter() - started

    def fragment_payload_nbytes(self, fragment: Fragment) -> int:
        """Bytes of ``fragment``'s AllReduce payload: float32 values, or the two-phase exchange's
        ``world_size`` encoded chunk rows (scales and padding included). A bandwidth-optimal AllReduce
        of it (ring, two-phase) sends 2(p-1)/p of that per rank."""
        numel = fragment.global_params.numel()
        if self.codec is None:
            return numel * 4
        world_size = self.comm.world_size
        return world_size * two_phase.row_nbytes(self.codec, -(-numel // world_size))

    def shared_state_module(self) -> torch.nn.Module:
        """A module whose buffers are what every rank must hold bitwise equal at any step: each fragment's
        θ_g and the outer optimizer's state tensors (for :func:`gradsync.check_replicas`)."""
        holder = torch.nn.Module()
        for fragment in self.fragments:
            holder.register_buffer(f"global_{fragment.key}", fragment.global_params)
        for name, tensor in _tensors(self.outer.state_dict()):
            holder.register_buffer(f"outer_{name}", tensor)
        return holder

    def _apply_due(self) -> bool:
        due = [p for p in self.pending if p.apply_at <= self.steps]
        for pending in due:
            self._apply(pending)
        return bool(due)

    def _apply(self, pending: Pending) -> None:
        """Wait for ``pending``'s AllReduce, step θ_g, move the local parameters (see the module docstring)."""
        try:
            self._wait(pending)
        finally:  # a failed AllReduce is raised here, once; the lane is not left held
            self.pending.remove(pending)
            if not any(p.future is not None for p in self.pending):
                self._release()
        fragment = self.fragments[pending.key]
        old_global = fragment.global_params.clone()
        self.outer.step(fragment.key, fragment.global_params, pending.averaged)
        if pending.launched_at == self.steps:  # no inner step since the launch: θ_i = θ_g' exactly
            fragment.write_local(fragment.global_params)
        else:
            local = fragment.flat_local()
            local += fragment.global_params - old_global + pending.own_delta
            fragment.write_local(local)
        self.rounds += 1

    def _release(self) -> None:
        if self._hold is not None:
            self.comm.lane.release(self._hold)
            self._hold = None

    def _wait(self, pending: Pending) -> None:
        """Wait for ``pending``'s AllReduce if it is in flight (counted as exposed); re-raises its error."""
        if pending.future is None:
            return
        started = time.perf_counter()
        try:
            pending.future.result()
        finally:
            self.exposed_comm_seconds += time.perf_counter() - started
            pending.future = None

    def wait(self) -> None:
        """Wait for every AllReduce in flight (results kept, applied when due); re-raises a failed one."""
        try:
            for pending in self.pending:
                self._wait(pending)
        finally:
            self._release()

    def sync_all(self) -> None:
        """Apply what is in flight, then one blocking round of every fragment with inner steps since it was
        sent (the end of training: the final parameters hold every step). Collective."""
        for pending in list(self.pending):
            self._apply(pending)
        for fragment in self.fragments:
            if fragment.dirty:
                delay, self.delay = self.delay, 0
                try:
                    self.launch(fragment)
                    self._apply(self.pending[-1])
                finally:
                    self.delay = delay

    def global_flat(self) -> list[torch.Tensor]:
        """Every fragment's θ_g, ``(numel,)`` float32 each (the same bits on every rank)."""
        return [fragment.global_params for fragment in self.fragments]

    def load_global_into_module(self) -> list[torch.Tensor]:
        """Write θ_g into the module's parameters; returns the local parameters it replaced (to restore)."""
        saved = [fragment.flat_local() for fragment in self.fragments]
        for fragment in self.fragments:
            fragment.write_local(fragment.global_params)
        return saved

    def restore_local(self, saved: list[torch.Tensor]) -> None:
        for fragment, flat in zip(self.fragments, saved):
            fragment.write_local(flat)

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's outer state: θ_g per fragment, the outer optimizer's, the error-feedback residuals
        (keyed by parameter name), the AllReduces not yet applied (waited for: their results are kept)
        and the counters. Tensors, numbers, lists and dicts only."""
        self.wait()
        return {"steps": self.steps, "rounds": self.rounds, "payload_nbytes": self.payload_nbytes,
                "global": [f.global_params.clone() for f in self.fragments],
                "dirty": [f.dirty for f in self.fragments], "optimizer": self.outer.state_dict(),
                "worker_residual": self.worker_feedback.state_dict() if self.worker_feedback else {},
                "server_residual": self.server_feedback.state_dict() if self.server_feedback else {},
                "pending": [{"key": p.key, "launched_at": p.launched_at, "apply_at": p.apply_at,
                             "own_delta": p.own_delta.clone(), "averaged": p.averaged.clone()}
                            for p in self.pending]}

    def load_state_dict(self, state: dict) -> None:
        """Put :meth:`state_dict`'s output back (the same fragments). ValueError if it does not fit."""
        sizes = [f.global_params.numel() for f in self.fragments]
        if [int(t.numel()) for t in state["global"]] != sizes:
            raise ValueError(f"outer state of fragments of {[int(t.numel()) for t in state['global']]} elements "
                             f"does not fit these fragments of {sizes} (another --outer-fragments or model?)")
        self.wait()
        self.steps, self.rounds = int(state["steps"]), int(state["rounds"])
        self.payload_nbytes = int(state["payload_nbytes"])
        for fragment, flat, dirty in zip(self.fragments, state["global"], state["dirty"]):
            fragment.global_params = flat.detach().to(torch.float32).clone()
            fragment.dirty = bool(dirty)
        self.outer.load_state_dict(state["optimizer"])
        if self.worker_feedback is not None:
            self.worker_feedback.load_state_dict(dict(state["worker_residual"]))
            self.server_feedback.load_state_dict(dict(state["server_residual"]))
        self.pending = [Pending(int(p["key"]), int(p["launched_at"]), int(p["apply_at"]), p["own_delta"].clone(),
                                p["averaged"].clone()) for p in state["pending"]]


def _tensors(state, prefix: str = ""):
    """``(dotted name with '_' for '.', tensor)`` of every tensor in a nested dict of an optimizer's state."""
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, dict):
            yield from _tensors(value, f"{name}_")
