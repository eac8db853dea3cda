"""``gradsync train``'s memory preflight before step 1, and the estimate beside the measured peak at the end.

:class:`MemoryReport` takes the rank's baseline when the trainer starts
(after the data is loaded, before the model is built:
:func:`~gradsync.train.process_memory.snapshot`), once the optimizer's
machinery is loaded: constructing and stepping the first torch optimizer
imports ``torch._dynamo`` and ~800 other modules (~70 MiB of Python
objects per process, whatever the model), which is torch's code, not the
run's memory; a throwaway optimizer of the run's kind stepped on one element
(:func:`~gradsync.parallel.preflight.state_slots`) loads it before the
snapshot, so the measured peak is the run's own. Once the replica and its
optimizer exist, :meth:`MemoryReport.check` (collective) runs
:func:`gradsync.parallel.preflight_fit.check_fit` on rank 0 with a sample
micro-batch of the task (the first training samples, at the run's
micro-batch size) and its evaluation (rank 0's piece of the test split,
scored without gradients between steps) against the smallest memory any
rank has available. It first probes: two passes of each at a sixteenth and
an eighth of the size, scaled linearly (:func:`~gradsync.parallel.pass_memory.scaled`),
so that a run whose activations cannot fit is refused without running them;
only then are the passes measured at their real size (the tensors exactly,
and what the allocator keeps beyond them). Under ``--memory-limit-mib`` the
estimate also counts the pages the rank's cgroup was charged beyond its own
growth once those passes ran (copy-on-write copies of the forkserver's pages:
:func:`~gradsync.train.process_memory.copied_bytes`). Both checks compare with the
smallest :func:`~gradsync.train.process_memory.available_bytes` of any
rank; rank 0 then gives its heap back (``malloc_trim``) and broadcasts
the verdict: every rank raises the same one-line
:class:`~gradsync.MemoryPreflightError` before anything is trained, or
keeps the estimate. ``--no-preflight`` skips it. At the end
:meth:`MemoryReport.summary_fields` (collective) gathers every rank's
measured peak (:func:`~gradsync.train.process_memory.measured_peak`) for
``summary.json``: ``"preflight": {"estimate_mib", "measured_peak_mib", ...}``,
the peak the largest over the ranks, as the estimate is one rank's (every
rank's estimate is the same).
"""

from __future__ import annotations

import contextlib
import os

import torch

from gradsync import api
from gradsync.errors import GradsyncError, MemoryPreflightError
from gradsync.hosts import resident
from gradsync.parallel.pass_memory import measure_pass, scaled
from gradsync.parallel.preflight import PARTS, MemoryEstimate, state_slots
from gradsync.parallel.preflight_fit import Trial, check_fit
from gradsync.process_group import default_communicator, rank
from gradsync.train import process_memory
from gradsync.train.setup import make_optimizer
from gradsync.train.task import make_model, position_counts, sample_loss

_NO_LIMIT = -1


def limit_below_parameters(config) -> str | None:
    """Why ``--memory-limit-mib`` cannot hold even one rank's parameters at ``config``'s ``--shard`` and
    ``--nproc`` (the model built on the meta device: no memory, no data), or None. Said before any process
    starts; what else fits is the preflight's, in each rank."""
    if config.memory_limit_mib is None:
        return None
    with torch.device("meta"):
        model = make_model(config)
    whole = sum(param.numel() * param.element_size() for param in model.parameters())
    per_rank = -(-whole // config.nproc) if config.shard == "parameters" else whole
    if per_rank < config.memory_limit_mib * 2**20:
        return None
    hint = "" if config.shard == "parameters" or -(-whole // config.nproc) >= config.memory_limit_mib * 2**20 \
        else f"; --shard parameters keeps 1/{config.nproc} of them per rank"
    return (f"--memory-limit-mib {config.memory_limit_mib} is below the {config.model} model's parameters alone: "
            f"{per_rank / 2**20:.1f} MiB per rank at --shard {config.shard} and --nproc {config.nproc}{hint}")


class MemoryReport:
    """One rank's baseline, the run's estimate (after :meth:`check`) and the end-of-run fields."""

    def __init__(self, config):
        self.config = config
        state_slots(make_optimizer([torch.zeros(1, requires_grad=True)], config))  # torch's optimizer code
        self.before = process_memory.snapshot()
        self.estimate: MemoryEstimate | None = None

    def micro_batch(self, world_size: int) -> int:
        """Samples in one of this rank's backward passes (``--deterministic``: one micro-shard's)."""
        config = self.config
        if config.deterministic:
            return max(config.global_batch_size // config.micro_shards, 1)
        return config.per_worker_batch_size(world_size)

    def check(self, model, optimizer, data, world_size: int) -> None:
        """The preflight (collective): raises :class:`~gradsync.MemoryPreflightError` on every rank alike
        when one rank's estimate exceeds the smallest memory available to any rank."""
        if not self.config.preflight:
            return
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        mine = process_memory.available_bytes(self.before, local_ranks)
        gathered = [int(value) for value in api.all_gather(torch.tensor([_NO_LIMIT if mine is None else mine]))]
        known = [value for value in gathered if value != _NO_LIMIT]
        available = min(known) if known else None
        message, found, failed = "", None, False
        whole = getattr(model, "full_parameters", None)  # ZeRO-3: every rank gathers, rank 0 measures
        with whole() if whole is not None else contextlib.nullcontext():
            if rank() == 0:
                try:
                    found = self._estimate(model, optimizer, data, world_size, available)
                except MemoryPreflightError as exc:
                    message, found = str(exc), exc.estimate
                except Exception as exc:  # noqa: BLE001 - said on every rank, not left to time out on the others
                    message, failed = f"gradsync preflight could not estimate: {type(exc).__name__}: {exc}", True
        resident.trim_heap()  # the measured passes' freed blocks go back: the run starts from a trimmed heap
        self.estimate, message, failed = _share(found, message, failed)
        if failed:
            raise GradsyncError(f"{message} (--no-preflight skips the preflight)")
        if message:
            raise MemoryPreflightError(message, estimate=self.estimate)

    def _estimate(self, model, optimizer, data, world_size: int, available: int | None) -> MemoryEstimate:
        """Rank 0's estimate: probes first (two small passes, scaled), then, if those fit, the real passes."""
        config, module = self.config, model.module
        size = min(self.micro_batch(world_size), len(data.y_train))
        piece = self._test_piece(len(data.y_test), world_size)

        def train_pass(count: int):
            targets = data.y_train[:count]
            return measure_pass(module, data.x_train[:count], lambda output: sample_loss(output, targets))

        def eval_pass(count: int):
            with torch.no_grad():
                return measure_pass(module, data.x_test[piece[:count]],
                                    lambda output: position_counts(output, data.y_test[piece[:count]]))

        train_at, eval_at = _probed(train_pass, size), _probed(eval_pass, len(piece))
        eval_for = lambda ranks: eval_at(len(self._test_piece(len(data.y_test), ranks)))  # noqa: E731
        locality = default_communicator().locality
        settings = {"bucket_cap_mb": config.bucket_cap_mb, "algorithm": config.algorithm,
                    "one_host": locality is None or locality.one_host,
                    "gradient_as_bucket_view": config.gradient_as_bucket_view}
        base = Trial(world_size, config.shard, size, config.accumulate)
        check_fit(module, optimizer, base, available, settings, train_at(size), train_at, evaluated=eval_for,
                  options=True, copied=process_memory.copied_bytes(self.before))
        measured, passed = eval_pass(len(piece)), train_pass(size)
        return check_fit(module, optimizer, base, available, settings, passed, train_at,
                         evaluated=lambda ranks: measured if ranks == world_size else eval_for(ranks), options=True,
                         copied=process_memory.copied_bytes(self.before))

    def _test_piece(self, num_test: int, world_size: int) -> torch.Tensor:
        """The largest piece of the test split one rank scores at once (:func:`~gradsync.train.evaluate.evaluate`)."""
        pieces = self.config.micro_shards if self.config.deterministic else world_size
        return torch.tensor_split(torch.arange(num_test), pieces)[0]

    def summary_fields(self) -> dict:
        """``{"preflight": {...}}`` for ``summary.json`` (collective: every rank's measured peak)."""
        peak = process_memory.measured_peak(self.before)
        total = self.estimate.total_bytes if self.estimate is not None else _NO_LIMIT
        rows = api.all_gather(torch.tensor([total, peak.bytes, peak.file_growth], dtype=torch.int64))
        measured = [int(row[1]) for row in rows]
        fields = {"estimate_mib": None if total == _NO_LIMIT else total / 2**20,
                  "measured_peak_mib": max(measured) / 2**20,
                  "measured_by": peak.source,
                  "measured_peak_mib_per_rank": [value / 2**20 for value in measured],
                  "file_pages_mib_per_rank": [int(row[2]) / 2**20 for row in rows]}
        if self.estimate is not None:
            fields["estimate_parts_mib"] = {part.replace("_bytes", ""): getattr(self.estimate, part) / 2**20
                                            for part in PARTS}
        return {"preflight": fields}


def _probed(measure, size: int):
    """``size -> PassMemory`` scaled from two probes of ``measure`` at a sixteenth and an eighth of ``size``
    (at least 1 and 2 samples): the passes a run that may not fit can afford."""
    small = max(size // 16, 1)
    if size <= 2 * small:
        return lambda count: measure(count)
    first, second = measure(small), measure(2 * small)
    return lambda count: scaled(first, second, small, 2 * small, count)


def _share(found: MemoryEstimate | None, message: str, failed: bool) -> tuple[MemoryEstimate, str, bool]:
    """Rank 0's estimate, its refusal (empty: it fits) and whether it failed, on every rank (collective)."""
    encoded = message.encode()
    parts = [getattr(found, part) if found is not None else 0 for part in PARTS]
    head = torch.tensor(parts + [int(failed), len(encoded)], dtype=torch.int64)
    api.broadcast(head, src=0)
    text = torch.tensor(list(encoded), dtype=torch.uint8) if rank() == 0 else \
        torch.zeros(int(head[-1]), dtype=torch.uint8)
    if int(head[-1]):
        api.broadcast(text, src=0)
    return MemoryEstimate(*(int(value) for value in head[:-2])), bytes(text.tolist()).decode(), bool(head[-2])


def preflight_line(summary: dict) -> str | None:
    """The end-of-run line: the estimate beside the measured peak (None when the summary has neither)."""
    fields = summary.get("preflight")
    if not fields:
        return None
    how = "its own cgroup's peak usage" if fields["measured_by"] == "cgroup" else "peak RSS less shared pages"
    measured = f"measured peak {fields['measured_peak_mib']:.1f} MiB (max over ranks, {how}, above the baseline)"
    if fields["estimate_mib"] is None:
        return f"gradsync: memory per rank: no estimate (the preflight did not run); {measured}"
    estimated = f"gradsync: memory per rank: estimated {fields['estimate_mib']:.1f} MiB, {measured}"
    if not fields["measured_peak_mib"] > 0:
        return f"{estimated}: no error (nothing measured above the baseline to compare with)"
    error = 100 * (fields["estimate_mib"] - fields["measured_peak_mib"]) / fields["measured_peak_mib"]
    return f"{estimated}: {error:+.1f}%"
