"""``gradsync bench faults``: what a kill and a hang cost, measured on the main job with restarts.

Three runs of the same job (same seed, checkpoints every K steps): one
without a fault, one where a worker dies (``--fail-at``) and one where a
worker hangs (``--hang-at``), each with ``--max-restarts 1``. From the run
folder's ``events.jsonl`` (wall-clock times written by the workers):

- ``detect_s``: fault -> first worker that raised for it (a closed
  connection for a kill, the timeout naming the hung rank for a hang);
- ``recover_s``: fault -> the restarted workers have loaded the checkpoint
  and start the next step ("training again");
- ``steps_recomputed``: steps finished after the checkpoint the job resumed
  from and lost with the failed attempt (at most K);
- ``params_equal``: the final model equals the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from gradsync.bench.output import claim_json_path, format_rows, optional, write_json
from gradsync.fault.events import read_events
from gradsync.launch import start_forkserver
from gradsync.train import data
from gradsync.train.config import TrainConfig, total_steps
from gradsync.train.validation import validate, validate_against_data
from gradsync.train.metrics import MODEL_FILE
from gradsync.jobs.worker import run_worker

FAULTS = ("kill", "hang")


def default_fault_step(last_step: int, checkpoint_every: int) -> int:
    """Mid-run, just before a checkpoint would be written: the most work a fault can lose."""
    middle = max(last_step // 2, checkpoint_every)
    return min(middle - middle % checkpoint_every + checkpoint_every, last_step)


def run_one(config: TrainConfig) -> tuple[dict, float]:
    from gradsync.jobs.job import run_job

    started = time.perf_counter()
    summary = run_job(config)
    return summary, time.perf_counter() - started


def params_equal(run_a: Path, run_b: Path) -> bool:
    a = torch.load(run_a / MODEL_FILE, weights_only=True)
    b = torch.load(run_b / MODEL_FILE, weights_only=True)
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def measure(events: list[dict]) -> dict:
    """detect_s, recover_s and steps_recomputed from one run's events (None where an event is missing)."""
    fault = next((e for e in events if e["event"] == "fault"), None)
    if fault is None:
        raise RuntimeError("the fault never fired: no 'fault' event in events.jsonl")
    detected = [e["time"] for e in events if e["event"] == "detected" and e["attempt"] == fault["attempt"]]
    resumed = next((e for e in events if e["event"] == "resumed" and e["attempt"] > fault["attempt"]), None)
    return {"detect_s": min(detected) - fault["time"] if detected else None,
            "recover_s": resumed["time"] - fault["time"] if resumed else None,
            "resumed_from_step": resumed["from_step"] if resumed else None,
            "steps_recomputed": (fault["step"] - 1 - resumed["from_step"]) if resumed else None,
            "blamed": sorted({e["peer"] for e in events if e["event"] == "detected"})}


def run_bench(*, nproc: int = 4, epochs: int = 3, checkpoint_every: int = 25, timeout: float = 5.0,
              fault_rank: int = 1, fault_step: int | None = None, num_samples: int | None = None,
              out: str | None = None, json_path: str | None = None) -> list[dict]:
    """Run the baseline, the kill and the hang; print the table; write JSON rows (one per fault)."""
    base = TrainConfig(nproc=nproc, epochs=epochs, checkpoint_every=checkpoint_every, timeout=timeout,
                       max_restarts=1, progress=False)
    if num_samples is not None:
        base.num_samples = num_samples
    validate(base)
    if nproc < 2:
        raise ValueError(f"--nproc must be >= 2 (a fault needs a survivor to detect it), got {nproc}")
    validate_against_data(base, nproc, data.num_train_samples(base.num_samples))
    last_step = total_steps(base, nproc, data.num_train_samples(base.num_samples))
    step = default_fault_step(last_step, checkpoint_every) if fault_step is None else fault_step
    if not 0 <= fault_rank < nproc:
        raise ValueError(f"--fault-rank {fault_rank} is not a worker: workers are ranks 0..{nproc - 1}")
    if not 1 <= step <= last_step:
        raise ValueError(f"--fault-step must be in [1, {last_step}] (the job's steps), got {step}")
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="gradsync-bench-faults-"))
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a folder")
    taken = [fault for fault in ("none",) + FAULTS if (out_dir / fault).exists()]
    if taken:
        raise ValueError(f"--out {out_dir} already holds bench faults runs ({', '.join(taken)}); choose another folder")
    claim_json_path(json_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"# gradsync bench faults: MNIST-1D CNN, {nproc} workers, {epochs} epochs ({last_step} steps), "
          f"checkpoint every {checkpoint_every} steps, --timeout {timeout:g} s, fault on rank {fault_rank} "
          f"at step {step}, --max-restarts 1; runs in {out_dir}", flush=True)
    start_forkserver(run_worker)  # its one-time imports would otherwise count in the first run only
    runs = {}
    for fault in ("none",) + FAULTS:
        folder = out_dir / fault
        option = {"kill": {"fail_at": f"{fault_rank}:{step}"},
                  "hang": {"hang_at": f"{fault_rank}:{step}"}}.get(fault, {})
        config = TrainConfig(**{**base.to_dict(), **option, "out": str(folder),
                                "checkpoint_dir": str(folder / "checkpoints")})
        summary, wall_s = run_one(config)
        runs[fault] = (folder, summary, wall_s)
        print(f"# done: {fault}", flush=True)
    baseline_folder, baseline_summary, baseline_wall_s = runs["none"]
    rows = []
    for fault in FAULTS:
        folder, summary, wall_s = runs[fault]
        rows.append({"fault": fault, "rank": fault_rank, "step": step, "num_workers": nproc,
                     "timeout_s": timeout, "checkpoint_every": checkpoint_every, **measure(read_events(folder)),
                     "params_equal": params_equal(folder, baseline_folder),
                     "test_accuracy": summary["final_test_accuracy"],
                     "baseline_test_accuracy": baseline_summary["final_test_accuracy"],
                     "job_s": wall_s, "baseline_job_s": baseline_wall_s, "extra_s": wall_s - baseline_wall_s,
                     "checkpoint_s": baseline_summary["checkpoint_s"], "run_folder": str(folder)})
    print(format_table(rows))
    if json_path:
        write_json(json_path, rows)
    return rows



def format_table(rows: list[dict]) -> str:
    lines = [format_rows(rows, [
        ("fault", 5, "{fault}"), ("rank:step", 9, "{rank}:{step}"), ("timeout s", 9, "{timeout_s:g}"),
        ("detect s", 8, optional("detect_s", ".2f")), ("recover s", 9, optional("recover_s", ".2f")),
        ("recomputed", 10, optional("steps_recomputed", "d")), ("ckpt every", 10, "{checkpoint_every:d}"),
        ("params equal", 12, "{params_equal!s}"), ("job s", 6, "{job_s:.1f}"),
        ("no-fault s", 10, "{baseline_job_s:.1f}"), ("extra s", 7, "{extra_s:.1f}")])]
    checkpoint_s = rows[0]["checkpoint_s"] if rows else 0.0
    lines.append(f"# checkpoints cost {checkpoint_s:.2f} s in total in the run without a fault")
    return "\n".join(lines)
