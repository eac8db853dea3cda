"""A minimal elastic training step for tests/test_elastic.py (top-level, so the forkserver can start it).

Each step all-reduces ``rank + 1`` and checks the sum for the current world size; slot ``die_slot``
dies (first incarnation only) before step ``die_step``. Rank 0 of the last membership writes
``{"steps", "memberships"}`` to ``out``.
"""

from __future__ import annotations

import json
import os

import torch

import gradsync
from gradsync.elastic.member import RECOVERABLE, ElasticMember, Evicted, MembershipChanged
from gradsync.elastic.run_store import connect


def run(slot, incarnation, host, port, steps, die_slot, die_step, out):
    torch.set_num_threads(1)
    member = ElasticMember(connect(host, port), slot, incarnation, timeout_s=20.0)
    member.join()
    step, memberships = 0, 0
    while True:
        try:
            membership = member.enter()
        except Evicted:
            return
        try:
            state = torch.tensor([step, memberships + 1])
            gradsync.broadcast(state, src=0)  # rank 0 has the most steps
            step, memberships = int(state[0]), int(state[1])
            while step < steps:
                if member.change_requested():
                    raise MembershipChanged("change")
                if (slot, incarnation, step) == (die_slot, 0, die_step):
                    os._exit(17)
                x = torch.full((1000,), float(membership.rank + 1))
                gradsync.all_reduce(x, algorithm="ring")
                n = membership.world_size
                assert torch.all(x == n * (n + 1) / 2), (x[0], n)
                step += 1
            if membership.rank == 0:
                with open(out, "w") as file:
                    json.dump({"steps": step, "memberships": memberships, "world_size": n}, file)
                member.finish()
            if member.wait_end():
                gradsync.shutdown()
                return
            raise MembershipChanged("closed before the end")
        except RECOVERABLE as exc:
            member.leave(step, exc)


def fail_at_start(slot, incarnation, host, port):
    raise RuntimeError(f"slot {slot} cannot start")
