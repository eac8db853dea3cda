"""One rank of a test world spread over test hosts (run inside a host by tests/test_hosts.py).

``python _hosts_worker.py SCENARIO`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; prints one
JSON line ``{"rank": r, ...}`` with what the scenario found (or the error it raised).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import gradsync
from gradsync.collectives import Communicator, ops
from gradsync.collectives.validate import resolve_algorithm
from gradsync.process_group import default_communicator

sys.path.insert(0, os.path.dirname(__file__))
from _reference import closed_form_input, closed_form_result  # noqa: E402


def collectives() -> dict:
    comm = default_communicator()
    out = {"hosts": list(comm.locality.hosts), "hostname": os.uname().nodename}
    try:
        gradsync.all_reduce(torch.ones(4), algorithm="shm")
        out["shm"] = "no error"
    except ValueError as exc:
        out["shm"] = str(exc)
    results = {}
    subs = {}
    for inter in ("ring", "tree", "halving_doubling", "native"):
        subs[inter] = Communicator(comm.transport, comm.timeout_s,
                                   options=[gradsync.HierarchicalOptions(inter_node_algorithm=inter)])
        subs[inter].locality = comm.locality
    for dtype in (torch.float32, torch.float16, torch.int64):
        for numel in (0, 1, 7, 5000):
            for inter, sub in subs.items():
                tensor = closed_form_input(numel, comm.rank, comm.world_size, dtype)
                ops.all_reduce(tensor, sub, algorithm="hierarchical")
                expected = closed_form_result(numel, comm.world_size, dtype, "sum")
                key = f"{dtype}-{numel}-{inter}"
                results[key] = [bool(torch.equal(tensor, expected)),
                                tensor.view(torch.uint8).sum().item() if numel else 0]
    out["hierarchical"] = results
    tensor = torch.randn(2**16, generator=torch.Generator().manual_seed(comm.rank))
    out["auto"] = {nbytes: resolve_algorithm(comm, nbytes, "auto") for nbytes in (1024, 2**20)}
    before = tensor.clone()
    gradsync.all_reduce(tensor, algorithm="auto")
    out["auto_digest"] = tensor.view(torch.int32).sum().item()
    out["auto_changed"] = not torch.equal(before, tensor)
    return out


def loop_until_error() -> dict:
    """All-reduce in a loop (timeout from GRADSYNC_TEST_TIMEOUT) until a call raises; print 'ready' first."""
    tensor = torch.ones(1000)
    gradsync.all_reduce(tensor, algorithm="ring")
    print(json.dumps({"rank": gradsync.rank(), "ready": True}), flush=True)
    while True:
        started = time.monotonic()
        try:
            gradsync.all_reduce(tensor, algorithm="ring")
        except gradsync.GradsyncError as exc:
            return {"error": type(exc).__name__, "message": str(exc), "peer": getattr(exc, "peer", None),
                    "waited_s": time.monotonic() - started}
        time.sleep(0.05)


def main(scenario: str) -> None:
    torch.set_num_threads(1)
    gradsync.init(timeout=float(os.environ.get("GRADSYNC_TEST_TIMEOUT", "20")))
    rank = gradsync.rank()
    result = {"collectives": collectives, "loop": loop_until_error}[scenario]()
    print(json.dumps({"rank": rank, **result}), flush=True)
    os._exit(0)  # a peer may be gone: no shutdown barrier


if __name__ == "__main__":
    main(sys.argv[1])
