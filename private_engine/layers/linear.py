"""Rule for ``nn.Linear`` with inputs of any rank ≥ 2: (B, d), (B, T, d), (B, H, W, d), …

With a_i ∈ R^{T×d} and g_i ∈ R^{T×p} (positions flattened, calls concatenated), the per-sample
weight gradient is ``G_i = g_iᵀ a_i`` and its ghost norm ``‖G_i‖²_F = ⟨a_i a_iᵀ, g_i g_iᵀ⟩``
(seed 002, eq. 2.7); the bias gradient is ``Σ_t g_{i,t}``.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from .base import (LayerDims, LayerRule, accumulation_dtype, cast, compute_dtype, flatten_positions, gram_inner, mm_into,
                   register_rule, row_norm_sq, scale_samples, sum_into, trainable, weighted_sum_into,
                   zeros_like_batch)


class LinearRule(LayerRule):
    module_types = (nn.Linear,)

    def _views(self, module: nn.Linear, calls):
        A, G = [], []
        for a, g in calls:
            if a.shape[-1] != module.in_features or g.shape[-1] != module.out_features:
                raise ValueError(
                    f"{type(module).__name__}: recorded shapes {tuple(a.shape)} -> {tuple(g.shape)} do not match "
                    f"in_features={module.in_features}, out_features={module.out_features}; a subclass that "
                    "changes Linear's forward needs its own rule (private_engine.layers.register_rule)."
                )
            dt = compute_dtype(g)
            A.append(cast(flatten_positions(a, module.in_features), dt))
            G.append(cast(flatten_positions(g, module.out_features), dt))
        if len(calls) == 1:
            return A[0], G[0]
        return torch.cat(A, 1), torch.cat(G, 1)

    def dims(self, module, activation, output):
        T = output.numel() // (output.shape[0] * module.out_features) if output.shape[0] else 1
        return LayerDims(T=T, D=module.in_features, p=module.out_features)

    def ghost_norm_sq(self, module, calls):
        A, G = self._views(module, calls)
        bias = trainable(module, "bias")
        if trainable(module, "weight"):
            return gram_inner(A, G, bias=bias)  # weight and bias together: ⟨aaᵀ + 11ᵀ, ggᵀ⟩
        if bias:
            return row_norm_sq(G.sum(1, dtype=accumulation_dtype(G)))
        return zeros_like_batch(G)

    def per_sample_grads(self, module, calls) -> Dict[str, torch.Tensor]:
        A, G = self._views(module, calls)
        out = {}
        if trainable(module, "weight"):
            out["weight"] = torch.bmm(G.transpose(1, 2), A)
        if trainable(module, "bias"):
            out["bias"] = G.sum(1, dtype=accumulation_dtype(G))
        return out

    def weighted_grads(self, module, calls, factors, out=None) -> Dict[str, torch.Tensor]:
        """``Σ_i C_i G_i = Gᵀ·diag(C)·A`` over all positions (one matmul), bias ``Σ_i C_i Σ_t g_{i,t}``; into
        ``out`` when given (the matmul writes the engine's flat buffer directly). ``diag(C)`` scales the narrower
        of A (D wide) and G (p wide) — ``(diag(C)·G)ᵀA = Gᵀ(diag(C)·A)`` — so the scaled copy, the one temporary,
        has ``min(D, p)`` columns (an MLP's first layer: A, a quarter of G)."""
        A, G = self._views(module, calls)
        out = out or {}
        res = {}
        scaled_g = None
        if trainable(module, "weight"):
            if A.shape[-1] < G.shape[-1]:
                A = scale_samples(A, factors)
            else:
                G = scaled_g = scale_samples(G, factors)
            res["weight"] = mm_into(out.get("weight"), G.reshape(-1, G.shape[-1]).t(), A.reshape(-1, A.shape[-1]))
        if trainable(module, "bias"):
            if scaled_g is not None:
                res["bias"] = sum_into(out.get("bias"), scaled_g, (0, 1))
            else:  # per-sample bias gradients Σ_t g_{i,t}, then Σ_i C_i ·
                res["bias"] = weighted_sum_into(out.get("bias"), G.sum(1, dtype=accumulation_dtype(G)), factors)
        return res


register_rule(LinearRule())
