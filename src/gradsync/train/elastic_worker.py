"""Entry point of one ``gradsync train --elastic`` worker process (what each slot's launcher starts).

The process joins the run through the quorum service's store, trains through
as many memberships as the run has, and exits 0 at the end (its launcher
then stops). The member that finishes as rank 0 writes ``summary.json`` and
the plots.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from tqdm import tqdm

from gradsync.elastic.member import ElasticMember
from gradsync.elastic.membership import ElasticMembership
from gradsync.elastic.run_store import connect
from gradsync.launch import die_with_launcher
from gradsync.train.config import TrainConfig
from gradsync.train.elastic_async import run_elastic_async  # imported here: the forkserver preloads this module
from gradsync.train.loop import Trainer
from gradsync.train.metrics import METRICS_FILE, SUMMARY_FILE, private_files, read_metrics, write_summary
from gradsync.train.plots import plot_run


def run_elastic_worker(slot: int, incarnation: int, config: TrainConfig, data_path: str, out_dir: str,
                       store_host: str, store_port: int) -> None:
    """Train as slot ``slot`` (incarnation ``incarnation``: 0 at first, +1 per relaunch)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the job stops its workers itself
    die_with_launcher()
    tqdm.set_lock(threading.RLock())
    with private_files():
        store = connect(store_host, store_port)
        member = ElasticMember(store, slot, incarnation, timeout_s=config.timeout)
        if config.mode == "async":
            summary = run_elastic_async(member, slot, config, Path(data_path), Path(out_dir))
        else:
            membership = ElasticMembership(member, Path(out_dir), config.elastic_fault)
            summary = Trainer(config, Path(data_path), Path(out_dir), membership).run()
        if summary is not None:
            out = Path(out_dir)
            write_summary(out / SUMMARY_FILE, summary)
            try:
                plot_run(read_metrics(out / METRICS_FILE), summary, out)
            except (KeyError, ValueError, TypeError):  # the plots are a convenience; the summary is written
                pass
