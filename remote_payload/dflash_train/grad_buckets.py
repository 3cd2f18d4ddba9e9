"""The workers' flat gradient buffers: one per dtype, which backward accumulates into and the
gradient reduction averages in place (workers.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class GradBuckets:
    """One flat gradient buffer per dtype, so a step reduces with one collective per dtype.

    `attach()` makes every param's `.grad` a view into persistent flat buffers: backward then
    accumulates straight into them (no packing copy per step), the reduction works in place, and
    the optimizer reads the result through the same views.
    """

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        self.groups: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(self.params):
            self.groups.setdefault(p.dtype, []).append(i)
        self.flats: list[torch.Tensor] = []

    def attach(self) -> list[torch.Tensor]:
        """Allocate zeroed flat buffers and point every param's .grad at its slice; returns them."""
        self.flats = []
        for dtype, idx in self.groups.items():
            device = self.params[idx[0]].device
            flat = torch.zeros(sum(self.params[i].numel() for i in idx), dtype=dtype, device=device)
            self.flats.append(flat)
            offset = 0
            for i in idx:
                p = self.params[i]
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        return self.flats

    def attached(self) -> bool:
        """True while every param's .grad still aliases the flat buffers (nothing replaced them)."""
        return bool(self.flats) and all(
            p.grad is not None and p.grad.untyped_storage().data_ptr() == self._flat_of(i).untyped_storage().data_ptr()
            for i, p in enumerate(self.params)
        )

    def zero(self) -> None:
        """Zero the attached buffers (one kernel per dtype), or, with none attached, drop the gradients."""
        for flat in self.flats:
            flat.zero_()
        if not self.flats:
            for p in self.params:
                p.grad = None

    def _flat_of(self, i: int) -> torch.Tensor:
        for flat, idx in zip(self.flats, self.groups.values()):
            if i in idx:
                return flat
        raise KeyError(i)
