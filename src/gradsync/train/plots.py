"""PNG plots of a run: loss, accuracy and where the time went (matplotlib, Agg backend).

:func:`new_figure` and :func:`save` are shared with the benchmarks' plots:
constrained layout, titles wrapped to the figure's width, and a tight bounding
box on save, so no title, label or legend is ever cut off.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.ticker import FuncFormatter, LogFormatter, MaxNLocator  # noqa: E402

TITLE_CHARS_PER_INCH = 9  # a 12 pt title fits ~11 characters per inch; keep a margin


def new_figure(width_in: float, height_in: float):
    """A figure of ``width_in`` x ``height_in`` inches with one axes, laid out so nothing is clipped."""
    return plt.subplots(figsize=(width_in, height_in), layout="constrained")


def set_title(axes, text: str) -> None:
    """Set ``text`` as the axes' title, wrapped onto as many lines as the figure's width needs."""
    width_in = axes.figure.get_size_inches()[0]
    axes.set_title(textwrap.fill(text, width=max(int(width_in * TITLE_CHARS_PER_INCH), 20)))


def whole_numbers(axis) -> None:
    """Ticks only at whole numbers (epochs), never 0.96, 0.98, ..."""
    axis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def save(figure, path: Path, dpi: int = 110) -> Path:
    figure.savefig(path, dpi=dpi, bbox_inches="tight", pad_inches=0.1)
    plt.close(figure)
    return Path(path)


def plot_run(records: list[dict], summary: dict, out_dir: Path) -> list[Path]:
    """Write ``loss.png``, ``accuracy.png`` and ``time.png`` into ``out_dir``; return their paths."""
    out_dir = Path(out_dir)
    steps = [r for r in records if r["kind"] == "step"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    return [_plot_loss(steps, epochs, out_dir / "loss.png"),
            _plot_accuracy(epochs, out_dir / "accuracy.png"),
            _plot_time(summary, out_dir / "time.png")]


def _plot_loss(steps: list[dict], epochs: list[dict], path: Path) -> Path:
    figure, axes = new_figure(7, 4)
    axes.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.6, alpha=0.5,
              label="train loss per step (rank 0; async: the pushing worker's)")
    if epochs and steps:
        steps_per_epoch = max(r["step"] for r in steps) / len(epochs)
        x = [(r["epoch"] + 1) * steps_per_epoch for r in epochs]
        axes.plot(x, [r["train_loss"] for r in epochs], "o-", label="train loss, all ranks (epoch)")
        axes.plot(x, [r["test_loss"] for r in epochs], "s-", label="test loss (epoch)")
    axes.set(xlabel="optimizer step", ylabel="cross-entropy (log scale)", yscale="log")
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # 0.1, not 10^-1
    axes.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    set_title(axes, "Loss")
    axes.legend(fontsize=8)
    return save(figure, path)


def _plot_accuracy(epochs: list[dict], path: Path) -> Path:
    figure, axes = new_figure(7, 4)
    axes.plot([r["epoch"] + 1 for r in epochs], [100 * r["test_accuracy"] for r in epochs], "o-")
    axes.set(xlabel="epoch", ylabel="test accuracy (%)")
    whole_numbers(axes.xaxis)
    set_title(axes, "Test accuracy")
    axes.grid(alpha=0.3)
    return save(figure, path)


def _plot_time(summary: dict, path: Path) -> Path:
    figure, axes = new_figure(7, 3.2)
    exposed = summary.get("exposed_communication_s", summary["communication_s"])
    parts = {"compute": summary["compute_s"], "exposed communication": exposed,
             "evaluation + other": max(summary["train_wall_s"] - summary["compute_s"] - exposed, 0.0)}
    left = 0.0
    for label, seconds in parts.items():
        axes.barh(["rank mean"], [seconds], left=left, label=f"{label} {seconds:.1f} s")
        left += seconds
    axes.set(xlabel="seconds")
    set_title(axes, f"Where the training time went (communication ran {summary['communication_s']:.1f} s, "
              f"{exposed:.1f} s of it not hidden by backward)")
    figure.legend(loc="outside lower center", ncol=3, fontsize=9)
    return save(figure, path)
