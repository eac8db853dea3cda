"""The options of ``gradsync train --elastic``: the bounds of its world, and their checks.

Kept apart from :mod:`gradsync.train.config` (which imports this module); ``config`` is a ``TrainConfig``.
"""

from __future__ import annotations


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def elastic_bounds(config) -> tuple[int, int]:
    """``(min_nproc, max_nproc)`` of an elastic run: workers in all (defaults 1 and the workers it starts)."""
    low = 1 if config.min_nproc is None else config.min_nproc
    high = elastic_workers(config) if config.max_nproc is None else config.max_nproc
    return low, high


def elastic_workers(config) -> int:
    """Workers an elastic run starts with: ``--nproc``, per host with ``--hosts``."""
    return config.nproc * (config.hosts or 1)


def elastic_global_batch(config) -> int:
    """Samples per optimizer step of an elastic run, whatever its world size."""
    return config.global_batch_size or config.batch_size * config.accumulate * elastic_workers(config)


def validate_elastic(config) -> None:
    if not config.elastic:
        for name in ("min_nproc", "max_nproc", "join", "elastic_fault"):
            if getattr(config, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} needs --elastic")
        return
    if config.elastic_fault is not None:
        from gradsync.elastic.faults import parse

        parse(config.elastic_fault)
    low, high = elastic_bounds(config)
    for name, value in (("--min-nproc", low), ("--max-nproc", high), ("--max-relaunches", config.max_relaunches)):
        if not _is_int(value) or value < (0 if name == "--max-relaunches" else 1):
            raise ValueError(f"{name} must be an int >= {0 if name == '--max-relaunches' else 1}, got {value}")
    if not low <= elastic_workers(config) <= high:
        what = f"--nproc {config.nproc}" + (f" x --hosts {config.hosts}" if config.hosts else "")
        raise ValueError(f"--elastic needs --min-nproc {low} <= {what} <= --max-nproc {high}")
    if config.max_restarts:
        raise ValueError("--elastic replaces --max-restarts: survivors go on and each worker's launcher starts "
                         "it again (--max-relaunches)")
    if config.hosts is not None and config.mode != "sync":
        raise ValueError("--elastic with --hosts runs --mode sync only")
    if config.mode == "local-sgd":
        raise ValueError("--elastic runs --mode sync or async (local-sgd is not elastic yet)")
