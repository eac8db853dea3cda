"""Command line: ``gradsync train`` (argparse only; the work is in train/ and launch.py)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from gradsync.collectives.api import ALGORITHMS
from gradsync.errors import CollectiveMismatchError, CollectiveTimeoutError, GradsyncError
from gradsync.train.config import LR_SCHEDULES, OPTIMIZERS, TrainConfig, validate, validate_against_data
from gradsync.train.models import MODELS

_DEFAULTS = TrainConfig()


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad option as one line and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_train_options(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    add = parser.add_argument
    add("--nproc", type=int, default=d.nproc, help="worker processes on this machine (default %(default)s)")
    add("--model", default=d.model, metavar="{" + ",".join(MODELS) + "}", help="model (default %(default)s)")
    add("--epochs", type=int, default=d.epochs, help="passes over the training data (default %(default)s)")
    add("--batch-size", type=int, default=d.batch_size, help="samples per worker per micro-batch "
        "(default %(default)s)")
    add("--accumulate", type=int, default=d.accumulate, help="micro-batches per optimizer step "
        "(default %(default)s)")
    add("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    add("--lr-schedule", default=d.lr_schedule, metavar="{" + ",".join(LR_SCHEDULES) + "}",
        help="learning-rate schedule (default %(default)s)")
    add("--optimizer", default=d.optimizer, metavar="{" + ",".join(OPTIMIZERS) + "}",
        help="optimizer: sgd (momentum 0.9) or adam (AdamW) (default %(default)s)")
    add("--weight-decay", type=float, default=d.weight_decay, help="(default %(default)s)")
    add("--algorithm", default=d.algorithm, metavar="{" + ",".join(ALGORITHMS) + "}",
        help="AllReduce algorithm for gradients (default %(default)s)")
    add("--bucket-cap-mb", type=float, default=d.bucket_cap_mb, help="MiB of gradients per bucket "
        "(default %(default)s)")
    add("--seed", type=int, default=d.seed, help="seed for model init and shuffling (default %(default)s)")
    add("--timeout", type=float, default=d.timeout, help="seconds a collective may wait for a peer "
        "(default %(default)s)")
    add("--num-samples", type=int, default=d.num_samples, help="MNIST-1D samples to draw, 80%% train / "
        "20%% test (default %(default)s; 5000 is the paper's split)")
    add("--data-dir", default=None, help="cache for generated data (default $GRADSYNC_DATA_DIR or "
        "~/.cache/gradsync)")
    add("--out", default=None, help="run folder (default runs/<timestamp>)")
    add("--no-progress", dest="progress", action="store_false", help="hide the progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="gradsync", description="Data-parallel training with gradsync.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    train = commands.add_parser("train", help="train a model on MNIST-1D across local workers",
                                description="Train on MNIST-1D data-parallel across --nproc local "
                                "workers (or under torchrun, across the workers it started).")
    _add_train_options(train)
    return parser


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {name: value for name, value in vars(args).items() if name != "command"}
    return TrainConfig(**fields)


def _default_out_dir() -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / stamp
    suffix = 1
    while path.exists():
        suffix += 1
        path = Path("runs") / f"{stamp}-{suffix}"
    return path


def prepare_out_dir(out: str | None) -> Path:
    """Create the run folder and prove it is writable; refuse to mix with an earlier run."""
    path = Path(out) if out else _default_out_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if (path / "metrics.jsonl").exists():
            raise ValueError(f"--out {path} already holds a run (metrics.jsonl); choose another folder")
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--out {path} is not a writable folder: {exc.strerror or exc}") from None
    return path


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def train(args: argparse.Namespace) -> int:
    from gradsync.launch import launch_local
    from gradsync.train import data
    from gradsync.train.loop import run_worker

    config = _config_from_args(args)
    validate(config)
    if _under_torchrun() and os.environ.get("RANK", "0") != "0":
        out_dir = Path(config.out or "runs/unused")  # only rank 0 writes the run folder
    else:
        out_dir = prepare_out_dir(config.out)
    config.out = str(out_dir)
    world_size = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else config.nproc
    validate_against_data(config, world_size, data.num_train_samples(config.num_samples))
    data_path = data.prepare(config.data_dir, config.num_samples)
    if _under_torchrun():
        summary = run_worker(config, str(data_path), str(out_dir))
    else:
        summary = launch_local(config.nproc, run_worker, config, str(data_path), str(out_dir))[0]
    if summary is not None:
        print(f"test accuracy {100 * summary['final_test_accuracy']:.2f}% | "
              f"{summary['samples_per_s']:.0f} samples/s | {summary['wall_s']:.1f} s | "
              f"run folder {out_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gradsync`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return train(args)
    except (ValueError, TypeError) as exc:
        print(f"gradsync {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (GradsyncError, CollectiveTimeoutError, CollectiveMismatchError, OSError) as exc:
        print(f"gradsync {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"gradsync {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
