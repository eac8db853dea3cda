"""MNIST-1D, generated locally by the ``mnist1d`` package and cached as ``.npz``.

MNIST-1D (Greydanus 2020) draws each example from one of ten 1-D digit
templates with random padding, translation, scaling, shear and noise; it
needs no download. The paper's split is ``num_samples=5000`` (4000 train /
1000 test). gradsync's default draws 20000 (16000 / 4000) from the same
generator, with which the paper's CNN reaches ~95% instead of ~90%.

Generating 20000 samples takes ~12 s, so the arrays are cached in
``cache_dir`` (default ``$GRADSYNC_DATA_DIR`` or ``~/.cache/gradsync``),
keyed by ``num_samples`` and ``seed``; the file is written to a temporary
name and renamed, so concurrent runs never read half a file.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DEFAULT_NUM_SAMPLES = 20_000
DEFAULT_DATA_SEED = 42  # the mnist1d package's default


@dataclass
class Splits:
    """Train and test arrays: MNIST-1D's x ``(N, 40)`` float32 and y ``(N,)`` int64, or the gpt's token
    windows x and next-token targets y, both ``(N, context)`` int64 (:mod:`~gradsync.train.corpus`)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def train_dataset(self) -> torch.utils.data.TensorDataset:
        return torch.utils.data.TensorDataset(self.x_train, self.y_train)


def num_train_samples(num_samples: int) -> int:
    """Training examples in a data set of ``num_samples`` (mnist1d keeps whole classes, 80% train)."""
    return int((num_samples // 10) * 10 * 0.8)


def default_cache_dir() -> Path:
    return Path(os.environ.get("GRADSYNC_DATA_DIR", Path.home() / ".cache" / "gradsync"))


def cache_path(cache_dir: Path, num_samples: int, seed: int) -> Path:
    return Path(cache_dir) / f"mnist1d-n{num_samples}-seed{seed}.npz"


def generate(num_samples: int = DEFAULT_NUM_SAMPLES, seed: int = DEFAULT_DATA_SEED) -> dict[str, np.ndarray]:
    """Draw a fresh MNIST-1D data set (80% train, 20% test) with the mnist1d package."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    data = make_dataset(args)
    return {"x_train": data["x"].astype(np.float32), "y_train": data["y"].astype(np.int64),
            "x_test": data["x_test"].astype(np.float32), "y_test": data["y_test"].astype(np.int64)}


def prepare(cache_dir: Path | None = None, num_samples: int = DEFAULT_NUM_SAMPLES,
            seed: int = DEFAULT_DATA_SEED) -> Path:
    """Make sure valid cached arrays exist and return their path (generates on the first call).

    A cached file that does not load (truncated, corrupt) is replaced, with a
    warning naming it.

    Raises:
        ValueError: ``num_samples`` < 10, or ``cache_dir`` cannot be used
        (the message names it).
    """
    if num_samples < 10:
        raise ValueError(f"num_samples must be >= 10 (one per digit), got {num_samples}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache_path(cache_dir, num_samples, seed)
    if path.exists():
        problem = load_problem(path)
        if problem is None:
            return path
        print(f"gradsync: cached data {path} is unreadable ({problem}); generating it again",
              file=sys.stderr)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        print(f"gradsync: generating MNIST-1D ({num_samples} samples, ~{num_samples * 6e-4:.0f} s once) "
              f"into {path}", file=sys.stderr, flush=True)
        write_arrays(path, generate(num_samples, seed))
    except OSError as exc:
        raise ValueError(f"--data-dir {cache_dir} cannot hold the data cache: {exc.strerror or exc}") from None
    return path


def write_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Save ``arrays`` as the ``.npz`` ``path``: written to a temporary name and renamed (readers never see half)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez(file, **arrays)
        os.chmod(temporary, 0o644)  # a shared cache folder stays readable by others
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def load_problem(path: Path) -> str | None:
    """Why ``path`` is not a usable cache, or None if it is."""
    try:
        splits = load(path)
    except Exception as exc:  # noqa: BLE001 - any failure to read means "regenerate"
        return f"{type(exc).__name__}: {exc}"
    if splits.x_train.dim() != 2 or len(splits.x_train) != len(splits.y_train):
        return "arrays of the wrong shape"
    return None


def load(path: Path) -> Splits:
    """Load arrays written by :func:`prepare` (or :func:`gradsync.train.corpus.prepare`)."""
    with np.load(path) as arrays:
        return Splits(*(torch.from_numpy(arrays[key].copy())
                        for key in ("x_train", "y_train", "x_test", "y_test")))
