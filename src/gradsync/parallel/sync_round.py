"""The bookkeeping of one synchronised backward of the reducer, and the status each rank reports in it.

The last bucket of every round carries, after one used flag per parameter,
one status slot per rank: 0, or a code saying this rank's gradients must not
be used (its parameters changed after wrapping, its backward failed, it ran
``torch.autograd.grad``). Every rank reads every slot once the bucket is
reduced, so a problem one rank found is raised on every rank, naming it.

>>> statuses = [0, AUTOGRAD_GRAD]
>>> print(status_error(statuses, rank=0, detail=""))  # doctest: +ELLIPSIS
DataParallel (on rank 0): rank 1: it ran torch.autograd.grad through DataParallel... use loss.backward()...
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from gradsync.errors import GradsyncError
from gradsync.parallel.bucketing import Bucket

PARAMS_CHANGED, BACKWARD_FAILED, AUTOGRAD_GRAD = 1, 2, 3
_CAUSES = {
    PARAMS_CHANGED: ("its parameters or buffers changed after wrapping",
                     "re-wrap the module in DataParallel after changing its parameters (on every rank)"),
    BACKWARD_FAILED: ("its backward raised before its gradients were synchronised (its own error says why)",
                      "call model.reset_after_failure() on every rank to go on"),
    AUTOGRAD_GRAD: ("it ran torch.autograd.grad through DataParallel, whose gradients are not averaged",
                    "DataParallel averages .grad during loss.backward() and torch.autograd.grad bypasses "
                    "it: use loss.backward(), or run the forward inside model.no_sync() and average the "
                    "gradients yourself"),
}
BREAKS_MODEL = (PARAMS_CHANGED, BACKWARD_FAILED)  # the model needs a reset or a re-wrap afterwards


class Round:
    """Bookkeeping of one synchronised backward."""

    def __init__(self, buckets: list[Bucket], num_params: int):
        self.pending = [len(bucket.param_indices) for bucket in buckets]
        self.ready = [False] * num_params
        self.used = [False] * num_params
        self.order: list[int] = []
        self.ready_s: list[float] = []  # perf_counter time of each entry of ``order``
        self.next_launch = 0
        self.futures: list[Future] = []
        self.failed = False  # a bucket failed: later buckets of this round are skipped, not waited for again
        self.status = 0       # this rank's code (0: fine)
        self.detail = ""      # this rank's own words for it (names the parameter)
        self.statuses: list[int] = []  # every rank's code, once the last bucket is reduced
        self.hold: int | None = None   # the lane hold while the round is in flight


def encode_flags(used: list[bool], status: int, rank: int, world_size: int) -> torch.Tensor:
    """The last bucket's flags: used per parameter, then this rank's status in its own slot."""
    slots = [0] * world_size
    slots[rank] = status
    return torch.tensor([float(flag) for flag in used] + slots, dtype=torch.float64)


def decode_statuses(slots: torch.Tensor, scale: int) -> list[int]:
    """Every rank's code from the reduced status slots (averaged over ``scale`` ranks; 1: summed)."""
    return [int(round(value)) for value in (slots.double() * scale).tolist()]


def status_error(statuses: list[int], rank: int, detail: str) -> GradsyncError | None:
    """The error every rank raises for a round whose ``statuses`` are not all 0 (None if they are)."""
    bad = [(r, code) for r, code in enumerate(statuses) if code]
    if not bad:
        return None
    parts, advice = [], []
    for r, code in bad:
        cause, what_to_do = _CAUSES.get(code, (f"reported status {code}", "re-wrap the module"))
        own = f" ({detail})" if r == rank and detail else ""
        parts.append(f"rank {r}: {cause}{own}")
        if what_to_do not in advice:
            advice.append(what_to_do)
    return GradsyncError(f"DataParallel (on rank {rank}): {'; '.join(parts)}; so the gradients of this "
                         f"backward must not be used: {'; '.join(advice)}")
