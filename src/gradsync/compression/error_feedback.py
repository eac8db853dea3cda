"""Error feedback: what a compressor did not transmit is added to the next step's gradient.

With compression C, a rank transmits C(g + e) and keeps the new residual
e' = g + e - C(g + e), so that transmitted + e' == g + e exactly (up to float
rounding) and no part of any gradient is lost, only delayed (Seide et al.
2014, 1-bit SGD; Karimireddy et al. 2019, EF-SignSGD; Stich et al. 2018).

Residuals are stored per bucket region, one flat buffer each, so that
compensating a bucket is one in-place add. The state is keyed by parameter
name (:meth:`ErrorFeedback.state_dict`): when buckets are rebuilt, or a
checkpoint is loaded into a model bucketed differently, each parameter's
residual follows it into its new bucket.
"""

from __future__ import annotations

from typing import Callable

import torch

from gradsync.compression.compressor import BucketLayout

_Key = tuple[tuple[str, ...], int, int]


class ErrorFeedback:
    """Per-rank residuals for the regions ``[start, stop)`` of buckets a compressor transmits."""

    def __init__(self):
        self._regions: dict[_Key, tuple[BucketLayout, torch.Tensor]] = {}
        self._loose: dict[str, torch.Tensor] = {}  # name -> flat residual not yet in a region
        self._shapes: dict[str, torch.Size] = {}   # name -> parameter shape (state_dict's tensors)

    def residual(self, layout: BucketLayout, start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
        """The ``(stop - start,)`` residual of ``layout``'s region, created (zeros, or from
        loaded/rebuilt state) on first use; the caller updates it in place."""
        key = (layout.names, start, stop)
        entry = self._regions.get(key)
        if entry is not None:
            return entry[1]
        self._dissolve(layout, start, stop)
        buffer = torch.zeros(stop - start, dtype=like.dtype, device=like.device)
        for name, offset, numel in zip(layout.names, layout.offsets, layout.numels):
            saved = self._loose.get(name)
            if saved is None:
                continue
            if saved.numel() != numel:
                raise ValueError(f"error-feedback state for {name!r} has {saved.numel()} elements, "
                                 f"the parameter {numel}")
            lo, hi = max(offset, start), min(offset + numel, stop)
            if lo < hi:
                buffer[lo - start:hi - start] = saved[lo - offset:hi - offset]
        self._regions[key] = (layout, buffer)
        self._shapes.update(zip(layout.names, layout.shapes))
        return buffer

    def compensate(self, layout: BucketLayout, flat: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Add the residual to ``flat`` (the region starting at ``start``) in place; return the residual."""
        residual = self.residual(layout, start, start + flat.numel(), flat)
        flat.add_(residual)
        return residual

    def step(self, layout: BucketLayout, flat: torch.Tensor,
             transmit: Callable[[torch.Tensor], torch.Tensor], start: int = 0) -> torch.Tensor:
        """Compensate ``flat`` in place, keep what ``transmit(flat)`` leaves out, return the transmitted values.

        ``transmit`` maps the compensated tensor to what the receivers will
        decode (same shape). Afterwards ``transmitted + residual == gradient +
        old residual`` (up to one float rounding).
        """
        residual = self.compensate(layout, flat, start)
        transmitted = transmit(flat)
        torch.sub(flat, transmitted, out=residual)
        forget_non_finite(residual)
        return transmitted

    def _dissolve(self, layout: BucketLayout, start: int, stop: int) -> None:
        """Move every region that conflicts with ``layout``'s ``[start, stop)`` back into per-name
        residuals (a rebuild): regions of other layouts sharing a name, and overlapping regions of
        this layout. Disjoint regions of the same layout (PowerSGD's matrices) stay."""
        names = set(layout.names)

        def conflicts(key: _Key) -> bool:
            if key[0] == layout.names:
                return key[1] < stop and start < key[2]
            return bool(names.intersection(key[0]))

        for key in [key for key in self._regions if conflicts(key)]:
            region_layout, buffer = self._regions.pop(key)
            for name, piece in _pieces(region_layout, key[1], key[2], buffer, self._loose).items():
                self._loose[name] = piece

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{parameter name: residual shaped like the parameter}``; zeros where this rank keeps none."""
        merged = {name: tensor.clone() for name, tensor in self._loose.items()}
        for (names, start, stop), (layout, buffer) in self._regions.items():
            merged.update(_pieces(layout, start, stop, buffer, merged))
        return {name: tensor.view(self._shapes.get(name, tensor.shape)) for name, tensor in merged.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`'s output (sizes are checked when a bucket first uses them).

        Raises:
            ValueError: ``state`` is not a dict of floating-point tensors keyed by name.
        """
        if not isinstance(state, dict):
            raise ValueError(f"error-feedback state must be a dict of tensors keyed by parameter name, got "
                             f"{type(state).__name__}")
        for name, tensor in state.items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise ValueError(f"error-feedback state for {name!r} must be a floating-point tensor, got "
                                 f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        self._regions.clear()
        self._loose = {name: tensor.detach().reshape(-1).clone() for name, tensor in state.items()}
        self._shapes = {name: tensor.shape for name, tensor in state.items()}


def forget_non_finite(residual: torch.Tensor) -> None:
    """Zero the residual's inf/NaN entries in place.

    A step with overflowing gradients (the kind AMP's GradScaler skips) still
    yields non-finite averages, so the caller sees it; but a NaN kept in the
    residual would be added to every later gradient and never leave.
    """
    residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def _pieces(layout: BucketLayout, start: int, stop: int, buffer: torch.Tensor,
            existing: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-name flat residuals of a region, merged into copies of ``existing`` entries (zeros elsewhere)."""
    out = {}
    for name, offset, numel in zip(layout.names, layout.offsets, layout.numels):
        lo, hi = max(offset, start), min(offset + numel, stop)
        if lo >= hi:
            continue
        full = existing.get(name)
        full = torch.zeros(numel, dtype=buffer.dtype, device=buffer.device) if full is None else full.clone()
        full[lo - offset:hi - offset] = buffer[lo - start:hi - start]
        out[name] = full
    return out
