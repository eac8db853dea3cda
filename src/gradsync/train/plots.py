"""PNG plots of a run: loss, accuracy and where the time went (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def plot_run(records: list[dict], summary: dict, out_dir: Path) -> list[Path]:
    """Write ``loss.png``, ``accuracy.png`` and ``time.png`` into ``out_dir``; return their paths."""
    out_dir = Path(out_dir)
    steps = [r for r in records if r["kind"] == "step"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    return [_plot_loss(steps, epochs, out_dir / "loss.png"),
            _plot_accuracy(epochs, out_dir / "accuracy.png"),
            _plot_time(summary, out_dir / "time.png")]


def _plot_loss(steps: list[dict], epochs: list[dict], path: Path) -> Path:
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.6, alpha=0.5,
              label="train loss per step (rank 0; async: the pushing worker's)")
    if epochs and steps:
        steps_per_epoch = max(r["step"] for r in steps) / len(epochs)
        x = [(r["epoch"] + 1) * steps_per_epoch for r in epochs]
        axes.plot(x, [r["train_loss"] for r in epochs], "o-", label="train loss, all ranks (epoch)")
        axes.plot(x, [r["test_loss"] for r in epochs], "s-", label="test loss (epoch)")
    axes.set(xlabel="optimizer step", ylabel="cross-entropy", yscale="log", title="Loss")
    axes.legend()
    return _save(figure, path)


def _plot_accuracy(epochs: list[dict], path: Path) -> Path:
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot([r["epoch"] + 1 for r in epochs], [100 * r["test_accuracy"] for r in epochs], "o-")
    axes.set(xlabel="epoch", ylabel="test accuracy (%)", title="Test accuracy")
    axes.grid(alpha=0.3)
    return _save(figure, path)


def _plot_time(summary: dict, path: Path) -> Path:
    figure, axes = plt.subplots(figsize=(7, 3))
    exposed = summary.get("exposed_communication_s", summary["communication_s"])
    parts = {"compute": summary["compute_s"], "exposed communication": exposed,
             "evaluation + other": max(summary["train_wall_s"] - summary["compute_s"] - exposed, 0.0)}
    left = 0.0
    for label, seconds in parts.items():
        axes.barh(["rank mean"], [seconds], left=left, label=f"{label} {seconds:.1f} s")
        left += seconds
    axes.set(xlabel="seconds", title=f"Where the training time went (communication ran "
             f"{summary['communication_s']:.1f} s, {exposed:.1f} s of it not hidden by backward)")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3)
    return _save(figure, path)


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
