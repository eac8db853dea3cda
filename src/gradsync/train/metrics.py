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
import hashlib
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
        resumed_text: when resuming, the text the file must hold (it is
            replaced by exactly this); None appends to the file as it is.

    A checkpoint keeps :meth:`position` (bytes written and their SHA-256), not
    the text, so that checkpoints do not grow with the run; the text is read
    back from the file on resume (:func:`resumed_text`).
    """

    def __init__(self, path: Path, resumed_text: str | None = None):
        self.path = Path(path)
        self._nbytes, self._digest = 0, hashlib.sha256()
        if resumed_text is not None:
            from gradsync.fault.checkpoint import write_atomic

            data = resumed_text.encode()
            write_atomic(self.path, data)
            self._nbytes = len(data)
            self._digest.update(data)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        self._nbytes += len(data)
        self._digest.update(data)
        self._file.write(data.decode())
        self._file.flush()

    def position(self) -> dict:
        """``{"path", "nbytes", "sha256"}`` of what this log wrote so far (what a checkpoint keeps)."""
        return {"path": str(self.path.resolve()), "nbytes": self._nbytes, "sha256": self._digest.hexdigest()}

    def close(self) -> None:
        self._file.close()


def resumed_text(position: dict, candidates: list[Path]) -> str | None:
    """The first ``position["nbytes"]`` bytes of the first candidate file (then ``position["path"]``) whose
    prefix has ``position["sha256"]``; None when none has (the log of the resumed run is gone or changed)."""
    nbytes = int(position["nbytes"])
    for path in [*candidates, Path(position["path"])]:
        try:
            with open(path, "rb") as file:
                data = file.read(nbytes)
        except OSError:
            continue
        if len(data) == nbytes and hashlib.sha256(data).hexdigest() == position["sha256"]:
            return data.decode()
    return None


def read_metrics(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def write_summary(path: Path, summary: dict) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(summary, file, indent=2)
        file.write("\n")
