"""Run-folder records: ``metrics.jsonl`` (one JSON object per step and per epoch) and ``summary.json``.

Step records: ``{"kind": "step", "epoch", "step", "loss", "lr", "forward_s",
"backward_s", "comm_s", "exposed_comm_s", "optimizer_s", "bytes_sent",
"bytes_sent_total"}``; ``loss`` is rank 0's local loss, times are rank 0's
seconds: ``backward_s`` is the wall time of ``loss.backward()`` including the
wait for communication at its end, ``comm_s`` the time gradient AllReduces
and buffer broadcasts ran (mostly overlapped with backward),
``exposed_comm_s`` the part of it the step waited for (backward plus sync
beyond backward alone); ``bytes_sent`` is rank 0's payload bytes in this step,
``bytes_sent_total`` so far. Epoch records: ``{"kind": "epoch", "epoch", "train_loss",
"test_loss", "test_accuracy", "elapsed_s"}`` with losses averaged over all
ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
MODEL_FILE = "model.pt"  # the final model's state_dict, written by rank 0
PRIVATE_UMASK = 0o077  # run folders, checkpoints, traces and plots: 0700 folders, 0600 files


@contextlib.contextmanager
def private_files():
    """While inside, files and folders this process creates are its user's only (umask 077).

    The run folder holds the model, the data order and the job's settings;
    nobody else on the machine needs to read them. The previous umask is
    restored on leaving (the umask is process-wide).
    """
    previous = os.umask(PRIVATE_UMASK)
    os.umask(previous | PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(previous)


class MetricsLog:
    """Append-only JSON-lines writer (rank 0 only); flushed every record so a crash loses nothing.

    Args:
        path: the ``metrics.jsonl`` file.
        resumed_text: the file's content at the checkpoint a job resumes from;
            the file is replaced by it (atomically), so records of steps done
            after that checkpoint by a failed attempt disappear and no step
            appears twice.
    """

    def __init__(self, path: Path, resumed_text: str | None = None):
        self.path = Path(path)
        self._lines: list[str] = []
        if resumed_text is not None:
            from gradsync.fault.checkpoint import write_atomic

            write_atomic(self.path, resumed_text.encode())
            self._lines = resumed_text.splitlines(keepends=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        self._lines.append(line)
        self._file.write(line)
        self._file.flush()

    def text(self) -> str:
        """Everything written so far (what a checkpoint keeps)."""
        return "".join(self._lines)

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def write_summary(path: Path, summary: dict) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(summary, file, indent=2)
        file.write("\n")
