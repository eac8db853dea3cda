"""The chunk pipeline NCCL's tuning model leaves out: the fill of NVLS's and NVLSTree's per-loop stages.

NCCL's model (:mod:`~gradsync.collectives.cost.nccl_tuning`) prices a call as
latency + bytes / bandwidth, the bandwidth being the steady state of a
pipeline. A call of NVLS (in-switch reduction) or NVLSTree runs in loops, and
each loop passes through several stages one after the other; the steady
state overlaps the stages of successive loops, but the first loop's stages
before the last one are not overlapped by anything: that fill is added here.
Read from NVIDIA/nccl v2.24.3-1 (commit 6aae3792), the version the
published curves ran:

* The loop: enqueue.cc ``calcCollChunking`` sets the chunk per channel and
  head: NVLS from ``nvlsChunkSize`` (transport/nvls.cc ``NCCL_NVLS_CHUNKSIZE``,
  128 KiB) down to 64/32/16 KiB while bytes < 64/8/2 x concurrentOps x chunk;
  NVLSTree from 128 KiB, at most 64 KiB from 4 nodes on
  (``NCCL_NVLSTREE_MAX_CHUNKSIZE`` -2), down to 32 KiB while bytes <
  concurrentOps x chunk; concurrentOps = channels (``nvlsChannels``, 16) x
  heads (the NVLS graph's channels). One loop moves channels x heads x chunk
  bytes (device/all_reduce.h ``RunWorkColl<AllReduce, NVLS|NVLS_TREE,
  Simple>``: ``loopCount = nHeads * chunkSize`` per channel); a call smaller
  than a loop runs one partial loop.
* The stages of a loop (all_reduce.h, the warp groups): scatter (each GPU
  writes the loop's (p-1)/p to the other heads' buffers over NVLink and posts
  once per loop, prims_simple.h ``ScatterGatherOp``), reduce and multicast
  through the switch (the steady state's bottleneck, the stage NCCL's
  bandwidth prices), gather (a copy out of the NVLS buffer in the GPU's own
  memory). NVLSTree puts the network tree between reduce and multicast: one
  hop per level of ``ncclGetBtree``'s tree up and as many down
  (graph/connect.cc ``connectNvls``: the two trees of ``ncclGetDtree`` on
  alternate channels, so a node receives from two children in at most one of
  them and a NIC carries a head's share, loop / heads, per hop).

Each stage's time is the loop's bytes through its own link: NVLink at NCCL's
NVLS bandwidth of the node (the NVLS graph's channels x bw_intra x 5/6), the
network at the graph's bw_inter per head NIC, the copy at the profile's HBM
copy cost. None of these numbers comes from a published curve.
"""

from __future__ import annotations

from gradsync.collectives.cost import nccl_constants as K
from gradsync.collectives.cost.profile import Profile
from gradsync.collectives.cost.topology import Topology

NVLS_CHUNK_BYTES = 128 * 1024           # transport/nvls.cc NCCL_NVLS_CHUNKSIZE default
NVLS_TREE_MAX_CHUNK_4_NODES = 64 * 1024  # enqueue.cc: NVLSTREE_MAX_CHUNKSIZE -2 -> 64 KiB from 4 nodes


def nvls_chunk_bytes(algorithm: str, nbytes: int, concurrent_ops: int, nodes: int) -> int:
    """enqueue.cc calcCollChunking's chunk (bytes per channel and head) for "nvls" or "nvls_tree" AllReduce.

    Raises:
        ValueError: another algorithm.
    """
    ops = concurrent_ops
    if algorithm == "nvls":
        chunk = NVLS_CHUNK_BYTES        # (the 32 KiB cap across nodes applies to NVLS across nodes: not modelled)
        for factor, size in ((64, 65536), (8, 32768), (2, 16384)):
            if nbytes < factor * ops * chunk and chunk > size:
                chunk = size
        return chunk
    if algorithm == "nvls_tree":
        chunk = min(NVLS_CHUNK_BYTES, NVLS_TREE_MAX_CHUNK_4_NODES if nodes >= 4 else NVLS_CHUNK_BYTES)
        for factor, size in ((32, 262144), (16, 131072), (4, 65536), (1, 32768)):
            if nbytes < factor * ops * chunk and chunk > size:
                chunk = size
        return chunk
    raise ValueError(f"algorithm must be 'nvls' or 'nvls_tree', got {algorithm!r}")


def btree_depth(nodes: int) -> int:
    """Levels of graph/trees.cc ncclGetBtree's tree over ``nodes`` ranks (root 0): the most parent hops of any
    rank to the root (a rank's parent clears its lowest set bit and sets the next, or clears it if that is
    past the end)."""
    depth = 0
    for rank in range(1, nodes):
        hops, r = 0, rank
        while r != 0:
            bit = r & -r
            up = (r ^ bit) | (bit << 1)
            r = up if up < nodes else r ^ bit
            hops += 1
        depth = max(depth, hops)
    return depth


def pipeline_fill_us(profile: Profile, topology: Topology, algorithm: str, nbytes: int, graph,
                     collective: str = "all_reduce") -> float:
    """The first loop's stages before the last one (microseconds) for NCCL's ``algorithm`` on ``topology``;
    0 for ring and tree (the ring's steps all carry data from the first; the tree's fill is in NCCL's own
    treeCorrectionFactor) and for collectives other than AllReduce (their NVLS kernels are not modelled).
    ``graph``: the NVLS search graph (channels = heads, bw_intra, bw_inter GB/s)."""
    if algorithm not in ("nvls", "nvls_tree") or collective != "all_reduce":
        return 0.0
    heads, ranks = graph.channels, topology.host_sizes[0]
    chunk = nvls_chunk_bytes(algorithm, nbytes, K.NVLS_CHANNELS * heads, topology.hosts)
    loop = min(nbytes, K.NVLS_CHANNELS * heads * chunk)
    nvlink_gbps = graph.channels * graph.bw_intra * K.NVLS_AR_RATIO
    scatter = loop * (ranks - 1) / ranks / (1000 * nvlink_gbps)
    gather = loop * profile.copy_s_per_byte * 1e6
    hops = 2 * btree_depth(topology.hosts) if algorithm == "nvls_tree" else 0
    network = hops * (loop / heads) / (1000 * graph.bw_inter)
    return scatter + gather + network
