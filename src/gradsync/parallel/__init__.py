"""Data-parallel engines built on the collectives: synchronous, deterministic (micro-shards), asynchronous
(parameter server), local SGD and DiLoCo."""

from gradsync.parallel.async_worker import AsyncWorker
from gradsync.parallel.bucketing import assign_buckets
from gradsync.parallel.data_parallel import DataParallel
from gradsync.parallel.deterministic import DeterministicDataParallel
from gradsync.parallel.diloco import DiLoCo
from gradsync.parallel.local_sgd import LocalSGD
from gradsync.parallel.parameter_server import ParameterServer
from gradsync.parallel.staleness import StalenessGate, StalenessStats

__all__ = ["AsyncWorker", "DataParallel", "DeterministicDataParallel", "DiLoCo", "LocalSGD", "ParameterServer",
           "StalenessGate", "StalenessStats", "assign_buckets"]
