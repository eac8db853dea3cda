"""Collective operations: one algorithm per module, one public layer (``ops``), one list (``registry``)."""

from gradsync.collectives.chunking import SegmentOptions
from gradsync.collectives.communicator import Communicator
from gradsync.collectives.hierarchical import HierarchicalOptions
from gradsync.collectives.ops import (ALGORITHMS, AUTO, DEFAULT_ALGORITHM, OPS, SUPPORTED_DTYPES, all_gather,
                                      all_reduce, all_to_all, average, broadcast, reduce_scatter, resolve_algorithm,
                                      validate_algorithm, validate_op)
from gradsync.collectives.options import AlgorithmOptions
from gradsync.collectives.shm import ShmState

__all__ = ["ALGORITHMS", "AUTO", "DEFAULT_ALGORITHM", "OPS", "SUPPORTED_DTYPES", "AlgorithmOptions",
           "Communicator", "HierarchicalOptions", "SegmentOptions", "ShmState", "all_gather", "all_reduce", "all_to_all", "average", "broadcast",
           "reduce_scatter", "resolve_algorithm", "validate_algorithm", "validate_op"]
