"""Mixed precision: float16 loss scaling with a ``torch.amp.GradScaler`` for the book-keeping modes.

Under ``torch.autocast(dtype=torch.float16)`` small output gradients underflow; a GradScaler multiplies
the loss by S before the backward. The engine then sees ``S·g`` at every layer, so per-sample norms and
clipped sums are divided by S (in float32)::

    ‖g_i‖ = ‖S·g_i‖ / S,       Σ_i C_i g_i = Σ_i (C_i / S)·(S·g_i).

A sample whose scaled norm (or loss) is not finite overflowed in float16: it gets ``C_i = 0`` and its rows
are zeroed before the clipped sum. That is a per-sample decision, so the sensitivity stays R (unlike
skipping the whole batch, which one overflowing sample could trigger). The scale then follows
GradScaler's schedule — ``× backoff_factor`` after a batch with an overflow, ``× growth_factor`` after
``growth_interval`` batches without — read from the scaler's public getters and written back with
``scaler.update(new_scale)``. That schedule depends on the data, as in all dynamic loss scaling; a scaler
with ``growth_factor=1, backoff_factor=1`` (a fixed scale) leaves nothing data-dependent but the
per-sample drops. bfloat16 needs no scaler.
"""
from __future__ import annotations

from typing import Optional

import torch


class LossScaling:
    """The engine's view of a ``torch.amp.GradScaler`` (None or disabled: no scaling)."""

    def __init__(self, scaler: Optional["torch.amp.GradScaler"]):
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                f"grad_scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}. Build it with "
                "torch.amp.GradScaler('cuda') (or 'cpu')."
            )
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._good_batches = 0
        #: physical batches in which at least one sample overflowed, and samples dropped (C_i = 0) in total
        self.overflow_batches = 0
        self.dropped_samples = 0

    @property
    def enabled(self) -> bool:
        return self.scaler is not None

    def scale(self, loss: torch.Tensor):
        """``(S·loss, S)`` with S the scaler's current scale as a 0-dim float32 tensor (no host sync)."""
        one = torch.ones((), dtype=torch.float32, device=loss.device)
        self._scale = self.scaler.scale(one)
        return loss * self._scale.to(loss.dtype), self._scale

    def update(self, dropped: int) -> None:
        """GradScaler's schedule after one physical batch in which ``dropped`` samples overflowed (the new scale
        is computed on the scale's device: no host sync)."""
        sc = self.scaler
        factor = 1.0
        if dropped:
            self.overflow_batches += 1
            self.dropped_samples += dropped
            self._good_batches = 0
            factor = sc.get_backoff_factor()
        else:
            self._good_batches += 1
            if self._good_batches >= sc.get_growth_interval():
                self._good_batches = 0
                factor = sc.get_growth_factor()
        sc.update(self._scale * factor)
