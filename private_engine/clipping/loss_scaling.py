"""Mixed precision: float16 loss scaling with a ``torch.amp.GradScaler`` for the book-keeping modes.

Under ``torch.autocast(dtype=torch.float16)`` small output gradients underflow; a GradScaler
multiplies the loss by S before the backward. The engine then sees ``S·g`` at every layer, so
per-sample norms and clipped sums are divided by S (in float32)::

    ‖g_i‖ = ‖S·g_i‖ / S,       Σ_i C_i g_i = Σ_i (C_i / S)·(S·g_i).

A sample whose scaled norm (or loss) is not finite overflowed in float16: it gets ``C_i = 0`` and
its rows are zeroed before the clipped sum. That is a per-sample decision, so the sensitivity stays
R (unlike skipping the whole batch, which one overflowing sample could trigger). By default the
scale stays fixed at the scaler's initial scale: a dynamic schedule (× backoff after a batch with an
overflow, × growth after ``growth_interval`` clean batches) would make the scale — public state,
saved with the scaler and read by every later step — a function of whether some private sample
overflowed, released without noise. Since overflowing samples are dropped one by one, a fixed scale
is safe when it is chosen from public information so that honest samples neither overflow nor
underflow. ``dynamic=True`` follows GradScaler's schedule instead (read from the scaler's public
getters, written back with ``scaler.update(new_scale)``), accepting that leak. bfloat16 needs no
scaler.

**The default scale.** GradScaler's default initial scale, 2¹⁶, is tuned for a loss averaged over
a batch, whose output gradients carry a factor 1/B. The engine backpropagates the per-sample
losses ``Σ_i L_i``: each sample's output gradient is of order one (cross-entropy:
``|softmax(z) − y| ≤ 1``), and 2¹⁶ times one already exceeds float16's largest value, 65504, so
nearly every honest sample would overflow and be dropped. A scaler left at torch's default
initial scale (2¹⁶, never used) therefore starts at :data:`DEFAULT_PER_SAMPLE_SCALE` = 2¹⁰
instead: a unit output gradient keeps six binades of headroom against overflow through the
backward, and gradients down to 2⁻³⁴ stay representable (float16's smallest subnormal is 2⁻²⁴).
A public constant, independent of the data. Any other ``init_scale`` is used as given.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch

log = logging.getLogger(__name__)
#: torch's default ``GradScaler(init_scale=...)``
TORCH_DEFAULT_SCALE = 2.0 ** 16
#: the fixed scale the engine starts a scaler at when it was left at torch's default (module
#: docstring, "The default scale")
DEFAULT_PER_SAMPLE_SCALE = 2.0 ** 10


class LossScaling:
    """The engine's view of a ``torch.amp.GradScaler`` (None or disabled: no scaling)."""

    def __init__(self, scaler: Optional["torch.amp.GradScaler"], dynamic: bool = False):
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                f"grad_scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}. "
                "Build it with "
                "torch.amp.GradScaler('cuda') (or 'cpu')."
            )
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        #: True when the scaler was at torch's default initial scale and starts at
        #: :data:`DEFAULT_PER_SAMPLE_SCALE` instead
        self.default_replaced = False
        if self.scaler is not None and _at_torch_default(self.scaler):
            self.scaler._init_scale = DEFAULT_PER_SAMPLE_SCALE
            self.default_replaced = True
        #: follow GradScaler's data-dependent schedule (False: the scale stays fixed)
        self.dynamic = bool(dynamic)
        self._good_batches = 0
        #: physical batches in which at least one sample overflowed, and samples dropped (C_i = 0)
        #: in total
        self.overflow_batches = 0
        self.dropped_samples = 0

    @property
    def enabled(self) -> bool:
        return self.scaler is not None

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """What a checkpoint keeps: ``{"scaler": GradScaler.state_dict()}`` when the scale is fixed
        (the scale chosen when the scaler was built: public); None without loss scaling or with
        ``dynamic`` (its scale moved with which private samples overflowed). The overflow counters
        are not included: they are functions of the data."""
        if self.scaler is None or self.dynamic:
            return None
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore :meth:`state_dict`: the fixed scale. None (or scaling disabled here) leaves the
        scaler as it was built; the counters keep their values."""
        if state is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def overflow_advice(self) -> str:
        """What to do when samples overflow under this scaling (for warnings)."""
        if self.scaler is None:
            return ("float16 autocast: pass grad_scaler=torch.amp.GradScaler(device) to the "
                    "engine (or train in bfloat16).")
        scale = self.scaler.get_scale()
        return (f"float16: the fixed loss scale S = {scale:g} overflows the scaled per-sample "
                f"gradients; build the GradScaler with a lower init_scale, e.g. "
                f"torch.amp.GradScaler(device, init_scale={max(scale / 64, 1.0):g}) (each sample's "
                "loss is backpropagated unaveraged, so it needs a smaller scale than a batch "
                "mean), or train in bfloat16.")

    def scale(self, loss: torch.Tensor):
        """``(S·loss, S)`` with S the scaler's current scale as a 0-dim float32 tensor (no host
        sync)."""
        if self.scaler is None:
            raise RuntimeError("internal error: scale() called without loss scaling.")
        one = torch.ones((), dtype=torch.float32, device=loss.device)
        self._scale = self.scaler.scale(one)
        return loss * self._scale.to(loss.dtype), self._scale

    def update(self, dropped: int) -> None:
        """Count one physical batch in which ``dropped`` samples overflowed; with ``dynamic``, move
        the scale by GradScaler's schedule (the new scale is computed on the scale's device: no host
        sync)."""
        sc = self.scaler
        factor = 1.0
        if dropped:
            self.overflow_batches += 1
            self.dropped_samples += dropped
        if not self.dynamic:
            return
        if sc is None:
            raise RuntimeError("internal error: update() called without loss scaling.")
        if dropped:
            self._good_batches = 0
            factor = sc.get_backoff_factor()
        else:
            self._good_batches += 1
            if self._good_batches >= sc.get_growth_interval():
                self._good_batches = 0
                factor = sc.get_growth_factor()
        if factor != 1.0:
            log.debug("dynamic loss scale × %g (%s)", factor,
                      "overflow" if dropped else "growth interval reached")
        sc.update(self._scale * factor)


def _at_torch_default(scaler: "torch.amp.GradScaler") -> bool:
    """The scaler is at torch's default initial scale and has not scaled anything yet."""
    return (getattr(scaler, "_scale", None) is None
            and getattr(scaler, "_init_scale", None) == TORCH_DEFAULT_SCALE)
