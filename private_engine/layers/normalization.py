"""Rules for the affine parameters of ``nn.LayerNorm`` and ``nn.GroupNorm``.

With the normalised input x̂ (recomputed from the recorded input, in ≥ float32) and output
gradient g, the per-sample gradients are ``∂L_i/∂γ = Σ_positions g ⊙ x̂`` and
``∂L_i/∂β = Σ_positions g`` (summed over calls too). These gradients are as small as one
activation row, so they are always instantiated: a ghost Gram matrix (2·T² per sample) could
only cost more (``LayerDims.ghost_capable = False``; every mode uses this exact path).
"""
from __future__ import annotations

import math
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerDims, LayerRule, accumulation_dtype, cast, register_rule, trainable


class _AffineNormRule(LayerRule):
    def _grads_one_call(self, module, a, g):
        raise NotImplementedError

    def per_sample_grads(self, module, calls) -> Dict[str, torch.Tensor]:
        out: Dict[str, torch.Tensor] = {}
        for a, g in calls:
            for name, grad in self._grads_one_call(module, a, g).items():
                out[name] = grad if name not in out else out[name] + grad
        return out

    def ghost_norm_sq(self, module, calls):
        return self.instantiated_norm_sq(module, calls)


class LayerNormRule(_AffineNormRule):
    module_types = (nn.LayerNorm,)

    def _normalized(self, module, a):
        n = len(module.normalized_shape)
        if tuple(a.shape[-n:]) != tuple(module.normalized_shape):
            raise ValueError(
                f"{type(module).__name__}: input shape {tuple(a.shape)} does not end with normalized_shape "
                f"{tuple(module.normalized_shape)}; a LayerNorm subclass that normalises other dimensions "
                "needs its own rule (private_engine.layers.register_rule)."
            )
        # x̂ = (x − mean) / √(var + eps) over the normalised dims, in one fused kernel
        return F.layer_norm(cast(a, accumulation_dtype(a)), module.normalized_shape, None, None, module.eps)

    def dims(self, module, activation, output):
        p = math.prod(module.normalized_shape)
        T = output.numel() // (output.shape[0] * p) if output.shape[0] else 1
        return LayerDims(T=T, D=1, p=p, ghost_capable=False)

    def _grads_one_call(self, module, a, g):
        B = g.shape[0]
        G = cast(g, accumulation_dtype(g)).reshape(B, -1, *module.normalized_shape)
        out = {}
        if trainable(module, "weight"):
            xhat = self._normalized(module, a).reshape(B, -1, *module.normalized_shape)
            out["weight"] = (G * xhat).sum(1)
        if trainable(module, "bias"):
            out["bias"] = G.sum(1)
        return out


class GroupNormRule(_AffineNormRule):
    module_types = (nn.GroupNorm,)

    def _normalized(self, module, a):
        B, C = a.shape[:2]
        if C != module.num_channels:
            raise ValueError(
                f"{type(module).__name__}: input has {C} channels, expected {module.num_channels} "
                "(batch-first (B, C, *) layout)."
            )
        # x̂ = (x − mean_group) / √(var_group + eps), in one fused kernel
        return F.group_norm(cast(a, accumulation_dtype(a)), module.num_groups, None, None, module.eps).reshape(B, C, -1)

    def dims(self, module, activation, output):
        T = math.prod(output.shape[2:])
        return LayerDims(T=T, D=1, p=module.num_channels, ghost_capable=False)

    def _grads_one_call(self, module, a, g):
        B, C = g.shape[:2]
        G = cast(g, accumulation_dtype(g)).reshape(B, C, -1)
        out = {}
        if trainable(module, "weight"):
            out["weight"] = (G * self._normalized(module, a)).sum(2)
        if trainable(module, "bias"):
            out["bias"] = G.sum(2)
        return out


register_rule(LayerNormRule())
register_rule(GroupNormRule())
