"""What DataParallel's debug mode measures and how every rank decides from it (pure functions).

Each rank sums up what it saw since the last forward in a :class:`Report`
(one int64 row); the rows are all-gathered at the next forward with grad
enabled and :func:`decide` turns the table into one error message and one
warning, the same on every rank. The measurements:

* :func:`checksum`: 64 bits of BLAKE2b over the tensors' dtypes, shapes and
  bytes. One flipped bit or two swapped elements change it (a float sum
  would not see the swap).
* :func:`ce_loss_scale`: the scale ``c`` of a cross-entropy loss, read from
  the gradient at the model's output. For ``L = c * cross_entropy(z, y)``
  (batch mean) the gradient row of sample ``b`` is ``(c / B) (softmax(z_b) -
  onehot(y_b))``: off the target every entry is ``softmax(z_b)`` times one
  ratio ``r_b``, each row sums to 0, and ``sum_b r_b = c`` (class weights
  included). A sum reduction gives ``c * B``; a gradient of another
  pattern (label smoothing, MSE) fails these tests and gives None.

>>> checksum([torch.tensor([1.0, 2.0])]) == checksum([torch.tensor([2.0, 1.0])])
False
>>> z = torch.randn(8, 5, requires_grad=True)
>>> (torch.nn.functional.cross_entropy(z, torch.arange(8) % 5) / 4).backward()
>>> round(ce_loss_scale(z.detach(), z.grad), 4)
0.25
"""

from __future__ import annotations

import hashlib
from dataclasses import astuple, dataclass, fields

import torch

MASK64 = 2**64 - 1
PPM = 1_000_000           # ratios travel as integers in millionths
RATIO_RTOL = 1e-3         # .grad within 0.1% of world_size x DataParallel's average: reduced twice
SCALE_RTOL = 1e-2         # a micro-batch loss scale within 1% of 1: not divided by k (correct code: 1/k)
CE_RTOL = 1e-2            # the cross-entropy gradient pattern must hold this well (fp16 outputs included)
MIN_PROB = 1e-6           # softmax entries below this carry too few bits to read a ratio from
ORDER_WINDOW = 4          # the first batches of training whose repeat, in order, means a fixed epoch order


@dataclass
class Report:
    """One rank's findings since its last exchange: one int64 row of the all_gather.

    Indices name parameters in DataParallel's order (requires_grad ones, as
    registered; the same on every rank). -1 or 0 means "none".
    """

    present: int = 0          # 1: this rank runs this forward; 0: it has left join() and shadows it
    forward: int = 0          # grad-enabled forwards of this model so far, this one included
    has_input: int = 0        # 1: the forward had tensor inputs (their checksum follows)
    input_sum: int = 0        # checksum of the forward's input tensors
    steps: int = 0            # optimizer steps over this model's parameters so far
    step_calls: int = 0       # of them since the last exchange
    step_sum: int = 0         # checksum chained over the .grad seen at those steps
    unsynced: int = 0         # parameters stepped with gradients accumulated under no_sync() since the last sync
    unsynced_first: int = -1  # the first of them
    doubled: int = 0          # parameters whose .grad was world_size x DataParallel's average at a step
    doubled_first: int = -1
    doubled_ppm: int = 0      # their mean ratio .grad / average, in millionths
    with_grad: int = 0        # parameters of that step with a gradient DataParallel had written
    micro_batches: int = 0    # k of an accumulation window whose micro-batch losses were not divided by k
    scale_sum_ppm: int = 0    # that window's summed loss scales, in millionths
    first_scale_ppm: int = 0  # its first micro-batch's loss scale, in millionths
    repeat_at: int = 0        # forward at which the first input batches started to repeat in order (0: none)

    def to_row(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.int64)

    @classmethod
    def from_row(cls, row: torch.Tensor) -> "Report":
        return cls(*[int(value) for value in row.tolist()])


REPORT_NUMEL = len(fields(Report))


def checksum(tensors, seed: int = 0) -> int:
    """A signed 64-bit BLAKE2b checksum of ``tensors`` (dtype, shape and bytes, in order; None allowed).

    ``seed``: an earlier checksum to chain onto (0: none). Costs one read of
    the tensors (and a copy to host memory for accelerator tensors).
    """
    digest = hashlib.blake2b(seed.to_bytes(8, "little", signed=True), digest_size=8)
    for tensor in tensors:
        if tensor is None:
            digest.update(b"none")
            continue
        flat = tensor.detach().contiguous().reshape(-1)
        digest.update(f"{flat.dtype}{tuple(tensor.shape)}".encode())
        if flat.numel():
            digest.update(memoryview(flat.view(torch.uint8).cpu().numpy()))  # no copy on the host
    return int.from_bytes(digest.digest(), "little", signed=True)


def ce_loss_scale(logits: torch.Tensor, grad: torch.Tensor) -> float | None:
    """The scale ``c`` of a batch-mean cross-entropy loss ``c * CE(logits, y)`` from ``grad`` = dL/dlogits.

    Args:
        logits: (B, C) the model's output, C >= 2.
        grad: (B, C) the gradient that reached it in backward.

    Returns:
        ``c`` (1.0 for a plain ``F.cross_entropy``, 1/k for one divided by k),
        or None when ``grad`` is not a cross-entropy gradient within ``CE_RTOL``.
    """
    if logits.dim() != 2 or logits.shape[1] < 2 or grad is None or grad.shape != logits.shape:
        return None
    probs, grad = torch.softmax(logits.double(), dim=1), grad.double()
    off_target = (grad > 0) & (probs > MIN_PROB)
    rows = off_target.any(dim=1)
    if not bool(rows.any()):
        return None
    ratios = torch.where(off_target, grad / probs, torch.zeros_like(grad))
    largest = ratios.amax(dim=1)
    smallest = torch.where(off_target, ratios, torch.full_like(ratios, float("inf"))).amin(dim=1)
    spread = ((largest - smallest) / largest)[rows]
    row_sums = grad.sum(dim=1).abs() / grad.abs().sum(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    if not (float(spread.max()) <= CE_RTOL and float(row_sums.max()) <= CE_RTOL):  # NaN included
        return None
    return float(largest[rows].sum())


def _hex(value: int) -> str:
    return f"{value & MASK64:016x}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _grouped(items: list[tuple[int, tuple]]) -> list[tuple[list[int], tuple]]:
    """(rank, evidence) pairs grouped by equal evidence, in order of first appearance: (ranks, evidence)."""
    groups: dict[tuple, list[int]] = {}
    for rank, evidence in items:
        groups.setdefault(evidence, []).append(rank)
    return [(ranks, evidence) for evidence, ranks in groups.items()]


def _same_input(reports: list[Report]) -> str | None:
    """Ranks (present, with inputs) whose input batches are bitwise identical."""
    present = [(r, report) for r, report in enumerate(reports) if report.present and report.has_input]
    groups: dict[int, list[int]] = {}
    for r, report in present:
        groups.setdefault(report.input_sum, []).append(r)
    shared = [(value, ranks) for value, ranks in groups.items() if len(ranks) > 1]
    if not shared:
        return None
    forward = present[0][1].forward
    if len(shared[0][1]) == len(present):
        who = ("every rank's input batch is" if len(present) == len(reports) else
               "the input batches of every rank still in join() are")
        return (f"at forward #{forward} {who} bitwise identical (checksum "
                f"{_hex(shared[0][0])} on {_ranks(shared[0][1])}): is a DistributedSampler missing? Give each "
                f"rank its own shard: DataLoader(dataset, sampler=DistributedSampler(dataset)), and call "
                f"sampler.set_epoch(epoch) at the start of every epoch")
    pairs = "; ".join(f"{_ranks(ranks)} share checksum {_hex(value)}" for value, ranks in shared)
    return (f"at forward #{forward} some ranks received bitwise-identical input batches ({pairs}): does every "
            f"rank pass its own rank and the world size to DistributedSampler(num_replicas=..., rank=...)?")


def _unsynced_cause(reports: list[Report], names: list[str]) -> str:
    culprits = _grouped([(r, (report.unsynced, report.unsynced_first))
                         for r, report in enumerate(reports) if report.unsynced])
    if not culprits:
        return ("no rank accumulated gradients under no_sync() since the last synchronised backward, so .grad "
                "was written or changed per rank after backward (an assignment to p.grad, a per-rank "
                "operation on it): every rank must step with the same gradients")
    words = "; ".join(f"{_ranks(ranks)} stepped with the gradients of {count} parameter(s) (first "
                      f"{names[first]!r}) accumulated under no_sync() after the last synchronised backward"
                      for ranks, (count, first) in culprits)
    return (f"{words}: those gradients were never averaged; run the last micro-batch's backward outside "
            f"no_sync() (leave the no_sync() block before the optimizer step)")


def _grads_differ(reports: list[Report], names: list[str]) -> str | None:
    """Ranks that stepped with different .grad (by checksum), or took different numbers of steps."""
    stepped = [(r, report) for r, report in enumerate(reports) if report.step_calls]
    if len(stepped) < 2:
        return None
    calls = {report.step_calls for _, report in stepped}
    step = max(report.steps for _, report in stepped)
    if len(calls) > 1:
        counts = ", ".join(f"rank {r}: {report.step_calls}" for r, report in stepped)
        return (f"since the last forward the ranks took different numbers of optimizer steps over "
                f"DataParallel's parameters ({counts}; up to step {step}): every rank must step alike")
    if len({report.step_sum for _, report in stepped}) == 1:
        return None
    sums = ", ".join(f"rank {r} {_hex(report.step_sum)}" for r, report in stepped)
    return (f"at optimizer step {step} the gradients differ across ranks (checksum of every .grad: {sums}), "
            f"but after a synchronised backward they are bitwise equal on every rank: "
            f"{_unsynced_cause(reports, names)}")


def _reduced_twice(reports: list[Report], names: list[str], world_size: int) -> str | None:
    culprits = _grouped([(r, (report.steps, report.doubled_ppm, report.doubled, report.with_grad,
                              report.doubled_first)) for r, report in enumerate(reports) if report.doubled])
    if not culprits:
        return None
    words = "; ".join(f"on {_ranks(ranks)} at optimizer step {step} .grad was {ppm / PPM:.4f}x what "
                      f"DataParallel wrote after averaging ({doubled} of the {with_grad} parameter(s) with a "
                      f"gradient, first {names[first]!r})" for ranks, (step, ppm, doubled, with_grad, first) in culprits)
    return (f"{words}, world size {world_size}: the gradients were reduced twice. DataParallel already "
            f"averages .grad in backward; your own all_reduce (sum) of p.grad on top multiplies it by the world "
            f"size: remove it")


def _loss_not_divided(reports: list[Report]) -> str | None:
    culprits = [(r, report) for r, report in enumerate(reports) if report.micro_batches]
    if not culprits:
        return None
    r, report = culprits[0]
    k = report.micro_batches
    return (f"{k} micro-batches were accumulated under no_sync() and each one's loss had scale "
            f"{report.first_scale_ppm / PPM:.4f} (the first micro-batch's; read from the cross-entropy gradient "
            f"at the model's output, where a batch-mean loss has scale 1 and one divided by {k} has "
            f"{1 / k:.4f}), so the accumulated gradient is {report.scale_sum_ppm / PPM:.3f}x the gradient of the "
            f"mean loss over the {k} micro-batches (on {_ranks([rank for rank, _ in culprits])}): divide each "
            f"micro-batch's loss by the number of accumulated micro-batches ({k})")


def decide(reports: list[Report], names: list[str], rank: int) -> tuple[str | None, tuple[str, ...], str | None]:
    """Every rank's verdict from the gathered ``reports`` (index = rank): (error message or None, the
    checks that fired, warning message or None). ``names``: DataParallel's parameter names."""
    found = [("same_input", _same_input(reports)), ("grads_differ", _grads_differ(reports, names)),
             ("reduced_twice", _reduced_twice(reports, names, len(reports))),
             ("loss_not_divided", _loss_not_divided(reports))]
    found = [(check, words) for check, words in found if words is not None]
    error = None
    if found:
        error = f"DataParallel debug check (on rank {rank}): " + "; and ".join(words for _, words in found)
    return error, tuple(check for check, _ in found), _epoch_order(reports, rank)


def _epoch_order(reports: list[Report], rank: int) -> str | None:
    culprits = [(r, report.repeat_at) for r, report in enumerate(reports) if report.repeat_at]
    if not culprits:
        return None
    start = culprits[0][1]
    return (f"DataParallel debug check (on rank {rank}): from forward #{start} on, the input batches repeat, in the "
            f"same order and bitwise, the first {ORDER_WINDOW} batches of training (forwards #1-#{ORDER_WINDOW}; "
            f"on {_ranks([r for r, _ in culprits])}): every epoch sees the same order. Is "
            f"sampler.set_epoch(epoch) missing at the start of each epoch? (DistributedSampler shuffles by epoch.) "
            f"A fixed order (shuffle=False, one fixed batch) is legitimate: silence this with "
            f"warnings.filterwarnings('ignore', category=gradsync.EpochOrderWarning)")
