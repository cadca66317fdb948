"""Rule for the slope of ``nn.PReLU`` (He, Zhang, Ren & Sun 2015, "Delving Deep into
Rectifiers").

``y = max(0, x) + w_c·min(0, x)`` with one slope per channel (dim 1 of the input) or one shared
slope, so with the output gradient g the per-sample gradient is

    ∂L_i/∂w_c = Σ_{positions of channel c} g ⊙ min(0, x)      (summed over all channels for one w).

It is as small as the slope vector, so it is always instantiated (``LayerDims.ghost_capable =
False``); the clipped sum is ``Σ_i C_i ∂L_i/∂w`` of these very gradients.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from ..foundation.dtypes import accumulation_dtype, cast
from .base import LayerDims, LayerRule, trainable
from .registry import register_rule


class PReLURule(LayerRule):
    """``nn.PReLU``: per-sample ``∂L_i/∂w_c = Σ_pos g ⊙ min(0, x)`` over channel c (dim 1), or over
    the whole sample for one shared slope."""

    module_types = (nn.PReLU,)
    param_names = ("weight",)

    def _channels(self, module, a: torch.Tensor) -> int:
        n = module.num_parameters
        if a.dim() < 1 or (n > 1 and (a.dim() < 2 or a.shape[1] != n)):
            raise ValueError(
                f"{type(module).__name__}(num_parameters={n}) expects a batched input (B, C, *) "
                f"with C = {n}; got shape {tuple(a.shape)}. Unbatched inputs cannot be clipped "
                "per sample: add a batch dimension.")
        return n

    def dims(self, module, activation, output):
        n = module.num_parameters
        T = output.numel() // (output.shape[0] * n) if output.shape[0] else 1
        return LayerDims(T=T, D=1, p=n, ghost_capable=False)

    def per_sample_grads(self, module, calls) -> Dict[str, torch.Tensor]:
        """``{weight: (B, n)}``: ``Σ_pos g ⊙ min(0, x)`` per channel (n > 1) or over everything
        (n = 1), in ≥ float32, summed over calls."""
        if not trainable(module, "weight"):
            return {}
        total = None
        for a, g in calls:
            n = self._channels(module, a)
            B = g.shape[0]
            dt = accumulation_dtype(g)
            prod = cast(g, dt) * cast(a, dt).clamp(max=0)
            grad = prod.reshape(B, n, -1).sum(2) if n > 1 else prod.reshape(B, -1).sum(1, True)
            total = grad if total is None else total + grad
        return {"weight": total}

    def ghost_norm_sq(self, module, calls):
        return self.instantiated_norm_sq(module, calls)


register_rule(PReLURule())
