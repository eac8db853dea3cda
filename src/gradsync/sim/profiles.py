"""The named hardware profiles ``--profile`` takes, each with the sources of its numbers.

* ``this-machine``: this machine class (2 cores, Gloo over loopback, shared
  memory), calibrated by ``gradsync calibrate`` and shipped in
  ``sim/data/this-machine.json`` so that a fresh clone has it; a file of
  your own calibration (``--profile PATH``) replaces it.
* ``test-hosts``: the emulated hosts of ``--hosts H`` (network namespaces on
  a veth bridge, links shaped to 1 Gbit/s by ``tc tbf``, this machine's
  cores), calibrated the same way (``sim/data/test-hosts.json``).
* ``h100-ib``, ``h200-ib``, ``a100-ib``: published GPU systems; see each
  builder's docstring for its sources.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from gradsync.sim.profile import Link, Profile, load

GB = 1e9
_CALIBRATED = {"this-machine": "this-machine.json", "test-hosts": "test-hosts.json"}


def h100_ib() -> Profile:
    """DGX H100 nodes: 8x H100 SXM5 per node, NVLink 4 through NVSwitch, 8x 400 Gb/s InfiniBand NDR per node.

    Sources: NVIDIA H100 Tensor Core GPU datasheet (NVLink 900 GB/s per GPU
    in both directions together: 450 GB/s each way; HBM3 3.35 TB/s); NVIDIA
    DGX H100 user guide (eight ConnectX-7 400 Gb/s NDR adapters, one per GPU:
    50 GB/s each way). Latencies: NCCL's own cost model (src/graph/tuning.cc,
    hardware latency of the Simple protocol: NVLink ~4 us per step, network
    ~14 us), as read in the NCCL sources. gamma: an add reads two bytes and
    writes one per output byte at HBM bandwidth. No in-switch reduction (the
    ring and tree over NVLink); NVLS is modelled separately where a curve
    used it.
    """
    return Profile(
        name="h100-ib", description=h100_ib.__doc__.strip().splitlines()[0],
        intra=Link(alpha_s=4e-6, bandwidth_bytes_per_s=450 * GB),
        inter=Link(alpha_s=14e-6, bandwidth_bytes_per_s=50 * GB),
        gamma_s_per_byte=3 / 3.35e12, copy_s_per_byte=2 / 3.35e12,
        ranks_per_host=8, nics_per_host=8,
        sources=("NVIDIA H100 Tensor Core GPU datasheet", "NVIDIA DGX H100 user guide",
                 "NCCL src/graph/tuning.cc (hardware latencies)"))


def h200_ib() -> Profile:
    """HGX H200 nodes: 8x H200 SXM per node, NVLink 4 through NVSwitch, 8x 400 Gb/s InfiniBand NDR per node.

    Sources: NVIDIA H200 Tensor Core GPU datasheet (NVLink 900 GB/s per GPU,
    HBM3e 4.8 TB/s); the same eight-NIC rail design as DGX H100 (DGX H200
    user guide); latencies as ``h100-ib``.
    """
    return Profile(
        name="h200-ib", description=h200_ib.__doc__.strip().splitlines()[0],
        intra=Link(alpha_s=4e-6, bandwidth_bytes_per_s=450 * GB),
        inter=Link(alpha_s=14e-6, bandwidth_bytes_per_s=50 * GB),
        gamma_s_per_byte=3 / 4.8e12, copy_s_per_byte=2 / 4.8e12,
        ranks_per_host=8, nics_per_host=8,
        sources=("NVIDIA H200 Tensor Core GPU datasheet", "NVIDIA DGX H200 user guide",
                 "NCCL src/graph/tuning.cc (hardware latencies)"))


def a100_ib() -> Profile:
    """DGX A100 nodes: 8x A100 SXM4 per node, NVLink 3 through NVSwitch, 8x 200 Gb/s InfiniBand HDR per node.

    Sources: NVIDIA A100 Tensor Core GPU datasheet (NVLink 600 GB/s per GPU
    in both directions: 300 GB/s each way; HBM2e 2.0 TB/s on the 80 GB part);
    NVIDIA DGX A100 user guide (eight ConnectX-6 200 Gb/s HDR adapters for the
    compute fabric: 25 GB/s each way); latencies as ``h100-ib``.
    """
    return Profile(
        name="a100-ib", description=a100_ib.__doc__.strip().splitlines()[0],
        intra=Link(alpha_s=4e-6, bandwidth_bytes_per_s=300 * GB),
        inter=Link(alpha_s=14e-6, bandwidth_bytes_per_s=25 * GB),
        gamma_s_per_byte=3 / 2.0e12, copy_s_per_byte=2 / 2.0e12,
        ranks_per_host=8, nics_per_host=8,
        sources=("NVIDIA A100 Tensor Core GPU datasheet", "NVIDIA DGX A100 user guide",
                 "NCCL src/graph/tuning.cc (hardware latencies)"))


PUBLISHED = {"h100-ib": h100_ib, "h200-ib": h200_ib, "a100-ib": a100_ib}
PROFILE_NAMES = tuple(_CALIBRATED) + tuple(PUBLISHED)


def shipped_path(name: str) -> Path:
    """Where the package keeps calibrated profile ``name``."""
    return Path(str(resources.files("gradsync.sim") / "data" / _CALIBRATED[name]))


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
    raise ValueError(f"unknown profile {name!r}: choose one of {', '.join(PROFILE_NAMES)} or give a profile "
                     f"file written by `gradsync calibrate`")
