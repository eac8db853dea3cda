"""Data-parallel engines built on the collectives."""

from gradsync.parallel.bucketing import assign_buckets
from gradsync.parallel.data_parallel import DataParallel

__all__ = ["DataParallel", "assign_buckets"]
