"""``gradsync bench fit``: the model that does not fit one replica, refused without sharding, trained with ZeRO-3.

Issue 39's proof on the real command line, each setting one ``gradsync
train`` process tree (the gpt at ``--nproc 4``):

1. the reference: ``--shard none`` without a memory limit;
2. ``--shard none --memory-limit-mib M``: the preflight must refuse it before
   step 1, in one line naming what would fit (nothing trained);
3. ``--shard parameters --memory-limit-mib M``: each rank runs in a child
   memory cgroup the kernel enforces, and must end within 2% of the
   reference's final test loss after the same steps.

M is chosen below what one unsharded replica needs. The runs train the
same data in the same order from the same seed, so the losses differ only
by summation order: a comparison of results, not of times (``wall s`` only
says what a run cost). ZeRO-3's sums are laid out once, unit by unit, so
its loss is the same in every run; the unsharded run's buckets are rebuilt
after its first backward where backward paused (:mod:`~gradsync.parallel.rebuild`),
which the machine's load moves, and its loss varies from run to run. The
reference therefore runs ``reference_runs`` times (the first before the
limited runs, the others after) and the 2% goal is judged against the
median of its losses, their min–max printed beside.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradsync.bench.output import claim_json_path, format_rows, optional, write_json
from gradsync.train.metrics import SUMMARY_FILE

LOSS_TOLERANCE = 0.02  # the goal: the ZeRO-3 run's final test loss within 2% of the reference's
RUN_TIMEOUT_S = 1800.0
SETTINGS = (("none", False), ("none", True), ("parameters", True))  # (shard, under the limit)


def train_argv(options: dict, shard: str, limit_mib: int | None, folder: Path) -> list[str]:
    """``gradsync train`` arguments of one setting (``limit_mib`` None: no memory limit)."""
    argv = ["train", "--model", "gpt", "--gpt-width", str(options["width"]), "--gpt-depth", str(options["depth"]),
            "--gpt-heads", str(options["heads"]), "--gpt-context", str(options["context"]),
            "--nproc", str(options["nproc"]), "--epochs", "1", "--global-batch-size", str(options["global_batch_size"]), "--optimizer", "adam",
            "--shard", shard, "--out", str(folder), "--no-progress", "--timeout", "300"]
    if limit_mib is not None:
        argv += ["--memory-limit-mib", str(limit_mib)]
    return argv


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_one(options: dict, shard: str, limited: bool, folder: Path) -> dict:
    """One setting's row: outcome (``trained``, ``refused`` by the preflight, ``failed``), its final test loss,
    steps, the preflight's estimate and measured peak (MiB, from summary.json), wall seconds, the last line."""
    limit = options["memory_limit_mib"] if limited else None
    row = {"shard": shard, "memory_limit_mib": limit, "outcome": "failed", "final_test_loss": None, "steps": None,
           "estimate_mib": None, "measured_peak_mib": None, "line": None}
    started = time.perf_counter()
    argv = [sys.executable, "-m", "gradsync", *train_argv(options, shard, limit, folder)]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return {**row, "wall_s": time.perf_counter() - started, "line": f"timed out after {RUN_TIMEOUT_S:g} s"}
    row["wall_s"] = time.perf_counter() - started
    if result.returncode != 0:
        line = _last_line(result.stderr)
        trained = (folder / SUMMARY_FILE).exists()
        outcome = "refused" if "preflight" in line and not trained else "failed"
        return {**row, "outcome": outcome, "line": line}
    summary = json.loads((folder / SUMMARY_FILE).read_text())
    preflight = summary.get("preflight") or {}
    return {**row, "outcome": "trained", "final_test_loss": summary.get("final_test_loss"),
            "steps": summary.get("steps"), "estimate_mib": preflight.get("estimate_mib"),
            "measured_peak_mib": preflight.get("measured_peak_mib"), "line": _last_line(result.stdout)}


def _parts(rows: list[dict]) -> tuple[list[dict], dict, dict]:
    """(the reference rows, the limited unsharded row, the limited ZeRO-3 row)."""
    references = [row for row in rows if row["memory_limit_mib"] is None]
    refused = next(row for row in rows if row["memory_limit_mib"] is not None and row["shard"] == "none")
    sharded = next(row for row in rows if row["memory_limit_mib"] is not None and row["shard"] == "parameters")
    return references, refused, sharded


def judge(rows: list[dict]) -> list[str]:
    """The goal lines: the limited unsharded run refused, the limited ZeRO-3 run within 2% of the median of
    the reference runs' final test losses (their min–max beside)."""
    references, refused, sharded = _parts(rows)
    lines = [f"# goal: --shard none under --memory-limit-mib {refused['memory_limit_mib']} refused by the "
             f"preflight before step 1: {'met' if refused['outcome'] == 'refused' else 'MISSED'} "
             f"({refused['outcome']}: {refused['line']})"]
    losses = [row["final_test_loss"] for row in references]
    if not losses or None in losses or sharded["final_test_loss"] is None:
        lines.append("# goal: --shard parameters under the limit within 2% of the reference's final test loss: "
                     "MISSED (a run did not train)")
        return lines
    median = statistics.median(losses)
    ratio = sharded["final_test_loss"] / median
    same_steps = all(row["steps"] == sharded["steps"] for row in references)
    met = abs(ratio - 1) <= LOSS_TOLERANCE and same_steps
    lines.append(f"# goal: --shard parameters under the limit ends within 2% of the unlimited --shard none runs' "
                 f"median final test loss after the same steps: {'met' if met else 'MISSED'} (ratio {ratio:.4f} to "
                 f"the median {median:.4f}; the {len(losses)} reference runs span {min(losses):.4f} to "
                 f"{max(losses):.4f}, {100 * (max(losses) - min(losses)) / median:.1f}% of their median; steps "
                 f"{sharded['steps']} and {', '.join(str(row['steps']) for row in references)})")
    return lines


def _order(reference_runs: int) -> list[tuple[str, bool]]:
    """The runs in order: one reference, the two limited settings, the other references."""
    return [SETTINGS[0], *SETTINGS[1:], *[SETTINGS[0]] * (reference_runs - 1)]


def format_table(rows: list[dict]) -> str:
    table = format_rows(rows, [
        ("shard", 10, "{shard}"),
        ("limit MiB", 9, lambda row: "-" if row["memory_limit_mib"] is None else str(row["memory_limit_mib"])),
        ("outcome", 7, "{outcome}"), ("steps", 5, optional("steps", "d")),
        ("test loss", 9, optional("final_test_loss", ".4f")),
        ("estimate MiB", 12, optional("estimate_mib", ".1f")),
        ("peak MiB", 8, optional("measured_peak_mib", ".1f")), ("wall s", 6, "{wall_s:.1f}")])
    notes = [f"# {row['shard']} under {row['memory_limit_mib']} MiB: {row['line']}"
             for row in rows if row["outcome"] != "trained"]
    return "\n".join([table, *notes, *judge(rows)])


def run_bench(*, memory_limit_mib: int = 400, nproc: int = 4, width: int = 256, depth: int = 8, heads: int = 8,
              context: int = 64, global_batch_size: int = 32, reference_runs: int = 3, out: str | None = None,
              json_path: str | None = None) -> list[dict]:
    """Run the settings (the reference ``reference_runs`` times), print the table and the goal lines, write
    the JSON rows; returns them."""
    if not isinstance(memory_limit_mib, int) or memory_limit_mib <= 0:
        raise ValueError(f"--memory-limit-mib must be a positive int, got {memory_limit_mib!r}")
    if not isinstance(reference_runs, int) or reference_runs < 1:
        raise ValueError(f"--reference-runs must be an int >= 1, got {reference_runs!r}")
    options = {"memory_limit_mib": memory_limit_mib, "nproc": nproc, "width": width, "depth": depth,
               "heads": heads, "context": context, "global_batch_size": global_batch_size}
    claim_json_path(json_path)
    folder = Path(out) if out else Path(tempfile.mkdtemp(prefix="gradsync-bench-fit-"))
    print(f"# gradsync bench fit: gradsync train --model gpt (width {width}, depth {depth}, context {context}), "
          f"--nproc {nproc}, AdamW, 1 epoch of its corpus at global batch {global_batch_size}; "
          f"the limit: --memory-limit-mib {memory_limit_mib} per rank", flush=True)
    rows = []
    try:
        for index, (shard, limited) in enumerate(_order(reference_runs)):
            row = run_one(options, shard, limited, folder / f"{index}-{shard}-{'limited' if limited else 'free'}")
            rows.append(row)
            print(f"# done: --shard {shard} {'under the limit' if limited else 'without a limit'}: "
                  f"{row['outcome']} ({row['wall_s']:.1f} s)", flush=True)
    finally:
        if not out:
            shutil.rmtree(folder, ignore_errors=True)
    print(format_table(rows), flush=True)
    if json_path:
        write_json(json_path, rows)
    return rows
