"""Collective operations: one algorithm per module, one public layer (``api``)."""

from gradsync.collectives.api import (ALGORITHMS, OPS, SUPPORTED_DTYPES, all_gather, all_reduce,
                                      broadcast, reduce_scatter, validate_algorithm, validate_op)
from gradsync.collectives.communicator import Communicator

__all__ = ["ALGORITHMS", "OPS", "SUPPORTED_DTYPES", "Communicator", "all_gather", "all_reduce",
           "broadcast", "reduce_scatter", "validate_algorithm", "validate_op"]
