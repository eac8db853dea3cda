"""The torchft peer row of ``gradsync bench faults --elastic``: torchft's own fault-tolerant DDP under chaos.

:func:`run_torchft_chaos` starts a torchft Lighthouse (in this process, on
loopback; no replica's death takes it down) and ``nproc`` replica groups of one
process each (:mod:`gradsync.bench.torchft_worker`: gradsync's MNIST-1D model,
data and optimizer under torchft's Manager, ProcessGroupGloo, DDP wrapper,
OptimizerWrapper and PGTransport). With ``chaos`` it SIGKILLs a random live
replica (seeded) every ``kill_every_s`` seconds of the measured window; this
process is also every replica's relauncher: a replica that exits is started
again at once, and joins by healing from a live peer. The window starts at the
first step committed by all ``nproc`` replicas and lasts ``duration_s``; then
every replica is let back in, a common stop step is written and each replica
saves its parameters, which are compared. Figures: :mod:`torchft_metrics`.

    python -m gradsync.bench.torchft_peer --duration 60            # fault-free then chaos, 4 replicas
    python -m gradsync.bench.torchft_peer --duration 60 --repeat 3 # three such pairs, alternated
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gradsync.bench.spread import add_repeat_option, check_repeat
from gradsync.bench.torchft_metrics import Batches, read_log, steps_of, summarize, window_start
from gradsync.bench.torchft_replicas import Progress, Replicas, start_forkserver
from gradsync.bench.torchft_rows import build_rows, format_table, settings
from gradsync.train import data as data_module
from gradsync.train.models import build_model

# Lighthouse (lighthouse.rs quorum_compute): a killed replica counts as healthy until its heartbeats
# are heartbeat_timeout_ms old, and a quorum without a healthy replica waits join_timeout_ms from the
# first request; so the survivors' next quorum waits for the shorter of the two. A relaunched replica
# heartbeats before it asks to join, which can hold a quorum up to join_timeout_ms too; its join is
# then the "fast quorum" (every previous member present). quorum_tick_ms: how often a waiting quorum
# is checked. Defaults: 60000 / 5000 / 100 ms; 1000 / 1000 ms recovered in ~1.1 s per kill, and these in
# ~0.5 s, with no spurious quorum change at load average ~8 on 2 cores (see the report in the log).
LIGHTHOUSE = {"min_replicas": 1, "join_timeout_ms": 300, "quorum_tick_ms": 20, "heartbeat_timeout_ms": 300}
MANAGER = {"heartbeat_ms": 100, "timeout": 10.0, "quorum_timeout": 30.0}  # heartbeat_ms: Manager -> Lighthouse
START_TIMEOUT_S = 120.0  # every replica in the first quorum (4 torch imports on 2 busy cores)
STOP_TIMEOUT_S = 60.0


def wait_for(condition, timeout_s: float, what: str, tick=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchft peer: {what} not within {timeout_s:g} s")
        if tick:
            tick()
        time.sleep(0.05)


def run_phase(replicas: Replicas, progress: Progress, *, duration_s: float, kill_every_s: float, chaos: bool,
              rng: random.Random) -> tuple[float, list[dict]]:
    """Start every replica, wait for the first full quorum, then run the window; returns (start, kills)."""
    for replica in range(replicas.nproc):
        replicas.launch(replica)

    def tick():
        replicas.relaunch_exited()
        progress.poll()

    wait_for(lambda: progress.all_in(), START_TIMEOUT_S, "every replica in the first quorum", tick)
    start, kills = time.time(), []
    next_kill = start + kill_every_s
    while time.time() < start + duration_s:
        tick()
        if chaos and time.time() >= next_kill and time.time() < start + duration_s - kill_every_s / 2:
            candidates = [r for r in range(replicas.nproc) if progress.healthy(r)]
            if len(candidates) > 1:
                victim = rng.choice(candidates)
                kills.append(replicas.kill(victim))
                progress.last.pop(victim, None)
            next_kill += kill_every_s
        time.sleep(0.02)
    return start, kills


def stop_all(replicas: Replicas, progress: Progress, stop_file: Path, margin_steps: int = 50) -> None:
    """Let every replica back into the quorum, then stop them all at one step; bounded waits."""
    def tick():
        replicas.relaunch_exited()
        progress.poll()

    wait_for(progress.all_in, STOP_TIMEOUT_S, "every replica back in the quorum", tick)
    stop_file.write_text(str(progress.max_step() + margin_steps))
    replicas.stopping = True
    wait_for(replicas.all_exited, STOP_TIMEOUT_S, "every replica stopped at the stop step", progress.poll)


def final_checks(out_dir: Path, nproc: int, model_name: str, splits) -> dict:
    """replicas_equal (bitwise, same step), final test accuracy of replica 0, and the final step."""
    finals = [torch.load(out_dir / f"final{r}.pt", weights_only=True) for r in range(nproc)]
    first = finals[0]
    equal = all(f["step"] == first["step"] and f["model"].keys() == first["model"].keys()
                and all(torch.equal(f["model"][k], first["model"][k]) for k in first["model"]) for f in finals)
    model = build_model(model_name)
    model.load_state_dict(first["model"])
    with torch.no_grad():
        accuracy = (model(splits.x_test).argmax(1) == splits.y_test).float().mean().item()
        loss = F.cross_entropy(model(splits.x_test), splits.y_test).item()
    return {"replicas_equal": equal, "final_step": first["step"], "final_test_accuracy": accuracy,
            "final_test_loss": loss}


def run_once(*, nproc: int, model: str, duration_s: float, kill_every_s: float, seed: int, global_batch_size: int,
             split: str, chaos: bool, data_path: Path, out_dir: Path, launcher: str, lighthouse: dict,
             heartbeat_ms: int, schedule_seed: int | None = None) -> dict:
    """One run (chaos or fault-free) in ``out_dir``: its measured keys (see torchft_metrics.summarize);
    ``seed`` seeds the training, ``schedule_seed`` (default ``seed``) the kills."""
    from torchft._torchft import LighthouseServer

    out_dir.mkdir(parents=True, exist_ok=True)
    stop_file = out_dir / "stop_step"
    server = LighthouseServer(bind="127.0.0.1:0", **lighthouse)
    port = server.address().rsplit(":", 1)[1]  # its address names the host name; connect on loopback
    worker_args = ["--nproc", str(nproc), "--lighthouse", f"http://127.0.0.1:{port}", "--data", str(data_path),
                   "--model", model, "--global-batch-size", str(global_batch_size), "--seed", str(seed),
                   "--split", split, "--stop-file", str(stop_file), "--timeout", str(MANAGER["timeout"]),
                   "--quorum-timeout", str(MANAGER["quorum_timeout"]), "--heartbeat-ms", str(heartbeat_ms)]
    replicas = Replicas(nproc, out_dir, worker_args, launcher)
    progress = Progress(replicas)
    try:
        start, kills = run_phase(replicas, progress, duration_s=duration_s, kill_every_s=kill_every_s, chaos=chaos,
                                 rng=random.Random(seed if schedule_seed is None else schedule_seed))
        stop_all(replicas, progress, stop_file)
    finally:
        replicas.close()
        server.shutdown()
    (out_dir / "driver.json").write_text(json.dumps({"start": start, "duration_s": duration_s, "kills": kills,
                                                     "launches": replicas.launches}))
    return analyze(out_dir, nproc=nproc, model=model, global_batch_size=global_batch_size, seed=seed,
                   data_path=data_path)


def analyze(out_dir: Path, *, nproc: int, model: str, global_batch_size: int, seed: int, data_path: Path) -> dict:
    """A finished run's figures from its folder (``driver.json``, the replicas' logs and final parameters)."""
    driver = json.loads((Path(out_dir) / "driver.json").read_text())
    splits = data_module.load(data_path)
    steps = steps_of([r for rep in range(nproc) for r in read_log(Path(out_dir) / f"replica{rep}.jsonl")])
    batches = Batches(len(splits.y_train), global_batch_size, seed)
    start = driver.get("start") or window_start(steps, nproc)
    measured = summarize(driver["kills"], steps, batches, start, start + driver["duration_s"])
    return {**measured, **final_checks(Path(out_dir), nproc, model, splits), "kills": driver["kills"],
            "relaunches": len(driver["launches"]) - nproc}


class TorchftPeer:
    """torchft's runs of the bench, all on one set of options: :meth:`run` one, :meth:`rows` the rows.

    Args: ``nproc`` replica groups of one process; ``duration_s`` the measured window (s), a kill every
    ``kill_every_s`` s of it (none in its last ``kill_every_s / 2`` s); ``seed`` the training's seed,
    and ``seed + repetition`` the kills'; ``split`` "fixed" (torchft's DistributedSampler rule) or
    "quorum" (see torchft_worker); ``launcher`` "forkserver" or "exec" (see :class:`Replicas`);
    ``lighthouse`` overrides :data:`LIGHTHOUSE`'s settings; ``heartbeat_ms`` the Managers' heartbeat
    interval. Raises ValueError on bad options, ImportError without torchft (both before any process
    starts); :meth:`run` raises TimeoutError when replicas do not start or stop in time.
    """

    def __init__(self, nproc: int = 4, model: str = "cnn", duration_s: float = 150.0, kill_every_s: float = 15.0,
                 seed: int = 0, global_batch_size: int = 128, split: str = "fixed",
                 out_dir: str | Path | None = None, num_samples: int = data_module.DEFAULT_NUM_SAMPLES,
                 data_dir: str | None = None, launcher: str = "forkserver", lighthouse: dict | None = None,
                 heartbeat_ms: int = MANAGER["heartbeat_ms"]):
        lighthouse = {**LIGHTHOUSE, **(lighthouse or {})}
        check_options(nproc, duration_s, kill_every_s, split, lighthouse, heartbeat_ms, launcher, global_batch_size)
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust log level, read once when torchft is imported
        importlib.import_module("torchft")  # ImportError here, before any process starts
        self.out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="gradsync-torchft-"))
        self.seed = seed
        self.common = dict(nproc=nproc, model=model, duration_s=duration_s, kill_every_s=kill_every_s, seed=seed,
                           global_batch_size=global_batch_size, split=split, launcher=launcher,
                           lighthouse=lighthouse, heartbeat_ms=heartbeat_ms,
                           data_path=data_module.prepare(data_dir, num_samples=num_samples))
        if launcher == "forkserver":
            start_forkserver()

    def run(self, chaos: bool, repetition: int = 0) -> dict:
        """One run in ``<out>/chaos-<repetition>`` or ``<out>/fault-free-<repetition>``: its measured keys."""
        before = os.getloadavg()
        folder = self.out / f"{'chaos' if chaos else 'fault-free'}-{repetition}"
        run = run_once(**self.common, chaos=chaos, out_dir=folder, schedule_seed=self.seed + repetition)
        return {**run, "repetition": repetition, "run_folder": str(folder),
                "load_average": {"before": list(before), "after": list(os.getloadavg())}}

    def rows(self, chaos_runs: list[dict], baselines: list[dict]) -> list[dict]:
        """The rows of these runs (:func:`~gradsync.bench.torchft_rows.build_rows`)."""
        c = self.common
        options = settings(c["lighthouse"], c["heartbeat_ms"], c["split"], c["launcher"], MANAGER)
        return build_rows(chaos_runs, baselines, nproc=c["nproc"], duration_s=c["duration_s"],
                          kill_every_s=c["kill_every_s"], settings=options)


def check_options(nproc, duration_s, kill_every_s, split, lighthouse, heartbeat_ms, launcher, global_batch_size):
    """ValueError naming the first bad option of :class:`TorchftPeer`."""
    if nproc < 2:
        raise ValueError(f"nproc must be >= 2 (a kill needs a survivor), got {nproc}")
    if duration_s <= 0 or kill_every_s <= 0:
        raise ValueError(f"duration_s and kill_every_s must be > 0, got {duration_s} and {kill_every_s}")
    if split not in ("fixed", "quorum"):
        raise ValueError(f"split must be 'fixed' or 'quorum', got {split!r}")
    if set(lighthouse) != set(LIGHTHOUSE) or not all(isinstance(v, int) and v > 0 for v in lighthouse.values()):
        raise ValueError(f"lighthouse settings must be positive integers for {', '.join(LIGHTHOUSE)}, got {lighthouse}")
    if not isinstance(heartbeat_ms, int) or heartbeat_ms <= 0:
        raise ValueError(f"heartbeat_ms must be a positive integer, got {heartbeat_ms!r}")
    if launcher not in ("forkserver", "exec"):
        raise ValueError(f"launcher must be 'forkserver' or 'exec', got {launcher!r}")
    if global_batch_size < nproc:
        raise ValueError(f"global_batch_size {global_batch_size} is smaller than nproc {nproc}")


def run_torchft_chaos(repeat: int = 1, chaos: bool = True, fault_free: bool = True, **options) -> list[dict]:
    """``repeat`` repetitions, each a fault-free run (``fault_free``) then a chaos run (``chaos``; else
    fault-free runs only); returns the rows (:func:`~gradsync.bench.torchft_rows.build_rows`).
    ``options``: :class:`TorchftPeer`'s.

    Raises:
        ValueError: a bad option (``--repeat`` included); ImportError without torchft; TimeoutError.
    """
    check_repeat(repeat)
    peer = TorchftPeer(**options)
    chaos_runs, baselines = [], []
    for k in range(repeat):
        if fault_free or not chaos:
            baselines.append(peer.run(chaos=False, repetition=k))
        if chaos:
            chaos_runs.append(peer.run(chaos=True, repetition=k))
    return peer.rows(chaos_runs, baselines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="torchft's fault-tolerant DDP under gradsync's chaos schedule")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--duration", type=float, default=150.0)
    parser.add_argument("--kill-every", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--split", choices=("fixed", "quorum"), default="fixed")
    parser.add_argument("--launcher", choices=("forkserver", "exec"), default="forkserver")
    parser.add_argument("--no-chaos", action="store_true", help="fault-free runs only")
    add_repeat_option(parser, default=1, what="repetitions, each a fault-free run then a chaos run")
    parser.add_argument("--no-fault-free", action="store_true", help="the chaos run only (no throughput_kept)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=LIGHTHOUSE["heartbeat_timeout_ms"])
    parser.add_argument("--join-timeout-ms", type=int, default=LIGHTHOUSE["join_timeout_ms"])
    parser.add_argument("--quorum-tick-ms", type=int, default=LIGHTHOUSE["quorum_tick_ms"])
    parser.add_argument("--heartbeat-ms", type=int, default=MANAGER["heartbeat_ms"], help="Managers' heartbeats")
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = run_torchft_chaos(repeat=args.repeat, nproc=args.nproc, model=args.model, duration_s=args.duration,
                             kill_every_s=args.kill_every, seed=args.seed, global_batch_size=args.global_batch_size,
                             split=args.split, out_dir=args.out, chaos=not args.no_chaos, launcher=args.launcher,
                             fault_free=not args.no_fault_free,
                             lighthouse={"heartbeat_timeout_ms": args.heartbeat_timeout_ms,
                                         "join_timeout_ms": args.join_timeout_ms,
                                         "quorum_tick_ms": args.quorum_tick_ms},
                             heartbeat_ms=args.heartbeat_ms)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
