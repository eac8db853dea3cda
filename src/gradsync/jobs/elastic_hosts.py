"""``gradsync train --elastic --hosts H --nproc L``: an elastic run across emulated hosts, and a lost host.

The quorum service runs in the switch namespace (its store on the switch's
address, reachable from every host and from nothing else); each host runs
one launcher process (:mod:`gradsync.jobs.elastic_host`) for its L slots
(host h: slots ``h*L .. h*L+L-1``). ``--kill-host-at HOST:STEP`` kills every
process of that host once rank 0's ``metrics.jsonl`` reaches the step (L
ranks at once, no launcher left to report them: the survivors see their
connections close), and starts the host's launcher again
``HOST_RETURN_S`` later, whose workers join as new incarnations and grow
the world back. The job process itself stays in the machine's namespace and
follows the run through the shared file system.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from gradsync.errors import GradsyncError
from gradsync.fault.events import read_events
from gradsync.train import task
from gradsync.train.config import TrainConfig
from gradsync.jobs.elastic import RUN_FILE
from gradsync.jobs.hosts import reached_step
from gradsync.train.metrics import SUMMARY_FILE

HOST_RETURN_S = 1.0
SERVICE_START_S = 60.0
STORE_PORT = 29410


class HostsElasticFailed(GradsyncError):
    """The elastic run across the test hosts did not finish."""


def run_elastic_on_hosts(config: TrainConfig, out_dir: Path) -> dict:
    from gradsync.hosts.netns import SWITCH_ADDR, TestHosts
    from gradsync.hosts.torchrun import host_environment

    out_dir.mkdir(parents=True, exist_ok=True)
    data_path = task.prepare_data(config)
    total = config.hosts * config.nproc
    low, high = config.elastic_bounds()
    (out_dir / RUN_FILE).write_text(json.dumps({"config": asdict(config), "data_path": str(data_path)}))
    kill = config.host_fault("kill_host_at")
    env = host_environment()
    with TestHosts(config.hosts, config.inter_host_gbit) as hosts:
        service = hosts.popen(None, [sys.executable, "-m", "gradsync.elastic.service", SWITCH_ADDR, str(STORE_PORT),
                                     str(total), str(low), str(high), str(config.timeout), str(out_dir)],
                              env=env, stdout=subprocess.PIPE)
        port = _service_port(service)

        def launch(index: int) -> subprocess.Popen:
            slots = [str(index * config.nproc + local) for local in range(config.nproc)]
            return hosts.popen(index, [sys.executable, "-m", "gradsync.jobs.elastic_host", SWITCH_ADDR, str(port),
                                       str(out_dir), *slots], env=env)

        launchers = {index: launch(index) for index in range(config.hosts)}
        trigger = reached_step(out_dir, kill[1]) if kill else None
        while service.poll() is None:
            if trigger is not None and trigger():
                trigger = None
                hosts.kill_host(kill[0])
                time.sleep(HOST_RETURN_S)
                launchers[kill[0]] = launch(kill[0])  # the host is back
            time.sleep(0.05)
    (out_dir / RUN_FILE).unlink(missing_ok=True)
    failed = [e for e in read_events(out_dir) if e["event"] == "failed"]
    if failed or not (out_dir / SUMMARY_FILE).exists():
        raise HostsElasticFailed(f"the elastic run across {config.hosts} test hosts did not finish: "
                                 f"{failed[0].get('reason') if failed else 'no summary was written'}")
    summary = json.loads((out_dir / SUMMARY_FILE).read_text())
    summary["hosts"] = config.hosts
    return summary


def _service_port(service: subprocess.Popen) -> int:
    line: list[bytes] = []
    reader = threading.Thread(target=lambda: line.append(service.stdout.readline()), daemon=True)
    reader.start()
    reader.join(SERVICE_START_S)
    if not line or not line[0].startswith(b"ready "):
        raise HostsElasticFailed("the elastic quorum service did not start in the switch namespace")
    return int(line[0].split()[1])
