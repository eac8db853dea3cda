"""``gradsync bench modes``: sync, async and local SGD side by side, with and without a straggler.

Trains the main job (MNIST-1D CNN, ``gradsync train`` defaults: 4 workers,
AdamW lr 1e-2 with cosine decay, 15 epochs) once per setting in each of
``--repeat`` repetitions: sync; async with each staleness bound (``none`` =
unbounded); local SGD with each H (a bound ending in ``+lr`` also divides
the lr by the staleness, Zhang et al. 2016); every one without a straggler
and with worker rank 1 slowed by ``--straggler-factor``. The whole runs
alternate (sync, async, local SGD, sync, ...); repetition k trains every
setting with seed k. Prints one table (samples/s, seconds until the test
accuracy first reaches the target, each against sync's in the same
repetition, final accuracy, staleness: the median with min-max over the
repetitions, :mod:`gradsync.bench.spread`) and one PNG of the first
repetition's test accuracy against wall time. Wall time includes the
per-epoch evaluations, which every mode runs at the same sample counts.

Staleness: for sync 0; for async the server versions a gradient missed; for
local SGD the local steps since the last average at which the gradient was
computed (0 .. H-1).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from gradsync.bench import modes_diloco
from gradsync.bench.modes_compute import describe, goal_lines, model_options
from gradsync.bench.output import claim_json_path, format_rows, write_json
from gradsync.bench.spread import check_repeat, fmt_spread, paired_ratios, scaled_cell, spread, spread_cell, with_spread
from gradsync.parallel.outer_optimizer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM
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
    if modes_diloco.is_diloco(setting):
        return modes_diloco.label(setting)
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


def run_setting(setting: dict, factor: float, out_dir: Path, options: dict, target: float, seed: int = 0) -> dict:
    """Train once with ``seed`` in a folder of ``out_dir``; return the run's figures."""
    from gradsync.jobs.job import run_job

    name = label(setting).replace(" ", "_").replace("<=", "").replace("/", "_") + f"_straggler{factor:g}"
    straggler = f"{STRAGGLER_RANK}:{factor:g}" if factor > 1 else None
    if setting["mode"] == modes_diloco.TORCHFT:  # torchft's DiLoCo, its own processes
        return modes_diloco.run_torchft(setting, {"straggler": straggler, "seed": seed, **options}, out_dir / name)
    config = TrainConfig(progress=False, out=str(out_dir / name), straggler=straggler, seed=seed, **setting,
                         **options)
    summary = run_job(config)
    records = [json.loads(line) for line in (out_dir / name / METRICS_FILE).read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    return {"num_workers": config.nproc, "samples_per_s": summary["samples_per_s"],
            "seconds_to_target": seconds_to(epochs, target), "test_accuracy": summary["final_test_accuracy"],
            "best_test_accuracy": summary["best_test_accuracy"], "staleness_mean": summary["staleness_mean"],
            "staleness_max": summary["staleness_max"], "wall_s": summary["wall_s"], "steps": summary["steps"],
            "samples": summary["samples"], "accuracy_curve": [[r["elapsed_s"], r["test_accuracy"]] for r in epochs],
            "run_folder": str(out_dir / name), "bytes_per_rank": modes_diloco.bytes_per_rank(summary)}


def setting_row(setting: dict, factor: float, runs: list[dict], sync_runs: list[dict], target: float) -> dict:
    """The table row of one setting and straggler factor from its runs, one per repetition.

    ``sync_runs`` are sync's runs with the same factor (the same list for sync itself). samples/s, seconds
    to ``target``, accuracy and wall time are the median with min and max over the repetitions;
    ``samples_per_s_vs_sync`` and ``seconds_to_target_vs_sync`` are formed within each repetition.
    Seconds to the target count the repetitions that reached it (``target_reached`` of ``repeat``); the
    ratio those where both this run and sync's reached it; None when none did.
    """
    speeds = [run["samples_per_s"] for run in runs]
    reached = [run["seconds_to_target"] for run in runs if run["seconds_to_target"] is not None]
    both = [(run["seconds_to_target"], sync["seconds_to_target"]) for run, sync in zip(runs, sync_runs)
            if run["seconds_to_target"] is not None and sync["seconds_to_target"] is not None]
    to_target = with_spread("seconds_to_target", reached) if reached else {"seconds_to_target": None}
    first = runs[0]
    return {"label": label(setting), "mode": setting["mode"], "max_staleness": setting.get("max_staleness"),
            "staleness_lr": setting.get("staleness_lr", False), "sync_every": setting.get("sync_every"),
            "straggler": factor, "num_workers": first["num_workers"], **with_spread("samples_per_s", speeds),
            **with_spread("samples_per_s_vs_sync", paired_ratios(speeds, [run["samples_per_s"] for run in sync_runs])),
            **to_target, f"seconds_to_{round(100 * target)}": to_target["seconds_to_target"],
            "target_reached": len(reached), "target_accuracy": target,
            **(with_spread("seconds_to_target_vs_sync", paired_ratios(*zip(*both))) if both
               else {"seconds_to_target_vs_sync": None}),
            **with_spread("test_accuracy", [run["test_accuracy"] for run in runs]),
            **with_spread("best_test_accuracy", [run["best_test_accuracy"] for run in runs]),
            "staleness_mean": spread([run["staleness_mean"] for run in runs]).median,
            "staleness_max": max(run["staleness_max"] for run in runs),
            **with_spread("wall_s", [run["wall_s"] for run in runs]), "steps": first["steps"],
            "samples": first["samples"], "accuracy_curve": first["accuracy_curve"], "run_folder": first["run_folder"],
            "run_folders": [run["run_folder"] for run in runs], "repeat": len(runs),
            **modes_diloco.row_fields(setting, runs, sync_runs)}


def format_table(rows: list[dict]) -> str:
    """The rows as aligned text: each figure's median (min-max) where recorded (rows of older records
    without ``samples_per_s_vs_sync`` get it from the medians)."""
    target = round(100 * rows[0]["target_accuracy"]) if rows else 85
    sync = {row["straggler"]: row["samples_per_s"] for row in rows if row["mode"] == "sync"}
    rows = [row if "samples_per_s_vs_sync" in row else
            {**row, "samples_per_s_vs_sync": row["samples_per_s"] / sync[row["straggler"]]
             if row["straggler"] in sync else None} for row in rows]
    return format_rows(rows, [
        ("run", 19, "{label}"), ("straggler", 9, "{straggler:g}x"),
        ("samples/s", 17, spread_cell("samples_per_s", ".0f")),
        ("vs sync", 18, spread_cell("samples_per_s_vs_sync", ".2f", "x")), (f"s to {target}%", 22, _to_target),
        ("t vs sync", 18, spread_cell("seconds_to_target_vs_sync", ".2f", "x")),
        ("test acc %", 20, scaled_cell("test_accuracy", 100, ".2f")),
        ("best %", 6, lambda row: f"{100 * row['best_test_accuracy']:.2f}"), ("stale mean", 10, "{staleness_mean:.2f}"),
        ("stale max", 9, "{staleness_max:d}"), ("wall s", 17, spread_cell("wall_s", ".1f")),
        *(modes_diloco.columns() if any(row.get("bytes_per_rank") is not None for row in rows) else [])])


def _to_target(row: dict) -> str:
    """Seconds to the target, and in how many repetitions of how many it was reached when not in all."""
    text = fmt_spread(row, "seconds_to_target", ".1f")
    reached, repeat = row.get("target_reached"), row.get("repeat")
    return text if reached is None or reached == repeat or not reached else f"{text} in {reached}/{repeat}"


def plot_curves(rows: list[dict], path: Path, target: float) -> Path:
    """Test accuracy against wall time, one line per setting's first repetition (dashed: with the straggler)."""
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
    set_title(axes, f"{rows[0].get('model_text', 'MNIST-1D CNN')}, {rows[0]['num_workers']} workers: "
                    f"sync vs async vs local SGD")
    axes.legend(fontsize=7, ncol=2, loc="center right")
    return save(figure, path, dpi=120)


def run_bench(*, staleness_bounds: str = "none,4,none+lr", sync_every: str = "4,16", straggler_factor: float = 3.0,
              nproc: int = 4, epochs: int = 15, num_samples: int | None = None, lr: float | None = None,
              staleness_lr: bool = False, target: float = 0.85, repeat: int = 5, out: str | None = None,
              json_path: str | None = None, diloco: str = "", outer_lr: float = DILOCO_OUTER_LR,
              outer_momentum: float = DILOCO_OUTER_MOMENTUM, torchft_diloco: bool = False, model: str = "cnn",
              batch_size: int | None = None) -> list[dict]:
    """Validate, train every setting with and without the straggler ``repeat`` times, print the table and
    plot, write JSON.

    Raises:
        ValueError: a bad option, naming it, before any run.
    """
    settings = parse_settings(staleness_bounds, sync_every)
    settings += modes_diloco.parse_diloco(diloco, outer_lr, outer_momentum, torchft_diloco)
    if torchft_diloco:
        modes_diloco.check_torchft()
    if not 1 <= straggler_factor < float("inf"):
        raise ValueError(f"--straggler-factor must be a finite number >= 1 (1: no straggler runs), "
                         f"got {straggler_factor}")
    if nproc <= STRAGGLER_RANK and straggler_factor > 1:
        raise ValueError(f"--nproc {nproc}: the straggler is worker rank {STRAGGLER_RANK}; use 2 or more workers")
    if not 0 < target <= 1:
        raise ValueError(f"--target must be in (0, 1], got {target}")
    check_repeat(repeat)
    if out and Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    options = {"nproc": nproc, "epochs": epochs}
    options.update({} if num_samples is None else {"num_samples": num_samples})
    options.update({} if lr is None else {"lr": lr})
    options.update(model_options(model, batch_size, lr))  # a compute-dominated setting (bench/modes_compute.py)
    for setting in settings:  # every run's options, before any run
        if staleness_lr and setting["mode"] == "async":
            setting["staleness_lr"] = True  # else as the list says: plain Downpour unless "+lr"
        validate(modes_diloco.train_config(setting, **options))
    claim_json_path(json_path)
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="gradsync-bench-modes-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    factors = [1.0] + ([straggler_factor] if straggler_factor > 1 else [])
    print(f"# gradsync bench modes: {describe(options)}, {nproc} workers (+1 server process for async), {epochs} epochs, "
          f"lr {options.get('lr', TrainConfig.lr)}; straggler = worker rank {STRAGGLER_RANK}; median (min-max) of "
          f"{repeat} repetitions of alternating runs, repetition k with seed k; runs in {out_dir}", flush=True)
    runs = _alternate(settings, factors, out_dir, options, target, repeat)
    rows = [{**setting_row(setting, factor, runs[factor, index], runs[factor, 0], target),
             "model_text": describe(options)} for factor in factors for index, setting in enumerate(settings)]
    print(format_table(rows))
    for line in modes_diloco.goal_lines(rows):
        print(f"# goal: {line}")
    print("\n".join(goal_lines(rows)), flush=True)
    print(f"# plot: {plot_curves(rows, out_dir / 'modes_accuracy.png', target)}", flush=True)
    if json_path:
        write_json(json_path, rows)
    return rows


def _alternate(settings: list[dict], factors: list[float], out_dir: Path, options: dict, target: float,
               repeat: int) -> dict[tuple[float, int], list[dict]]:
    """Every (factor, setting index) run once per repetition, in turn (repetition k: seed k, ``out_dir/rep<k+1>``)."""
    keys = [(factor, index) for factor in factors for index in range(len(settings))]
    runs: dict[tuple[float, int], list[dict]] = {key: [] for key in keys}
    for repetition in range(repeat):
        shift = repetition % len(keys)
        for factor, index in keys[shift:] + keys[:shift]:
            runs[factor, index].append(run_setting(dict(settings[index]), factor, out_dir / f"rep{repetition + 1}",
                                                   options, target, seed=repetition))
            print(f"# done: {label(settings[index])}, straggler {factor:g}x, repetition {repetition + 1}", flush=True)
    return runs
