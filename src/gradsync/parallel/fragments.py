"""Streaming DiLoCo's fragments: which parameters travel together, and at which inner step of each round.

Douillard et al. 2025 ("Streaming DiLoCo with overlapping communication")
cut the model into F fragments and synchronise them one at a time, each
fragment once every H inner steps, the fragments staggered evenly over the
round so that only 1/F of the model is on the wire at any moment. Here a
fragment is a run of consecutive parameters (in ``named_parameters`` order)
of about ``total / F`` elements, and fragment f is sent after inner step
``(f + 1) * H / F`` of each H-step round (as torchft's ``DiLoCo``), so the
last fragment leaves at the round's end, where plain DiLoCo syncs everything.

>>> plan_fragments([10, 10, 10, 10], 2)
[(0, 2), (2, 4)]
>>> plan_fragments([100, 1, 1, 1], 3)
[(0, 1), (1, 2), (2, 4)]
>>> launch_offsets(sync_every=8, fragments=4)
[2, 4, 6, 8]
"""

from __future__ import annotations

from collections.abc import Sequence

from gradsync.parallel.option_names import KEYWORDS, Spelling


def check_fragments(fragments: int, sync_every: int, num_parameters: int, *, spelling: Spelling = KEYWORDS) -> None:
    """ValueError (one line naming the option as ``spelling`` does: keyword arguments, or the CLI's flags)
    unless ``fragments`` can cut ``num_parameters`` tensors and divides ``sync_every``."""
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"{spelling.name('outer_fragments')} must be an int >= 1, got {fragments!r}")
    if fragments > num_parameters:
        raise ValueError(f"{spelling.setting('outer_fragments', fragments)} is more than the model's {num_parameters} "
                         f"parameter tensors (a fragment is a run of whole tensors)")
    if sync_every % fragments:
        raise ValueError(f"{spelling.setting('outer_fragments', fragments)} must divide "
                         f"{spelling.setting('sync_every', sync_every)} (each fragment is sent every "
                         f"{spelling.name('sync_every')} steps, the fragments evenly staggered)")


def plan_fragments(numels: Sequence[int], fragments: int) -> list[tuple[int, int]]:
    """Cut tensors of ``numels`` elements (in order) into ``fragments`` runs of about equal element counts.

    Returns:
        ``fragments`` half-open ``(start, stop)`` bounds in tensor indices, covering ``[0, len(numels))``
        in order, none empty: fragment k closes at the first tensor that reaches ``(k + 1) / fragments`` of
        all elements, or earlier when the later fragments need the tensors left.

    Raises:
        ValueError: ``fragments`` is not in ``[1, len(numels)]``.
    """
    if not 1 <= fragments <= len(numels):
        raise ValueError(f"{fragments} fragments of {len(numels)} tensors: need 1 <= fragments <= tensors")
    total, bounds, start, seen = sum(numels), [], 0, 0
    for index, numel in enumerate(numels):
        seen += numel
        k = len(bounds)
        left_after = len(numels) - index - 1  # tensors still to place once this one is in
        if k < fragments - 1 and (seen * fragments >= (k + 1) * total or left_after == fragments - 1 - k):
            bounds.append((start, index + 1))
            start = index + 1
    bounds.append((start, len(numels)))
    return bounds


def launch_offsets(sync_every: int, fragments: int) -> list[int]:
    """The inner step, in ``1..sync_every``, of each round after which fragment f is sent: ``(f + 1) * H / F``."""
    return [(f + 1) * sync_every // fragments for f in range(fragments)]
