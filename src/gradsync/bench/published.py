"""Published nccl-tests ``all_reduce_perf`` curves that ``gradsync simulate --reproduce`` compares with.

Each curve is copied from a raw nccl-tests log, out-of-place columns,
float32 sum, sizes 4 KiB to 8 GiB where published (smaller sizes print busbw
with too few digits to compare). ``points``: (bytes, time in microseconds) as printed;
busbw is recomputed from the time (nccl-tests' definition, algbw x
2(p-1)/p), which equals the printed busbw within its two decimals.

Whether NVLS (in-switch reduction, NVLink SHARP) was on: neither log
forces an algorithm (no NCCL_ALGO), so NCCL 2.24 picks by its own model;
on 8 H100 SXM with NVSwitch its default for large AllReduce is NVLS
(S. Jeaugey, NVIDIA/nccl-tests#212: "allreduce uses NVLink SHARP by
default ... peak busBw of ~480GB/s"), and the single-node curve's peak
(479.7 GB/s) is above what any ring over NVLink can reach (~370 GB/s),
so it was on. The multi-node run on the same machines most likely used
NVLSTree or Tree for large sizes; the log does not say.
"""

from __future__ import annotations

from dataclasses import dataclass

_VP = "https://github.com/ZiyanIshani/vpbenchmarking"


@dataclass(frozen=True)
class PublishedCurve:
    """One published all_reduce curve.

    Args:
        key: short name (``--reproduce`` prints it).
        source: where the numbers are (URL and file).
        system: the hardware and software, as the source states it.
        profile: the gradsync profile of that hardware (:mod:`gradsync.collectives.cost.profiles`).
        hosts, ranks_per_host: the topology of the run.
        nvls: whether NCCL used in-switch reduction (True, False, or None: not known).
        note: what the source says about algorithms, channels and doubts.
        points: (nbytes, time_us) rows as published.
        gpus_per_thread: GPUs one benchmark thread drives (nccl-tests ``-g``); it launches their kernels
            one after the other on every call.
    """

    key: str
    source: str
    system: str
    profile: str
    hosts: int
    ranks_per_host: int
    nvls: bool | None
    note: str
    points: tuple[tuple[int, float], ...]
    gpus_per_thread: int = 1

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def busbw_gbps(self, nbytes: int, time_us: float) -> float:
        p = self.world_size
        return nbytes / (time_us * 1e-6) / 1e9 * 2 * (p - 1) / p


H100_NODE = PublishedCurve(
    key="8xH100-NVLS",
    source=f"{_VP} results/nccl/nccl_allreduce_20260224_223444.txt (Voltage Park / AI @ Georgia Tech, 2026-02-24)",
    system="1 node, 8x H100 80GB HBM3 SXM5, NVLink 4 + NVSwitch; NCCL 2.24.3, nccl-tests 2.17.9, "
           "one process driving 8 GPUs (-g 8)",
    profile="h100-ib", hosts=1, ranks_per_host=8, nvls=True,
    note="default algorithm selection (no NCCL_ALGO): NVLS for large sizes; the 33 us floor of small "
         "sizes is one thread launching and synchronizing 8 GPUs (-g 8)",
    points=((4096, 33.19), (8192, 33.09), (16384, 32.95), (32768, 32.74), (65536, 33.62), (131072, 34.26),
            (262144, 35.05), (524288, 36.97), (1048576, 38.74), (2097152, 43.23), (4194304, 55.70),
            (8388608, 84.47), (16777216, 125.88), (33554432, 200.39), (67108864, 328.56),
            (134217728, 588.39), (268435456, 1112.19), (536870912, 2152.91), (1073741824, 4010.54),
            (2147483648, 7918.12), (4294967296, 15753.1), (8589934592, 31335.8)),
    gpus_per_thread=8)

H100_4NODES = PublishedCurve(
    key="4x8xH100-IB",
    source=f"{_VP} results/nccl/nccl_multinode/nccl_allreduce_20260224_225706.txt (Voltage Park, 2026-02-24)",
    system="4 nodes x 8 H100 80GB HBM3 SXM5, 3.2 Tb/s InfiniBand per node (8x 400 Gb/s NDR; the run's "
           "summary also says '3 active ports per node'); NCCL 2.24.3, OpenMPI 4.1.2, one process per GPU",
    profile="h100-ib", hosts=4, ranks_per_host=8, nvls=None,
    note="default algorithm selection (no NCCL_ALGO); NVLS was available on these nodes (the single-node run "
         "reached NVLS busbw), so large sizes likely ran NVLSTree or Tree; small sizes Tree/LL",
    points=((4096, 44.98), (8192, 53.19), (16384, 56.41), (32768, 57.42), (65536, 60.10), (131072, 59.27),
            (262144, 69.81), (524288, 79.34), (1048576, 92.47), (2097152, 154.66), (4194304, 160.50),
            (8388608, 230.19), (16777216, 272.07), (33554432, 373.03), (67108864, 579.49),
            (134217728, 944.74), (268435456, 2169.01), (536870912, 3578.60), (1073741824, 6411.42),
            (2147483648, 12681.1), (4294967296, 25265.5), (8589934592, 50291.8)))

A100_NODE = PublishedCurve(
    key="8xA100-NVLink3",
    source="https://github.com/theap06/gcm gcm/tests/health_checks_tests/test_check_nccl.py "
           "(commit 54e1b1d0, a fork of Meta's facebookresearch/gcm: the log kept as the test fixture "
           "sample_single_success_output of its NCCL health check)",
    system="1 node, 8x A100-SXM4-80GB, NVLink 3 + NVSwitch; NCCL 2.16.2+cuda11.6, one process per GPU "
           "(8 ranks, nThread 1 nGpus 1)",
    profile="a100-ib", hosts=1, ranks_per_host=8, nvls=False,
    note="only 32 MiB to 1 GiB were published (a health check's sizes), so the 4 KiB-32 MiB part of the "
         "goal cannot be scored; a fixture's log, the run behind it not described beyond it; priced by NCCL "
         "2.24.3's model: the run's 2.16.2 counted 22.0 GB/s per NVLink 3 link (topo.h SM80_NVLINK_BW at "
         "v2.16.2-1), not 20.0, so its own model put the 8-GPU ring at 12 x 22 = 264 GB/s busbw, 10% above "
         "2.24's (same ring Simple latency, 8.4 + 14 x 3.4 us); no NVLS on A100",
    points=((33554432, 344.8), (67108864, 557.4), (134217728, 1149.9), (268435456, 2106.1),
            (536870912, 4145.6), (1073741824, 8109.1)))

CURVES = (H100_NODE, H100_4NODES, A100_NODE)


@dataclass(frozen=True)
class HarnessMeasurement:
    """Published all_reduce times of the smallest sizes with one thread driving G GPUs (nccl-tests ``-g G``).

    Args:
        source, system, note: as :class:`PublishedCurve`.
        points: (G, time_us) rows as published.
    """

    source: str
    system: str
    note: str
    points: tuple[tuple[int, float], ...]


# Not one of the scored curves: another system, another NCCL, sizes of 8-128 B, one ring channel.
ONE_THREAD_GPUS = HarnessMeasurement(
    source="https://github.com/NVIDIA/nccl-tests/issues/123 (ConnollyLeon, 2022-12-14, the table of the "
           "issue's description)",
    system="DGX A100, one node; NCCL_ALGO=Ring NCCL_MAX_NCHANNELS=1 all_reduce_perf -b 8 -e 128 -f 2 -n 100 "
           "-g G (one thread driving G GPUs)",
    note="the actual time per G, flat over 8-128 B",
    points=((2, 10.0), (3, 13.76), (4, 16.88), (5, 20.8), (6, 25.2), (7, 29.5), (8, 33.7)))
GOAL_FROM_BYTES, GOAL_ALL_PCT = 4 * 1024, 20.0        # the goal: every size from 4 KiB within 20%
GOAL_LARGE_BYTES, GOAL_LARGE_PCT = 64 * 1024 ** 2, 10.0  # and every size from 64 MiB within 10%
