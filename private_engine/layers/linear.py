"""Rules for ``nn.Linear`` with inputs of any rank ≥ 2: (B, d), (B, T, d), (B, H, W, d), …, and
for the transposed-weight ``Conv1D`` of Hugging Face transformers (GPT-2, GPT: ``y = x·W + b``
with ``W`` of shape ``(d, p)``, one ``addmm``).

With a_i ∈ R^{T×d} and g_i ∈ R^{T×p} (positions flattened, calls concatenated), the per-sample
weight gradient is ``G_i = g_iᵀ a_i`` and its ghost norm ``‖G_i‖²_F = ⟨a_i a_iᵀ, g_i g_iᵀ⟩``
(Bu, Mao & Xu 2022, "Scalable and Efficient Training of Large Convolutional Neural Networks with
Differential Privacy", eq. 2.7); the bias gradient is ``Σ_t g_{i,t}``. ``Conv1D``'s weight
gradient is the transpose ``a_iᵀ g_i``: the same norms, the same rounding, the same certificate.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import nn

from ..foundation.dtypes import accumulation_dtype, cast, compute_dtype, release_dtype
from ..foundation.matmul import mm_into, scale_samples, sum_into, weighted_sum_into
from .base import (
    LayerDims,
    LayerRule,
    certified_kept,
    flatten_positions,
    gram_inner,
    gram_unit,
    row_norm_sq,
    trainable,
    zeros_like_batch,
)
from .gram import certified_ghost_sq
from .registry import register_named_rule, register_rule
from .rounding import (
    certified_ghost,
    certified_instantiated,
    ghost_may_underflow,
    ghost_underflow,
    gram_coefficient,
    gram_eta,
    instantiation_coefficient,
    mass_of,
    pair_norms,
    release_coefficient,
)

#: the last clip factors repeated per position, per number of positions T:
#: ``{T: (factors, factors._version, C ⊗ 1_T)}`` (the factors are the same for every layer of a
#: step: one repetition per step and T)
_ROW_FACTORS: Dict[int, Tuple[torch.Tensor, int, torch.Tensor]] = {}


def row_factors(factors: torch.Tensor, T: int) -> torch.Tensor:
    """``C ⊗ 1_T``: each sample's factor repeated for its ``T`` rows, ``(B,) -> (B·T,)``, formed
    once per factors tensor and T."""
    hit = _ROW_FACTORS.get(T)
    if hit is not None and hit[0] is factors and hit[1] == factors._version:
        return hit[2]
    rows = factors.repeat_interleave(T)
    if len(_ROW_FACTORS) > 8:
        _ROW_FACTORS.clear()
    _ROW_FACTORS[T] = (factors, factors._version, rows)
    return rows


class LinearRule(LayerRule):
    module_types = (nn.Linear,)
    #: the weight is stored ``(in, out)`` (Conv1D) rather than ``(out, in)``
    transposed = False

    def features(self, module: nn.Module):
        """``(in_features, out_features)`` of the module."""
        return module.in_features, module.out_features

    def _views(self, module: nn.Linear, calls, dtype=None):
        A, G = [], []
        d_in, d_out = self.features(module)
        for a, g in calls:
            if a.shape[-1] != d_in or g.shape[-1] != d_out:
                raise ValueError(
                    f"{type(module).__name__}: recorded shapes {tuple(a.shape)} -> "
                    f"{tuple(g.shape)} do not match in_features={d_in}, "
                    f"out_features={d_out}; a subclass that changes Linear's forward "
                    "needs its own rule (private_engine.layers.register_rule)."
                )
            dt = compute_dtype(g) if dtype is None else dtype
            A.append(cast(flatten_positions(a, d_in), dt))
            G.append(cast(flatten_positions(g, d_out), dt))
        if len(calls) == 1:
            return A[0], G[0]
        return torch.cat(A, 1), torch.cat(G, 1)

    def dims(self, module, activation, output):
        d_in, d_out = self.features(module)
        T = output.numel() // (output.shape[0] * d_out) if output.shape[0] else 1
        return LayerDims(T=T, D=d_in, p=d_out)

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
            out["weight"] = (torch.bmm(A.transpose(1, 2), G) if self.transposed
                             else torch.bmm(G.transpose(1, 2), A))
        if trainable(module, "bias"):
            out["bias"] = G.sum(1, dtype=accumulation_dtype(G))
        return out

    def certified_norm_sq(self, module, calls, use_ghost, grads=None):
        """Certified ``‖release_i‖²`` bound at C_i = 1 (:mod:`private_engine.layers.rounding`).

        Weight trained: the release is ``Gᵀ·diag(C)·A`` over the batch's ``B·T`` rows
        (:meth:`weighted_grads`), so the bound is ``(√ν⁺ + c_r M)²`` from an upper bound ``ν⁺`` of
        the ghost norm (float32 Grams and their rounding bounded per sample,
        :func:`private_engine.layers.gram.certified_ghost_sq`; float64 Grams, ``ν⁺ = ν̃ + c_ν M²``,
        for float64 operands and where the fast bound is loose), or ``(‖G̃‖ + (c_inst + c_r) M)²``
        from an instantiated ``G̃``, with
        ``M = Σ_t ‖(a_t, 1)‖·‖g_t‖``. Bias alone: the release is ``Σ_i C_i b̃_i`` of the per-sample
        sums ``b̃_i = Σ_t g_t`` themselves."""
        weight, bias = trainable(module, "weight"), trainable(module, "bias")
        if not weight:
            if not bias:
                return zeros_like_batch(calls[0][1])
            _, G = self._views(module, calls)
            return certified_kept([G.sum(1, dtype=accumulation_dtype(G))], G)
        A, G = self._views(module, calls)
        B, T = A.shape[0], A.shape[1]
        na, ng = pair_norms(A, G, bias)
        mass = mass_of(na, ng, A.shape[-1])
        c_rel = release_coefficient(release_dtype(G), G.device, B * T)
        if use_ghost:
            fast = certified_ghost_sq(A, G, bias, na, ng, c_rel)
            if fast is not None:  # float32 Grams, their rounding bounded per sample
                return certified_ghost(fast, mass, 0.0, c_rel)
            unit = gram_unit(A)
            c_nu = gram_coefficient(A.shape[2] + bias, G.shape[2], T, unit)
            lost = (ghost_underflow(na.sum(1), ng.sum(1), A.shape[2] + bias, G.shape[2], T,
                                    gram_eta(unit)) if ghost_may_underflow(A, unit) else None)
            return certified_ghost(gram_inner(A, G, bias=bias), mass, c_nu, c_rel, lost)
        grads = self.per_sample_grads(module, calls) if grads is None else grads
        norm_sq = sum(row_norm_sq(g) for g in grads.values())
        c_inst = instantiation_coefficient(G.dtype, G.device, T)
        d_in, d_out = self.features(module)
        terms = d_out * (d_in + 1)
        return certified_instantiated(norm_sq, mass, c_inst, c_rel, terms)

    def defer_ghost_norm_sq(self, module, calls, stack) -> bool:
        """Hand the ghost-norm bound of :meth:`certified_norm_sq` (``use_ghost``) to ``stack``
        (:class:`private_engine.layers.ghost_stack.GhostBoundStack`), which forms it with those of
        the other layers at the end of the norm pass, by the same formulas. False (nothing handed
        over; the caller forms the bound now) for a rule that overrides the certificate, a
        layer whose weight is frozen, several calls or operands that a cast would copy (the
        stack holds views of kept tensors only), and operands with no fast Gram path."""
        if type(self).certified_norm_sq is not LinearRule.certified_norm_sq or \
                not trainable(module, "weight") or len(calls) != 1:
            return False
        a, g = calls[0]
        if not (a.dtype == g.dtype == compute_dtype(g)):
            return False
        A, G = self._views(module, calls)
        c_rel = release_coefficient(release_dtype(G), G.device, A.shape[0] * A.shape[1])
        return stack.add(A, G, trainable(module, "bias"), c_rel)

    def weighted_grads(self, module, calls, factors, out=None) -> Dict[str, torch.Tensor]:
        """``Σ_i C_i G_i = Gᵀ·diag(C)·A`` over all positions (one matmul), bias
        ``Σ_i C_i Σ_t g_{i,t}``; into ``out`` when given (the matmul writes the engine's flat buffer
        directly). ``diag(C)`` scales the narrower of A (D wide) and G (p wide) —
        ``(diag(C)·G)ᵀA = Gᵀ(diag(C)·A)`` — so the scaled copy, the one temporary, has ``min(D, p)``
        columns (an MLP's first layer: A, a quarter of G). Operands in
        :func:`~private_engine.foundation.dtypes.release_dtype`."""
        A, G = self._views(module, calls, release_dtype(calls[0][1]) if calls else None)
        out = out or {}
        res = {}
        scaled_g = None
        if trainable(module, "weight"):
            if A.shape[-1] < G.shape[-1]:
                A = scale_samples(A, factors)
            else:
                G = scaled_g = scale_samples(G, factors)
            A2, G2 = A.reshape(-1, A.shape[-1]), G.reshape(-1, G.shape[-1])
            res["weight"] = (mm_into(out.get("weight"), A2.t(), G2) if self.transposed
                             else mm_into(out.get("weight"), G2.t(), A2))
        if trainable(module, "bias"):
            if scaled_g is not None:
                res["bias"] = sum_into(out.get("bias"), scaled_g, (0, 1))
            else:  # Σ_{i,t} C_i g_{i,t}: one product of the B·T rows with C ⊗ 1_T
                res["bias"] = weighted_sum_into(out.get("bias"), G.reshape(-1, G.shape[-1]),
                                                row_factors(factors, G.shape[1]))
        return res



class TransposedLinearRule(LinearRule):
    """Hugging Face transformers' ``Conv1D`` (GPT-2, GPT): ``y = addmm(b, x, W)``, ``W: (d, p)``.
    Per-sample weight gradient ``a_iᵀ g_i`` (d×p), clipped sum ``Aᵀ·diag(C)·G``; norms and
    certificate as :class:`LinearRule`'s (a transpose changes neither)."""

    module_types = ()
    transposed = True

    def features(self, module: nn.Module):
        """``(nx, nf)``: Conv1D's input and output widths (its weight is ``(nx, nf)``)."""
        return module.weight.shape[0], module.weight.shape[1]


register_rule(LinearRule())
register_named_rule(TransposedLinearRule(), "transformers.pytorch_utils.Conv1D")
