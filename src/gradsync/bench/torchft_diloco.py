"""``bench modes``' torchft DiLoCo row: torchft's own ``DiLoCo`` on gradsync's model, data and world size, as a peer.

:func:`run_torchft_diloco` starts a torchft Lighthouse in this process (on
loopback, every quorum waits for all ``nproc`` replicas) and ``nproc``
replica processes (:mod:`gradsync.bench.torchft_diloco_worker`), each one
replica group of one process on torchft's ``ProcessGroupGloo``, as torchft's
docs recommend on CPU. They train what gradsync's ``--mode local-sgd
--outer-optimizer nesterov`` trains with the same options (model, seed,
samples per rank, AdamW and its schedule, H, outer lr and momentum, the
straggler), so the row compares the two DiLoCos at equal H and bytes. Every
process is started here and ended by its PID.

Figures, as :func:`gradsync.bench.modes.run_setting`'s: samples/s over the
replicas' training (first step to last, replica 0's wall clock; quorum
start-up and the final evaluation left out, as gradsync's evaluations are),
replica 0's final test accuracy (its only evaluation), staleness (the local
steps since the last sync, as local SGD's) and the bytes of the tensors the
replicas hand to ``Manager.allreduce``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gradsync
from gradsync.bench.torchft_peer import LIGHTHOUSE
from gradsync.train.config import TrainConfig
from gradsync.train.task import prepare_data

START_AND_RUN_TIMEOUT_S = 1800.0  # the whole run: 4 torch + torchft imports on 2 busy cores, then training
TIMEOUT_S = 120.0                 # each Manager / Gloo call


def run_torchft_diloco(config: TrainConfig, out_dir: Path) -> dict:
    """Train ``config`` (local-sgd, outer Nesterov, fp32, one fragment) once with torchft in ``out_dir``.

    Returns:
        the figures :func:`gradsync.bench.modes.run_setting` returns, plus ``allreduce_payload_nbytes``
        (per replica: the bytes it handed to ``Manager.allreduce``) and ``allreduces``.

    Raises:
        RuntimeError: a replica failed or the run did not end within :data:`START_AND_RUN_TIMEOUT_S`
            (every replica is then killed by its PID; the message names the replica and its output file).
    """
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust log level, read once when torchft is imported
    from torchft._torchft import LighthouseServer

    out_dir.mkdir(parents=True, exist_ok=True)
    data_path = prepare_data(config)
    server = LighthouseServer(bind="127.0.0.1:0", **{**LIGHTHOUSE, "min_replicas": config.nproc})
    port = server.address().rsplit(":", 1)[1]  # its address names the host name; connect on loopback
    fields = json.dumps(dataclasses.asdict(config))
    try:
        results = _run_replicas(config.nproc, out_dir, ["--config", fields, "--lighthouse", f"http://127.0.0.1:{port}",
                                                        "--data", str(data_path), "--timeout", str(TIMEOUT_S)])
    finally:
        server.shutdown()
    return _figures(config, results, out_dir)


def _run_replicas(nproc: int, out_dir: Path, argv: list[str]) -> list[dict]:
    """Start the replicas, wait for all of them; their result dicts (index = replica)."""
    src = str(Path(gradsync.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
           "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    procs = []
    try:
        for replica in range(nproc):
            with open(out_dir / f"replica{replica}.out", "w") as output:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "gradsync.bench.torchft_diloco_worker", "--replica", str(replica),
                     "--result", str(out_dir / f"replica{replica}.json"), *argv],
                    env=env, stdout=output, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + START_AND_RUN_TIMEOUT_S
        while any(proc.poll() is None for proc in procs):
            failed = [r for r, proc in enumerate(procs) if proc.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                replica = failed[0] if failed else 0
                why = f"exited with {procs[replica].returncode}" if failed else \
                    f"did not finish within {START_AND_RUN_TIMEOUT_S:g} s"
                raise RuntimeError(f"torchft DiLoCo replica {replica} {why}; see {out_dir / f'replica{replica}.out'}")
            time.sleep(0.1)
        failed = [r for r, proc in enumerate(procs) if proc.returncode != 0]
        if failed:
            raise RuntimeError(f"torchft DiLoCo replica {failed[0]} exited with {procs[failed[0]].returncode}; see "
                               f"{out_dir / f'replica{failed[0]}.out'}")
    finally:
        for proc in procs:  # only the processes started here, each by its PID
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return [json.loads((out_dir / f"replica{replica}.json").read_text()) for replica in range(nproc)]


def _figures(config: TrainConfig, results: list[dict], out_dir: Path) -> dict:
    first = results[0]
    samples = sum(r["samples"] for r in results)
    steps, every = first["steps"], config.sync_every
    staleness = [step % every for step in range(steps)]  # local steps since the last sync, as local SGD's
    accuracy = first["test_accuracy"]
    return {"num_workers": config.nproc, "samples_per_s": samples / first["train_s"],
            "seconds_to_target": None, "test_accuracy": accuracy,  # evaluated once, at the end
            "best_test_accuracy": accuracy, "staleness_mean": sum(staleness) / max(len(staleness), 1),
            "staleness_max": max(staleness, default=0), "wall_s": first["train_s"], "steps": steps,
            "samples": samples, "accuracy_curve": [[first["train_s"], accuracy]], "run_folder": str(out_dir),
            "allreduce_payload_nbytes": sum(r["allreduce_nbytes"] for r in results) / len(results),
            "allreduces": first["allreduces"]}
