"""Errors raised by gradsync.

Every runtime failure derives from :class:`GradsyncError`, so one
``except gradsync.GradsyncError`` catches a timeout, a mismatch across ranks
and a dead peer alike; each also keeps the standard base a caller would
expect (``TimeoutError``, ``ValueError``). Bad arguments are not runtime
failures: they raise plain ``ValueError`` / ``TypeError``.

Every collective failure names what a user needs to find the culprit: the
operation, the algorithm, this rank and the peer rank it waited for.
"""


class GradsyncError(Exception):
    """Base class for gradsync runtime errors that are not a bad argument.

    It derives from ``Exception``, not ``RuntimeError``: a timeout is an
    ``OSError`` (``TimeoutError``) and a mismatch a ``ValueError``, and
    making them ``RuntimeError`` as well would let code that catches torch's
    own ``RuntimeError`` swallow them.
    """


class CollectiveTimeoutError(GradsyncError, TimeoutError):
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


class CollectiveMismatchError(GradsyncError, ValueError):
    """Ranks called the same collective with tensors of different layout.

    Raised on every rank of the group, before any tensor is modified; the
    group stays usable afterwards. The message names the ranks and what
    differs (shape, dtype, op, algorithm or src).
    """


class ReplicaDivergenceError(GradsyncError):
    """The ranks' replicas are no longer bitwise equal (``check_replicas``).

    Raised on every rank. The message names the first differing tensor
    ("parameter 'fc.weight'"), the ranks on each side ("ranks 0, 2 have
    checksum ...; rank 1 has ..."), and the step.

    Attributes:
        tensor: the first differing tensor's label, or None (ranks at different steps).
        step: the step the check was told (-1: none given).
        groups: the ranks grouped by what they hold there, the largest group first.
    """

    def __init__(self, message, *, tensor=None, step=-1, groups=()):
        super().__init__(message)
        self.tensor = tensor
        self.step = step
        self.groups = [list(group) for group in groups]


class PeerFailure(GradsyncError):
    """A transport-level wait on ``peer`` failed: timed out, or the peer is gone.

    Transports raise it; collectives turn it into a
    :class:`CollectiveTimeoutError` naming the operation (so callers of the
    public API never see it).
    """

    def __init__(self, peer: int, reason: str, timed_out: bool):
        super().__init__(f"peer rank {peer}: {reason}")
        self.peer = peer
        self.reason = reason
        self.timed_out = timed_out


class NotInitializedError(GradsyncError):
    """A collective was called before ``gradsync.init()``."""


class GroupClosedError(GradsyncError):
    """A collective, or a DataParallel built on a group, was used after that group was shut down."""


class ShmSetupError(GradsyncError, OSError):
    """A group's shared-memory segment could not be created or mapped on some rank; raised on every
    rank, naming it (``algorithm="shm"`` and zero-copy buckets)."""


class CheckpointFolderError(GradsyncError):
    """The checkpoint folder is not the same folder on every rank (a node-local disk); raised on every rank."""


class DebugCheckError(GradsyncError):
    """A debug-mode check of DataParallel (``debug=True`` / ``GRADSYNC_DEBUG=1``) found a training mistake.

    Raised on every rank at the same forward, decided from one exchange of
    every rank's findings; the message names the mistake, the ranks, the
    forward and optimizer step, and the evidence (checksums, ratios). The
    model stays usable: the next forward runs normally.

    Attributes:
        checks: the names of the checks that fired, in the order the message
            lists them: ``"same_input"`` (ranks received bitwise-identical
            batches), ``"grads_differ"`` (``.grad`` differed across ranks at an
            optimizer step), ``"reduced_twice"`` (``.grad`` was world_size x
            DataParallel's average at a step), ``"loss_not_divided"`` (the
            loss of accumulated micro-batches was not divided by their number).
    """

    def __init__(self, message, *, checks=()):
        super().__init__(message)
        self.checks = tuple(checks)


class EpochOrderWarning(UserWarning):
    """Debug mode saw the first input batches of training repeat later in the same order (a missing
    ``sampler.set_epoch(epoch)``). A warning, not an error: a fixed order (``shuffle=False``) is
    legitimate; silence it with ``warnings.filterwarnings("ignore", category=gradsync.EpochOrderWarning)``."""


class MemoryPreflightError(GradsyncError):
    """``gradsync.preflight`` found that a run does not fit the memory available per rank.

    The message names the part of the estimate that is largest and what would fit (a shard level, a world
    size); ``estimate`` is the :class:`~gradsync.parallel.preflight.MemoryEstimate` that did not fit.
    """

    def __init__(self, message, *, estimate=None):
        super().__init__(message)
        self.estimate = estimate


class MissingExtraError(GradsyncError, ImportError):
    """A feature needs an optional extra that is not installed (``pip install 'gradsync[NAME]'``).

    An ``ImportError`` too, so ``pytest.importorskip``-style code and ``except ImportError`` see it.
    """


def import_extra(module: str, extra: str, feature: str):
    """Import ``module`` for ``feature``, or raise :class:`MissingExtraError` naming the extra, in one line.

    >>> import_extra("json", "none", "a test").__name__
    'json'
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(f"{feature} needs the {extra!r} extra ({module} is not installed: "
                                f"{exc.name or exc}); install it with: pip install 'gradsync[{extra}]'") from None
