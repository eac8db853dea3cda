"""``gradsync bench large-batch``'s table, goal lines, breaking points and plot, from its per-run rows.

A run row (one ``gradsync train`` run, what ``--json`` writes): ``recipe``, ``global_batch_size``, ``seed``,
``final_test_accuracy`` (fraction, None when the run failed), ``steps``, ``samples_per_s``, ``wall_s``, ``lr``
(the peak learning rate the run stepped with), ``final_train_loss`` (the last epoch's mean, may be nan),
``accuracy_curve`` (the test accuracy after each epoch), ``train_loss_curve`` (each epoch's mean train
loss), ``outcome`` (``trained`` | ``failed`` | ``timed out``) and ``line`` (why, when not trained). A cell
is one (recipe, batch) over its seeds.

The goals of issue 40, judged on medians over the seeds: at :data:`GOAL_BATCH` the best recipe (of those
other than :data:`BASELINE_RECIPE`) loses at most :data:`GOAL_FRACTION` of what linear-scaled SGD loses
against the baseline (linear-scaled SGD at the smallest batch, the base batch of the scaling rule), and at
most :data:`GOAL_ABSOLUTE_PP` percentage points. At :data:`BREAK_BATCH` each recipe gets a line saying the
first batch where its median falls more than :data:`BREAK_PP` below the baseline, and why (:func:`reason`).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from gradsync.bench.output import format_rows
from gradsync.bench.spread import scaled_cell, with_spread

BASELINE_RECIPE = "sgd-linear"
GOAL_BATCH = 4096
BREAK_BATCH = 8192
GOAL_FRACTION = 0.5      # the best recipe loses at most half of what linear-scaled SGD loses at GOAL_BATCH
GOAL_ABSOLUTE_PP = 2.0   # ... and at most 2 percentage points against the baseline
BREAK_PP = 2.0           # a recipe breaks at the first batch whose median is more than this below the baseline
CHANCE_ACCURACY = 0.2    # at or below: no better than guessing among MNIST-1D's ten classes (0.1) + noise
CHANCE_LOSS = math.log(10)  # cross-entropy of a uniform guess over ten classes
UNDERTRAINED_LOSS_FACTOR = 1.5  # train loss this many times the recipe's own at its smallest batch: too few steps
UNSTABLE_LOSS = 1.5 * CHANCE_LOSS  # an epoch's train loss above this, well above where training starts: unstable


def _median(values: list[float]) -> float:
    """The median, nan when any value is nan or there are none (a diverged run's loss stays visible)."""
    values = [float(value) for value in values]
    if not values or any(math.isnan(value) for value in values):
        return math.nan
    return statistics.median(values)


def cells(runs: list[dict]) -> list[dict]:
    """One row per (recipe, batch), recipes in their first-run order, batches ascending.

    ``final_test_accuracy`` (with ``_median``, ``_min``, ``_max``) is over the trained seeds, None when none
    trained; ``wall_s`` and ``samples_per_s`` the same; ``final_train_loss`` and ``accuracy_gain_last_quarter``
    (test accuracy after the last epoch minus after three quarters of the epochs) are medians; ``trained`` of
    ``seeds`` ran to the end.
    """
    recipes = list(dict.fromkeys(run["recipe"] for run in runs))
    keys = sorted({(run["recipe"], run["global_batch_size"]) for run in runs},
                  key=lambda key: (recipes.index(key[0]), key[1]))
    return [_cell(recipe, batch, [run for run in runs if (run["recipe"], run["global_batch_size"]) == (recipe, batch)])
            for recipe, batch in keys]


def _cell(recipe: str, batch: int, runs: list[dict]) -> dict:
    trained = [run for run in runs if run.get("final_test_accuracy") is not None]
    cell = {"recipe": recipe, "global_batch_size": batch, "seeds": len(runs), "trained": len(trained),
            "steps": (trained or runs)[0].get("steps"), "lr": runs[0].get("lr"),
            "lines": sorted({run["line"] for run in runs if run.get("line")})}
    if not trained:
        return {**cell, "final_test_accuracy": None, "wall_s": None, "samples_per_s": None,
                "final_train_loss": math.nan, "accuracy_gain_last_quarter": None, "peak_train_loss": None}
    return {**cell, **with_spread("final_test_accuracy", [run["final_test_accuracy"] for run in trained]),
            **with_spread("wall_s", [run["wall_s"] for run in trained]),
            **with_spread("samples_per_s", [run["samples_per_s"] for run in trained]),
            "final_train_loss": _median([run["final_train_loss"] for run in trained]),
            "accuracy_gain_last_quarter": _median([_last_quarter_gain(run.get("accuracy_curve") or [])
                                                   for run in trained]),
            "peak_train_loss": _median([_peak(run["train_loss_curve"]) for run in trained])
            if all(run.get("train_loss_curve") for run in trained) else None}


def _peak(curve: list[float]) -> float:
    """The largest epoch train loss of a run (nan when one is nan)."""
    return math.nan if any(math.isnan(value) for value in curve) else max(curve)


def _last_quarter_gain(curve: list[float]) -> float:
    """Test accuracy after the last epoch minus after epoch ``ceil(3/4 E)`` (0 for a run of one epoch)."""
    if len(curve) < 2:
        return 0.0
    return curve[-1] - curve[min(math.ceil(0.75 * len(curve)), len(curve) - 1) - 1]


def baseline(table: list[dict]) -> dict | None:
    """The baseline cell: :data:`BASELINE_RECIPE` at its smallest batch with a trained run (None: not measured)."""
    rows = [row for row in table if row["recipe"] == BASELINE_RECIPE and row["final_test_accuracy"] is not None]
    return min(rows, key=lambda row: row["global_batch_size"]) if rows else None


def _loss_pp(row: dict | None, base: dict) -> float | None:
    """Percentage points ``row`` loses against ``base`` (medians; None when ``row`` has no trained run)."""
    if row is None or row["final_test_accuracy"] is None:
        return None
    return 100 * (base["final_test_accuracy"] - row["final_test_accuracy"])


def _at(table: list[dict], recipe: str, batch: int) -> dict | None:
    return next((row for row in table if row["recipe"] == recipe and row["global_batch_size"] == batch), None)


def judge(table: list[dict], goal_batch: int = GOAL_BATCH) -> list[str]:
    """The two goal lines at ``goal_batch`` (met / MISSED with the medians they compare), or why not judged."""
    base = baseline(table)
    others = [row for row in table if row["recipe"] != BASELINE_RECIPE and row["global_batch_size"] == goal_batch
              and row["final_test_accuracy"] is not None]
    sgd_loss = None if base is None else _loss_pp(_at(table, BASELINE_RECIPE, goal_batch), base)
    if base is None or sgd_loss is None or not others:
        return [f"# goal at global batch {goal_batch}: not judged (needs {BASELINE_RECIPE} at a smaller batch and at "
                f"{goal_batch}, and another recipe at {goal_batch}, each with a trained run)"]
    best = max(others, key=lambda row: row["final_test_accuracy"])
    best_loss = _loss_pp(best, base)
    head = (f"# goal at global batch {goal_batch}: the best recipe, {best['recipe']} "
            f"({100 * best['final_test_accuracy']:.2f}%), loses {best_loss:.2f} pp against the baseline "
            f"({BASELINE_RECIPE} at {base['global_batch_size']}: {100 * base['final_test_accuracy']:.2f}%)")
    bound = GOAL_FRACTION * sgd_loss
    return [f"{head}; at most {GOAL_FRACTION:g} x what {BASELINE_RECIPE} loses at {goal_batch} ({sgd_loss:.2f} pp "
            f"-> {bound:.2f} pp): {'met' if best_loss <= bound else 'MISSED'}",
            f"{head}; at most {GOAL_ABSOLUTE_PP:g} pp: {'met' if best_loss <= GOAL_ABSOLUTE_PP else 'MISSED'}"]


def breaking_batch(table: list[dict], recipe: str) -> int | None:
    """The first batch where ``recipe``'s median is more than :data:`BREAK_PP` below the baseline's (or it failed)."""
    base = baseline(table)
    for row in sorted((row for row in table if row["recipe"] == recipe), key=lambda row: row["global_batch_size"]):
        loss = None if base is None else _loss_pp(row, base)
        if loss is None or loss > BREAK_PP:
            return row["global_batch_size"]
    return None


def reason(row: dict, reference: dict, base: dict) -> str:
    """Why ``row`` (a recipe at a large batch) lost against ``base``, measured: failed, diverged (final train
    loss nan or no better than a uniform guess), unstable (an epoch's train loss above :data:`UNSTABLE_LOSS`,
    recovered from), too few steps (train loss >= :data:`UNDERTRAINED_LOSS_FACTOR` x its own at ``reference``,
    the recipe's smallest batch) or a generalisation gap (train loss close to the reference's, accuracy lower)."""
    if row["final_test_accuracy"] is None:
        return f"every run failed ({'; '.join(row['lines']) or 'no reason recorded'})"
    loss, ref_loss = row["final_train_loss"], reference["final_train_loss"]
    acc, lost = 100 * row["final_test_accuracy"], _loss_pp(row, base)
    if math.isnan(loss) or loss >= CHANCE_LOSS or row["final_test_accuracy"] <= CHANCE_ACCURACY:
        return (f"diverged at peak lr {row['lr']:.4g}: {acc:.1f}% test accuracy, final train loss {loss:.3g} "
                f"(a uniform guess: {CHANCE_LOSS:.2f})")
    if lost <= BREAK_PP:
        return f"holds: {lost:.2f} pp below the baseline with {row['steps']} steps"
    peak = row.get("peak_train_loss")
    if peak is not None and not math.isnan(peak) and peak > UNSTABLE_LOSS:
        return (f"unstable at peak lr {row['lr']:.4g}: an epoch's train loss rose to {peak:.3g} (a uniform guess: "
                f"{CHANCE_LOSS:.2f}), down to {loss:.3f} at the end; {acc:.1f}% test accuracy")
    steps = (f"{row['steps']} steps for the whole budget ({reference['steps']} at batch "
             f"{reference['global_batch_size']})")
    if not math.isnan(ref_loss) and loss >= UNDERTRAINED_LOSS_FACTOR * ref_loss:
        gain = row["accuracy_gain_last_quarter"]
        return (f"too few steps: {steps}; final train loss {loss:.3f} against {ref_loss:.3f}, test accuracy still "
                f"{100 * gain:+.2f} pp over the last quarter of the epochs")
    return (f"generalisation gap: final train loss {loss:.3f} close to {ref_loss:.3f} at batch "
            f"{reference['global_batch_size']}, yet test accuracy {lost:.2f} pp below the baseline ({steps})")


def breaks(table: list[dict], break_batch: int = BREAK_BATCH) -> list[str]:
    """One line per recipe: where it breaks (:func:`breaking_batch`) and why at ``break_batch`` (:func:`reason`)."""
    base = baseline(table)
    if base is None:
        return [f"# at global batch {break_batch}: not judged (no trained {BASELINE_RECIPE} baseline)"]
    lines = []
    for recipe in dict.fromkeys(row["recipe"] for row in table):
        row = _at(table, recipe, break_batch)
        if row is None:
            continue
        reference = min((r for r in table if r["recipe"] == recipe and r["final_test_accuracy"] is not None),
                        key=lambda r: r["global_batch_size"], default=base)
        at = breaking_batch(table, recipe)
        where = ("does not break" if at is None
                 else f"breaks at {at} (first batch > {BREAK_PP:g} pp below the baseline)")
        lines.append(f"# at global batch {break_batch}, {recipe}: {where}; {reason(row, reference, base)}")
    return lines


def format_table(runs: list[dict]) -> str:
    """The cells as aligned text (accuracy as median (min-max) %), then the goal lines and the breaking lines."""
    table = cells(runs)
    base = baseline(table)

    def versus(row: dict) -> str:
        lost = None if base is None else _loss_pp(row, base)
        return "-" if lost is None else f"{0.0 - lost:+.2f}"

    text = format_rows(table, [
        ("recipe", 11, "{recipe}"), ("batch", 5, "{global_batch_size}"),
        ("peak lr", 8, lambda row: "-" if row["lr"] is None else f"{row['lr']:.4g}"),
        ("steps", 5, lambda row: "-" if row["steps"] is None else str(row["steps"])),
        ("test acc %", 21, lambda row: "-" if row["final_test_accuracy"] is None
         else scaled_cell("final_test_accuracy", 100, ".2f")(row)),
        ("vs base pp", 10, versus), ("train loss", 10, lambda row: f"{row['final_train_loss']:.3f}"),
        ("wall s", 6, lambda row: "-" if row["wall_s"] is None else f"{row['wall_s']:.1f}"),
        ("samples/s", 9, lambda row: "-" if row["samples_per_s"] is None else f"{row['samples_per_s']:.0f}"),
        ("runs", 5, lambda row: f"{row['trained']}/{row['seeds']}")])
    notes = [f"# {row['recipe']} at {row['global_batch_size']}: {line}" for row in table for line in row["lines"]]
    return "\n".join([text, *notes, *judge(table), *breaks(table)])


def plot(runs: list[dict], path: Path, title: str) -> Path:
    """Median test accuracy against the global batch (log axis), one line per recipe, min-max as error bars."""
    from gradsync.train.plots import new_figure, save, set_title

    table = [row for row in cells(runs) if row["final_test_accuracy"] is not None]
    figure, axes = new_figure(7, 4.5)
    for index, recipe in enumerate(dict.fromkeys(row["recipe"] for row in table)):
        rows = [row for row in table if row["recipe"] == recipe]
        medians = [100 * row["final_test_accuracy"] for row in rows]
        errors = [[median - 100 * row["final_test_accuracy_min"] for median, row in zip(medians, rows)],
                  [100 * row["final_test_accuracy_max"] - median for median, row in zip(medians, rows)]]
        axes.errorbar([row["global_batch_size"] for row in rows], medians, yerr=errors, marker="o", ms=4,
                      capsize=3, color=f"C{index}", label=recipe)
    base = baseline(table)
    if base is not None:
        axes.axhline(100 * base["final_test_accuracy"] - BREAK_PP, color="grey", lw=0.8, ls=":",
                     label=f"baseline - {BREAK_PP:g} pp")
    axes.set_xscale("log", base=2)
    batches = sorted({row["global_batch_size"] for row in table})
    axes.set_xticks(batches, [str(batch) for batch in batches])
    axes.set(xlabel="global batch (samples per step)", ylabel="final test accuracy (%)")
    set_title(axes, title)
    if table:
        axes.legend(fontsize=8, loc="lower left")
    return save(figure, path, dpi=120)
