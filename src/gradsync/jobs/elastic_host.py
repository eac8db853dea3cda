"""One emulated host's launcher in ``gradsync train --elastic --hosts H``: its slots' launchers, nothing else.

``python -m gradsync.jobs.elastic_host ADDR PORT OUT SLOT [SLOT ...]`` runs inside
the host's namespaces: it reads the run's configuration from ``OUT/elastic.json``
(the hosts share the machine's file system), starts its forkserver and one
:class:`~gradsync.elastic.launcher.Launcher` per slot, and exits once the
run is over or every launcher has ended. Killing the host kills it and its
workers together: the survivors see the host's connections close at once,
and a new launcher started on the host later brings its slots back (new
incarnations), which grows the world again.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from gradsync.elastic.run_store import connect
from gradsync.fault.events import EventLog
from gradsync.launch import die_with_launcher, start_forkserver
from gradsync.train.config import TrainConfig
from gradsync.jobs.elastic import RUN_FILE, make_launcher
from gradsync.jobs.worker import run_elastic_worker


def main(argv: list[str] | None = None) -> int:
    host, port, out_dir, *slots = argv if argv is not None else sys.argv[1:]
    die_with_launcher()
    store = connect(host, int(port))
    run = json.loads((Path(out_dir) / RUN_FILE).read_text())
    config, data_path = TrainConfig(**run["config"]), Path(run["data_path"])
    start_forkserver(run_elastic_worker)
    events = EventLog(out_dir)
    launchers = [make_launcher(int(slot), config, data_path, Path(out_dir), host, int(port), events)
                 for slot in slots]
    for launcher in launchers:
        launcher.start()
    while any(launcher.is_alive() for launcher in launchers):
        if store.check(["q/done"]) or store.check(["q/failed"]):
            for launcher in launchers:
                launcher.join(30)
            break
        time.sleep(0.1)
    for launcher in launchers:
        launcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
