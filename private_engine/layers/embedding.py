"""Rule for ``nn.Embedding`` (``padding_idx`` respected).

For token ids x_i ∈ {0..V-1}^T and output gradient g_i ∈ R^{T×p}, the per-sample gradient is
``G_i = Σ_t e_{x_{i,t}} g_{i,t}ᵀ`` (V×p), with rows at ``padding_idx`` zero. Its ghost norm is
``‖G_i‖² = Σ_{t,s} 1[x_{i,t} = x_{i,s}] ⟨g_{i,t}, g_{i,s}⟩`` (Li et al. 2022; Bu, Mao & Xu
2022, "Scalable and Efficient Training of Large Convolutional Neural Networks with Differential
Privacy", §1), i.e. ``⟨a_i a_iᵀ, g_i g_iᵀ⟩`` with one-hot rows ``a_{i,t} = e_{x_{i,t}}``;
``D = V``.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from ..foundation.dtypes import accumulation_dtype, cast
from ..foundation.matmul import put_into, scale_samples
from .base import LayerDims, LayerRule, row_norm_sq, trainable, zeros_like_batch
from .gram import certified_token_ghost_sq
from .registry import register_rule
from .rounding import (
    ETA64,
    certified_ghost,
    certified_instantiated,
    gamma,
    ghost_underflow,
    gram_coefficient,
    instantiation_coefficient,
    release_coefficient,
    row_norms64,
    unit_roundoff,
)


class EmbeddingRule(LayerRule):
    module_types = (nn.Embedding,)
    param_names = ("weight",)

    def check(self, module):
        if module.sparse:
            raise ValueError(
                "nn.Embedding(sparse=True) produces sparse gradients that DP noise would densify; "
                "build it with sparse=False."
            )
        if module.max_norm is not None:
            raise ValueError(
                "nn.Embedding(max_norm=...) renormalises the rows its batch looks up, in place, "
                "during the forward: the weights then move with the data, without clipping or "
                "noise. Build it with max_norm=None (renormalise, if needed, outside training)."
            )
        if module.scale_grad_by_freq:
            raise ValueError(
                "nn.Embedding(scale_grad_by_freq=True) scales gradients by token counts of the "
                "whole batch, which couples samples and breaks per-sample clipping; build it with "
                "scale_grad_by_freq=False."
            )

    def _views(self, module, calls):
        ids_all, G_all = [], []
        for ids, g in calls:
            B = ids.shape[0]
            ids = ids.reshape(B, -1)
            G = cast(g, accumulation_dtype(g)).reshape(B, ids.shape[1], module.embedding_dim)
            if module.padding_idx is not None:
                G = G * (ids != module.padding_idx).unsqueeze(-1).to(G.dtype)
            ids_all.append(ids)
            G_all.append(G)
        if len(calls) == 1:
            return ids_all[0], G_all[0]
        return torch.cat(ids_all, 1), torch.cat(G_all, 1)

    def dims(self, module, activation, output):
        B = activation.shape[0]
        T = activation.numel() // B if B else 1
        return LayerDims(T=T, D=module.num_embeddings, p=module.embedding_dim, gram_D=1)

    def ghost_norm_sq(self, module, calls):
        """``Σ_{t,s} 1[x_t = x_s]·⟨g_t, g_s⟩`` in float64 (terms of both signs: a repeated token
        whose positions get opposite gradients cancels; float64 keeps the rounding small against
        ``M² = (Σ_t ‖g_t‖)²``)."""
        if not trainable(module, "weight"):
            return zeros_like_batch(calls[0][1])
        return _ghost(*self._views(module, calls))

    def certified_norm_sq(self, module, calls, use_ghost, grads=None):
        """Certified ``‖release_i‖²`` bound at C_i = 1 (:mod:`private_engine.layers.rounding`): the
        release adds ``C_i g_t`` at row ``x_t`` over the batch's ``B·T`` positions
        (:meth:`weighted_grads`), so with ``M_i = Σ_t ‖g_t‖`` (one-hot inputs have norm 1; padding
        positions 0) the bound is ``(√ν⁺ + c_r M)²`` (ghost; ``ν⁺`` from a float32 Gram and its
        rounding, :func:`private_engine.layers.gram.certified_token_ghost_sq`, or ``ν̃ + c_ν M²``
        from a float64 one) or ``(‖G̃‖ + (c_inst + c_r) M)²`` (scatter-added ``G̃``)."""
        if not trainable(module, "weight"):
            return zeros_like_batch(calls[0][1])
        ids, G = self._views(module, calls)
        B, T = ids.shape
        slack = 1 + gamma(T + G.shape[2] + 4, unit_roundoff(torch.float64))  # float64 sums
        mass = row_norms64(G).sum(1) * slack
        c_rel = release_coefficient(G.dtype, G.device, B * T)
        if use_ghost:
            fast = certified_token_ghost_sq(ids, G, row_norms64(G))
            if fast is not None:  # a float32 Gram, its rounding bounded per sample
                return certified_ghost(fast, mass, 0.0, c_rel)
            c_nu = gram_coefficient(1, G.shape[2], T, unit_roundoff(torch.float64))
            lost = (ghost_underflow(torch.full_like(mass, float(T)), mass, 1, G.shape[2], T,
                                    ETA64) if G.dtype == torch.float64 else None)
            return certified_ghost(_ghost(ids, G), mass, c_nu, c_rel, lost)
        grads = self.per_sample_grads(module, calls) if grads is None else grads
        c_inst = instantiation_coefficient(G.dtype, G.device, T)
        norm_sq = row_norm_sq(grads["weight"])
        return certified_instantiated(norm_sq, mass, c_inst, c_rel, module.weight.numel())

    def per_sample_grads(self, module, calls) -> Dict[str, torch.Tensor]:
        if not trainable(module, "weight"):
            return {}
        ids, G = self._views(module, calls)
        B, T = ids.shape
        out = torch.zeros(B, module.num_embeddings, module.embedding_dim, dtype=G.dtype,
                          device=G.device)
        out.scatter_add_(1, ids.unsqueeze(-1).expand(B, T, module.embedding_dim), G)
        return {"weight": out}

    def weighted_grads(self, module, calls, factors, out=None) -> Dict[str, torch.Tensor]:
        """``Σ_i C_i G_i``: rows ``C_i g_{i,t}`` added at token ids ``x_{i,t}`` (one index_add, no
        per-sample V×p gradient), into ``out["weight"]`` when given and of the accumulation
        dtype."""
        if not trainable(module, "weight"):
            return {}
        ids, G = self._views(module, calls)
        GC = scale_samples(G, factors)
        target = (out or {}).get("weight")
        into = target if target is not None and target.dtype == G.dtype else \
            torch.empty(module.num_embeddings, module.embedding_dim, dtype=G.dtype, device=G.device)
        into.zero_().index_add_(0, ids.reshape(-1), GC.reshape(-1, module.embedding_dim))
        return {"weight": into if into is target else put_into(target, into)}


def _ghost(ids: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``Σ_{t,s} 1[x_t = x_s]·⟨g_t, g_s⟩`` per sample in float64, summed over s and then over t (two
    T-term reductions, as :func:`private_engine.layers.rounding.gram_coefficient` assumes)."""
    G = G.double()
    same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(G.dtype)
    return torch.bmm(G, G.transpose(1, 2)).mul_(same).sum(2).sum(1)


register_rule(EmbeddingRule())
