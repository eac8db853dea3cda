"""``gradsync bench compression``: accuracy, bytes on the wire and speed of every compressor.

Two parts, one table each:

* accuracy: the main job over the ring (``gradsync train`` defaults otherwise: MNIST-1D CNN, 4
  workers, AdamW lr 1e-2 with cosine decay, 15 epochs) once per compressor
  in each of ``--repeat`` repetitions, the compressors one after the other;
  repetition k trains every compressor with seed k (the same data and initial
  weights within it). Every compressor starts with
  ``compression_warmup_steps`` exact steps (1-bit Adam's warm-up stage).
  ``bytes_per_step`` is the median over steps of the bytes rank 0's transport
  sent during the step (the compressed steady state); ``mean_bytes_per_step``
  averages all steps, warm-up included.
* throughput: the ~25M-parameter MLP of ``gradsync bench train``, one local
  world, every compressor (no warm-up) timed on a fixed batch, alternating
  inside every repetition so they share the machine's noise.

Ratios (and the accuracy difference) are taken against the uncompressed run
of the same repetition; every figure is then the median over the repetitions
with its min and max (:mod:`gradsync.bench.spread`). The break-even link
speed follows from the medians.
"""

from __future__ import annotations

import copy
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

import gradsync
from gradsync.bench.output import claim_json_path, format_rows, optional, write_json
from gradsync.bench.spread import check_repeat, paired_ratios, scaled_cell, spread, spread_cell, with_spread
from gradsync.bench.train import BATCH_PER_RANK, LR, MODEL_SEED, build_bench_model, make_batch, train_steps
from gradsync.compression import COMPRESSIONS, make
from gradsync.train.config import TrainConfig
from gradsync.train.validation import validate
from gradsync.train.metrics import METRICS_FILE
from gradsync.train.setup import threads_per_worker

DEFAULT_WARMUP_STEPS = 375   # 20% of the main job's 1875 steps (1-bit Adam warms up for 15-25%)
THROUGHPUT_MODEL = "mlp"
# the accuracy runs count bytes on the wire: an algorithm that sends through the transport, not
# shm (what gradsync train's default auto picks on one machine), whose copies the transport does not count
ACCURACY_ALGORITHM = "ring"


def run_accuracy(compression: str, warmup_steps: int, nproc: int, epochs: int, out_dir: Path, options: dict,
                 seed: int = 0) -> dict:
    """Train the main job with ``compression`` and ``seed`` in ``out_dir / compression``; return its figures."""
    from gradsync.jobs.job import run_job

    config = TrainConfig(nproc=nproc, epochs=epochs, compression=compression, progress=False,
                         algorithm=ACCURACY_ALGORITHM, seed=seed,
                         compression_warmup_steps=0 if compression == "none" else warmup_steps,
                         out=str(out_dir / compression), **options)
    summary = run_job(config)
    if summary["steps"] <= config.compression_warmup_steps:
        print(f"# warning: {compression}: the run's {summary['steps']} steps all fall in the "
              f"{config.compression_warmup_steps} warm-up steps: nothing was compressed", flush=True)
    records = [json.loads(line) for line in (out_dir / compression / METRICS_FILE).read_text().splitlines()]
    step_bytes = [r["bytes_sent"] for r in records if r["kind"] == "step"]
    return {"model": config.model, "test_accuracy": summary["final_test_accuracy"],
            "samples_per_s": summary["samples_per_s"], "bytes_per_step": spread(step_bytes).median,
            "mean_bytes_per_step": sum(step_bytes) / len(step_bytes),
            "compression_warmup_steps": config.compression_warmup_steps, "steps": summary["steps"],
            "samples_per_step": config.samples_per_step(nproc),
            "test_accuracy_per_epoch": [r["test_accuracy"] for r in records if r["kind"] == "epoch"],
            "run_folder": str(out_dir / compression)}


def accuracy_rows(runs: dict[str, list[dict]], world_size: int) -> list[dict]:
    """One accuracy row per compressor from its runs, one per repetition (what :func:`run_accuracy` returns).

    Accuracy and samples/s are the median (min-max) over the repetitions, the comparisons with "none" are
    paired within each repetition (:func:`compare_to_none`), the accuracy per epoch is the median curve.
    """
    keys = ("samples_per_s", "bytes_per_step", "test_accuracy")
    figures = {name: {key: [run[key] for run in found] for key in keys} for name, found in runs.items()}
    first = next(iter(runs.values()))[0]
    compared = compare_to_none(figures, first["samples_per_step"])
    rows = []
    for name, found in runs.items():
        curves = zip(*(run["test_accuracy_per_epoch"] for run in found))
        rows.append({"kind": "accuracy", "model": first["model"], "compression": name, "world_size": world_size,
                     **compared[name],
                     "mean_bytes_per_step": spread([run["mean_bytes_per_step"] for run in found]).median,
                     "compression_warmup_steps": found[0]["compression_warmup_steps"], "steps": found[0]["steps"],
                     "samples_per_step": first["samples_per_step"],
                     "test_accuracy_per_epoch": [spread(epoch).median for epoch in curves],
                     "run_folders": [run["run_folder"] for run in found]})
    return rows


def measure_throughput(compression: str, initial: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                       steps: int, warmup: int) -> dict:
    """Time ``steps`` SGD steps of a fresh copy of ``initial`` compressed by ``compression`` (collective)."""
    model = gradsync.DataParallel(copy.deepcopy(initial), compression=make(compression))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    train_steps(model, optimizer, inputs, labels, warmup)
    stats, comm_before = model.comm.stats, model.comm_seconds
    gradsync.all_reduce(torch.zeros(1), algorithm="native")  # line the ranks up
    bytes_before, started = stats.bytes_sent, time.perf_counter()
    train_steps(model, optimizer, inputs, labels, steps)
    gradsync.all_reduce(torch.zeros(1), algorithm="native")
    elapsed_s, sent = time.perf_counter() - started, stats.bytes_sent - bytes_before
    mine = torch.tensor([elapsed_s, sent, model.comm_seconds - comm_before], dtype=torch.float64)
    gathered = torch.stack(gradsync.all_gather(mine))  # (world_size, 3)
    del model, optimizer
    gc.collect()
    return {"elapsed_s": float(gathered[:, 0].max()), "bytes_per_step": float(gathered[:, 1].mean()) / steps,
            "comm_s_per_step": float(gathered[:, 2].mean()) / steps}


def throughput_worker(compressions: list[str], steps: int, warmup: int, repeat: int) -> list[dict] | None:
    """Entry point of one throughput process; rank 0 returns one row per compressor."""
    gradsync.init()
    try:
        torch.set_num_threads(threads_per_worker(gradsync.world_size()))
        torch.manual_seed(MODEL_SEED)
        initial = build_bench_model(THROUGHPUT_MODEL)
        inputs, labels = make_batch(THROUGHPUT_MODEL, gradsync.rank())
        runs: dict[str, list[dict]] = {name: [] for name in compressions}
        for repetition in range(repeat):
            shift = repetition % len(compressions)
            for name in compressions[shift:] + compressions[:shift]:
                runs[name].append(measure_throughput(name, initial, inputs, labels, steps, warmup))
        if gradsync.rank() != 0:
            return None
        setting = {"model": THROUGHPUT_MODEL, "world_size": gradsync.world_size(),
                   "num_parameters": sum(p.numel() for p in initial.parameters()), "steps": steps,
                   "samples_per_step": BATCH_PER_RANK[THROUGHPUT_MODEL] * gradsync.world_size()}
        return throughput_rows(setting, runs)
    finally:
        gradsync.shutdown()


def throughput_rows(setting: dict, runs: dict[str, list[dict]]) -> list[dict]:
    """One throughput row per compressor from its repetitions (``elapsed_s`` of ``setting["steps"]`` steps,
    ``bytes_per_step``, ``comm_s_per_step``), compared with "none" within each repetition."""
    samples = setting["samples_per_step"] * setting["steps"]
    figures = {name: {"samples_per_s": [samples / run["elapsed_s"] for run in found],
                      "bytes_per_step": [run["bytes_per_step"] for run in found]} for name, found in runs.items()}
    compared = compare_to_none(figures, setting["samples_per_step"])
    return [{"kind": "throughput", "compression": name, **setting, "test_accuracy": None, **compared[name],
             **with_spread("comm_s_per_step", [run["comm_s_per_step"] for run in found])}
            for name, found in runs.items()]


def compare_to_none(figures: dict[str, dict[str, list[float]]], samples_per_step: int) -> dict[str, dict]:
    """Each compressor's fields from its per-repetition ``samples_per_s``, ``bytes_per_step`` and (when
    given) ``test_accuracy``, compared with the "none" figures of the same repetition.

    ``speedup`` (samples/s over none's), ``bytes_reduction`` (none's bytes over these: x fewer) and
    ``accuracy_delta_pp`` (percentage points above none) are formed per repetition; they, samples/s and
    accuracy are then the median with min and max, ``bytes_per_step`` the median. ``break_even_gbit_s``
    follows from the medians (:func:`break_even_gbit_s`). Without a "none" compressor they are None.
    """
    base = figures.get("none")
    fields = {}
    for name, figure in figures.items():
        row = {**with_spread("samples_per_s", figure["samples_per_s"]),
               "bytes_per_step": spread(figure["bytes_per_step"]).median, "repeat": len(figure["samples_per_s"])}
        if "test_accuracy" in figure:
            row.update(with_spread("test_accuracy", figure["test_accuracy"]))
        row.update(_paired_with_none(figure, base) if base else {"speedup": None, "bytes_reduction": None})
        fields[name] = row
    for row in fields.values():
        row["break_even_gbit_s"] = break_even_gbit_s(row, fields["none"], samples_per_step) if base else None
    return fields


def _paired_with_none(figure: dict[str, list[float]], base: dict[str, list[float]]) -> dict:
    fields = with_spread("speedup", paired_ratios(figure["samples_per_s"], base["samples_per_s"]))
    sent = figure["bytes_per_step"]
    fields.update(with_spread("bytes_reduction", paired_ratios(base["bytes_per_step"], sent))
                  if all(sent) else {"bytes_reduction": None})
    if "test_accuracy" in figure:
        deltas = [100 * (mine - none) for mine, none in zip(figure["test_accuracy"], base["test_accuracy"])]
        fields.update(with_spread("accuracy_delta_pp", deltas))
    return fields


def break_even_gbit_s(row: dict, base: dict, samples_per_step: float) -> float | None:
    """Bytes saved per step over the extra seconds per step, in Gbit/s, from the two rows' median samples/s
    and bytes per step: on a link slower than this (and with communication not hidden by compute) the
    compressor's saved transfer time would pay for its extra work. None when it is not slower here."""
    extra_s = samples_per_step / row["samples_per_s"] - samples_per_step / base["samples_per_s"]
    saved_bytes = base["bytes_per_step"] - row["bytes_per_step"]
    if extra_s <= 0 or saved_bytes <= 0:
        return None
    return 8 * saved_bytes / extra_s / 1e9


def format_accuracy_table(rows: list[dict]) -> str:
    """The accuracy rows as aligned text, each figure's median (min-max) where recorded."""
    return format_rows(rows, [
        ("model", 5, "{model}"), ("compression", 11, "{compression}"),
        ("test acc %", 20, scaled_cell("test_accuracy", 100, ".2f")),
        ("vs none pp", 21, spread_cell("accuracy_delta_pp", "+.2f")), ("bytes/step", 10, "{bytes_per_step:.0f}"),
        ("x fewer", 19, spread_cell("bytes_reduction", ".1f")),
        ("mean bytes/step", 15, "{mean_bytes_per_step:.0f}"), ("samples/s", 17, spread_cell("samples_per_s", ".0f")),
        ("speed vs none", 18, spread_cell("speedup", ".2f", "x"))])


def format_throughput_table(rows: list[dict]) -> str:
    """The throughput rows as aligned text, each figure's median (min-max) where recorded."""
    lines = [format_rows(rows, [
        ("model", 5, "{model}"), ("world_size", 10, "{world_size}"), ("compression", 11, "{compression}"),
        ("samples/s", 19, spread_cell("samples_per_s", ".1f")),
        ("speed vs none", 18, spread_cell("speedup", ".2f", "x")), ("bytes/step", 10, "{bytes_per_step:.0f}"),
        ("x fewer", 19, spread_cell("bytes_reduction", ".1f")),
        ("comm_ms/step", 22, scaled_cell("comm_s_per_step", 1e3, ".1f")),
        ("break-even Gb/s", 15, optional("break_even_gbit_s", ".2f"))])]
    lines.append("# break-even: the link speed under which the bytes saved would pay for the compressor's extra "
                 "time per step (communication not hidden by compute), from the medians")
    return "\n".join(lines)


def plot_accuracy(rows: list[dict], path: Path) -> Path:
    """Test accuracy per epoch (the median over the repetitions), one line per compressor (PNG)."""
    from gradsync.train.plots import new_figure, save, set_title, whole_numbers

    figure, axes = new_figure(7, 4)
    for row in rows:
        epochs = range(1, len(row["test_accuracy_per_epoch"]) + 1)
        axes.plot(epochs, [100 * a for a in row["test_accuracy_per_epoch"]], "o-", ms=3, label=row["compression"])
    axes.set(xlabel="epoch", ylabel="test accuracy (%)", ylim=(0, 100))
    whole_numbers(axes.xaxis)
    set_title(axes, f"MNIST-1D CNN, {rows[0]['world_size']} workers: test accuracy per compressor")
    axes.legend()
    return save(figure, path, dpi=120)


def _parse(compressions: str, **counts: int) -> list[str]:
    names = list(dict.fromkeys(name.strip() for name in compressions.split(",") if name.strip()))
    for name in names:
        if name not in COMPRESSIONS:
            raise ValueError(f"unknown compression {name!r} in --compressions; choose from {', '.join(COMPRESSIONS)}")
    if not names:
        raise ValueError("--compressions is empty")
    for option, (value, low) in counts.items():
        if value < low:
            raise ValueError(f"--{option.replace('_', '-')} must be >= {low}, got {value}")
    return names


def run_bench(*, compressions: str, nproc: int, epochs: int, warmup_steps: int, throughput_nproc: int,
              throughput_steps: int, repeat: int, out: str | None, json_path: str | None,
              num_samples: int | None = None, accuracy: bool = True, throughput: bool = True) -> list[dict]:
    """Validate, run both parts, print the tables and the plot path, write JSON; return all rows.

    Raises:
        ValueError: a bad option, naming it, before any run.
    """
    from gradsync.launch import launch_local

    names = _parse(compressions, nproc=(nproc, 1), epochs=(epochs, 1), compression_warmup_steps=(warmup_steps, 0),
                   throughput_nproc=(throughput_nproc, 1), throughput_steps=(throughput_steps, 1))
    check_repeat(repeat)
    if not (accuracy or throughput):
        raise ValueError("--no-accuracy and --no-throughput leave nothing to run")
    if out and Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    options = {} if num_samples is None else {"num_samples": num_samples}
    validate(TrainConfig(nproc=nproc, epochs=epochs, **options))  # the accuracy runs' options, before any run
    claim_json_path(json_path)
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="gradsync-bench-compression-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if accuracy:
        print(f"# gradsync bench compression: main job (MNIST-1D CNN, {nproc} workers, {epochs} epochs, AdamW "
              f"lr 1e-2 cosine), {warmup_steps} exact warm-up steps per compressor; median (min-max) of {repeat} "
              f"repetitions, repetition k with seed k; runs in {out_dir}", flush=True)
        trained = accuracy_rows(_accuracy_runs(names, warmup_steps, nproc, epochs, out_dir, options, repeat), nproc)
        print(format_accuracy_table(trained))
        print(f"# plot: {plot_accuracy(trained, out_dir / 'compression_accuracy.png')}", flush=True)
        rows += trained
    if throughput:
        print(f"\n# throughput: {THROUGHPUT_MODEL} (~25.2M parameters), {throughput_nproc} workers, batch "
              f"{BATCH_PER_RANK[THROUGHPUT_MODEL]} per rank, {throughput_steps} steps after 1 warm-up, median "
              f"(min-max) of {repeat} repetitions, the compressors alternating in each, no compression warm-up",
              flush=True)
        timed = launch_local(throughput_nproc, throughput_worker, names, throughput_steps, 1, repeat)[0]
        print(format_throughput_table(timed), flush=True)
        rows += timed
    if json_path:
        write_json(json_path, rows)
    return rows


def _accuracy_runs(names: list[str], warmup_steps: int, nproc: int, epochs: int, out_dir: Path, options: dict,
                   repeat: int) -> dict[str, list[dict]]:
    """Every compressor once per repetition (repetition k: seed k, folder ``out_dir/rep<k+1>``), in turn."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repetition in range(repeat):
        shift = repetition % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(run_accuracy(name, warmup_steps, nproc, epochs, out_dir / f"rep{repetition + 1}",
                                           options, seed=repetition))
    return runs
