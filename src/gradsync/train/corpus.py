"""The gpt's character corpus: Python's own help texts (``pydoc_data.topics``), read from the standard library.

Source: ``pydoc_data/topics.py`` of the running Python, the text ``help()``
shows for keywords and topics (``help("with")``): ~465 KB of English prose
and code from the Python Language Reference, part of every CPython since 2.6,
so nothing is downloaded and nothing large is committed. The topics are
joined in sorted order, one newline between them, and encoded as UTF-8; a
token is one byte (256 tokens, :data:`~gradsync.train.gpt.VOCAB_SIZE`), and
since all but ~0.1% of the characters are ASCII a token is a character.

License: the Python documentation is © Python Software Foundation under the
PSF License Agreement (version 2), which grants the right to "reproduce,
analyze, test, perform and/or display publicly, prepare derivative works,
distribute, and otherwise use" Python and its documentation; gradsync reads
the user's own copy at run time and redistributes none of it. It is not a
public-domain text: a gradsync release that shipped it would have to carry
the PSF notice.

The text differs between Python versions; :func:`describe` names the one
used (its size and SHA-256) and ``summary.json`` records it.

Splits (deterministic, no shuffle): the first 90% of the bytes train, the
last 10% test, contiguous (nanoGPT's split of its character corpora).
Each split is cut into non-overlapping windows of ``context`` tokens; a
window's targets are the same positions one byte later, so every byte of
a split but the first is predicted once per epoch. The windows are cached
as ``.npz`` in the data folder like MNIST-1D's arrays (:mod:`~gradsync.train.data`),
keyed by the context and the text's digest.
"""

from __future__ import annotations

import hashlib
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from gradsync.train.data import Splits, default_cache_dir, load_problem, write_arrays

TEST_FRACTION = 0.1
SOURCE = "pydoc_data.topics"
LICENSE = "PSF License Agreement version 2 (the Python documentation)"


@lru_cache(maxsize=1)
def corpus_bytes() -> bytes:
    """The corpus as UTF-8 bytes: every ``pydoc_data.topics`` entry, sorted by topic, joined by newlines."""
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


def tokens() -> torch.Tensor:
    """The whole corpus as token ids, ``(num_bytes,)`` int64 in [0, 256)."""
    return torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()


def describe() -> dict:
    """What ``summary.json`` records of the corpus: source, license, Python version, bytes, SHA-256."""
    data = corpus_bytes()
    return {"source": SOURCE, "license": LICENSE, "python": sys.version.split()[0], "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "test_fraction": TEST_FRACTION}


def split_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, test)`` token ids: the first 90% of the bytes and the last 10%, contiguous."""
    ids = tokens()
    cut = int(len(ids) * (1 - TEST_FRACTION))
    return ids[:cut], ids[cut:]


def windows(ids: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of ``ids``: inputs ``(N, context)`` and next-token targets ``(N, context)``, int64,
    with ``N = (len(ids) - 1) // context``."""
    count = (len(ids) - 1) // context
    inputs = ids[:count * context].reshape(count, context)
    targets = ids[1:count * context + 1].reshape(count, context)
    return inputs.clone(), targets.clone()


def splits(context: int) -> Splits:
    """The train and test windows for a gpt of this ``context`` (x and y ``(N, context)`` int64)."""
    train, test = split_tokens()
    return Splits(*windows(train, context), *windows(test, context))


def num_train_windows(context: int) -> int:
    """Training windows (samples) at this ``context``, without building them."""
    return (int(len(corpus_bytes()) * (1 - TEST_FRACTION)) - 1) // context


def batch(batch_size: int, context: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` training windows drawn at random (seeded): inputs and targets ``(batch_size, context)``
    int64, e.g. for a benchmark's step. ValueError if the split has fewer windows than ``batch_size``."""
    train_x, train_y = windows(split_tokens()[0], context)
    if batch_size > len(train_x):
        raise ValueError(f"batch size {batch_size} is more than the corpus's {len(train_x)} windows of {context}")
    chosen = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(seed))[:batch_size]
    return train_x[chosen], train_y[chosen]


def cache_path(cache_dir: Path, context: int) -> Path:
    digest = hashlib.sha256(corpus_bytes()).hexdigest()[:16]
    return Path(cache_dir) / f"pydoc-topics-{digest}-c{context}.npz"


def prepare(cache_dir: Path | None, context: int) -> Path:
    """Make sure the windows for ``context`` are cached and return their path (loadable by
    :func:`gradsync.train.data.load`). ValueError naming ``--data-dir`` if the folder cannot hold them."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache_path(cache_dir, context)
    if path.exists() and load_problem(path) is None:
        return path
    data = splits(context)
    arrays = {name: getattr(data, name).numpy() for name in ("x_train", "y_train", "x_test", "y_test")}
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_arrays(path, {name: np.ascontiguousarray(array) for name, array in arrays.items()})
    except OSError as exc:
        raise ValueError(f"--data-dir {cache_dir} cannot hold the data cache: {exc.strerror or exc}") from None
    return path
