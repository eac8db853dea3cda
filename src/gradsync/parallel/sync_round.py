"""The bookkeeping of one synchronised backward of the reducer, and the status each rank reports in it.

The last bucket of every round carries, after one used flag per parameter,
one status slot per rank: a code saying whether this rank's gradients must
not be used (0: fine; its parameters changed after wrapping, its backward
failed, it ran ``torch.autograd.grad``) plus the number of grad-enabled
forwards it ran since its last synchronised backward (``no_sync`` ones
included). Every rank reads every slot once the bucket is reduced, so a
problem one rank found is raised on every rank, naming it, and so is a
difference in the forward counts: the ranks are running different
forward/backward sequences (a rank skipped ``backward()`` or used
``no_sync()`` alone), and its bucket was paired with another iteration's.
A slot of 0 is a rank that did not report (a rank shadowing under ``join``).
After the status slots come ``NAME_DIGITS`` slots per rank: which wrapped
parameter or buffer changed on that rank (its index + 1 in wrapping order,
base 16; 0: none or one added after wrapping), so every rank's message names it.

A slot is ``code + 4 * (1 + min(forwards, MAX_FORWARDS))``, at most 63: small
integers survive averaging in the bucket's dtype (bfloat16 included) and the
compressors' uint8 sum of the flags.

>>> statuses = [0, AUTOGRAD_GRAD]
>>> print(status_error(statuses, rank=0, detail=""))  # doctest: +ELLIPSIS
DataParallel (on rank 0): rank 1: it ran torch.autograd.grad through DataParallel... use loss.backward()...
>>> print(sequence_error([1, 2], rank=0))  # doctest: +ELLIPSIS
DataParallel (on rank 0): rank 1 ran 2 forwards since the last gradient sync, rank 0 ran 1: a rank skipped...
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
MAX_FORWARDS = 14  # forward counts are compared up to this many (a slot stays below 64)
NAME_DIGITS = 3    # base-16 digits per rank naming the changed parameter or buffer (up to 4095 of them)
SLOTS_PER_RANK = 1 + NAME_DIGITS


class SkippedAfterFailure(GradsyncError):
    """A bucket not reduced because an earlier bucket of the same round failed."""


def flag_count(num_params: int, world_size: int) -> int:
    """Elements the last bucket carries after its gradients: a used flag per parameter, then the slots."""
    return num_params + world_size * SLOTS_PER_RANK


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
        self.forwards = 0     # grad-enabled forwards this rank ran since its last synchronised backward
        self.detail = ""      # this rank's own words for it (names the parameter)
        self.name_code = 0    # index + 1 of the changed wrapped parameter or buffer (0: none)
        self.statuses: list[int] = []  # every rank's code, once the last bucket is reduced
        self.counts: list[int | None] = []  # every rank's forward count then (None: did not report)
        self.name_codes: list[int] = []     # every rank's name_code then
        self.hold: int | None = None   # the lane hold while the round is in flight
        self.divide_out = 1   # > 1: buckets hold sums, divided by this while copied into .grad
        self.fresh: list[bool] = []  # ZeRO: per piece, whether its .grad was None when the round began

    def fail(self, detail: str) -> None:
        """Mark this rank's part failed (``BACKWARD_FAILED``): every bucket goes out now, gradients or not."""
        self.status, self.detail = BACKWARD_FAILED, detail
        self.pending = [0] * len(self.pending)


def encode_flags(used: list[bool], state: "Round", rank: int, world_size: int) -> torch.Tensor:
    """The last bucket's flags: used per parameter, then this rank's status and forward count in its slot,
    then the digits of its name code in its own ``NAME_DIGITS`` slots."""
    slots = [0] * (world_size * SLOTS_PER_RANK)
    slots[rank] = state.status + 4 * (1 + min(state.forwards, MAX_FORWARDS))
    code = min(state.name_code, 16**NAME_DIGITS - 1)
    for digit in range(NAME_DIGITS):
        slots[world_size + rank * NAME_DIGITS + digit] = (code >> (4 * digit)) & 15
    return torch.tensor([float(flag) for flag in used] + slots, dtype=torch.float64)


def decode_statuses(slots: torch.Tensor, scale: int) -> tuple[list[int], list[int | None], list[int]]:
    """Every rank's code, forward count (None: no report) and name code from the reduced status slots
    (averaged over ``scale`` ranks; 1: summed)."""
    values = [int(round(value)) for value in (slots.double() * scale).tolist()]
    world_size = len(values) // SLOTS_PER_RANK
    status, digits = values[:world_size], values[world_size:]
    names = [sum(digits[r * NAME_DIGITS + d] << (4 * d) for d in range(NAME_DIGITS)) for r in range(world_size)]
    return [value % 4 for value in status], [value // 4 - 1 if value >= 4 else None for value in status], names


def sequence_error(counts: list[int | None], rank: int) -> GradsyncError | None:
    """The error every rank raises when the reporting ranks ran different numbers of forwards (None if not)."""
    reported = [(r, count) for r, count in enumerate(counts) if count is not None]
    if len({count for _, count in reported}) < 2:
        return None
    reported.sort(key=lambda item: (-item[1], item[0]))  # the most forwards first

    def ran(count: int) -> str:
        many = "+" if count >= MAX_FORWARDS else ""
        return f"{count}{many} forward{'' if count == 1 else 's'}"

    first, rest = reported[0], reported[1:]
    words = f"rank {first[0]} ran {ran(first[1])} since the last gradient sync, " + ", ".join(
        f"rank {r} ran {count}{'+' if count >= MAX_FORWARDS else ''}" for r, count in rest)
    return GradsyncError(f"DataParallel (on rank {rank}): {words}: a rank skipped backward() or used no_sync() "
                         f"alone (or ran a forward with grad enabled alone: evaluate under torch.no_grad()); "
                         f"every rank must run the same forward/backward sequence. The gradients of "
                         f"this backward were averaged with another iteration's and must not be used; call "
                         f"model.reset_after_failure() on every rank to go on")


def status_error(statuses: list[int], rank: int, detail: str,
                 where: list[str | None] | None = None) -> GradsyncError | None:
    """The error every rank raises for a round whose ``statuses`` are not all 0 (None if they are).

    ``where[r]``: the name of the parameter or buffer that rank ``r`` reported (None: not known)."""
    bad = [(r, code) for r, code in enumerate(statuses) if code]
    if not bad:
        return None
    parts, advice = [], []
    for r, code in bad:
        cause, what_to_do = _CAUSES.get(code, (f"reported status {code}", "re-wrap the module"))
        named = where[r] if where is not None and where[r] is not None else None
        own = f" ({detail})" if r == rank and detail else f" (at {named!r})" if named else ""
        parts.append(f"rank {r}: {cause}{own}")
        if what_to_do not in advice:
            advice.append(what_to_do)
    return GradsyncError(f"DataParallel (on rank {rank}): {'; '.join(parts)}; so the gradients of this "
                         f"backward must not be used: {'; '.join(advice)}")
