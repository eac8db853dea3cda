"""The named hardware profiles ``--profile`` takes, each with the sources of its numbers.

* ``this-machine``: this machine class (2 cores, Gloo over loopback, shared
  memory), calibrated by ``gradsync calibrate`` and shipped in
  ``collectives/cost/data/this-machine.json`` so that a fresh clone has it; a file of
  your own calibration (``--profile PATH``) replaces it.
* ``test-hosts``: the emulated hosts of ``--hosts H`` (network namespaces on
  a veth bridge, links shaped to 1 Gbit/s by ``tc tbf``, this machine's
  cores), calibrated the same way (``collectives/cost/data/test-hosts.json``).
* ``h100-ib``, ``h200-ib``, ``a100-ib``: published GPU systems; see each
  builder's docstring for its sources.
"""

from __future__ import annotations

import dataclasses

from importlib import resources
from pathlib import Path

from gradsync.collectives.cost.nccl_constants import NcclConstants
from gradsync.collectives.cost.profile import Link, Profile, load

GB = 1e9
_CALIBRATED = {"this-machine": "this-machine.json", "test-hosts": "test-hosts.json"}


# NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc, ncclTunerConstantsDefaults, and
# src/graph/topo.h), read at NVIDIA/nccl commit 5067397c (2026-06): the per-step hardware latency of the
# Simple protocol is 3.4 us over NVLink and 14 us over the network for the ring (4.0 / 14 us for the
# tree); the base latency of a ring Simple call is 8.4 us; NCCL counts 20.6 GB/s per NVLink 4 link
# (SM90_NVLINK_BW) and 20.0 GB/s per NVLink 3 link (SM80_NVLINK_BW): the line rate less the protocol's
# overhead (about 20%, S. Jeaugey in NVIDIA/nccl-tests#212); NVLS (in-switch reduction) runs at
# nvlsEfficiency = 0.85 of that on Hopper.
NCCL_SOURCE = "NVIDIA/nccl src/graph/tuning.cc and src/graph/topo.h at commit 5067397c"
NVLINK_RING_SIMPLE_S = 3.4e-6
NET_RING_SIMPLE_S = 14e-6
RING_SIMPLE_BASE_S = 8.4e-6
SM90_NVLINK_GBPS, SM80_NVLINK_GBPS = 20.6, 20.0
HOPPER_NVLS_EFFICIENCY = 0.85


# What NCCL sees of a DGX/HGX H100 or H200 node (NCCL's model: gradsync.collectives.cost.nccl_tuning).
HOPPER_NODE_NCCL = NcclConstants(
    compute_capability=90, nvlinks=18, nvswitch=True, nvls=True, nics=8, nic_gbps=50.0,
    pcie_lanes=16, pcie_gt_s=32.0, cpu_vendor="intel",
    sources=("NVIDIA H100 datasheet: SM 9.0, 18 NVLink 4 links per GPU to NVSwitch 3 (NVLink SHARP)",
             "NVIDIA DGX H100 user guide: 8x ConnectX-7 400 Gb/s (50 GB/s) NDR, PCIe Gen5 x16, "
             "2x Intel Xeon Platinum 8480C",
             "NVIDIA/nccl-tests#212 (S. Jeaugey): AllReduce uses NVLink SHARP by default on H100 nodes"))
# What NCCL sees of a DGX A100 node.
AMPERE_NODE_NCCL = NcclConstants(
    compute_capability=80, nvlinks=12, nvswitch=True, nvls=False, nics=8, nic_gbps=25.0,
    pcie_lanes=16, pcie_gt_s=16.0, cpu_vendor="amd",
    sources=("NVIDIA A100 datasheet: SM 8.0, 12 NVLink 3 links per GPU to NVSwitch 2 (no NVLink SHARP)",
             "NVIDIA DGX A100 user guide: 8x ConnectX-6 200 Gb/s (25 GB/s) HDR, PCIe Gen4 x16, "
             "2x AMD EPYC 7742"))


def nvls_busbw_bytes_per_s(port_bytes_per_s: float, ranks: int, efficiency: float) -> float:
    """busbw of an in-switch (NVLS) AllReduce of ``ranks`` GPUs: each GPU sends its n bytes to the
    switch for the reduction of every shard, fetches its reduced shard n/p, and multicasts it (n/p
    out, n in): n (1 + 1/p) per port and direction, so algbw = B p / (p + 1) and busbw = algbw 2(p-1)/p
    = 2 B (p - 1) / (p + 1), with B = ``efficiency`` x the port bandwidth."""
    return 2 * efficiency * port_bytes_per_s * (ranks - 1) / (ranks + 1)


def h100_ib() -> Profile:
    """DGX H100 nodes: 8x H100 SXM5 per node, NVLink 4 through NVSwitch, 8x 400 Gb/s InfiniBand NDR per node.

    Sources: NVIDIA H100 Tensor Core GPU datasheet (18 NVLink 4 links per
    GPU, 900 GB/s in both directions together: 450 GB/s line rate each way;
    HBM3 3.35 TB/s); NCCL's usable bandwidth per NVLink 4 link, 20.6 GB/s
    (topo.h SM90_NVLINK_BW), times 18 links: 370.8 GB/s each way, the
    intra-host link here; NVIDIA DGX H100 user guide (eight ConnectX-7
    400 Gb/s NDR adapters, one per GPU: 50 GB/s line rate each way, NCCL's
    maintainers expect 46-48 GB/s through NCCL, NVIDIA/nccl-tests#290).
    Latencies: NCCL's tuning model (tuning.cc): 3.4 us per ring step over
    NVLink and 14 us over the network (Simple protocol), 8.4 us per call
    (the ring's base latency). gamma: an add reads two bytes and writes one
    per output byte at HBM bandwidth; a copy moves two. In-switch reduction
    (NVLS): 0.85 (tuning.cc nvlsEfficiency, Hopper) of the NVLink bandwidth
    per port, busbw 2 B (p-1)/(p+1) for 8 GPUs (:func:`nvls_busbw_bytes_per_s`);
    gradsync's algorithms do not use it. ``nccl``: what NCCL's topology
    search and tuning model see of the node (:data:`HOPPER_NODE_NCCL`: SM 9.0,
    18 NVLinks to NVSwitch with NVLink SHARP, 8 NDR NICs on PCIe Gen5 x16,
    Intel CPUs), for NCCL's own choice and time
    (:func:`~gradsync.collectives.cost.nccl_tuning.nccl_choice`, which
    ``gradsync simulate --reproduce`` prices the published curves with).
    None of these numbers comes from a published all_reduce curve.
    """
    nvlink = 18 * SM90_NVLINK_GBPS * GB
    return Profile(
        name="h100-ib", description=h100_ib.__doc__.strip().splitlines()[0],
        intra=Link(alpha_s=NVLINK_RING_SIMPLE_S, bandwidth_bytes_per_s=nvlink),
        inter=Link(alpha_s=NET_RING_SIMPLE_S, bandwidth_bytes_per_s=50 * GB),
        gamma_s_per_byte=3 / 3.35e12, copy_s_per_byte=2 / 3.35e12,
        ranks_per_host=8, nics_per_host=8, call_overhead_s=RING_SIMPLE_BASE_S,
        in_switch_reduction_bytes_per_s=nvls_busbw_bytes_per_s(nvlink, 8, HOPPER_NVLS_EFFICIENCY),
        sources=("NVIDIA H100 Tensor Core GPU datasheet", "NVIDIA DGX H100 user guide", NCCL_SOURCE),
        nccl=HOPPER_NODE_NCCL)


def h200_ib() -> Profile:
    """HGX H200 nodes: 8x H200 SXM per node, NVLink 4 through NVSwitch, 8x 400 Gb/s InfiniBand NDR per node.

    Sources: NVIDIA H200 Tensor Core GPU datasheet (18 NVLink 4 links, 900 GB/s
    per GPU in both directions; HBM3e 4.8 TB/s); the same eight-NIC rail
    design as DGX H100 (DGX H200 user guide: eight ConnectX-7 400 Gb/s);
    NVLink usable bandwidth, latencies and NVLS as ``h100-ib`` (NCCL's
    tuning model, which has one set of constants for Hopper).

    Not reproduced on its own: no public nccl-tests curve of an H200 system was
    found (``gradsync simulate --reproduce`` scores ``h100-ib``'s two curves;
    only the HBM terms γ and copy, which an AllReduce over NVLink barely uses,
    differ from that profile).
    """
    h100 = h100_ib()  # the same node but for HBM3e 4.8 TB/s
    return dataclasses.replace(
        h100, name="h200-ib", description=h200_ib.__doc__.strip().splitlines()[0],
        gamma_s_per_byte=3 / 4.8e12, copy_s_per_byte=2 / 4.8e12,
        sources=("NVIDIA H200 Tensor Core GPU datasheet", "NVIDIA DGX H200 user guide", NCCL_SOURCE))


def a100_ib() -> Profile:
    """DGX A100 nodes: 8x A100 SXM4 per node, NVLink 3 through NVSwitch, 8x 200 Gb/s InfiniBand HDR per node.

    Sources: NVIDIA A100 Tensor Core GPU datasheet (12 NVLink 3 links,
    600 GB/s per GPU in both directions: 300 GB/s line rate each way; HBM2e
    2.0 TB/s on the 80 GB part); NCCL's usable 20.0 GB/s per NVLink 3 link
    (topo.h SM80_NVLINK_BW) x 12 = 240 GB/s each way; NVIDIA DGX A100 user
    guide (eight ConnectX-6 200 Gb/s HDR adapters for the compute fabric:
    25 GB/s each way); latencies as ``h100-ib`` (NCCL's hardware latencies
    do not depend on the GPU generation). No in-switch reduction (NVLS needs
    NVLink 4 switches). ``nccl``: :data:`AMPERE_NODE_NCCL` (SM 8.0, 12 NVLinks
    to NVSwitch, 8 HDR NICs on PCIe Gen4 x16, AMD CPUs).
    """
    return Profile(
        name="a100-ib", description=a100_ib.__doc__.strip().splitlines()[0],
        intra=Link(alpha_s=NVLINK_RING_SIMPLE_S, bandwidth_bytes_per_s=12 * SM80_NVLINK_GBPS * GB),
        inter=Link(alpha_s=NET_RING_SIMPLE_S, bandwidth_bytes_per_s=25 * GB),
        gamma_s_per_byte=3 / 2.0e12, copy_s_per_byte=2 / 2.0e12,
        ranks_per_host=8, nics_per_host=8, call_overhead_s=RING_SIMPLE_BASE_S,
        sources=("NVIDIA A100 Tensor Core GPU datasheet", "NVIDIA DGX A100 user guide", NCCL_SOURCE),
        nccl=AMPERE_NODE_NCCL)


PUBLISHED = {"h100-ib": h100_ib, "h200-ib": h200_ib, "a100-ib": a100_ib}
PROFILE_NAMES = tuple(_CALIBRATED) + tuple(PUBLISHED)


def shipped_path(name: str) -> Path:
    """Where the package keeps calibrated profile ``name``."""
    return Path(str(resources.files("gradsync.collectives.cost") / "data" / _CALIBRATED[name]))


def get_profile(name: str) -> Profile:
    """The profile called ``name`` (one of ``PROFILE_NAMES``) or the profile JSON file at path ``name``.

    Raises:
        ValueError: neither a known name nor a profile file.
    """
    if name in PUBLISHED:
        return PUBLISHED[name]()
    if name in _CALIBRATED:
        return load(shipped_path(name))
    path = Path(name)
    if path.is_file():
        return load(path)
    if path.is_dir():
        raise ValueError(f"--profile {name}: a directory, not a profile file (`gradsync calibrate --out FILE`)")
    raise ValueError(f"unknown profile {name!r}: choose one of {', '.join(PROFILE_NAMES)} or give a profile "
                     f"file written by `gradsync calibrate`")
