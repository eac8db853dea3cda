"""TensorBoard event files: :class:`TensorBoardHook` for any loop around DataParallel; ``train --tensorboard``.

One writer serves both. A user's loop calls :meth:`TensorBoardHook.step`
after each optimizer step and the hook takes the step's communication from
the model's counters (``comm_seconds``, ``exposed_comm_seconds``,
``comm.stats.bytes_sent``) as differences since the previous step, as
Horovod's timeline takes its spans from the ops it wraps. ``gradsync train``
(:class:`TrainBoard`) writes the numbers its ``metrics.jsonl`` records, so
the two agree. Only the main rank writes (rank 0; the parameter server in
``--mode async``): one run in TensorBoard's list, the loss of a synchronous
step the same on every rank; ``all_ranks=True`` gives each rank a run of
its own (``rank-R``) for per-rank communication. The tags and their units
are :data:`TAGS` (docs/tensorboard.md). Needs the ``tensorboard`` extra.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from gradsync import collectives
from gradsync.errors import import_extra
from gradsync.train.validation import writable_folder

OPTION = "--tensorboard"
HOOK_OPTION = "TensorBoardHook log_dir"  # how the hook's refusals name its folder
ALGORITHMS_TAG = "buckets/algorithms"  # text: one row per bucket (bytes, algorithm); add_text appends /text_summary
TAGS = {  # scalar tag -> unit (every scalar's step is the optimizer step it describes)
    "train/loss": "the step's loss (the mean over its samples)",
    "train/accuracy": "fraction of the step's samples right (the hook, when given)",
    "throughput/samples_per_s": "samples of the step / its wall seconds",
    "step/wall_s": "seconds from the step's start to its end",
    "comm/seconds": "seconds of communication in the step (overlapped with backward or not)",
    "comm/share": "comm/seconds / step/wall_s (0..1)",
    "comm/exposed_seconds": "seconds the step waited for communication",
    "comm/exposed_share": "comm/exposed_seconds / step/wall_s (0..1)",
    "comm/bytes_sent": "payload bytes this rank sent during the step",
    "buckets/count": "buckets the gradients are reduced in",
    "eval/loss": "test loss at an evaluation",
    "eval/accuracy": "test accuracy at an evaluation (fraction)",
    "run/samples_per_s": "the run's samples / its training wall seconds (summary.json)",
    "run/communication_share": "the run's communication seconds / its training wall seconds (summary.json)",
    "run/exposed_communication_s": "the run's exposed communication seconds, mean over ranks (summary.json)",
    "run/bytes_sent_per_step": "bytes sent per optimizer step, mean over ranks (summary.json)",
    "run/final_test_accuracy": "test accuracy at the end (summary.json)",
}


def summary_writer(feature: str = OPTION):
    """``torch.utils.tensorboard.SummaryWriter``, or :class:`~gradsync.errors.MissingExtraError` naming the
    ``tensorboard`` extra and ``feature`` in one line."""
    import_extra("tensorboard", "tensorboard", feature)
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


def check_log_dir(folder: str | Path, option: str = OPTION) -> Path:
    """Prove, before anything starts, that the extra is installed and ``folder`` can hold event files.

    Returns:
        The absolute folder (created if needed).

    Raises:
        MissingExtraError: the ``tensorboard`` extra is not installed.
        ValueError: ``folder`` is empty, a file, or not writable (one line naming ``option``).
    """
    summary_writer(option)
    _check_not_empty(folder, option)
    return writable_folder(folder, option)


def _check_not_empty(folder: str | Path, option: str) -> None:
    if not str(folder).strip():
        raise ValueError(f"{option} needs a folder, got an empty string")


def agree_on_log_dir(comm, log_dir: str | Path, all_ranks: bool) -> Path | None:
    """The hook's run folder on this rank (None: this rank writes nothing), checked on the ranks that write.

    Rank 0 (every rank with ``all_ranks``, each its ``log_dir/rank-R``) runs :func:`check_log_dir`; the
    verdicts are exchanged, so that every rank raises the first failing rank's one-line error.

    Raises:
        ValueError: ``log_dir`` (or a rank's ``rank-R`` below it) is empty, a file or not writable, on
            any rank that checked it; the same message on every rank.

    Collective (when ``comm.world_size > 1``): every rank of ``comm`` calls it with the same ``log_dir``.
    """
    writes = all_ranks or comm.rank == 0
    folder = (Path(log_dir) / f"rank-{comm.rank}" if all_ranks else Path(log_dir)) if writes else None
    try:
        _check_not_empty(log_dir, HOOK_OPTION)
        if folder is not None:
            folder = check_log_dir(folder, HOOK_OPTION)  # absolute, ``~`` expanded, created
        problem = ""
    except ValueError as exc:
        problem = str(exc)
    problem = _first_problem(comm, problem)
    if problem:
        raise ValueError(problem)
    return folder


def _first_problem(comm, problem: str) -> str:
    """The first non-empty ``problem`` of the ranks of ``comm`` (rank order), or "" (collective)."""
    if comm.world_size == 1:
        return problem
    encoded = problem.encode()
    length = max(int(n) for n in collectives.all_gather(torch.tensor([len(encoded)]), comm))
    if length == 0:
        return ""
    mine = torch.zeros(length, dtype=torch.uint8)
    mine[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    texts = [bytes(part.tolist()).rstrip(b"\0").decode(errors="replace")
             for part in collectives.all_gather(mine, comm)]
    return next(text for text in texts if text)


def algorithms_table(algorithms: list[tuple[int, str]]) -> str:
    """Markdown rows ``| bucket | bytes | algorithm |`` of ``(nbytes, algorithm)`` per bucket (TensorBoard's
    text tab renders them as a table)."""
    rows = ["| bucket | bytes | algorithm |", "|---|---|---|"]
    rows += [f"| {index} | {int(nbytes)} | {name} |" for index, (nbytes, name) in enumerate(algorithms)]
    return "\n".join(rows)


class EventWriter:
    """Scalars and texts of one run folder (``SummaryWriter``), or nothing when ``log_dir`` is None.

    The numbers are given; :class:`TensorBoardHook` measures them from a model, :class:`TrainBoard` takes
    ``gradsync train``'s own.
    """

    def __init__(self, log_dir: str | Path | None, feature: str = OPTION, flush_secs: float = 10.0):
        writer = summary_writer(feature)  # on every rank: a missing extra fails everywhere alike
        self.writer = None if log_dir is None else writer(str(log_dir), flush_secs=flush_secs)
        self.algorithms_written = None

    @property
    def writing(self) -> bool:
        return self.writer is not None

    def write_step(self, step: int, loss: float | None, samples: float | None, wall_s: float,
                   comm_s: float | None = None, exposed_s: float | None = None, bytes_sent: int | None = None,
                   accuracy: float | None = None) -> None:
        """One optimizer step's tags (see :data:`TAGS`); None leaves a tag out."""
        if self.writer is None:
            return
        values = {"train/loss": loss, "train/accuracy": accuracy, "step/wall_s": wall_s,
                  "throughput/samples_per_s": _ratio(samples, wall_s), "comm/seconds": comm_s,
                  "comm/share": _ratio(comm_s, wall_s), "comm/exposed_seconds": exposed_s,
                  "comm/exposed_share": _ratio(exposed_s, wall_s), "comm/bytes_sent": bytes_sent}
        self._scalars(step, values)

    def write_evaluation(self, step: int, loss: float | None = None, accuracy: float | None = None) -> None:
        """An evaluation's ``eval/loss`` and ``eval/accuracy`` at optimizer step ``step``."""
        if self.writer is not None:
            self._scalars(step, {"eval/loss": loss, "eval/accuracy": accuracy})

    def write_algorithms(self, step: int, algorithms: list[tuple[int, str]]) -> None:
        """The algorithm per bucket (:meth:`DataParallel.bucket_algorithms`) as text and ``buckets/count``,
        unless they are the ones written last."""
        algorithms = [(int(nbytes), str(name)) for nbytes, name in algorithms]
        if self.writer is None or algorithms == self.algorithms_written:
            return
        self.algorithms_written = algorithms
        self.writer.add_text(ALGORITHMS_TAG, algorithms_table(algorithms), step)
        self.writer.add_scalar("buckets/count", len(algorithms), step)

    def write_summary(self, summary: dict) -> None:
        """``summary.json``'s run totals (``run/*``) and algorithms at its last step."""
        if self.writer is None:
            return
        step, train_s = int(summary.get("steps", 0)), summary.get("train_wall_s")
        self._scalars(step, {"run/samples_per_s": summary.get("samples_per_s"),
                             "run/communication_share": _ratio(summary.get("communication_s"), train_s),
                             "run/exposed_communication_s": summary.get("exposed_communication_s"),
                             "run/bytes_sent_per_step": summary.get("bytes_sent_per_step"),
                             "run/final_test_accuracy": summary.get("final_test_accuracy")})
        algorithms = [(entry["bucket_nbytes"], entry["algorithm"]) for entry in summary.get("algorithms", [])]
        if algorithms:
            self.write_algorithms(step, algorithms)

    def _scalars(self, step: int, values: dict) -> None:
        for tag, value in values.items():
            if value is not None and math.isfinite(float(value)):
                self.writer.add_scalar(tag, float(value), step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Write what is buffered and close the event file (idempotent)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _ratio(part: float | None, whole: float | None) -> float | None:
    if part is None or not whole or whole <= 0:
        return None
    return float(part) / float(whole)


HOOK_FEATURE = "gradsync.integrations.tensorboard.TensorBoardHook"


class TensorBoardHook(EventWriter):
    """TensorBoard logging for any training loop around :class:`gradsync.DataParallel` (or LocalSGD, or
    DeterministicDataParallel): call :meth:`step` after each optimizer step.

    Each step's communication is taken from ``model``'s counters as differences since the previous
    :meth:`step` (``comm_seconds``, ``exposed_comm_seconds``; bytes from ``model.comm.stats``, as
    ``gradsync.comm_stats()`` counts them), its wall time from the previous :meth:`step` (or the hook's
    creation, or :meth:`begin_step`) to this one; the algorithm per bucket is written at the first step
    (call :meth:`write_algorithms` to write it again).

    The constructor is collective: every rank of ``model``'s group creates the hook with the same
    ``log_dir``, and the ranks that write check their folder and share the verdict, so that a bad folder
    stops every rank with the same one-line ValueError. After it, no collective is called: ranks may log
    different steps.

    Args:
        model: the wrapped model (has ``comm_seconds``, ``exposed_comm_seconds``, ``comm``,
            ``bucket_algorithms()``).
        log_dir: the run folder the event files go to (``tensorboard --logdir``'s folder or one below it).
        all_ranks: False: only rank 0 writes (into ``log_dir``); True: every rank writes into
            ``log_dir/rank-R``.
        flush_secs: seconds between flushes of the event file.

    Raises:
        MissingExtraError: the ``tensorboard`` extra is not installed (one line).
        ValueError: ``log_dir`` (or, with ``all_ranks``, a rank's ``log_dir/rank-R``) is empty, a file or not
            a writable folder (one line naming ``TensorBoardHook log_dir``, as ``--tensorboard``'s), on
            every rank.

    Example::

        model = gradsync.DataParallel(net)
        with TensorBoardHook(model, "runs/tb") as hook:
            for x, y in loader:
                loss = loss_fn(model(x), y)
                loss.backward(); optimizer.step(); optimizer.zero_grad()
                hook.step(loss=loss.item(), samples=len(x) * gradsync.world_size())
    """

    def __init__(self, model, log_dir: str | Path, *, all_ranks: bool = False, flush_secs: float = 10.0):
        summary_writer(HOOK_FEATURE)  # on every rank, before the exchange: a missing extra fails everywhere alike
        folder = agree_on_log_dir(model.comm, log_dir, all_ranks)
        super().__init__(folder, HOOK_FEATURE, flush_secs)
        self.model, self.rank, self.global_step = model, model.comm.rank, 0
        self.begin_step()

    def begin_step(self) -> None:
        """Mark the start of the next step (optional: after an evaluation the hook should not count)."""
        self._started = time.perf_counter()
        self._comm0, self._exposed0 = self.model.comm_seconds, self.model.exposed_comm_seconds
        self._bytes0 = self.model.comm.stats.bytes_sent

    def step(self, loss: float | None = None, samples: int | None = None, accuracy: float | None = None,
             step: int | None = None) -> None:
        """Log the optimizer step just taken.

        Args:
            loss: the step's loss (a float or a one-element tensor), or None.
            samples: samples the step processed, as you want ``throughput/samples_per_s`` to count them
                (this rank's batch, or the global batch: ``len(x) * world_size``), or None.
            accuracy: fraction of the step's samples right, or None.
            step: the step number (default: the steps logged so far, from 1).
        """
        now = time.perf_counter()
        self.global_step = self.global_step + 1 if step is None else int(step)
        if self.writing:
            model = self.model
            loss = None if loss is None else float(loss.detach() if hasattr(loss, "detach") else loss)
            self.write_step(self.global_step, loss, samples, now - self._started, model.comm_seconds - self._comm0,
                            model.exposed_comm_seconds - self._exposed0,
                            model.comm.stats.bytes_sent - self._bytes0, accuracy)
            if self.algorithms_written is None:  # after the first backward: the buckets as rebuilt
                self.write_algorithms(self.global_step, model.bucket_algorithms())
        self.begin_step()

    def evaluation(self, loss: float | None = None, accuracy: float | None = None) -> None:
        """Log an evaluation at the current step; the time it took is not counted in the next step."""
        self.write_evaluation(self.global_step, loss, accuracy)
        self.begin_step()

    def __enter__(self) -> "TensorBoardHook":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TrainBoard:
    """``gradsync train --tensorboard DIR``: the main rank's :class:`EventWriter`, opened per membership
    (an elastic run's rank 0 may change), fed with the numbers ``metrics.jsonl`` records."""

    def __init__(self, folder: str | None):
        self.folder, self.events = folder, None

    def open(self, model, is_main: bool) -> None:
        """This membership's writer: the main rank's, or none (a previous one is closed)."""
        self.close()
        if self.folder is not None and is_main:
            self.events, self.model = EventWriter(self.folder), model
        self._last_update_s = time.perf_counter()

    def step(self, step: int, loss: float, record, samples: int, started_s: float) -> None:
        """Optimizer step ``step`` (1-based) done: ``record`` its :class:`~gradsync.train.meter.StepRecord`,
        ``samples`` over all ranks, ``started_s`` its ``time.perf_counter()`` start."""
        if self.events is None:
            return
        self.events.write_step(step, loss, samples, time.perf_counter() - started_s, record.comm_s,
                               record.exposed_comm_s, record.bytes_sent)
        if self.events.algorithms_written is None:  # once per writer: the buckets as the first backward rebuilt them
            self.events.write_algorithms(step, self.model.bucket_algorithms())

    def update(self, step: int, loss: float, samples: int) -> None:
        """A parameter server's applied update ``step`` of ``samples``; its wall time is the time since the
        previous update (or :meth:`open`): the server's applied throughput, whichever worker pushed it."""
        now = time.perf_counter()
        if self.events is not None:
            self.events.write_step(step, loss, samples, now - self._last_update_s)
        self._last_update_s = now

    def evaluation(self, step: int, loss: float, accuracy: float) -> None:
        if self.events is not None:
            self.events.write_evaluation(step, loss, accuracy)

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
            self.events = None


def write_run_summary(summary: dict | None) -> None:
    """The main rank's end of a ``--tensorboard`` run: ``summary.json``'s totals (``run/*``) and algorithms."""
    folder = (summary or {}).get("config", {}).get("tensorboard")
    if folder is None:
        return
    events = EventWriter(folder)
    try:
        events.write_summary(summary)
    finally:
        events.close()
