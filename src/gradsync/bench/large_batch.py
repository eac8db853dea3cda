"""``gradsync bench large-batch``: one model trained to one sample budget at growing global batches, per recipe.

Issue 40's question: how far can the global batch grow before accuracy falls,
and which recipe holds it longest (Goyal et al. 2017: linear lr scaling +
warm-up; You et al. 2017, LARS; You et al. 2019, LAMB). Every run is
``gradsync train --nproc 2`` (in this process, as ``bench modes`` runs it; a
run gets ``--run-timeout`` seconds) on the same MNIST-1D data for the same
epochs, so every batch sees the same samples and fewer steps: steps =
epochs x train samples // batch. Each (recipe, batch) trains once per seed;
the runs of a seed go in a rotated order, so a busy moment of the machine
hits different cells in different seeds.

The recipes (:data:`RECIPES`), each one setting for every batch, its base lr
given at the base batch (128) and scaled by ``gradsync train
--lr-scaling`` to the run's global batch:

* ``sgd-linear``: SGD (momentum 0.9), lr scaled linearly, no warm-up (the
  baseline; at batch 128 it is the reference accuracy);
* ``sgd-warmup``: the same with a linear warm-up (Goyal et al.);
* ``lars-warmup``: LARS, SGD with a layer-wise trust ratio (You et al. 2017),
  lr scaled by the square root, with warm-up;
* ``lamb-warmup``: LAMB, Adam's moments with the trust ratio (You et al.
  2019), lr scaled by the square root as that paper does, with warm-up.

The model and budget (the defaults, :data:`DEFAULT_OPTIONS`) fit the whole
bench, 5 batches x 4 recipes x 3 seeds = 60 runs, in about 30 minutes on
this 2-core machine when it is otherwise idle: MNIST-1D's MLP, 60 epochs of
32768 training samples (``--num-samples 40960``): 15360 steps at 128, 480 at
4096, 240 at 8192. Not the CNN: at batch 128 a step costs both models about
the same (communication and Python), but at 4096 the MLP computes several
times as fast, so the same 30 minutes give it a budget several times the
CNN's, and the goal batch a few hundred steps rather than a few dozen
(measured: the CNN at 4096 with 160 steps stayed below 75% whatever the
optimizer, where it reaches 97% at 128). Prints the table (median test
accuracy with its min-max over the seeds, steps, wall time, samples/s), the
goal lines and where each recipe breaks, and a PNG of accuracy against the
batch; ``--json`` writes one row per run
(:mod:`gradsync.bench.large_batch_rows`).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

from gradsync.bench.large_batch_rows import BREAK_BATCH, GOAL_BATCH, format_table, plot
from gradsync.bench.output import claim_json_path, comma_names, write_json
from gradsync.train.config import TrainConfig
from gradsync.train.data import num_train_samples
from gradsync.train.metrics import METRICS_FILE

PLOT_FILE = "large_batch_accuracy.png"
DEFAULT_BATCHES = (128, 512, 2048, GOAL_BATCH, BREAK_BATCH)
# One setting per recipe for every batch. Base lr: the best of a grid at batch 128 (one seed, the default
# budget; final test accuracy): sgd 0.1, 0.2, 0.4, 0.8 -> 0.4; lars 0.5, 2, 4, 8, 16, 32 -> 4 (8 within noise,
# 16 and 32 diverged); lamb 0.001, 0.004, 0.008, 0.016, 0.032, 0.064 -> 0.008. sgd-warmup takes sgd-linear's.
# The rest is the papers': weight decay 1e-4 (Goyal et al.), 5e-4 (LARS), 0.01 (LAMB); 5 warm-up epochs
# (Goyal et al.); LARS's trust coefficient 0.001 and LAMB's betas (gradsync train's, the papers' defaults);
# sqrt scaling for LARS and LAMB (You et al. 2019), linear for SGD (Goyal et al.).
RECIPES: dict[str, dict] = {
    "sgd-linear": {"optimizer": "sgd", "lr": 0.4, "lr_scaling": "linear", "weight_decay": 1e-4},
    "sgd-warmup": {"optimizer": "sgd", "lr": 0.4, "lr_scaling": "linear", "weight_decay": 1e-4, "warmup_epochs": 5},
    "lars-warmup": {"optimizer": "lars", "lr": 4.0, "lr_scaling": "sqrt", "weight_decay": 5e-4, "warmup_epochs": 5},
    "lamb-warmup": {"optimizer": "lamb", "lr": 0.008, "lr_scaling": "sqrt", "weight_decay": 0.01, "warmup_epochs": 5},
}
# The default budget: 32768 train samples (4 x 8192) x 60 epochs, 1966080 samples per run (module docstring).
DEFAULT_OPTIONS = {"model": "mlp", "epochs": 60, "num_samples": 40960, "nproc": 2, "base_batch_size": 128}
RUN_TIMEOUT_S = 600.0


class RunTimeout(Exception):
    """A run took longer than ``--run-timeout``."""


def scaled_lr(recipe: dict, batch: int, base_batch: int) -> float:
    """The peak lr a recipe runs at ``batch``: its lr x (batch / base), x sqrt of it, or as it is."""
    ratio = batch / base_batch
    return recipe["lr"] * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[recipe.get("lr_scaling", "none")]


def train_options(recipe_name: str, batch: int, options: dict, seed: int) -> dict:
    """The :class:`TrainConfig` fields of one run (what ``gradsync train`` would be given)."""
    recipe = dict(RECIPES[recipe_name])
    fields = {"model": options["model"], "nproc": options["nproc"], "epochs": options["epochs"],
              "num_samples": options["num_samples"], "global_batch_size": batch, "seed": seed, "progress": False,
              "lr_schedule": "cosine", "optimizer": recipe["optimizer"], "lr": recipe["lr"],
              "weight_decay": recipe.get("weight_decay", 0.0)}
    if recipe.get("lr_scaling", "none") != "none":
        fields.update(lr_scaling=recipe["lr_scaling"], base_batch_size=options["base_batch_size"])
    if recipe.get("warmup_epochs"):
        fields["warmup_epochs"] = recipe["warmup_epochs"]
    return fields


def train_command(recipe_name: str, options: dict) -> str:
    """The ``gradsync train`` options a recipe adds to every run (for the header and the docs)."""
    recipe = RECIPES[recipe_name]
    parts = [f"--optimizer {recipe['optimizer']}", f"--lr {recipe['lr']:g}"]
    if recipe.get("lr_scaling", "none") != "none":
        parts.append(f"--lr-scaling {recipe['lr_scaling']} --base-batch-size {options['base_batch_size']}")
    if recipe.get("warmup_epochs"):
        parts.append(f"--warmup-epochs {recipe['warmup_epochs']:g}")
    if recipe.get("weight_decay"):
        parts.append(f"--weight-decay {recipe['weight_decay']:g}")
    return " ".join(parts)


def parse_batches(text: str, nproc: int, num_train: int) -> list[int]:
    """The ``--batch-sizes`` list, ascending.

    Raises:
        ValueError: empty, not an integer, not positive, not divisible by ``nproc``, or more than the
            ``num_train`` training samples (naming ``--batch-sizes`` and the value).
    """
    batches = []
    for item in dict.fromkeys(part.strip() for part in text.split(",") if part.strip()):
        try:
            batch = int(item)
        except ValueError:
            raise ValueError(f"--batch-sizes: {item!r} is not an integer") from None
        if batch < 1 or batch % nproc:
            raise ValueError(f"--batch-sizes: {batch} is not a positive multiple of --nproc {nproc} (each worker "
                             f"takes batch / nproc samples)")
        if batch > num_train:
            raise ValueError(f"--batch-sizes: {batch} is more than the {num_train} training samples of "
                             f"--num-samples; generate more")
        batches.append(batch)
    if not batches:
        raise ValueError("--batch-sizes needs at least one batch size")
    return sorted(batches)


def check_options(recipes: list[str], batches: list[int], seeds: int, options: dict, run_timeout: float) -> None:
    """Every run's options, before any run (ValueError in one line naming the option)."""
    from gradsync.jobs.job import check_options as check_train_options
    from gradsync.train.validation import validate_against_data

    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"--seeds must be an integer >= 1, got {seeds!r}")
    if options["model"] not in ("mlp", "cnn"):
        raise ValueError(f"--model must be mlp or cnn (MNIST-1D), got {options['model']!r}")
    if options["base_batch_size"] < 1:
        raise ValueError(f"--base-batch-size must be >= 1, got {options['base_batch_size']}")
    if not 0 < run_timeout < math.inf:
        raise ValueError(f"--run-timeout must be a positive number of seconds, got {run_timeout}")
    for recipe in recipes:
        for batch in batches:
            config = TrainConfig(**train_options(recipe, batch, options, 0))
            check_train_options(config, "local")
            validate_against_data(config, config.world_size(), num_train_samples(options["num_samples"]))


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`RunTimeout` in this (the main) thread after ``seconds``; torch's agent then stops the
    workers. Off the main thread there is no limit (signals reach the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise RunTimeout(f"timed out after {seconds:g} s (--run-timeout)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_one(recipe: str, batch: int, seed: int, options: dict, folder: Path, run_timeout: float) -> dict:
    """Train one (recipe, batch, seed) in ``folder``; its run row (see :mod:`gradsync.bench.large_batch_rows`)."""
    from gradsync.jobs.job import run_job
    from gradsync.launch import WorkerFailedError

    config = TrainConfig(out=str(folder), **train_options(recipe, batch, options, seed))
    row = {"recipe": recipe, "global_batch_size": batch, "seed": seed, "final_test_accuracy": None,
           "steps": None, "samples_per_s": None, "wall_s": None, "final_train_loss": math.nan,
           "lr": scaled_lr(RECIPES[recipe], batch, options["base_batch_size"]), "accuracy_curve": [],
           "train_loss_curve": [],
           "outcome": "trained", "line": None, "run_folder": str(folder)}
    started = time.perf_counter()
    try:
        with time_limit(run_timeout):
            summary = run_job(config)
    except RunTimeout as exc:
        return {**row, "outcome": "timed out", "line": str(exc), "wall_s": time.perf_counter() - started}
    except WorkerFailedError as exc:
        return {**row, "outcome": "failed", "line": str(exc).splitlines()[0][:200],
                "wall_s": time.perf_counter() - started}
    records = [json.loads(line) for line in (folder / METRICS_FILE).read_text().splitlines()]
    step_lrs = [record["lr"] for record in records if record["kind"] == "step" and "lr" in record]
    epochs = [record for record in records if record["kind"] == "epoch"]
    return {**row, "final_test_accuracy": summary["final_test_accuracy"], "steps": summary["steps"],
            "samples_per_s": summary["samples_per_s"], "wall_s": summary["wall_s"],
            "final_train_loss": summary["final_train_loss"], "lr": max(step_lrs, default=row["lr"]),
            "accuracy_curve": [record["test_accuracy"] for record in epochs],
            "train_loss_curve": [record["train_loss"] for record in epochs]}


def run_all(recipes: list[str], batches: list[int], seeds: int, options: dict, out_dir: Path,
            run_timeout: float) -> list[dict]:
    """Every (recipe, batch) once per seed; seed k's runs start k places further along the list."""
    keys = [(recipe, batch) for batch in batches for recipe in recipes]
    runs = []
    for seed in range(seeds):
        shift = seed % len(keys)
        for recipe, batch in keys[shift:] + keys[:shift]:
            row = run_one(recipe, batch, seed, options, out_dir / f"seed{seed}" / f"{recipe}-b{batch}", run_timeout)
            runs.append(row)
            accuracy = "-" if row["final_test_accuracy"] is None else f"{100 * row['final_test_accuracy']:.2f}%"
            print(f"# done: {recipe} at {batch}, seed {seed}: {row['outcome']}, {accuracy}, {row['steps']} steps, "
                  f"{row['wall_s']:.1f} s", flush=True)
    return runs


def run_bench(*, recipes: str = ",".join(RECIPES), batch_sizes: str = ",".join(map(str, DEFAULT_BATCHES)),
              seeds: int = 3, model: str = DEFAULT_OPTIONS["model"], epochs: int = DEFAULT_OPTIONS["epochs"],
              num_samples: int = DEFAULT_OPTIONS["num_samples"], nproc: int = DEFAULT_OPTIONS["nproc"],
              base_batch_size: int = DEFAULT_OPTIONS["base_batch_size"], run_timeout: float = RUN_TIMEOUT_S,
              out: str | None = None, json_path: str | None = None) -> list[dict]:
    """Validate, train every (recipe, batch, seed), print the table, goal lines and plot, write the run rows.

    Raises:
        ValueError: a bad option, naming it, before any run.
    """
    names = comma_names(recipes, "--recipes", tuple(RECIPES))
    options = {"model": model, "epochs": epochs, "num_samples": num_samples, "nproc": nproc,
               "base_batch_size": base_batch_size}
    batches = parse_batches(batch_sizes, nproc, num_train_samples(num_samples))
    check_options(names, batches, seeds, options, run_timeout)
    if out and Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    claim_json_path(json_path)
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="gradsync-bench-large-batch-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    train_samples = num_train_samples(num_samples)
    print(f"# gradsync bench large-batch: MNIST-1D {model}, --nproc {nproc}, {epochs} epochs of {train_samples} "
          f"train samples at every batch (steps = {epochs} x {train_samples} // batch), cosine schedule; "
          f"{seeds} seeds per cell, runs rotated per seed", flush=True)
    for name in names:
        print(f"#   {name}: gradsync train {train_command(name, options)}", flush=True)
    try:
        from gradsync.launch import start_forkserver
        from gradsync.jobs.worker import run_worker
        from gradsync.train.task import prepare_data

        prepare_data(TrainConfig(**train_options(names[0], batches[0], options, 0)))  # generated before any run
        start_forkserver(run_worker)  # every run's workers start the same way
        runs = run_all(names, batches, seeds, options, out_dir, run_timeout)
        print(format_table(runs), flush=True)
        title = (f"MNIST-1D {model}, {nproc} workers, {epochs} epochs of {train_samples} samples: final test "
                 f"accuracy (median, min-max over {seeds} seeds)")
        kept = plot(runs, out_dir / PLOT_FILE, title) if out else None
        if json_path:
            kept = shutil.copyfile(out_dir / PLOT_FILE, Path(json_path).with_suffix(".png")) if kept else \
                plot(runs, Path(json_path).with_suffix(".png"), title)
            write_json(json_path, runs)
        print(f"# plot: {kept or 'not kept (--out or --json keeps it)'}", flush=True)
    finally:
        if not out:
            shutil.rmtree(out_dir, ignore_errors=True)
    return runs
