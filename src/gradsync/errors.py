"""Errors raised by gradsync.

Every collective failure names what a user needs to find the culprit: the
operation, the algorithm, this rank and the peer rank it waited for.
"""


class GradsyncError(RuntimeError):
    """Base class for gradsync runtime errors that are not a bad argument."""


class CollectiveTimeoutError(TimeoutError):
    """A peer did not answer in time, or its connection closed (it died).

    The message names the operation, the algorithm, the step inside the
    algorithm, this rank and the peer ("peer rank 3"). The attributes carry
    the same facts for programs. After this error the process group is no
    longer usable: tear it down (``gradsync.shutdown``) and restart, as with
    NCCL's watchdog.
    """

    def __init__(self, message, *, op=None, algorithm=None, rank=None, peer=None, step=None,
                 timed_out=True):
        super().__init__(message)
        self.timed_out = timed_out  # False: the peer's connection closed (it died) before the deadline
        self.op = op
        self.algorithm = algorithm
        self.rank = rank
        self.peer = peer
        self.step = step


class CollectiveMismatchError(ValueError):
    """Ranks called the same collective with tensors of different layout.

    Raised on every rank of the group, before any tensor is modified; the
    group stays usable afterwards. The message names the ranks and what
    differs (shape, dtype, op, algorithm or src).
    """


class NotInitializedError(GradsyncError):
    """A collective was called before ``gradsync.init()``."""
