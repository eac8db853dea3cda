"""``gradsync bench faults --elastic``: what a failure costs when the survivors go on (``gradsync train --elastic``).

Runs, all on the main job's model and data with ``--deterministic`` (so a
recovery that changed the trajectory at all shows as unequal bits):

- ``none``: no fault, the reference of the next two (not a result: it is not
  compared with itself);
- ``kill`` / ``hang``: one worker killed (``--fail-at``) or hung
  (``--hang-at``) mid-run; the survivors shrink, its replacement grows the
  world back: the final model must be bitwise the fault-free one;
- ``chaos``: ``--repeat R`` times, alternated, a fault-free run of about
  ``--chaos-s`` s (``chaos-none``, the reference) and the same run with a
  random worker (seeded, seed + repetition) SIGKILLed every ``--kill-every``
  s; ``throughput_kept`` is formed within each repetition;
- ``torchft``: torchft's own fault-tolerant DDP on the same model, data and
  chaos schedule (:mod:`gradsync.bench.torchft_peer`), its own fault-free and
  chaos runs alternated in the same repetitions, when torchft is installed.

Per failure, both libraries' figures have one definition
(:mod:`gradsync.bench.elastic_metrics`); gradsync's records map to it in
:func:`run_events`. Samples lost or used twice are counted per sample id
from the members' own records.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from gradsync.bench.elastic_metrics import RunEvents, all_failures, paired_kept, pooled, reference_fields
from gradsync.bench.elastic_table import format_table
from gradsync.bench.faults import params_equal
from gradsync.bench.output import claim_json_path, write_json
from gradsync.bench.spread import check_repeat, with_spread
from gradsync.elastic.samples import count_samples
from gradsync.fault.events import read_events
from gradsync.train import data
from gradsync.train.config import TrainConfig
from gradsync.train.global_batch import global_batches
from gradsync.train.metrics import METRICS_FILE, read_metrics
from gradsync.train.validation import validate

__all__ = ["format_table", "run_bench", "run_events"]


def _config(base: dict, folder: Path, **options) -> TrainConfig:
    return TrainConfig(**{**base, **options, "out": str(folder)})


def _run(config: TrainConfig, chaos: tuple[float, int] | None = None) -> tuple[dict, list[dict]]:
    """Run the job (``chaos``: kill a random worker every ``chaos[0]`` s, RNG seed ``chaos[1]``);
    returns (summary, kills ``[{"victim": slot, "pid", "time"}]``)."""
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
        kills.append({"victim": slot, "pid": pids[slot], "time": time.time()})
        try:
            os.kill(pids[slot], signal.SIGKILL)
        except ProcessLookupError:
            kills.pop()


def run_events(folder: Path) -> RunEvents:
    """A gradsync run folder's records in the common form of :mod:`gradsync.bench.elastic_metrics`.

    Commits: rank 0's step records (``metrics.jsonl``: ``step`` counts the steps done, so the index is
    ``step - 1``). A member's ``left`` event (``step``: the index it was running) is a failed attempt when
    its membership had started training (a ``resumed_training`` event of that membership) and the error is
    not the quorum closing the membership at a step boundary (``MembershipChanged``); else it saw a changed
    membership. A joiner's first committed step: the first step record after the ``resumed_training``
    event of the membership it joined.
    """
    events = read_events(folder)
    commits = [(r["time"], r["step"] - 1) for r in read_metrics(Path(folder) / METRICS_FILE) if r.get("kind") == "step"]
    trained = {e["epoch"] for e in events if e["event"] == "resumed_training"}
    run = RunEvents(commits=commits)
    for event in events:
        if event["event"] == "left":
            if event["epoch"] in trained and not event["error"].startswith("MembershipChanged"):
                run.failed.append((event["time"], event["slot"], event["step"]))
            else:
                run.changed.append((event["time"], event["slot"]))
        elif event["event"] == "resumed_training" and event.get("joined"):
            first = min((when for when, _ in commits if when > event["time"]), default=None)
            if first is not None:
                run.joined += [(first, slot) for slot in event["joined"]]
    return run


def _measure(config: TrainConfig, chaos: tuple[float, int] | None = None, victim: int | None = None) -> "Run":
    """Run ``config`` (``chaos``: see :func:`_run`; ``victim``: the slot its ``--fail-at``/``--hang-at`` names,
    the fault's time read from its ``fault`` event)."""
    summary, kills = _run(config, chaos)
    if victim is not None:
        fault = next(e for e in read_events(config.out) if e["event"] == "fault")
        kills = [{"victim": victim, "time": fault["time"]}]
    return Run(config, summary, kills)


class Run:
    """One finished gradsync run: its folder, summary, kills and (from its records) failures, samples counted
    per id and samples/s (:func:`training_samples_per_s`)."""

    def __init__(self, config: TrainConfig, summary: dict, faults: list[dict]):
        self.folder, self.summary, self.faults = Path(config.out), summary, faults
        self.failures = all_failures(run_events(self.folder), faults)
        num_train, batch = data.num_train_samples(config.num_samples), config.elastic_global_batch()
        self.samples = count_samples(self.folder, lambda epoch: global_batches(num_train, batch, config.seed, epoch),
                                     steps_done=summary.get("steps"))
        handed = [e.get("replicas_equal", False) for e in read_events(self.folder) if e["event"] == "resumed_training"]
        self.replicas_equal = bool(summary.get("replicas_equal")) and all(handed)
        self.samples_per_s = training_samples_per_s(self.folder, config.global_batch_size)


def training_samples_per_s(folder: Path, global_batch_size: int) -> float:
    """Samples of the steps committed after the run's first, per second from its first to its last step
    record: the start-up left out, as torchft's rows leave it out (their window opens at the first full
    quorum). Raises ValueError when the run committed fewer than 2 steps."""
    times = [r["time"] for r in read_metrics(Path(folder) / METRICS_FILE) if r.get("kind") == "step"]
    if len(times) < 2 or times[-1] <= times[0]:
        raise ValueError(f"{folder}: fewer than 2 committed steps, no throughput to measure")
    return (len(times) - 1) * global_batch_size / (times[-1] - times[0])


def epochs_for(run: Run, epochs: int, seconds: float) -> int:
    """Epochs of a run of about ``seconds`` wall seconds, by ``run`` (of ``epochs`` epochs): its start-up,
    then its epoch time from its first to its last step record (the start-up is not an epoch's)."""
    times = [r["time"] for r in read_metrics(run.folder / METRICS_FILE) if r.get("kind") == "step"]
    if len(times) < 2:
        return max(round(seconds / (run.summary["wall_s"] / epochs)), 1)
    train_s = (times[-1] - times[0]) * len(times) / (len(times) - 1)
    startup_s = max(run.summary["wall_s"] - train_s, 0.0)
    return max(round((seconds - startup_s) / (train_s / epochs)), 1)


def _base_row(name: str, runs: list[Run], nproc: int) -> dict:
    return {"system": "gradsync", "elastic": True, "fault": name, "nproc": nproc, "runs": len(runs),
            "replicas_equal": all(run.replicas_equal for run in runs),
            "samples_lost": sum(run.samples["samples_lost"] for run in runs),
            "samples_duplicated": sum(run.samples["samples_duplicated"] for run in runs),
            "final_test_accuracy": statistics.median(run.summary["final_test_accuracy"] for run in runs),
            "wall_s_list": [run.summary["wall_s"] for run in runs], "run_folders": [str(run.folder) for run in runs]}


def reference_row(name: str, runs: list[Run], nproc: int) -> dict:
    """A fault-free reference: its throughput, no comparative figure (it is compared with nothing)."""
    return {**_base_row(name, runs, nproc), **reference_fields(), "reference": True, "steps_redone": None,
            **with_spread("samples_per_s", [run.samples_per_s for run in runs])}


def fault_row(name: str, runs: list[Run], references: list[Run], nproc: int) -> dict:
    """Runs with faults against their references (one each, the same repetition): pooled failures, bitwise
    equality, and for chaos (``len(runs) == len(references)``) the paired throughput kept."""
    failures = [dict(f, repetition=k) for k, run in enumerate(runs) for f in run.failures]
    equal = all(params_equal(run.folder, ref.folder) for run, ref in zip(runs, references))  # --deterministic runs
    row = {**_base_row(name, runs, nproc), **pooled(failures), "reference": False, "failures_detail": failures,
           "bitwise_equal_to_fault_free": equal}
    if name == "chaos":
        row.update(paired_kept([run.samples_per_s for run in runs], [ref.samples_per_s for ref in references]))
    return row


def _check(base: TrainConfig, nproc, fault_rank, fault_step, chaos_s, kill_every_s, repeat, epochs) -> int:
    """The fault step; ValueError naming the option for bad input, before any process starts."""
    validate(base)
    check_repeat(repeat)
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
    return step


def run_bench(*, nproc: int = 4, epochs: int = 3, timeout: float = 5.0, fault_rank: int = 1,
              fault_step: int | None = None, num_samples: int | None = None, chaos_s: float = 150.0,
              kill_every_s: float = 15.0, seed: int = 0, repeat: int = 5, torchft: bool = True,
              out: str | None = None, json_path: str | None = None) -> list[dict]:
    """The elastic runs; prints the tables and writes JSON rows (one per row of the tables).

    Raises:
        ValueError: a bad option (naming it), before any process starts.
    """
    base = TrainConfig(nproc=nproc, epochs=epochs, timeout=timeout, elastic=True, deterministic=True,
                       global_batch_size=32 * nproc, progress=False)
    if num_samples is not None:
        base.num_samples = num_samples
    step = _check(base, nproc, fault_rank, fault_step, chaos_s, kill_every_s, repeat, epochs)
    claim_json_path(json_path)
    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="gradsync-bench-elastic-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = base.to_dict()
    _start_forkserver(torchft)  # before anything forks: the same start-up for every run it compares
    print(f"# gradsync bench faults --elastic: MNIST-1D CNN, {nproc} workers, global batch "
          f"{base.global_batch_size}, --deterministic, --timeout {timeout:g} s, --repeat {repeat}; runs in {out_dir}",
          flush=True)
    none = _measure(_config(fields, out_dir / "none"))
    rows = [reference_row("none", [none], nproc)]
    for name, option in (("kill", {"fail_at": f"{fault_rank}:{step}"}), ("hang", {"hang_at": f"{fault_rank}:{step}"})):
        run = _measure(_config(fields, out_dir / name, **option), victim=fault_rank)
        rows.append(fault_row(name, [run], [none], nproc))
        print(f"# done: {name}", flush=True)
    chaos_epochs = epochs_for(none, epochs, chaos_s)
    rows += _repetitions(fields, out_dir, chaos_epochs, chaos_s, kill_every_s, seed, repeat, torchft, nproc)
    print(format_table(rows))
    if json_path:
        write_json(json_path, rows)
    return rows


def _repetitions(fields: dict, out_dir: Path, chaos_epochs: int, chaos_s: float, kill_every_s: float, seed: int,
                 repeat: int, torchft: bool, nproc: int) -> list[dict]:
    """``repeat`` times: gradsync fault-free, gradsync chaos, torchft fault-free, torchft chaos; their rows."""
    peer = _torchft_peer(nproc, chaos_s, kill_every_s, seed, out_dir, fields) if torchft else None
    calm, chaos, pairs, torchft_going = [], [], ([], []), peer is not None
    for k in range(repeat):
        calm.append(_measure(_config(fields, out_dir / f"chaos-none-{k}", epochs=chaos_epochs)))
        chaos.append(_measure(_config(fields, out_dir / f"chaos-{k}", epochs=chaos_epochs), (kill_every_s, seed + k)))
        torchft_going = torchft_going and _torchft_pair(peer, k, pairs)
        print(f"# done: repetition {k + 1} of {repeat}", flush=True)
    rows = [reference_row("chaos-none", calm, nproc), fault_row("chaos", chaos, calm, nproc)]
    if pairs[0]:
        rows += peer.rows(*pairs)
    return rows


def _start_forkserver(torchft: bool) -> None:
    from gradsync.launch import start_forkserver
    from gradsync.jobs.worker import run_elastic_worker

    import importlib.util

    found = torchft and importlib.util.find_spec("torchft") is not None
    start_forkserver(run_elastic_worker, *(("gradsync.bench.torchft_worker",) if found else ()))


def _torchft_peer(nproc: int, duration_s: float, kill_every_s: float, seed: int, out_dir: Path, fields: dict):
    """torchft's runner (None, said, when torchft is missing)."""
    try:
        from gradsync.bench.torchft_peer import TorchftPeer

        # "quorum": the global batch re-split over the replicas of each step's quorum, as gradsync does
        return TorchftPeer(nproc=nproc, duration_s=duration_s, kill_every_s=kill_every_s, seed=seed,
                           global_batch_size=fields["global_batch_size"], split="quorum",
                           out_dir=out_dir / "torchft", num_samples=fields["num_samples"])
    except ImportError as exc:
        print(f"# torchft rows skipped: {exc}", flush=True)
        return None


def _torchft_pair(peer, k: int, pairs: tuple[list, list]) -> bool:
    """torchft's fault-free and chaos runs of repetition ``k`` onto ``pairs`` (chaos runs, fault-free runs);
    False when they failed (said)."""
    try:
        baseline = peer.run(chaos=False, repetition=k)
        chaos = peer.run(chaos=True, repetition=k)
        pairs[0].append(chaos)
        pairs[1].append(baseline)
        return True
    except Exception as exc:  # noqa: BLE001 - the peer's rows must not cost the gradsync rows
        print(f"# torchft runs stop at repetition {k + 1}: {type(exc).__name__}: {exc}", flush=True)
        return False
