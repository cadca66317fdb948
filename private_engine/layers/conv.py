"""Rule for ``nn.Conv1d/2d/3d``: stride, padding (ints, "same", "valid", every padding mode),
dilation, groups and bias.

The input is padded exactly as the layer pads it and unfolded (im2col, operator U of Bu, Mao & Xu
2022, "Scalable and Efficient Training of Large Convolutional Neural Networks with Differential
Privacy") into ``U(a_i) ∈ R^{T×groups×D}`` with ``T = Π S_out`` and ``D = (C_in/groups)·Π k``.
For each group γ the layer is linear: ``G_i^γ = g_i^γᵀ U(a_i)^γ`` (p/groups × D), so

* ghost norm: ``‖G_i‖² = Σ_γ ⟨U(a_i)^γ U(a_i)^γᵀ, g_i^γ g_i^γᵀ⟩`` (Bu, Mao & Xu 2022, eq. 2.7,
  per group),
* instantiation: ``Σ_γ ‖g_i^γᵀ U(a_i)^γ‖²_F``,
* bias: ``‖Σ_t g_{i,t}‖²``.
"""
from __future__ import annotations

import math
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from .base import (LayerDims, LayerRule, accumulation_dtype, cast, certified_kept, compute_dtype,
                   gram_inner, gram_unit, put_into, row_norm_sq, scale_samples, trainable,
                   weighted_sum_into, zeros_like_batch)
from .gram import certified_ghost_sq
from .registry import register_rule
from .rounding import (ETA64, certified_ghost, certified_instantiated, gamma,
                       ghost_may_underflow, ghost_underflow, gram_coefficient, gram_eta,
                       instantiation_coefficient, release_coefficient, row_norms64, unit_roundoff)


def unfold_conv_input(module: nn.modules.conv._ConvNd, a: torch.Tensor) -> torch.Tensor:
    """im2col for any spatial rank: ``(B, C_in, *S) -> (B, T, groups, (C_in/groups)·Πk)``.

    Padding follows the module (``_reversed_padding_repeated_twice`` covers ints, "same" with
    its asymmetric split, and "valid"; the padding mode picks zeros/reflect/replicate/circular),
    so the column order matches ``weight.view(p, -1)`` within each group.
    """
    nd = a.dim() - 2
    pad = list(module._reversed_padding_repeated_twice)
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        a = F.pad(a, pad, mode=mode)
    for i in range(nd):
        k, s, d = module.kernel_size[i], module.stride[i], module.dilation[i]
        a = a.unfold(2 + i, d * (k - 1) + 1, s)
    if any(d != 1 for d in module.dilation):
        index = (slice(None),) * (2 + nd) + tuple(slice(None, None, d) for d in module.dilation)
        a = a[index]
    B, C = a.shape[:2]
    T = math.prod(a.shape[2 : 2 + nd])
    a = a.permute(0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd))
    return a.reshape(B, T, module.groups, (C // module.groups) * math.prod(module.kernel_size))


class ConvRule(LayerRule):
    module_types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def _views(self, module, calls):
        """Unfolded inputs ``(B·groups, T, D)`` and output grads ``(B·groups, T, p/groups)``."""
        Us, Gs = [], []
        for a, g in calls:
            dt = compute_dtype(g)
            if a.dim() != len(module.kernel_size) + 2:
                raise ValueError(
                    f"{type(module).__name__} expects batched input (B, C, *spatial); got shape "
                    f"{tuple(a.shape)}. "
                    "Unbatched inputs cannot be clipped per sample: add a batch dimension."
                )
            U = unfold_conv_input(module, cast(a, dt))  # (B, T, groups, D)
            B, T, groups, D = U.shape
            # (B, groups, p_g, T)
            G = cast(g, dt).reshape(B, groups, module.out_channels // groups, -1)
            if G.shape[-1] != T:
                raise ValueError(
                    f"{type(module).__name__}: unfolded {T} positions but the output has "
                    f"{G.shape[-1]}; "
                    "a subclass that changes Conv's forward needs its own rule."
                )
            Us.append(U.permute(0, 2, 1, 3).reshape(B * groups, T, D))
            Gs.append(G.permute(0, 1, 3, 2).reshape(B * groups, T, -1))
        if len(calls) == 1:
            return Us[0], Gs[0]
        return torch.cat(Us, 1), torch.cat(Gs, 1)

    def dims(self, module, activation, output):
        T = math.prod(output.shape[2:])
        D = (module.in_channels // module.groups) * math.prod(module.kernel_size)
        return LayerDims(T=T, D=D, p=module.out_channels, groups=module.groups)

    def _bias_grad(self, calls):
        return sum(g.flatten(2).sum(2, dtype=accumulation_dtype(g)) for _, g in calls)

    def ghost_norm_sq(self, module, calls):
        g0 = calls[0][1]
        bias = trainable(module, "bias")
        if trainable(module, "weight"):
            U, G = self._views(module, calls)
            # weight and bias together, per group: ⟨U Uᵀ + 11ᵀ, g gᵀ⟩ (the bias of group γ is g^γᵀ1)
            gram = gram_inner(U, G, bias=bias)
            return gram if module.groups == 1 else gram.reshape(g0.shape[0], module.groups).sum(1)
        if bias:
            return row_norm_sq(self._bias_grad(calls))
        return zeros_like_batch(g0)

    def _mass(self, module, calls, bias: bool) -> torch.Tensor:
        """``M_i = Σ_γ Σ_t ‖(U(a_i)^γ_t, 1)‖·‖g_{i,t}^γ‖`` in float64, group by group (the bias
        column of group γ is its output channels' bias). ``‖U(a)^γ_t‖²`` — the input window of
        position t — is a convolution of ``Σ_{c ∈ γ} a_c²`` with a kernel of ones (stride, dilation
        and padding of the layer), so no im2col copy is formed."""
        total = None
        groups = module.groups
        for a, g in calls:
            B, C = a.shape[:2]
            # squares in float32 on the CPU (float64 on CUDA, where cuDNN may pick TF32 or
            # transform-based kernels): positive terms, summed over the channels of a group and the
            # window's Πk positions, so exact to (1 + γ_K); an overflow gives inf (dropped)
            acc = torch.float64 if a.is_cuda else accumulation_dtype(a)
            x, padding = _padded(module, a.to(acc).square())
            x = x.reshape(B, groups, C // groups, *x.shape[2:]).sum(2)
            ones = x.new_ones(groups, 1, *module.kernel_size)
            conv = (F.conv1d, F.conv2d, F.conv3d)[len(module.kernel_size) - 1]
            window = conv(x, ones, None, module.stride, padding, module.dilation, groups)
            terms = (C // groups) * math.prod(module.kernel_size) + 2
            window = window.reshape(B, groups, -1).double() * (1 + gamma(terms, unit_roundoff(acc)))
            # squares below float32's (or float64's) normal range
            window = window + terms * (2.0 ** -149 + ETA64)
            if bias:
                window = window + 1
            per_group = g.reshape(B, groups, module.out_channels // groups, -1)
            ng = row_norms64(per_group.transpose(2, 3))
            m = (window.sqrt() * ng).sum((1, 2))
            total = m if total is None else total + m
        positions = sum(g[0].numel() // module.out_channels for _, g in calls) * groups
        slack = 1 + gamma(positions + module.out_channels + 4, unit_roundoff(torch.float64))
        # the float64 norms and sums of positive terms, and products below the normal range
        return total * slack + positions * ETA64

    def certified_norm_sq(self, module, calls, use_ghost, grads=None):
        """Certified ``‖release_i‖²`` bound at C_i = 1 (:mod:`private_engine.layers.rounding`): the
        weight's release is one weight-gradient kernel over the batch's ``B·T`` positions per call
        (:meth:`weighted_grads`), bounded as for a Linear layer group by group, ``(√(ν̃ + c_ν M²) +
        c_r M)²`` or ``(‖G̃‖ + (c_inst + c_r) M)²``; bias alone: its per-sample sums ``Σ_t g_t`` are
        released as they are."""
        weight, bias = trainable(module, "weight"), trainable(module, "bias")
        g0 = calls[0][1]
        if not weight:
            if not bias:
                return zeros_like_batch(g0)
            return certified_kept([self._bias_grad(calls)], g0)
        B = g0.shape[0]
        T = sum(g[0].numel() // module.out_channels for _, g in calls)
        dt = compute_dtype(g0)
        mass = self._mass(module, calls, bias)
        rows = B * T + len(calls)
        c_rel = release_coefficient(accumulation_dtype(g0), g0.device, rows, conv=True)
        if use_ghost:
            U, G = self._views(module, calls)
            D = U.shape[2]
            fast = self._fast_ghost(module, U, G, bias)
            if fast is not None:
                return certified_ghost(fast, mass, 0.0, c_rel)
            c_nu = gram_coefficient(D + bias, G.shape[2], T, gram_unit(U))
            nu = gram_inner(U, G, bias=bias)
            unit = gram_unit(U)
            lost = (ghost_underflow(row_norms64(U).sum(1) + (T if bias else 0),
                                    row_norms64(G).sum(1), D + bias, G.shape[2], T,
                                    gram_eta(unit)) if ghost_may_underflow(U, unit) else None)
            if module.groups > 1:  # the groups' terms (each within ±M_γ², Σ M_γ² ≤ M²) summed
                nu = nu.reshape(B, module.groups).sum(1)
                lost = None if lost is None else lost.reshape(B, module.groups).sum(1)
                c_nu += 2 * gamma(module.groups + 1, unit_roundoff(torch.float64))
            return certified_ghost(nu, mass, c_nu, c_rel, lost)
        grads = self.per_sample_grads(module, calls) if grads is None else grads
        norm_sq = sum(row_norm_sq(g) for g in grads.values())
        c_inst = instantiation_coefficient(dt, g0.device, T + len(calls), conv=True)
        terms = module.weight.numel() + module.out_channels
        return certified_instantiated(norm_sq, mass, c_inst, c_rel, terms)

    @staticmethod
    def _fast_ghost(module, U: torch.Tensor, G: torch.Tensor, bias: bool):
        """Upper bound of the ghost norm per sample from float32 Grams of the unfolded input
        ``U`` and ``G`` (:func:`private_engine.layers.gram.certified_ghost_sq`), the groups'
        non-negative bounds summed in float64 (raised by ``γ^{(64)}_{groups+1}``); None where
        the operands have no fast path."""
        na, ng = row_norms64(U), row_norms64(G)
        if bias:
            na = (na.square() + 1).sqrt()
        fast = certified_ghost_sq(U, G, bias, na, ng)
        if fast is None or module.groups == 1:
            return fast
        fast = fast.reshape(-1, module.groups).sum(1)
        return fast * (1 + gamma(module.groups + 1, unit_roundoff(torch.float64)))

    def per_sample_grads(self, module, calls) -> Dict[str, torch.Tensor]:
        """Per-sample weight gradients by the grouped-convolution trick (Rochette et al. 2019,
        "Efficient per-example gradient computations in convolutional neural networks"): the batch
        folded into the channels, ``(B, C, *S) -> (1, B·C, *S)``, makes sample i group i of a
        convolution with ``B·groups`` groups, so one weight-gradient kernel (cuDNN / oneDNN)
        returns ``G_i = g_iᵀ U(a_i)`` for every i at the cost of the ordinary weight gradient — no
        im2col copy (Π k times the input) and no bmm."""
        out = {}
        B = calls[0][1].shape[0]
        if trainable(module, "weight"):
            W = None
            for a, g in calls:
                dt = compute_dtype(g)
                x, padding = _padded(module, cast(a, dt))
                w = _conv_weight_grad(module, (x.reshape(1, -1, *x.shape[2:]), padding),
                                      cast(g, dt).reshape(1, -1, *g.shape[2:]), B * module.groups,
                                      (B * module.out_channels, *module.weight.shape[1:]))
                W = w if W is None else W + w
            out["weight"] = W.reshape(B, *module.weight.shape)
        if trainable(module, "bias"):
            out["bias"] = self._bias_grad(calls)
        return out

    def weighted_grads(self, module, calls, factors, out=None) -> Dict[str, torch.Tensor]:
        """``Σ_i C_i G_i`` as the ordinary weight gradient of the layer for the input ``diag(C)·a``
        or the output gradient ``diag(C)·g`` — whichever is smaller: the weight gradient is linear
        in each, and padding (any mode) commutes with scaling a sample — one cuDNN / oneDNN
        weight-gradient kernel per call, no per-sample gradient; bias ``Σ_i C_i Σ_t g_{i,t}``;
        copied into ``out`` when given. Operands in ≥ float32: the kernel returns its operands'
        dtype, and a 16-bit result would round the whole batch's sum."""
        out = out or {}
        res = {}
        if trainable(module, "weight"):
            W = None
            for a, g in calls:
                # a weight-gradient kernel returns its operands' dtype: ≥ float32
                dt = accumulation_dtype(g)
                a, g = cast(a, dt), cast(g, dt)
                if a.numel() < g.numel():
                    a = scale_samples(a, factors)
                else:
                    g = scale_samples(g, factors)
                w = _conv_weight_grad(module, _padded(module, a), g, module.groups,
                                      module.weight.shape)
                W = w if W is None else W + w
            res["weight"] = put_into(out.get("weight"), W)
        if trainable(module, "bias"):
            res["bias"] = weighted_sum_into(out.get("bias"), self._bias_grad(calls), factors)
        return res


def _padded(module: nn.modules.conv._ConvNd, a: torch.Tensor):
    """``(input, padding)`` for the kernels below: the input as the layer convolves it, padded by
    the module's own rule (ints, "same" with its asymmetric split, every padding mode) with padding
    0 left to the kernel — or, for symmetric zero padding, the input itself and the layer's padding
    (no copy)."""
    nd = a.dim() - 2
    pad = list(module._reversed_padding_repeated_twice)
    if not any(pad):
        return a, (0,) * nd
    if module.padding_mode == "zeros" and all(pad[2 * i] == pad[2 * i + 1] for i in range(nd)):
        return a, tuple(pad[2 * (nd - 1 - i)] for i in range(nd))
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(a, pad, mode=mode), (0,) * nd


def _conv_weight_grad(module, x, g: torch.Tensor, groups: int, weight_shape) -> torch.Tensor:
    """``∂/∂W`` of ``⟨conv(x, W; stride, dilation, groups), g⟩`` for ``x = (input, padding)`` from
    :func:`_padded` (as ``torch.nn.grad.conv*d_weight``: the weight enters only through its
    shape)."""
    x, padding = x
    nd = x.dim() - 2
    weight = x.new_empty(1).expand(weight_shape)
    return torch.ops.aten.convolution_backward(
        g, x, weight, None, module.stride, padding, module.dilation, False, (0,) * nd, groups,
        (False, True, False))[1]


register_rule(ConvRule())
