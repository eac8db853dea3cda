"""``gradsync bench faults --elastic``: what a failure costs when the survivors go on (``gradsync train --elastic``).

Runs, all on the main job's model and data with ``--deterministic`` (so a
recovery that changed the trajectory at all shows as unequal bits):

- ``none``: no fault (the throughput and the final model to compare with);
- ``kill`` / ``hang``: one worker killed (``--fail-at``) or hung
  (``--hang-at``) mid-run; the survivors shrink, its replacement grows the
  world back: the final model must be bitwise the fault-free one;
- ``chaos``: a random worker (seeded) SIGKILLed every ``--kill-every`` s
  through a run of about ``--chaos-s`` s, against a fault-free run of the same
  length (``throughput_kept``);
- ``torchft``: torchft's own fault-tolerant DDP on the same model, data and
  chaos schedule (:mod:`gradsync.bench.torchft_peer`), when torchft is installed.

Per failure, from the run folder's ``events.jsonl`` (wall-clock times):
``detect_s`` fault -> the first survivor or launcher that saw it;
``recover_s`` fault -> the survivors' first membership after it has its
state and is training; ``steps_lost`` committed steps the survivors did not
have (the step in flight is redone, not lost); ``joiner_s`` fault -> the
replacement trains in a membership. Samples lost or used twice are counted
per sample id from the members' own records.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from gradsync.bench.faults import params_equal
from gradsync.bench.output import claim_json_path, fmt_optional, format_rows, optional, write_json
from gradsync.fault.events import read_events
from gradsync.train import data
from gradsync.train.config import TrainConfig
from gradsync.train.validation import validate
from gradsync.elastic.samples import count_samples
from gradsync.train.global_batch import global_batches
from gradsync.train.metrics import METRICS_FILE, read_metrics


def _config(base: dict, folder: Path, **options) -> TrainConfig:
    return TrainConfig(**{**base, **options, "out": str(folder)})


def _run(config: TrainConfig, chaos: tuple[float, int] | None = None) -> tuple[dict, list[dict]]:
    """Run the job (``chaos``: kill a random worker every ``chaos[0]`` s, RNG seed ``chaos[1]``)."""
    from gradsync.jobs.elastic import ElasticJob

    folder = Path(config.out)
    folder.mkdir(parents=True)
    job = ElasticJob(config, data.prepare(config.data_dir, config.num_samples), folder)
    kills, stop = [], threading.Event()
    killer = threading.Thread(target=_chaos, args=(job, chaos, kills, stop), daemon=True) if chaos else None
    try:
        if killer:
            killer.start()
        summary = job.wait()
    finally:
        stop.set()
        if killer:
            killer.join(5)
        job.close()
    return summary, kills


def _chaos(job, chaos: tuple[float, int], kills: list[dict], stop: threading.Event) -> None:
    import os
    import signal

    every_s, seed = chaos
    rng = random.Random(seed)
    while not stop.wait(every_s * rng.uniform(0.8, 1.2)):
        pids = job.worker_pids()
        if not pids:
            continue
        slot = rng.choice(sorted(pids))
        kills.append({"slot": slot, "pid": pids[slot], "time": time.time()})
        try:
            os.kill(pids[slot], signal.SIGKILL)
        except ProcessLookupError:
            kills.pop()


def measure_failures(folder: Path, faults: list[dict]) -> list[dict]:
    """One record per fault: detect_s, recover_s, steps_lost, joiner_s, replicas_equal (None where missing)."""
    events = read_events(folder)
    steps = [(r["time"], r["step"]) for r in read_metrics(folder / METRICS_FILE) if r.get("kind") == "step"]
    rows = []
    for index, fault in enumerate(faults):
        t = fault["time"]
        until = faults[index + 1]["time"] if index + 1 < len(faults) else float("inf")
        seen = [e["time"] for e in events if e["event"] in ("left", "died") and t <= e["time"] < until]
        back = [e for e in events if e["event"] == "resumed_training" and t < e["time"] < until]
        shrunk = back[0] if back else None
        joined = next((e for e in back if fault["slot"] in e.get("joined", [])), None)
        before = max((step for when, step in steps if when <= t), default=0)
        rows.append({"slot": fault["slot"], "detect_s": min(seen) - t if seen else None,
                     "recover_s": shrunk["time"] - t if shrunk else None,
                     "steps_lost": max(before - shrunk["step"], 0) if shrunk else None,
                     "joiner_s": joined["time"] - t if joined else None,
                     "replicas_equal": all(e.get("replicas_equal", False) for e in back) if back else None})
    return rows


def seconds_lost(folder: Path) -> float:
    """Wall seconds between the first and last step beyond the run's own steady pace (median step gap)."""
    times = [r["time"] for r in read_metrics(folder / METRICS_FILE) if r.get("kind") == "step"]
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not gaps:
        return 0.0
    return (times[-1] - times[0]) - statistics.median(gaps) * len(gaps)


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _row(name: str, config: TrainConfig, summary: dict, folder: Path, failures: list[dict],
         reference: tuple[Path, dict] | None) -> dict:
    num_train, batch = data.num_train_samples(config.num_samples), config.elastic_global_batch()
    counts = count_samples(folder, lambda epoch: global_batches(num_train, batch, config.seed, epoch),
                           steps_done=summary.get("steps"))
    row = {"system": "gradsync", "elastic": True, "fault": name, "nproc": config.nproc,
           "failures": len(failures), "detect_s": _median(f["detect_s"] for f in failures),
           "recover_s": _median(f["recover_s"] for f in failures),
           "recover_after_detect_s": max((f["recover_s"] - f["detect_s"] for f in failures
                                          if f["recover_s"] is not None and f["detect_s"] is not None), default=None),
           "steps_lost_per_fault": max((f["steps_lost"] or 0 for f in failures), default=0),
           "joiner_s": _median(f["joiner_s"] for f in failures),
           "samples_lost": counts["samples_lost"], "samples_duplicated": counts["samples_duplicated"],
           "replicas_equal": summary.get("replicas_equal") and all(f["replicas_equal"] is not False
                                                                   for f in failures),
           "final_test_accuracy": summary.get("final_test_accuracy"), "samples_per_s": summary.get("samples_per_s"),
           "wall_s": summary.get("wall_s"), "failures_detail": failures, "run_folder": str(folder)}
    row["seconds_lost"] = seconds_lost(folder)
    if reference is not None:
        ref_folder, ref_summary = reference
        row["throughput_kept"] = (summary["samples"] / summary["wall_s"]) / (ref_summary["samples"] / ref_summary["wall_s"])
        # robust to the load moving between the two runs: each run against its own steady pace
        extra_s = row["seconds_lost"] - seconds_lost(ref_folder)
        row["throughput_kept_within_run"] = 1.0 - max(extra_s, 0.0) / summary["wall_s"]
        row["bitwise_equal_to_fault_free"] = params_equal(folder, ref_folder) if config.deterministic else None
    return row


def run_bench(*, nproc: int = 4, epochs: int = 3, timeout: float = 5.0, fault_rank: int = 1,
              fault_step: int | None = None, num_samples: int | None = None, chaos_s: float = 150.0,
              kill_every_s: float = 15.0, seed: int = 0, torchft: bool = True, out: str | None = None,
              json_path: str | None = None) -> list[dict]:
    """The elastic runs; prints the table and writes JSON rows (one per run)."""
    base = TrainConfig(nproc=nproc, epochs=epochs, timeout=timeout, elastic=True, deterministic=True,
                       global_batch_size=32 * nproc, progress=False)
    if num_samples is not None:
        base.num_samples = num_samples
    validate(base)
    if nproc < 2:
        raise ValueError(f"--nproc must be >= 2 (a fault needs a survivor), got {nproc}")
    if not 0 <= fault_rank < nproc:
        raise ValueError(f"--fault-rank {fault_rank} is not a worker slot: slots are 0..{nproc - 1}")
    if chaos_s <= 0 or kill_every_s <= 0:
        raise ValueError("--chaos-s and --kill-every must be > 0 seconds")
    steps = data.num_train_samples(base.num_samples) // base.global_batch_size * epochs
    step = fault_step or max(steps // 2, 1)
    if not 1 <= step <= steps:
        raise ValueError(f"--fault-step must be in [1, {steps}], got {step}")
    claim_json_path(json_path)
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="gradsync-bench-elastic-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = base.to_dict()
    _start_forkserver(torchft)  # before anything forks: the same start-up for every run it compares
    print(f"# gradsync bench faults --elastic: MNIST-1D CNN, {nproc} workers, global batch "
          f"{base.global_batch_size}, --deterministic, --timeout {timeout:g} s; runs in {out_dir}", flush=True)
    rows = []
    none_summary, _ = _run(_config(fields, out_dir / "none"))
    reference = (out_dir / "none", none_summary)
    rows.append(_row("none", base, none_summary, out_dir / "none", [], reference))
    for name, option in (("kill", {"fail_at": f"{fault_rank}:{step}"}), ("hang", {"hang_at": f"{fault_rank}:{step}"})):
        config = _config(fields, out_dir / name, **option)
        summary, _ = _run(config)
        fault = next(e for e in read_events(out_dir / name) if e["event"] == "fault")
        failures = measure_failures(out_dir / name, [{"slot": fault_rank, "time": fault["time"]}])
        rows.append(_row(name, config, summary, out_dir / name, failures, reference))
        print(f"# done: {name}", flush=True)
    rows += _chaos_rows(fields, out_dir, none_summary, epochs, chaos_s, kill_every_s, seed, torchft, nproc)
    print(format_table(rows))
    if json_path:
        write_json(json_path, rows)
    return rows


def _chaos_rows(fields: dict, out_dir: Path, none_summary: dict, epochs: int, chaos_s: float,
                kill_every_s: float, seed: int, torchft: bool, nproc: int) -> list[dict]:
    """The fault-free run of the chaos length, the chaos run, and torchft's on the same schedule."""
    epoch_s = none_summary["wall_s"] / epochs
    chaos_epochs = max(int(round(chaos_s / epoch_s)), 1)
    calm_config = _config(fields, out_dir / "chaos-none", epochs=chaos_epochs)
    calm, _ = _run(calm_config)
    rows = [_row("chaos-none", calm_config, calm, out_dir / "chaos-none", [], (out_dir / "chaos-none", calm))]
    config = _config(fields, out_dir / "chaos", epochs=chaos_epochs)
    summary, kills = _run(config, chaos=(kill_every_s, seed))
    rows.append(_row("chaos", config, summary, out_dir / "chaos", measure_failures(out_dir / "chaos", kills),
                     (out_dir / "chaos-none", calm)))
    print("# done: chaos", flush=True)
    if torchft:
        rows += _torchft_rows(nproc, calm["wall_s"], kill_every_s, seed, out_dir, fields)
    return rows


def _start_forkserver(torchft: bool) -> None:
    from gradsync.launch import start_forkserver
    from gradsync.jobs.worker import run_elastic_worker

    import importlib.util

    found = torchft and importlib.util.find_spec("torchft") is not None
    start_forkserver(run_elastic_worker, *(("gradsync.bench.torchft_worker",) if found else ()))


def _torchft_rows(nproc: int, duration_s: float, kill_every_s: float, seed: int, out_dir: Path,
                  fields: dict) -> list[dict]:
    try:
        from gradsync.bench.torchft_peer import run_torchft_chaos
    except ImportError as exc:
        print(f"# torchft row skipped: {exc}", flush=True)
        return []
    try:
        # "quorum": the global batch re-split over the replicas of each step's quorum, as gradsync does
        return [run_torchft_chaos(nproc=nproc, duration_s=duration_s, kill_every_s=kill_every_s, seed=seed,
                                  global_batch_size=fields["global_batch_size"], split="quorum",
                                  out_dir=out_dir / "torchft", num_samples=fields["num_samples"])]
    except Exception as exc:  # noqa: BLE001 - the peer row must not cost the gradsync rows
        print(f"# torchft row failed: {type(exc).__name__}: {exc}", flush=True)
        return []


def format_table(rows: list[dict]) -> str:
    lines = [format_rows(rows, [
        ("system", 8, lambda r: r.get("system", "gradsync")), ("fault", 10, "{fault}"),
        ("n", 2, lambda r: f"{r.get('nproc', 0)}"), ("failures", 8, "{failures}"),
        ("detect s", 8, optional("detect_s", ".3f")), ("recover s", 9, optional("recover_s", ".3f")),
        ("after det", 9, optional("recover_after_detect_s", ".3f")),
        ("steps lost", 10, optional("steps_lost_per_fault", "d")),
        ("joiner s", 8, lambda r: fmt_optional(r.get("joiner_s") or r.get("joiner_startup_s"), ".2f")),
        ("lost", 5, optional("samples_lost", "d")), ("dup", 4, optional("samples_duplicated", "d")),
        ("kept", 6, optional("throughput_kept", ".3f")), ("replicas=", 9, lambda r: str(r.get("replicas_equal"))),
        ("bitwise=", 8, lambda r: str(r.get("bitwise_equal_to_fault_free"))),
        ("kept*", 6, optional("throughput_kept_within_run", ".3f")),
        ("test acc", 8, optional("final_test_accuracy", ".4f"))])]
    lines.append("# detect/recover/joiner: medians over the run's failures, seconds from the fault; after det: the "
                 "longest recover - detect of any failure; steps lost: the "
                 "most committed steps any failure cost; kept: samples/s against the fault-free run of the same length; "
                 "kept*: the same within the run (time beyond its own steady step pace, less the fault-free run's)")
    return "\n".join(lines)
