"""DeterministicDataParallel: gradients bitwise independent of the world size, the placement and the algorithm.

How it works (one optimizer step; every rank sees the same global batch):

1. The global batch is cut into ``M`` micro-shards (:mod:`~gradsync.parallel.micro_shards`); rank r holds a block.
2. For each micro-shard it holds, the rank runs one forward and backward inside ``with model.micro_shard(index)``;
   that micro-shard's gradient is kept apart (never summed in floating point into ``.grad``), and torch's RNG is
   seeded from ``(seed, step, index)`` so dropout does not depend on the rank either.
3. ``model.synchronize(divisor)``: one all_gather of a small header per rank (the
   micro-shards it computed, the largest exponent of each gradient, the divisor,
   any misuse) gives every rank the shared scale of each tensor and lets every
   rank refuse a bad step with the same error; each rank adds its micro-shards'
   gradients into one int64 buffer as fixed point (:mod:`~gradsync.parallel.exact_sum`),
   one int64 AllReduce sums the ranks' buffers (exact in any order, so any
   algorithm), and every rank turns the sum back into floats divided by ``divisor``.
   Sharded (``shard=``, ZeRO-1/2/3), the int64 sum is laid out as the ZeRO buckets and reduce-scattered
   instead, and each rank converts its chunk only (:mod:`~gradsync.parallel.deterministic_shards`).

Each step is either a computation on the same samples or an exact integer sum,
so ``.grad`` has the same bits for 1, 2, 3, 4 ... ranks, any contiguous or
uneven placement, and any ``algorithm``, as long as the thread count (kernels'
blocking) and the micro-shards are the same. Frameworks make one machine
reproducible by fixing reduction orders (``torch.use_deterministic_algorithms``);
an exact sum makes the order irrelevant, so the result also survives a change of
world size: Demmel & Nguyen's reproducible summation (see ``exact_sum``) applied
to micro-batch gradients.

Cost per step and rank: ``M / world_size`` forwards and backwards of ``B / M``
samples instead of one of ``B / world_size``; the local micro-shards'
gradients are held until ``synchronize`` (parameter bytes each) beside an
int64 buffer (twice the float32 parameter bytes) and float64 scratch of the
largest tensor; the AllReduce moves int64, twice a float32 one's bytes, and
nothing overlaps backward. ``bench deterministic`` measures it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn

from gradsync.collectives import ops as collectives
from gradsync.errors import CollectiveMismatchError
from gradsync.parallel.deterministic_shards import UNIT_CAP_MB, ExactSumLayout
from gradsync.parallel.exact_sum import (NO_VALUE, NON_FINITE, ZERO, add_fixed_point, exponent_codes,
                                         from_fixed_point, precision_bits)
from gradsync.parallel.micro_shards import (MicroShard, check_arguments, contiguous_placement,
                                            micro_shard_bounds, shard_seed)
from gradsync.parallel.replica_check import check_replicas
from gradsync.parallel.replicas import agree_on_arguments, broadcast_tensors, verify_parameters
from gradsync.parallel.shard_layout import check_sharding
from gradsync.parallel.zero import ShardedModel, zero_units

DEFAULT_MICRO_SHARDS = 12  # 1, 2, 3, 4, 6 and 12 ranks hold equal shares
OWNER = "DeterministicDataParallel"
# This rank's misuse, reported by every rank at synchronize: code -> message (argument: index or parameter)
_PROBLEMS = {1: "entered micro_shard({arg}), outside [0, {m})",
             2: "entered micro_shard({arg}) twice in one step",
             3: "had a gradient in parameter {name!r} before a micro_shard (a backward outside micro_shard(), "
                "or no zero_grad() after the last step)",
             4: "passed a divisor that is not a finite number > 0",
             5: "entered micro_shard({arg}) inside another micro_shard",
             6: "ran no backward in micro_shard({arg}) (every .grad was None at its end)",
             7: "called backward twice in micro_shard({arg}) (its gradient would count twice)"}
_HEADER_FIXED = 5  # problem code, problem argument, divisor (float64 bits), micro-shards with a loss, spare


class DeterministicDataParallel(ShardedModel, nn.Module):
    """Data parallelism over micro-shards whose averaged gradients do not depend on where they ran.

    Args:
        module: the model (every rank builds the same architecture); no BatchNorm with running
            statistics (they would follow the micro-shards a rank ran): use GroupNorm, LayerNorm or
            ``track_running_stats=False``.
        num_micro_shards: ``M`` >= 1, equal on every rank: the pieces of each global batch. Any
            world size works; equal shares need ``world_size`` to divide it (the default 12:
            1, 2, 3, 4, 6, 12).
        algorithm: a name in ``gradsync.ALGORITHMS`` that carries the int64 sum; every one gives
            the same bits.
        group: None (the default group), a Communicator or a torch ProcessGroup.
        seed: the RNG seed of micro-shard ``i`` at step ``s`` is a hash of ``(seed, s, i)``.
        shard: ``"none"``, ``"optimizer"``, ``"gradients"`` or ``"parameters"`` (ZeRO-1/2/3, see
            ``DataParallel``): the int64 sum is reduce-scattered and each rank converts its chunk only; the
            same bits at every level. Train with ``optimizer = model.shard_optimizer(optimizer)``. At
            ``"parameters"`` each unit is gathered for every micro-shard's forward and backward, so every
            rank must run the same number of micro-shards: ``num_micro_shards`` a multiple of the world size.
        units: ZeRO-3's units (:func:`~gradsync.parallel.units.choose_units`): None (by size, at most
            25 MiB of parameters each), or submodule names, submodules or module classes.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; a parameter that is not floating point.
        ValueError: bad ``num_micro_shards``, ``algorithm``, ``seed``, ``shard`` or ``units``; a BatchNorm
            tracking running statistics (naming it); ``shard="parameters"`` with ``num_micro_shards`` not a
            multiple of the world size (on every rank).
        CollectiveMismatchError: replicas or arguments differ across ranks (on every rank, naming them).

    Example::

        model = gradsync.DeterministicDataParallel(Net(), num_micro_shards=12)
        for step, (x, y) in enumerate(global_batches):            # the same (B, ...) batch on every rank
            bounds = model.shard_bounds(len(x))
            for index in model.local_shards():
                start, stop = bounds[index]
                with model.micro_shard(index, step) as shard:
                    shard.backward(F.cross_entropy(model(x[start:stop]), y[start:stop], reduction="sum"))
            loss = model.synchronize(divisor=len(x))               # .grad = sum over all micro-shards / B
            optimizer.step(); optimizer.zero_grad()

    Attributes:
        comm_seconds, exposed_comm_seconds: seconds in synchronize's collectives, summed (all exposed).
        timeline: a :class:`~gradsync.parallel.timeline.Timeline` the AllReduce spans go to, or None.
    """

    def __init__(self, module: nn.Module, num_micro_shards: int = DEFAULT_MICRO_SHARDS, *,
                 algorithm: str = collectives.DEFAULT_ALGORITHM, group=None, seed: int = 0, shard: str = "none",
                 units=None):
        super().__init__()
        settings = {"num_micro_shards": num_micro_shards, "algorithm": algorithm, "seed": seed, "shard": shard,
                    "units": None}
        chosen = []  # ZeRO-3's units

        def check() -> None:
            check_arguments(module, num_micro_shards, algorithm, seed, OWNER)
            check_sharding(shard, None, False, algorithm)
            chosen.extend(zero_units(module, shard, units, UNIT_CAP_MB))
            settings["units"] = ",".join(unit.name for unit in chosen) if chosen else None

        self.comm = agree_on_arguments(OWNER, group, settings, check)
        if shard == "parameters" and num_micro_shards % self.comm.world_size:  # agreed: every rank raises
            raise ValueError(f"{OWNER}(shard='parameters'): num_micro_shards {num_micro_shards} is not a multiple "
                             f"of the world size {self.comm.world_size}; every rank must run as many micro-shards "
                             f"(each one's forward and backward gathers the parameters, a collective)")
        self.module, self.num_micro_shards, self.algorithm, self.seed = module, num_micro_shards, algorithm, seed
        verify_parameters(list(module.named_parameters()) + list(module.named_buffers()), self.comm, owner=OWNER)
        broadcast_tensors([p.data for p in module.parameters()] + list(module.buffers()), self.comm,
                          names=[n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()])
        self._named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
        self._bits = precision_bits(num_micro_shards)
        # the int64 sum's layout (the ZeRO buckets when sharded; ZeRO-3 frees the parameters here)
        self._layout = ExactSumLayout(module, self._named, self.comm, algorithm, shard, chosen)
        self.shard, self._zero, self._bounds = shard, self._layout.zero, self._layout.bounds
        self._padded = self._layout.numel  # its last element is the loss
        self._accumulator = torch.zeros(self._padded + 1, dtype=torch.int64)  # allocated once, reused
        largest, segment = self._layout.largest_param, self._layout.largest_segment
        # float64 for converting back (one tensor at a time), its bytes as float32 for scaling (a segment at once)
        self._scratch = torch.empty(max(largest, (segment + 1) // 2, 1), dtype=torch.float64)
        self._integers = torch.empty(segment, dtype=torch.int64)
        self._steps = 0
        self._comm_seconds = 0.0
        self.timeline = None
        self._new_step()

    exact_norm = True  # gradsync.clip_grad_norm_ sums the squares exactly: the same bits at any world size

    def forward(self, *args, **kwargs):
        with self._read_check():  # ZeRO-3's first forward: a read of a unit not gathered is named
            output = self.module(*args, **kwargs)
        if self._zero is not None:
            self._zero.flat.wait_all()
        return output

    # -- placement -------------------------------------------------------------------------------

    def local_shards(self) -> range:
        """The micro-shard indices this rank computes by default: its contiguous block (maybe empty)."""
        return contiguous_placement(self.num_micro_shards, self.comm.world_size, self.comm.rank)

    def shard_bounds(self, num_samples: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of each of the ``M`` micro-shards in a global batch of ``num_samples``."""
        return micro_shard_bounds(num_samples, self.num_micro_shards)

    # -- one micro-shard -------------------------------------------------------------------------

    @contextmanager
    def micro_shard(self, index: int, step: int | None = None):
        """Compute micro-shard ``index``'s gradient inside the block (its backward); yields a :class:`MicroShard`.

        Torch's CPU RNG is seeded from ``(seed, step, index)`` inside the block and
        restored after it. ``.grad`` must be None or zero on entry; the gradient the
        block leaves is taken out of ``.grad`` and kept for :meth:`synchronize`.
        Misuse (an index outside ``[0, M)`` or entered twice, a stale gradient) is
        raised by ``synchronize`` on every rank, so no rank waits for another.

        Args:
            index: the micro-shard, in ``[0, num_micro_shards)``; any rank may compute it,
                but every micro-shard exactly once per step over all ranks.
            step: identifies the optimizer step for the seed, the same on every rank
                (default: the number of ``synchronize`` calls so far).
        """
        problem = self._entry_problem(index)
        handle = MicroShard(index)
        self._open = True
        try:
            with torch.random.fork_rng(devices=[]):
                # the CPU generator only: torch.manual_seed also queues every accelerator's (~1.5 ms)
                torch.default_generator.manual_seed(shard_seed(self.seed, self._steps if step is None else step,
                                                               index))
                yield handle
        finally:  # on an exception in the block this micro-shard is dropped: synchronize names it missing
            self._open = False
            grads = [param.grad for _, param in self._named]
            for _, param in self._named:
                param.grad = None
        if problem is None and all(grad is None for grad in grads):
            problem = (6, index)
        if problem is None and handle.backwards > 1:
            problem = (7, index)
        if problem is not None:
            self._problem = self._problem or problem
        else:
            self._keep(index, grads, handle.loss)

    def _entry_problem(self, index) -> tuple[int, int] | None:
        """(code, argument) of what is wrong with entering ``micro_shard(index)`` now, or None."""
        if self._open:
            return 5, int(index) if isinstance(index, int) else -1
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.num_micro_shards:
            return 1, int(index) if isinstance(index, int) else -1
        if index in self._grads:
            return 2, index
        for position, (_, param) in enumerate(self._named):
            if param.grad is not None and bool(param.grad.count_nonzero()):
                return 3, position
            param.grad = None
        return None

    def _keep(self, index: int, grads: list[torch.Tensor | None], loss: float | None) -> None:
        self._grads[index] = grads
        if loss is not None:
            self._losses[index] = torch.tensor([loss], dtype=torch.float64)
        codes = exponent_codes(grads + [self._losses.get(index)])
        self._codes = [max(mine, new) for mine, new in zip(self._codes, codes)]

    def _new_step(self) -> None:
        self._grads: dict[int, list[torch.Tensor | None]] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._codes = [NO_VALUE] * (len(self._named) + 1)
        self._problem: tuple[int, int] | None = None
        self._open = False

    # -- the exchange ----------------------------------------------------------------------------

    def synchronize(self, divisor: float) -> float | None:
        """Set every ``.grad`` to the sum of all ranks' micro-shard gradients divided by ``divisor``.

        Args:
            divisor: a finite number > 0, equal on every rank: usually the global batch's samples
                (the micro-shard losses being sums over samples).

        Returns:
            The loss summed over every micro-shard divided by ``divisor`` (exact, the same on every
            rank), if every micro-shard recorded one with ``MicroShard.backward``; else None.
            ``.grad`` keeps ``param.dtype``; a parameter no micro-shard reached keeps ``.grad = None``;
            a NaN or infinity in any micro-shard makes that parameter's ``.grad`` all NaN.

        Raises:
            CollectiveMismatchError: on every rank, naming the ranks: a micro-shard computed by no
                rank or by two, a rank's misuse of ``micro_shard`` or divisor, divisors that differ.
            CollectiveTimeoutError: a peer never reached ``synchronize``.

        Collective: every rank must call this once per step, after its micro-shards.
        """
        try:
            header = self._header(divisor)
            # layouts were compared at construction (parameters, M): the header's numel is equal everywhere
            gathered = torch.stack(self._timed(collectives.all_gather, header, self.comm, verify=False))
            codes, has_loss = self._check(gathered)
            self._accumulate(codes, has_loss)
            if self._zero is not None:
                self._layout.reduce_scatter(self._accumulator, self._timed)
                self._timed(collectives.all_reduce, self._accumulator[self._padded:], self.comm,
                            algorithm=self.algorithm, verify=False)
                self._layout.write_shards(self._accumulator, codes, self._bits, float(divisor), self._scratch)
                return self._loss(codes, float(divisor), has_loss)
            self._timed(collectives.all_reduce, self._accumulator, self.comm, algorithm=self.algorithm,
                        verify=False, bucket=0)
            return self._write_grads(codes, float(divisor), has_loss)
        finally:
            self._steps += 1
            self._new_step()

    def _timed(self, collective, *args, bucket: int | None = None, **kwargs):
        """``collective(*args, **kwargs)``, its seconds counted; with a ``bucket``, a timeline span of
        ``args[0]``'s bytes."""
        started = time.perf_counter()
        result = collective(*args, **kwargs)
        ended = time.perf_counter()
        self._comm_seconds += ended - started
        if bucket is not None and self.timeline is not None:
            self.timeline.add("allreduce", started, ended, bucket=bucket, nbytes=args[0].numel() * 8)
        return result

    def _header(self, divisor) -> torch.Tensor:
        """This rank's int64 header: problem, divisor bits, losses kept, micro-shards computed, exponent codes."""
        problem = self._problem
        valid = isinstance(divisor, (int, float)) and not isinstance(divisor, bool) and 0 < divisor < float("inf")
        if problem is None and not valid:
            problem = (4, 0)
        bits = torch.tensor([float(divisor) if valid else 0.0], dtype=torch.float64).view(torch.int64)
        counts = [1 if index in self._grads else 0 for index in range(self.num_micro_shards)]
        fixed = [*(problem or (0, 0)), int(bits), len(self._losses), 0]
        return torch.tensor(fixed + counts + self._codes, dtype=torch.int64)

    def _check(self, gathered: torch.Tensor) -> tuple[list[int], bool]:
        """Raise the same CollectiveMismatchError on every rank for a bad step; else the shared codes."""
        problems = [self._problem_text(rank, int(row[0]), int(row[1]))
                    for rank, row in enumerate(gathered) if int(row[0])]
        if problems:
            raise CollectiveMismatchError(f"{OWNER}.synchronize: " + "; ".join(problems))
        divisors = gathered[:, 2].clone().view(torch.float64).tolist()
        if any(value != divisors[0] for value in divisors):
            detail = "; ".join(f"rank {rank} has {value!r}" for rank, value in enumerate(divisors))
            raise CollectiveMismatchError(f"{OWNER}.synchronize: ranks passed different divisors: {detail}")
        m = self.num_micro_shards
        holders = [[rank for rank in range(len(gathered)) if int(gathered[rank, _HEADER_FIXED + index])]
                   for index in range(m)]
        wrong = [f"micro-shard {index} was computed by " + (f"ranks {', '.join(map(str, ranks))}" if ranks
                                                             else "no rank")
                 for index, ranks in enumerate(holders) if len(ranks) != 1]
        if wrong:
            raise CollectiveMismatchError(f"{OWNER}.synchronize: " + "; ".join(wrong) + f": each of the {m} "
                                          "micro-shards must be computed exactly once per step over all ranks")
        codes = gathered[:, _HEADER_FIXED + m:].amax(0).tolist()
        return codes, int(gathered[:, 3].sum()) == m

    def _problem_text(self, rank: int, code: int, arg: int) -> str:
        name = self._named[arg][0] if code == 3 and 0 <= arg < len(self._named) else "?"
        text = _PROBLEMS.get(code, "reported problem {arg}").format(arg=arg, m=self.num_micro_shards, name=name)
        return f"rank {rank} {text}"

    def _accumulate(self, codes: list[int], has_loss: bool) -> None:
        """Add this rank's micro-shard gradients (and losses) into the int64 buffer as fixed point."""
        self._accumulator.zero_()
        work = self._scratch.view(torch.float32)
        for index, grads in self._grads.items():
            self._layout.accumulate(self._accumulator, grads, codes[:-1], self._bits, work, self._integers)
            if has_loss and ZERO < codes[-1] < NON_FINITE:
                add_fixed_point(self._accumulator[-1:], self._losses[index], codes[-1], self._bits)

    def _write_grads(self, codes: list[int], divisor: float, has_loss: bool) -> float | None:
        for position, (_, param) in enumerate(self._named):
            if codes[position] == NO_VALUE:
                param.grad = None
                continue
            start, stop = self._bounds[position]
            out = self._reusable(position, param)
            from_fixed_point(self._accumulator[start:stop], codes[position], self._bits, divisor, param.dtype,
                             self._scratch, out=out)
            param.grad = out.view_as(param)
        return self._loss(codes, divisor, has_loss)

    def _loss(self, codes: list[int], divisor: float, has_loss: bool) -> float | None:
        if not has_loss:
            return None
        return float(from_fixed_point(self._accumulator[-1:], codes[-1], self._bits, divisor, torch.float64))

    def _reusable(self, position: int, param: torch.Tensor) -> torch.Tensor:
        """A kept gradient of ``param`` to write its result into (no new allocation), else a new tensor."""
        for grads in self._grads.values():
            grad = grads[position]
            if grad is not None and grad.is_contiguous() and grad.dtype == param.dtype and grad.shape == param.shape:
                return grad.detach()
        return torch.empty(param.shape, dtype=param.dtype, device=param.device)

    # -- what the trainer and benchmarks read ----------------------------------------------------

    def check_replicas(self, optimizer=None, *, step: int | None = None, timeout: float | None = None):
        """Raise ReplicaDivergenceError on every rank unless parameters, buffers and (given)
        ``optimizer`` state are bitwise equal: see :func:`gradsync.check_replicas`. ``step`` (None:
        this model's count of synchronized steps, quoted but not compared)."""
        if self._zero is not None:  # the optimizer state differs by design
            optimizer = None
        with self.full_parameters():  # parameters whole and equal first
            return check_replicas(self.module, optimizer, group=self.comm, timeout=timeout,
                                  step=self._steps if step is None else step, compare_step=step is not None)

    @property
    def comm_seconds(self) -> float:
        return self._comm_seconds

    @property
    def exposed_comm_seconds(self) -> float:
        return self._comm_seconds  # synchronize waits for all of it: nothing overlaps backward

    def bucket_algorithms(self) -> list[tuple[int, str]]:
        """``[(bytes, algorithm)]`` of the one int64 AllReduce per step (``auto`` resolved for that size); sharded,
        of each bucket's int64 reduce-scatter (``"<algorithm> reduce_scatter"``, as DataParallel's)."""
        if self._zero is not None:
            return [(numel * 8, collectives.resolve_algorithm(self.comm, numel * 8, self.algorithm,
                                                              collective="reduce_scatter") + " reduce_scatter")
                    for numel in self._zero.layout.padded_numel]
        nbytes = self._accumulator.numel() * self._accumulator.element_size()
        return [(nbytes, collectives.resolve_algorithm(self.comm, nbytes, self.algorithm))]
