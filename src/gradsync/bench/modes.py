"""``gradsync bench modes``: sync, async and local SGD side by side, with and without a straggler.

Trains the main job (MNIST-1D CNN, ``gradsync train`` defaults: 4 workers,
AdamW lr 1e-2 with cosine decay, 15 epochs, seed 0) once per setting:
sync; async with each staleness bound (``none`` = unbounded); local SGD
with each H (a bound ending in ``+lr`` also divides the lr by the
staleness, Zhang et al. 2016); every one without a straggler and with worker rank 1 slowed by
``--straggler-factor``. Prints one table (samples/s, seconds until the test
accuracy first reaches the target, final accuracy, staleness) and one PNG of
test accuracy against wall time. Wall time includes the per-epoch
evaluations, which every mode runs at the same sample counts.

Staleness: for sync 0; for async the server versions a gradient missed; for
local SGD the local steps since the last average at which the gradient was
computed (0 .. H-1).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from gradsync.bench.output import claim_json_path, fmt_optional, format_rows, optional, write_json
from gradsync.train.config import TrainConfig
from gradsync.train.validation import validate
from gradsync.train.metrics import METRICS_FILE

STRAGGLER_RANK = 1


def parse_settings(staleness_bounds: str, sync_every: str) -> list[dict]:
    """The runs' mode options: sync, async per bound, local-sgd per H (ValueError on a bad list)."""
    settings = [{"mode": "sync"}]
    for text in _items(staleness_bounds, "--staleness-bounds"):
        bound_text, lr_suffix = (text[:-3], True) if text.endswith("+lr") else (text, False)
        bound = None if bound_text == "none" else _int(bound_text, "--staleness-bounds", 0)
        settings.append({"mode": "async", "max_staleness": bound, "staleness_lr": lr_suffix})
    for text in _items(sync_every, "--sync-every"):
        settings.append({"mode": "local-sgd", "sync_every": _int(text, "--sync-every", 1)})
    return settings


def _items(text: str, option: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if len(set(items)) != len(items):
        raise ValueError(f"{option} repeats a value: {text}")
    return items


def _int(text: str, option: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{option}: {text!r} is not an integer") from None
    if value < low:
        raise ValueError(f"{option}: values must be >= {low}, got {value}")
    return value


def label(setting: dict) -> str:
    if setting["mode"] == "async":
        bound = setting["max_staleness"]
        return ("async" + ("" if bound is None else f" s<={bound}")
                + (" lr/s" if setting.get("staleness_lr") else ""))
    if setting["mode"] == "local-sgd":
        return f"local-sgd H={setting['sync_every']}"
    return "sync"


def seconds_to(epochs: list[dict], target: float) -> float | None:
    """Wall seconds at the first evaluation with accuracy >= ``target`` (None if never)."""
    return next((r["elapsed_s"] for r in epochs if r["test_accuracy"] >= target), None)


def run_setting(setting: dict, factor: float, out_dir: Path, options: dict, target: float) -> dict:
    """Train once; return the table row."""
    from gradsync.jobs.job import run_job

    name = label(setting).replace(" ", "_").replace("<=", "").replace("/", "_") + f"_straggler{factor:g}"
    straggler = f"{STRAGGLER_RANK}:{factor:g}" if factor > 1 else None
    config = TrainConfig(progress=False, out=str(out_dir / name), straggler=straggler, **setting, **options)
    summary = run_job(config)
    records = [json.loads(line) for line in (out_dir / name / METRICS_FILE).read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    return {"label": label(setting), "mode": setting["mode"], "max_staleness": setting.get("max_staleness"),
            "staleness_lr": setting.get("staleness_lr", False),
            "sync_every": setting.get("sync_every"), "straggler": factor, "num_workers": config.nproc,
            "samples_per_s": summary["samples_per_s"], "seconds_to_target": seconds_to(epochs, target),
            f"seconds_to_{round(100 * target)}": seconds_to(epochs, target), "target_accuracy": target,
            "test_accuracy": summary["final_test_accuracy"], "best_test_accuracy": summary["best_test_accuracy"],
            "staleness_mean": summary["staleness_mean"], "staleness_max": summary["staleness_max"],
            "wall_s": summary["wall_s"], "steps": summary["steps"], "samples": summary["samples"],
            "accuracy_curve": [[r["elapsed_s"], r["test_accuracy"]] for r in epochs],
            "run_folder": str(out_dir / name)}



def format_table(rows: list[dict]) -> str:
    target = round(100 * rows[0]["target_accuracy"]) if rows else 85
    sync = {row["straggler"]: row["samples_per_s"] for row in rows if row["mode"] == "sync"}

    def versus_sync(row: dict) -> str:
        ratio = row["samples_per_s"] / sync[row["straggler"]] if row["straggler"] in sync else None
        return fmt_optional(ratio, ".2f") + "x"

    return format_rows(rows, [
        ("run", 17, "{label}"), ("straggler", 9, "{straggler:g}x"), ("samples/s", 9, "{samples_per_s:.0f}"),
        ("vs sync", 7, versus_sync), (f"s to {target}%", 8, optional("seconds_to_target", ".1f")),
        ("test acc %", 10, lambda row: f"{100 * row['test_accuracy']:.2f}"),
        ("best %", 6, lambda row: f"{100 * row['best_test_accuracy']:.2f}"), ("stale mean", 10, "{staleness_mean:.2f}"),
        ("stale max", 9, "{staleness_max:d}"), ("wall s", 6, "{wall_s:.1f}")])


def plot_curves(rows: list[dict], path: Path, target: float) -> Path:
    """Test accuracy against wall time, one line per run (dashed: with the straggler)."""
    from gradsync.train.plots import new_figure, save, set_title

    figure, axes = new_figure(8, 5)
    colors: dict[str, str] = {}
    for row in rows:
        color = colors.setdefault(row["label"], f"C{len(colors)}")
        times = [t for t, _ in row["accuracy_curve"]]
        accuracies = [100 * a for _, a in row["accuracy_curve"]]
        straggling = row["straggler"] > 1
        axes.plot(times, accuracies, "--" if straggling else "-", marker="o", ms=2.5, color=color,
                  label=row["label"] + (f", straggler {row['straggler']:g}x" if straggling else ""))
    axes.axhline(100 * target, color="grey", lw=0.8, ls=":")
    axes.set(xlabel="wall time (s)", ylabel="test accuracy (%)", ylim=(0, 100))
    set_title(axes, f"MNIST-1D CNN, {rows[0]['num_workers']} workers: sync vs async vs local SGD")
    axes.legend(fontsize=7, ncol=2, loc="center right")
    return save(figure, path, dpi=120)


def run_bench(*, staleness_bounds: str = "none,4,none+lr", sync_every: str = "4,16", straggler_factor: float = 3.0,
              nproc: int = 4, epochs: int = 15, num_samples: int | None = None, lr: float | None = None,
              staleness_lr: bool = False, target: float = 0.85, out: str | None = None,
              json_path: str | None = None) -> list[dict]:
    """Validate, train every setting with and without the straggler, print the table and plot, write JSON."""
    settings = parse_settings(staleness_bounds, sync_every)
    if not 1 <= straggler_factor < float("inf"):
        raise ValueError(f"--straggler-factor must be a finite number >= 1 (1: no straggler runs), "
                         f"got {straggler_factor}")
    if nproc <= STRAGGLER_RANK and straggler_factor > 1:
        raise ValueError(f"--nproc {nproc}: the straggler is worker rank {STRAGGLER_RANK}; use 2 or more workers")
    if not 0 < target <= 1:
        raise ValueError(f"--target must be in (0, 1], got {target}")
    if out and Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    options = {"nproc": nproc, "epochs": epochs}
    options.update({} if num_samples is None else {"num_samples": num_samples})
    options.update({} if lr is None else {"lr": lr})
    for setting in settings:  # every run's options, before any run
        if staleness_lr and setting["mode"] == "async":
            setting["staleness_lr"] = True  # else as the list says: plain Downpour unless "+lr"
        validate(TrainConfig(**setting, **options))
    claim_json_path(json_path)
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="gradsync-bench-modes-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    factors = [1.0] + ([straggler_factor] if straggler_factor > 1 else [])
    print(f"# gradsync bench modes: MNIST-1D CNN, {nproc} workers (+1 server process for async), {epochs} epochs, "
          f"lr {options.get('lr', TrainConfig.lr)}; straggler = worker rank {STRAGGLER_RANK}; runs in {out_dir}",
          flush=True)
    rows = []
    for factor in factors:
        for setting in settings:
            rows.append(run_setting(dict(setting), factor, out_dir, options, target))
            print(f"# done: {rows[-1]['label']}, straggler {factor:g}x", flush=True)
    print(format_table(rows))
    print(f"# plot: {plot_curves(rows, out_dir / 'modes_accuracy.png', target)}", flush=True)
    if json_path:
        write_json(json_path, rows)
    return rows
