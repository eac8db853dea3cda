"""gradsync: data-parallel training for PyTorch, with AllReduce written over point-to-point calls.

>>> import gradsync
>>> gradsync.ALGORITHMS
('ring', 'tree', 'double_binary_tree', 'halving_doubling', 'hierarchical', 'shm', 'native', 'auto')
"""

from gradsync.slurm import catch_preemption_early as _catch_preemption_early

_catch_preemption_early()  # `gradsync train` under srun: a preemption signal during start-up (imports) is remembered

from gradsync import compression, optim
from gradsync.api import all_gather, all_reduce, all_to_all, broadcast, comm_stats, flight_records, reduce_scatter
from gradsync.collectives import ALGORITHMS, OPS, Communicator, HierarchicalOptions, SegmentOptions
from gradsync.errors import (CheckpointFolderError, CollectiveMismatchError, CollectiveTimeoutError, DebugCheckError,
                             EpochOrderWarning, GradsyncError, GroupClosedError, MemoryPreflightError,
                             NotInitializedError,
                             ReplicaDivergenceError, ShmSetupError)
from gradsync.parallel import AsyncWorker, DataParallel, DeterministicDataParallel, DiLoCo, LocalSGD, ParameterServer
from gradsync.parallel.clip import clip_grad_norm_
from gradsync.parallel.preflight import MemoryEstimate
from gradsync.parallel.preflight_fit import preflight
from gradsync.parallel.replica_check import ReplicaCheck, check_replicas
from gradsync.parallel.shard_layout import SHARD_LEVELS
from gradsync.parallel.sharded_optimizer import ShardedOptimizer
from gradsync.process_group import init, is_initialized, rank, shutdown, world_size
from gradsync.transport.thread import ThreadTransport, ThreadWorld
from gradsync.transport.torch_p2p import TorchP2PTransport

__version__ = "0.1.0"  # the one version source: pyproject.toml reads it (dynamic = ["version"])

__all__ = [
    "ALGORITHMS", "AsyncWorker", "CheckpointFolderError", "CollectiveMismatchError",
    "CollectiveTimeoutError", "Communicator", "DataParallel", "DebugCheckError", "DeterministicDataParallel", "DiLoCo",
    "EpochOrderWarning", "GradsyncError", "GroupClosedError", "HierarchicalOptions", "LocalSGD", "MemoryEstimate",
    "MemoryPreflightError",
    "NotInitializedError", "OPS", "ParameterServer", "ReplicaCheck", "ReplicaDivergenceError", "SHARD_LEVELS",
    "SegmentOptions", "ShardedOptimizer", "ShmSetupError", "ThreadTransport", "ThreadWorld", "TorchP2PTransport", "__version__", "all_gather",
    "all_reduce", "all_to_all", "broadcast", "check_replicas", "clip_grad_norm_", "comm_stats", "compression", "flight_records",
    "init", "is_initialized", "optim", "preflight", "rank", "reduce_scatter", "shutdown", "world_size",
]
