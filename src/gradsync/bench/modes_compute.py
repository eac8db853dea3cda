"""``gradsync bench modes --model M --batch-size B``: the modes where compute dominates a step, and the goals.

On the main job (the MNIST-1D CNN at 32 samples per worker) a step computes
for a few milliseconds, about what its communication and the per-step
overheads take, so a worker that computes 3x as long slows sync training far
less than 3x and asynchronous training has little to win. Where compute
dominates (the same CNN at a larger batch per worker, or the gpt), a 3x
straggler slows every synchronous step about 3x; a parameter server lets the
other workers go on, and local SGD / DiLoCo wait for it only every H steps.
:func:`goal_lines` judges issue 40's goals from a table's medians:

* under the straggler: async >= 1.5x sync samples/s; DiLoCo (``--mode
  local-sgd --outer-optimizer nesterov``; plain local SGD where a table has no
  DiLoCo row) >= 2x sync; each ending within 1 pp of sync's final accuracy;
* without a straggler: async >= 0.9x sync samples/s.

It also says how much the straggler slows sync (the ratio of sync's medians
without and with it): about the factor when compute dominates.
"""

from __future__ import annotations

from gradsync.bench.spread import fmt_spread, verdict
from gradsync.train.config import TrainConfig, default_lr

ASYNC_STRAGGLER_GOAL, LOCAL_STRAGGLER_GOAL, ASYNC_PLAIN_GOAL = 1.5, 2.0, 0.9  # x sync samples/s
ACCURACY_GOAL_PP = 1.0  # at most this far below sync's final test accuracy (percentage points)
_NAMES = {"cnn": "MNIST-1D CNN", "mlp": "MNIST-1D MLP", "logreg": "MNIST-1D logistic regression",
          "gpt": "gpt on the corpus"}


def model_options(model: str, batch_size: int | None, lr: float | None = None) -> dict:
    """The ``TrainConfig`` fields of ``--model`` and ``--batch-size`` (only those that differ from the main job),
    with the gpt's own default lr unless ``lr`` is given (as ``gradsync train --model gpt``).

    Raises:
        ValueError: an unknown model (naming the choices), or a batch size < 1.
    """
    if model not in _NAMES:
        raise ValueError(f"--model: unknown model {model!r}; choose one of {', '.join(_NAMES)}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"--batch-size must be an int >= 1, got {batch_size!r}")
    options = {} if model == TrainConfig.model else {"model": model}
    if lr is None and default_lr(model) != TrainConfig.lr:
        options["lr"] = default_lr(model)
    return options if batch_size is None else {**options, "batch_size": batch_size}


def describe(options: dict) -> str:
    """``"MNIST-1D CNN, 256 samples per worker per step"`` for the run options ``options``."""
    model = options.get("model", TrainConfig.model)
    return f"{_NAMES.get(model, model)}, {options.get('batch_size', TrainConfig.batch_size)} samples per worker per step"


def diloco_rows(rows: list[dict]) -> tuple[list[dict], str]:
    """The rows the DiLoCo goal is judged on: local SGD with the outer Nesterov optimizer (DiLoCo), else
    every plain local SGD row; and how to name them."""
    diloco = [row for row in rows if row["mode"] == "local-sgd" and row.get("outer_optimizer") == "nesterov"]
    if diloco:
        return diloco, "DiLoCo"
    return [row for row in rows if row["mode"] == "local-sgd"], "local SGD (no DiLoCo row in this table)"


def _throughput(row: dict, goal: float) -> str:
    return (f"{fmt_spread(row, 'samples_per_s_vs_sync', '.2f', 'x')} sync samples/s "
            f"(goal >= {goal:g}x): {verdict(row, 'samples_per_s_vs_sync', goal, at_most=False)}")


def _accuracy(row: dict, sync: dict) -> str:
    gap_pp = 100 * (row["test_accuracy"] - sync["test_accuracy"])
    met = "met" if gap_pp >= -ACCURACY_GOAL_PP else "missed"
    return (f"final accuracy {100 * row['test_accuracy']:.2f}% vs sync {100 * sync['test_accuracy']:.2f}% "
            f"({gap_pp:+.2f} pp; goal within {ACCURACY_GOAL_PP:g} pp): {met}")


def goal_lines(rows: list[dict]) -> list[str]:
    """Issue 40's goals for async and DiLoCo (module docstring), one ``# goal`` line per judged row, from the
    medians of ``rows`` (``gradsync bench modes`` rows; the straggler rows are those with a factor > 1)."""
    sync = {row["straggler"]: row for row in rows if row["mode"] == "sync"}
    factors = sorted(sync)
    if not factors:
        return []
    lines = []
    slow = factors[-1] if factors[-1] > 1 else None
    if slow is not None and 1.0 in sync:
        lines.append(f"# the {slow:g}x straggler slows sync {sync[1.0]['samples_per_s'] / sync[slow]['samples_per_s']:.2f}x "
                     f"(medians; {slow:g}x where compute is all of a step)")
        locals_, name = diloco_rows([row for row in rows if row["straggler"] == slow])
        for row in [r for r in rows if r["straggler"] == slow and r["mode"] == "async"]:
            lines.append(f"# goal: {row['label']}, {slow:g}x straggler: {_throughput(row, ASYNC_STRAGGLER_GOAL)}; "
                         f"{_accuracy(row, sync[slow])}")
        for row in locals_:
            lines.append(f"# goal: {row['label']} [{name}], {slow:g}x straggler: "
                         f"{_throughput(row, LOCAL_STRAGGLER_GOAL)}; {_accuracy(row, sync[slow])}")
    for row in [r for r in rows if r["straggler"] == 1.0 and r["mode"] == "async"]:
        lines.append(f"# goal: {row['label']}, no straggler: {_throughput(row, ASYNC_PLAIN_GOAL)}")
    return lines
