"""NCCL's tuning constants and a GPU system's NCCL-visible hardware (the ``nccl`` field of a Profile).

The tables are NCCL 2.24.3's (NVIDIA/nccl tag v2.24.3-1, commit 6aae3792,
``src/graph/tuning.cc``: ``baseLat``, ``hwLat``, ``llMaxBws``,
``perChMaxRingLL128Bws``, ``perChMaxTreeLL128Bws``, ``perChMaxTreeBws``,
``treeCorrectionFactor``; ``src/graph/search.cc``: ``speedArrayIntra``,
``sm90SpeedArrayIntra``, ``speedArrayInter``, ``sm90SpeedArrayInter``;
``src/graph/topo.h``: ``SM80_NVLINK_BW``, ``SM90_NVLINK_BW``;
``src/include/device.h``: thread counts and thresholds), the version the
published curves ran. Read from the source, not copied: each number is
written here with the table it comes from. Latencies are microseconds,
bandwidths GB/s (1e9 B/s), as NCCL keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

NCCL_VERSION = "2.24.3"
NCCL_SOURCE = ("NVIDIA/nccl v2.24.3-1 (commit 6aae3792): src/graph/tuning.cc ncclTopoTuneModel and "
               "ncclTopoGetAlgoTime, src/graph/search.cc ncclTopoCompute, src/enqueue.cc topoGetAlgoInfo, "
               "src/graph/topo.h")

ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree")
PROTOCOLS = ("LL", "LL128", "Simple")

# tuning.cc baseLat[algorithm][protocol], us (NVLS, NVLSTree, CollNet: 0).
BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
# tuning.cc hwLat[NVLINK | PCI | NET][algorithm][protocol], us; 0 where NCCL has no such pair.
HW_LATENCY_US = {
    "NVLINK": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "collnet_direct": (0, 0, 3.7),
               "collnet_chain": (0, 0, 2.8), "nvls": (0, 0, 25.0), "nvls_tree": (0, 0, 25.0)},
    "PCI": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "collnet_direct": (0, 0, 3.7),
            "collnet_chain": (0, 0, 2.8), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0)},
    "NET": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "collnet_direct": (0, 0, 31.0),
            "collnet_chain": (0, 0, 30.0), "nvls": (0, 0, 18.0), "nvls_tree": (0, 0, 14.0)},
}
# Rows Volta, Ampere, Hopper; columns 1 node, 2 nodes, more. llMaxBws' row is the GPU generation on one
# node, and on several the CPU vendor (row 0 Intel, row 1 AMD).
LL_MAX_BW = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0))
PER_CH_MAX_RING_LL128_BW = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 36.7))
PER_CH_MAX_TREE_LL128_BW = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 29.0))
PER_CH_MAX_TREE_BW = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0))
# tuning.cc treeCorrectionFactor[protocol][log2(nBytes / 64)], 64 B .. 256 MiB.
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
)
# search.cc: the per-channel bandwidths the topology search tries, highest first.
SPEEDS_INTRA = (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)
SPEEDS_INTER = (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2,
                0.24, 0.12)
SM90_SPEEDS_INTRA = (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)
SM90_SPEEDS_INTER = (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24,
                     0.12)
# topo.h: NCCL's usable bandwidth of one NVLink, GB/s per direction.
NVLINK_BW = {80: 20.0, 90: 20.6}
# device.h / tuning.cc: threads per protocol (LL, LL128, Simple), the per-thread thresholds before NCCL adds
# channels (ring LL's is multiplied by the ranks), MAXCHANNELS, NVLS_NCHANNELS' default (nvls.cc).
MAX_THREADS = (512, 640, 512)
THREAD_THRESHOLDS = (8, 8, 64)
MAX_CHANNELS = 32
NVLS_CHANNELS = 16
NVLS_AR_RATIO = 5.0 / 6.0   # tuning.cc 2.24: NVLS and NVLSTree busBw -> algBw


@dataclass(frozen=True)
class NcclConstants:
    """What NCCL's topology search and tuning model see of a GPU system (one node type).

    Args:
        compute_capability: the GPUs' SM version x 10 (80 Ampere, 90 Hopper): picks NCCL's tables.
        nvlinks: NVLink links per GPU (to the NVSwitches); NCCL counts ``NVLINK_BW[cc]`` GB/s each.
        nvswitch: the GPUs meet in NVSwitches (each GPU's links all go to the switches).
        nvls: NVLink SHARP (in-switch reduction) is available and enabled (NVSwitch 3 and Hopper).
        nics: NICs per node (one per GPU on rail-optimised nodes).
        nic_gbps: one NIC's line rate, GB/s per direction (NCCL: the port speed in Mb/s / 8000).
        pcie_lanes, pcie_gt_s: the GPU-NIC PCIe link (NCCL: lanes x GT/s x 7.5 / 80 GB/s for Gen4/5).
        cpu_vendor: "intel" or "amd" (NCCL's LL ceiling across nodes and network post overhead).
        version: the NCCL version whose constants these are.
        sources: where each hardware number comes from.
    """

    compute_capability: int
    nvlinks: int
    nvswitch: bool = True
    nvls: bool = False
    nics: int = 0
    nic_gbps: float = 0.0
    pcie_lanes: int = 16
    pcie_gt_s: float = 16.0
    cpu_vendor: str = "intel"
    version: str = NCCL_VERSION
    sources: tuple[str, ...] = ()

    def __post_init__(self):
        if self.compute_capability not in NVLINK_BW:
            raise ValueError(f"nccl.compute_capability must be one of {sorted(NVLINK_BW)}, "
                             f"got {self.compute_capability}")
        if self.cpu_vendor not in ("intel", "amd"):
            raise ValueError(f"nccl.cpu_vendor must be 'intel' or 'amd', got {self.cpu_vendor!r}")
        if self.nvlinks < 1:
            raise ValueError(f"nccl.nvlinks must be >= 1, got {self.nvlinks}")
        object.__setattr__(self, "sources", tuple(self.sources))

    @property
    def generation(self) -> int:
        """Row of NCCL's per-generation tables: 1 Ampere, 2 Hopper."""
        return 2 if self.compute_capability >= 90 else 1

    @property
    def nvlink_gbps(self) -> float:
        """NCCL's bandwidth of the GPU's NVLinks together (GB/s per direction): nvlinks x NVLINK_BW."""
        return self.nvlinks * NVLINK_BW[self.compute_capability]

    @property
    def pcie_gbps(self) -> float:
        """NCCL's GPU-NIC PCIe bandwidth: lanes x (GT/s x 7.5 in 100 Mb/s) / 80 (topo.cc kvDictPciGen)."""
        return self.pcie_lanes * self.pcie_gt_s * 7.5 / 80

    @property
    def net_gbps(self) -> float:
        """One GPU's path to its NIC: the slower of the NIC and the PCIe link."""
        return min(self.nic_gbps, self.pcie_gbps)

    @classmethod
    def from_dict(cls, data: dict) -> "NcclConstants":
        """The constants written by ``dataclasses.asdict``.

        Raises:
            ValueError: a missing or unknown field.
        """
        try:
            return cls(**data)
        except TypeError as error:
            raise ValueError(f"not NCCL constants: {error}") from error
