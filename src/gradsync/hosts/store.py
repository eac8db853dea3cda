"""The rendezvous store of the test hosts, run inside the switch namespace.

``python -m gradsync.hosts.store ADDR PORT RUN_ID REPORT`` serves a TCPStore
on ``ADDR:PORT`` for torchrun's c10d rendezvous (``--rdzv-endpoint``), prints
``ready``, and every half second writes to the file REPORT the addresses of
the nodes that have joined the current round of rendezvous RUN_ID, so that
a failed rendezvous can say how many hosts arrived. It lives until killed (the
switch's PID namespace ends it with the harness).
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import pickle
import sys
import time

from torch.distributed import TCPStore

STATE_KEY = "torch.rendezvous.{run_id}"  # torch's C10dRendezvousBackend key for a run's state


def joined_nodes(store: TCPStore, run_id: str) -> tuple[int, list[str]]:
    """(round, addresses of the participants and wait-listed nodes) of rendezvous ``run_id``."""
    key = STATE_KEY.format(run_id=run_id)
    if not store.check([key]):
        return 0, []
    raw = store.get(key)
    try:
        state = pickle.loads(base64.b64decode(raw))
    except Exception:  # noqa: BLE001 - torch's sentinel before the first state, or a torch change
        return 0, []
    nodes = list(getattr(state, "participants", {})) + list(getattr(state, "wait_list", ()))
    return int(getattr(state, "round", 0)), sorted({node.addr for node in nodes})


def main(addr: str, port: str, run_id: str, report: str) -> None:
    store = TCPStore(addr, int(port), None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    print("ready", flush=True)
    seen: dict[int, list[str]] = {}
    while True:
        round_, nodes = joined_nodes(store, run_id)
        if nodes and nodes != seen.get(round_):
            seen[round_] = nodes
            tmp = f"{report}.tmp"
            with open(tmp, "w", encoding="utf-8") as file:
                json.dump({"round": round_, "nodes": nodes, "time": time.time()}, file)
            os.replace(tmp, report)
        time.sleep(0.5)


if __name__ == "__main__":
    main(*sys.argv[1:5])
