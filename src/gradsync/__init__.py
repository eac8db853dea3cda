"""gradsync: data-parallel training for PyTorch, with AllReduce written over point-to-point calls.

>>> import gradsync
>>> gradsync.ALGORITHMS
('ring', 'tree', 'halving_doubling', 'hierarchical', 'shm', 'native', 'auto')
"""

from gradsync import compression
from gradsync.api import all_gather, all_reduce, broadcast, comm_stats, reduce_scatter
from gradsync.collectives import ALGORITHMS, OPS, Communicator
from gradsync.errors import CollectiveMismatchError, CollectiveTimeoutError, GradsyncError, NotInitializedError
from gradsync.parallel import AsyncWorker, DataParallel, LocalSGD, ParameterServer
from gradsync.process_group import init, is_initialized, rank, shutdown, world_size

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS", "OPS", "AsyncWorker", "CollectiveMismatchError", "CollectiveTimeoutError", "Communicator", "compression",
    "DataParallel", "GradsyncError", "NotInitializedError", "all_gather", "all_reduce", "broadcast", "comm_stats",
    "LocalSGD", "ParameterServer", "init", "is_initialized", "rank", "reduce_scatter", "shutdown", "world_size",
]
