"""A predicted data-parallel training step at 8-4096 GPUs: compute, DataParallel's buckets, priced exchanges.

For every GPU count, algorithm, bucket size and compressor: the model's
compute (:mod:`gradsync.sim.compute`), DataParallel's real buckets and
their exchanges overlapped with backward (:mod:`gradsync.sim.step`), each
exchange priced by the simulator (:mod:`gradsync.sim.exchange`). Rows:
``gpus``, ``algorithm``, ``bucket_mb``, ``compression``,
``step_ms``, ``compute_ms`` (forward + backward + optimizer), ``comm_ms``
(all exchanges), ``exposed_comm_ms``, ``comm_fraction`` (= exposed / step:
the share of the step spent only communicating), ``copy_ms`` (gradients
into and out of the buckets), ``buckets``, ``method`` (event or formula).
``gradsync simulate train`` (:mod:`gradsync.bench.simulate_train`) prints them.

>>> from gradsync.collectives.cost.profiles import get_profile
>>> from gradsync.sim.compute import flops_compute, layered_params
>>> rows = predict_rows(flops_compute(layered_params(10**9, 8), 4096, 989e12, 0.4, get_profile("h100-ib")),
...                     get_profile("h100-ib"), [8], ["ring"], [25.0], ["none"])
>>> rows[0]["gpus"], rows[0]["buckets"] > 1
(8, True)
"""

from __future__ import annotations

from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.cost.topology import Topology
from gradsync.sim.compute import StepCompute
from gradsync.sim.exchange import BucketPricer
from gradsync.sim.step import overlap, plan_step


def topology_for(gpus: int, ranks_per_host: int) -> Topology:
    """``gpus`` ranks in hosts of ``ranks_per_host`` (one host when fewer).

    Raises:
        ValueError: ``gpus`` < 1 or not a multiple of ``ranks_per_host``.
    """
    if gpus < 1 or ranks_per_host < 1:
        raise ValueError(f"need gpus >= 1 and ranks per host >= 1, got {gpus}, {ranks_per_host}")
    if gpus <= ranks_per_host:
        return Topology.uniform(1, gpus)
    if gpus % ranks_per_host:
        raise ValueError(f"--gpus {gpus} is not a multiple of {ranks_per_host} ranks per host")
    return Topology.uniform(gpus // ranks_per_host, ranks_per_host)


def predict_step(compute: StepCompute, profile: Profile, topology: Topology, algorithm: str, bucket_mb: float,
                 compression: str = "none", *, event_max_ranks: int = 64, bucket_view: bool = False,
                 rebuilt: bool = True, two_phase_events: bool = False) -> dict:
    """One row: the predicted steady-state step (see the module docstring for the fields)."""
    oversub = profile.oversubscription(max(topology.host_sizes))
    plan = plan_step(compute, bucket_mb, topology.world_size, profile.copy_s_per_byte * oversub, bucket_view,
                     rebuilt)
    pricer = BucketPricer(profile, topology, algorithm, compression, event_max_ranks,
                          two_phase_events=two_phase_events)
    dtypes = [compute.params[bucket[0]].dtype for bucket in plan.assignment]
    last = len(plan.numels) - 1
    comm = [pricer.bucket_s(numel, plan.flags if b == last else 0, dtypes[b]) for b, numel in enumerate(plan.numels)]
    sync = overlap(plan.ready_s, comm, plan.backward_s, plan.copy_out_s)
    step_s = compute.forward_s + sync.end_s + compute.optimizer_s
    copy_s = plan.copy_in_s + sum(plan.copy_out_s)
    return {"gpus": topology.world_size, "hosts": topology.hosts, "algorithm": algorithm, "bucket_mb": bucket_mb,
            "compression": compression, "step_ms": step_s * 1e3, "compute_ms": compute.compute_s * 1e3,
            "comm_ms": sum(comm) * 1e3, "exposed_comm_ms": sync.exposed_s * 1e3,
            "comm_fraction": sync.exposed_s / step_s if step_s > 0 else 0.0, "copy_ms": copy_s * 1e3,
            "buckets": len(plan.assignment), "layout": "rebuilt" if rebuilt else "initial", "method": pricer.method}


def predict_rows(compute: StepCompute, profile: Profile, gpus: list[int], algorithms: list[str],
                 bucket_mbs: list[float], compressions: list[str], *, ranks_per_host: int | None = None,
                 event_max_ranks: int = 64, bucket_view: bool = False, rebuilt: bool = True,
                 two_phase_events: bool = False) -> list[dict]:
    """Every combination, GPU count outermost."""
    per_host = ranks_per_host or profile.ranks_per_host
    rows = []
    for count in gpus:
        topology = topology_for(count, per_host)
        for algorithm in algorithms:
            for bucket_mb in bucket_mbs:
                for compression in compressions:
                    rows.append(predict_step(compute, profile, topology, algorithm, bucket_mb, compression,
                                             event_max_ranks=event_max_ranks, bucket_view=bucket_view,
                                             rebuilt=rebuilt, two_phase_events=two_phase_events))
    return rows
