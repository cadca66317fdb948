"""Rule for ``nn.ConvTranspose1d/2d/3d``: stride, padding, output_padding (also chosen per call
by ``output_size``), dilation, groups and bias.

A transposed convolution is the adjoint of a convolution in its input:
``⟨conv_transpose(x, W), g⟩ = ⟨x, conv(g, W)⟩``, with ``W: (C_in, C_out/groups, *k)``. Its
weight gradient for one sample is therefore the weight gradient of the convolution
``conv(g_i, W)`` under the output gradient ``a_i`` (the roles of input and output swapped):

    ∂L_i/∂W[c_in, c_out, κ] = Σ_t a_i[c_in, t] · g_i[c_out, s·t − p + d·κ]      (per group),

and ``∂L_i/∂b = Σ_positions g_i``. All samples' gradients come from one weight-gradient kernel
with the batch folded into the groups (Rochette, Manoel & Tramel 2019, "Efficient per-example
gradient computations in convolutional neural networks"): ``(B, C, *S) -> (1, B·C, *S)`` makes
sample i the groups ``i·groups … (i+1)·groups − 1`` of a transposed convolution with
``B·groups`` groups. The per-sample gradients are instantiated (``LayerDims.ghost_capable =
False``) and the clipped sum is ``Σ_i C_i G_i`` of these very tensors, so what is released for a
sample is exactly what was normed.
"""
from __future__ import annotations

import math
from typing import Dict

import torch
from torch import nn

from ..foundation.dtypes import accumulation_dtype, cast
from .base import LayerDims, LayerRule, trainable
from .registry import register_rule


class ConvTransposeRule(LayerRule):
    """``nn.ConvTranspose1d/2d/3d``: per-sample ``∂L_i/∂W`` = the weight gradient of the adjoint
    convolution ``conv(g_i, W)`` under the output gradient ``a_i``; ``∂L_i/∂b = Σ_pos g_i``."""

    module_types = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)

    def check(self, module):
        if module.padding_mode != "zeros":
            raise ValueError(f"{type(module).__name__}: padding_mode={module.padding_mode!r} is "
                             "not a transposed convolution torch runs; use 'zeros'.")

    def dims(self, module, activation, output):
        T = math.prod(output.shape[2:])
        D = (module.out_channels // module.groups) * math.prod(module.kernel_size)
        return LayerDims(T=T, D=D, p=module.in_channels, ghost_capable=False)

    def per_sample_grads(self, module, calls) -> Dict[str, torch.Tensor]:
        """``{weight: (B, C_in, C_out/groups, *k), bias: (B, C_out)}`` in ≥ float32, summed over
        calls: one transposed-convolution weight-gradient kernel with ``B·groups`` groups."""
        out = {}
        B = calls[0][1].shape[0]
        nd = len(module.kernel_size)
        if trainable(module, "weight"):
            total = None
            for a, g in calls:
                if a.dim() != nd + 2:
                    raise ValueError(
                        f"{type(module).__name__} expects batched input (B, C, *spatial); got "
                        f"shape {tuple(a.shape)}. Unbatched inputs cannot be clipped per sample: "
                        "add a batch dimension.")
                output_padding = self._output_padding(module, a, g)
                dt = accumulation_dtype(g)
                x = cast(a, dt).reshape(1, -1, *a.shape[2:])
                gy = cast(g, dt).reshape(1, -1, *g.shape[2:])
                shape = (B * module.in_channels, *module.weight.shape[1:])
                weight = x.new_empty(1).expand(shape)
                w = torch.ops.aten.convolution_backward(
                    gy, x, weight, None, module.stride, module.padding, module.dilation, True,
                    output_padding, B * module.groups, (False, True, False))[1]
                total = w if total is None else total + w
            out["weight"] = total.reshape(B, *module.weight.shape)
        if trainable(module, "bias"):
            out["bias"] = sum(g.flatten(2).sum(2, dtype=accumulation_dtype(g)) for _, g in calls)
        return out

    @staticmethod
    def _output_padding(module, a: torch.Tensor, g: torch.Tensor):
        """The call's ``output_padding``, from its shapes: a forward given ``output_size`` chooses
        it per call, ``L_out − ((L_in − 1)·s − 2p + d·(k − 1) + 1)`` in each spatial dim."""
        pads = []
        for i, (k, s, p, d) in enumerate(zip(module.kernel_size, module.stride, module.padding,
                                             module.dilation)):
            op = g.shape[2 + i] - ((a.shape[2 + i] - 1) * s - 2 * p + d * (k - 1) + 1)
            if not 0 <= op < max(s, d):
                raise ValueError(
                    f"{type(module).__name__}: input {tuple(a.shape)} and output "
                    f"{tuple(g.shape)} do not fit its stride, padding and dilation; a subclass "
                    "that changes ConvTranspose's forward needs its own rule.")
            pads.append(op)
        return tuple(pads)

    def ghost_norm_sq(self, module, calls):
        return self.instantiated_norm_sq(module, calls)


register_rule(ConvTransposeRule())
