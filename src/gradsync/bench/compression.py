"""``gradsync bench compression``: accuracy, bytes on the wire and speed of every compressor.

Two parts, one table each:

* accuracy: the main job over the ring (``gradsync train`` defaults otherwise: MNIST-1D CNN, 4
  workers, AdamW lr 1e-2 with cosine decay, 15 epochs, seed 0) once per
  compressor, the same data and initial weights. Every compressor starts with
  ``compression_warmup_steps`` exact steps (1-bit Adam's warm-up stage).
  ``bytes_per_step`` is the median over steps of the bytes rank 0's transport
  sent during the step (the compressed steady state); ``mean_bytes_per_step``
  averages all steps, warm-up included.
* throughput: the ~25M-parameter MLP of ``gradsync bench train``, one local
  world, every compressor (no warm-up) timed on a fixed batch, alternating
  over rounds so they share the machine's noise; samples/s is the median.

Ratios are taken against the uncompressed row of the same run.
"""

from __future__ import annotations

import copy
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import gradsync
from gradsync.bench.output import claim_json_path, fmt_optional, format_rows, optional, write_json
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


def run_accuracy(compression: str, warmup_steps: int, nproc: int, epochs: int, out_dir: Path,
                 options: dict) -> dict:
    """Train the main job with ``compression``; return its accuracy row."""
    from gradsync.jobs.job import run_job

    config = TrainConfig(nproc=nproc, epochs=epochs, compression=compression, progress=False,
                         algorithm=ACCURACY_ALGORITHM,
                         compression_warmup_steps=0 if compression == "none" else warmup_steps,
                         out=str(out_dir / compression), **options)
    summary = run_job(config)
    if summary["steps"] <= config.compression_warmup_steps:
        print(f"# warning: {compression}: the run's {summary['steps']} steps all fall in the "
              f"{config.compression_warmup_steps} warm-up steps: nothing was compressed", flush=True)
    records = [json.loads(line) for line in (out_dir / compression / METRICS_FILE).read_text().splitlines()]
    step_bytes = [r["bytes_sent"] for r in records if r["kind"] == "step"]
    return {"kind": "accuracy", "model": config.model, "compression": compression, "world_size": nproc,
            "test_accuracy": summary["final_test_accuracy"], "samples_per_s": summary["samples_per_s"],
            "bytes_per_step": statistics.median(step_bytes),
            "mean_bytes_per_step": statistics.fmean(step_bytes),
            "compression_warmup_steps": config.compression_warmup_steps, "steps": summary["steps"],
            "samples_per_step": config.samples_per_step(nproc),
            "test_accuracy_per_epoch": [r["test_accuracy"] for r in records if r["kind"] == "epoch"],
            "run_folder": str(out_dir / compression)}


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


def throughput_worker(compressions: list[str], steps: int, warmup: int, rounds: int) -> list[dict] | None:
    """Entry point of one throughput process; rank 0 returns one row per compressor."""
    gradsync.init()
    try:
        torch.set_num_threads(threads_per_worker(gradsync.world_size()))
        torch.manual_seed(MODEL_SEED)
        initial = build_bench_model(THROUGHPUT_MODEL)
        inputs, labels = make_batch(THROUGHPUT_MODEL, gradsync.rank())
        runs: dict[str, list[dict]] = {name: [] for name in compressions}
        for round_index in range(rounds):
            shift = round_index % len(compressions)
            for name in compressions[shift:] + compressions[:shift]:
                runs[name].append(measure_throughput(name, initial, inputs, labels, steps, warmup))
        if gradsync.rank() != 0:
            return None
        samples = BATCH_PER_RANK[THROUGHPUT_MODEL] * gradsync.world_size() * steps
        return [{"kind": "throughput", "model": THROUGHPUT_MODEL, "compression": name,
                 "world_size": gradsync.world_size(), "test_accuracy": None,
                 "samples_per_s": statistics.median(samples / r["elapsed_s"] for r in measured),
                 "bytes_per_step": statistics.median(r["bytes_per_step"] for r in measured),
                 "comm_s_per_step": statistics.median(r["comm_s_per_step"] for r in measured),
                 "num_parameters": sum(p.numel() for p in initial.parameters()), "steps": steps,
                 "samples_per_step": samples / steps,
                 "rounds": rounds} for name, measured in runs.items()]
    finally:
        gradsync.shutdown()


def add_ratios(rows: list[dict]) -> list[dict]:
    """Add ``bytes_reduction`` (x fewer), ``speedup``, ``accuracy_delta_pp`` and ``break_even_gbit_s``
    against the "none" row.

    ``break_even_gbit_s`` = bytes saved per step / extra seconds per step: on
    a link slower than this (and with communication not hidden by compute),
    the compressor's saved transfer time would pay for its extra work. None
    when the compressor is not slower here.
    """
    base = next((row for row in rows if row["compression"] == "none"), None)
    for row in rows:
        row["bytes_reduction"] = base["bytes_per_step"] / row["bytes_per_step"] if base and row["bytes_per_step"] \
            else None
        row["speedup"] = row["samples_per_s"] / base["samples_per_s"] if base else None
        if row["test_accuracy"] is not None and base:
            row["accuracy_delta_pp"] = 100 * (row["test_accuracy"] - base["test_accuracy"])
        row["break_even_gbit_s"] = _break_even_gbit_s(row, base) if base else None
    return rows


def _break_even_gbit_s(row: dict, base: dict) -> float | None:
    samples_per_step = base.get("samples_per_step") or 1.0  # cancels: both rows share the batch
    extra_s = samples_per_step / row["samples_per_s"] - samples_per_step / base["samples_per_s"]
    saved_bytes = base["bytes_per_step"] - row["bytes_per_step"]
    if extra_s <= 0 or saved_bytes <= 0:
        return None
    return 8 * saved_bytes / extra_s / 1e9



def format_accuracy_table(rows: list[dict]) -> str:
    return format_rows(rows, [
        ("model", 5, "{model}"), ("compression", 11, "{compression}"),
        ("test acc %", 10, lambda row: f"{100 * row['test_accuracy']:.2f}"),
        ("vs none pp", 10, optional("accuracy_delta_pp", "+.2f")), ("bytes/step", 11, "{bytes_per_step:.0f}"),
        ("x fewer", 8, optional("bytes_reduction", ".1f")), ("mean bytes/step", 15, "{mean_bytes_per_step:.0f}"),
        ("samples/s", 9, "{samples_per_s:.0f}"), ("speed vs none", 13, _speedup)])


def _speedup(row: dict) -> str:
    return fmt_optional(row["speedup"], ".2f") + "x"


def format_throughput_table(rows: list[dict]) -> str:
    lines = [format_rows(rows, [
        ("model", 5, "{model}"), ("world_size", 10, "{world_size}"), ("compression", 11, "{compression}"),
        ("samples/s", 9, "{samples_per_s:.1f}"), ("speed vs none", 13, _speedup),
        ("bytes/step", 12, "{bytes_per_step:.0f}"), ("x fewer", 8, optional("bytes_reduction", ".1f")),
        ("comm_ms/step", 12, lambda row: f"{1e3 * row['comm_s_per_step']:.1f}"),
        ("break-even Gb/s", 15, optional("break_even_gbit_s", ".2f"))])]
    lines.append("# break-even: the link speed under which the bytes saved would pay for the compressor's extra "
                 "time per step (communication not hidden by compute)")
    return "\n".join(lines)


def plot_accuracy(rows: list[dict], path: Path) -> Path:
    """Test accuracy per epoch, one line per compressor (PNG)."""
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
              throughput_steps: int, rounds: int, out: str | None, json_path: str | None,
              num_samples: int | None = None, accuracy: bool = True, throughput: bool = True) -> list[dict]:
    """Validate, run both parts, print the tables and the plot path, write JSON; return all rows."""
    from gradsync.launch import launch_local

    names = _parse(compressions, nproc=(nproc, 1), epochs=(epochs, 1), compression_warmup_steps=(warmup_steps, 0),
                   throughput_nproc=(throughput_nproc, 1), throughput_steps=(throughput_steps, 1),
                   rounds=(rounds, 1))
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
              f"lr 1e-2 cosine), {warmup_steps} exact warm-up steps per compressor; runs in {out_dir}", flush=True)
        accuracy_rows = add_ratios([run_accuracy(name, warmup_steps, nproc, epochs, out_dir, options)
                                    for name in names])
        print(format_accuracy_table(accuracy_rows))
        print(f"# plot: {plot_accuracy(accuracy_rows, out_dir / 'compression_accuracy.png')}", flush=True)
        rows += accuracy_rows
    if throughput:
        print(f"\n# throughput: {THROUGHPUT_MODEL} (~25.2M parameters), {throughput_nproc} workers, batch "
              f"{BATCH_PER_RANK[THROUGHPUT_MODEL]} per rank, {throughput_steps} steps after 1 warm-up, median "
              f"of {rounds} alternating rounds, no compression warm-up", flush=True)
        throughput_rows = add_ratios(launch_local(throughput_nproc, throughput_worker, names, throughput_steps, 1,
                                                  rounds)[0])
        print(format_throughput_table(throughput_rows), flush=True)
        rows += throughput_rows
    if json_path:
        write_json(json_path, rows)
    return rows
