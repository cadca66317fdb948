"""Rules for the affine parameters of ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm`` (and
timm's ``RmsNorm``, transformers' Llama-family RMSNorms) and
``nn.InstanceNorm1d/2d/3d(affine=True)``.

With the normalised input x̂ (recomputed from the recorded input, in ≥ float32) and output
gradient g, the per-sample gradients are ``∂L_i/∂γ = Σ_positions g ⊙ x̂`` and
``∂L_i/∂β = Σ_positions g`` (summed over calls too). x̂ is per layer:

* LayerNorm: ``(x − mean) / √(var + ε)`` over ``normalized_shape``;
* GroupNorm: the same over each sample's group of channels and all positions;
* RMSNorm: ``x / √(mean(x²) + ε)`` over ``normalized_shape`` (Zhang & Sennrich 2019, "Root Mean
  Square Layer Normalization");
* InstanceNorm: ``(x − mean) / √(var + ε)`` over each sample's channel, all positions
  (statistics of the input itself: running statistics are refused before training).

These gradients are as small as one activation row, so they are always instantiated: a ghost
Gram matrix (2·T² per sample) could only cost more (``LayerDims.ghost_capable = False``; every
mode uses this exact path).
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..foundation.dtypes import accumulation_dtype, cast
from .base import LayerDims, LayerRule, trainable
from .registry import register_named_rule, register_rule

_UNIT_WEIGHTS: Dict[Tuple[Tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}


def unit_weight(shape: Tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A cached tensor of ones of ``shape`` (``like``'s dtype and device): the affine weight γ = 1
    under which ``layer_norm``/``group_norm`` return x̂ itself. Passed instead of ``None`` because
    CPU kernels normalise about 2× faster with a weight than without one (torch 2.x; the result is
    the same x̂), and cached, in its shape, so that a step adds neither a fill kernel nor a reshape
    per call."""
    key = (tuple(shape), like.dtype, like.device)
    w = _UNIT_WEIGHTS.get(key)
    if w is None:
        # a normal tensor even if first made under inference
        with torch.inference_mode(False), torch.no_grad():
            w = _UNIT_WEIGHTS[key] = torch.ones(key[0], dtype=like.dtype, device=like.device)
    return w


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


def _check_normalized_shape(module, a: torch.Tensor, hint: str = "") -> None:
    """Raise ``ValueError`` when the input ``a`` does not end with ``module.normalized_shape``."""
    n = len(module.normalized_shape)
    if tuple(a.shape[-n:]) != tuple(module.normalized_shape):
        raise ValueError(
            f"{type(module).__name__}: input shape {tuple(a.shape)} does not end with "
            f"normalized_shape {tuple(module.normalized_shape)}{hint}.")


class LayerNormRule(_AffineNormRule):
    module_types = (nn.LayerNorm,)

    def _normalized(self, module, a):
        self._normalized_shape_ok(module, a)
        # x̂ = (x − mean) / √(var + eps) over the normalised dims, in one fused kernel (γ = 1: see
        # unit_weight)
        x = cast(a, accumulation_dtype(a))
        return F.layer_norm(x, module.normalized_shape, unit_weight(module.normalized_shape, x),
                            None, module.eps)

    def dims(self, module, activation, output):
        p = math.prod(module.normalized_shape)
        T = output.numel() // (output.shape[0] * p) if output.shape[0] else 1
        return LayerDims(T=T, D=1, p=p, ghost_capable=False)

    def defer_per_sample_grads(self, module, calls, stack) -> bool:
        """Hand one call's ``(a, g)`` to ``stack``
        (:class:`private_engine.layers.norm_stack.LayerNormGradStack`), which instantiates
        :meth:`per_sample_grads` with those of the other LayerNorms of its shape at the end of the
        norm pass; False (nothing handed over) for subclasses, several calls, frozen affine
        parameters or a full stack."""
        if type(self) is not LayerNormRule or len(calls) != 1:
            return False
        a, g = calls[0]
        self._normalized_shape_ok(module, a)
        names = tuple(n for n in ("weight", "bias") if trainable(module, n))
        return bool(names) and stack.add(module, a, g, names)

    def _normalized_shape_ok(self, module, a) -> None:
        _check_normalized_shape(module, a, "; a LayerNorm subclass that normalises other "
                                "dimensions needs its own rule "
                                "(private_engine.layers.register_rule)")

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
        # x̂ = (x − mean_group) / √(var_group + eps), in one fused kernel (γ = 1: see unit_weight)
        x = cast(a, accumulation_dtype(a))
        return F.group_norm(x, module.num_groups, unit_weight((C,), x), None,
                            module.eps).reshape(B, C, -1)

    def dims(self, module, activation, output):
        T = math.prod(output.shape[2:])
        return LayerDims(T=T, D=1, p=module.num_channels, ghost_capable=False)

    def _grads_one_call(self, module, a, g):
        B, C = g.shape[:2]
        G = cast(g, accumulation_dtype(g)).reshape(B, C, -1)
        out = {}
        if trainable(module, "weight"):
            xhat = self._normalized(module, a)
            # x̂ is a fresh tensor of the rule's own: the products overwrite it (one buffer of its
            # size fewer), unless G's dtype is wider
            prod = xhat.mul_(G) if xhat.dtype == G.dtype else xhat * G
            out["weight"] = prod.sum(2)
        if trainable(module, "bias"):
            out["bias"] = G.sum(2)
        return out


class RMSNormRule(LayerNormRule):
    """``y = x / √(mean_{normalized_shape}(x²) + ε) ⊙ γ`` (torch's ``nn.RMSNorm``, ε = the input
    dtype's machine epsilon when None; timm's ``RmsNorm``, the same formula): per-sample
    ``∂L_i/∂γ = Σ_positions g ⊙ x̂`` with ``x̂ = x / √(mean(x²) + ε)``; no bias."""

    module_types = (nn.RMSNorm,)
    param_names = ("weight",)

    def _normalized(self, module, a):
        _check_normalized_shape(module, a)
        # ε of the dtype the layer ran in (nn.RMSNorm's default), before widening
        eps = torch.finfo(a.dtype).eps if module.eps is None else module.eps
        x = cast(a, accumulation_dtype(a))
        return F.rms_norm(x, module.normalized_shape, unit_weight(module.normalized_shape, x), eps)


class HFRMSNormRule(LayerNormRule):
    """The RMSNorm of Hugging Face transformers' Llama family (``LlamaRMSNorm`` and its copies in
    Mistral, Qwen2/3, Phi-3, …): ``y = γ ⊙ cast_in(x̂)`` with ``x̂ = x₃₂ / √(mean(x₃₂²) + ε)``
    computed in float32 (``x₃₂`` the input in float32, ``cast_in`` back to the input's dtype), ε
    = ``variance_epsilon``. Per-sample ``∂L_i/∂γ = Σ_positions g ⊙ cast_in(x̂)``, x̂ recomputed
    by the same operations."""

    module_types = ()
    param_names = ("weight",)

    def _normalized(self, module, a):
        d = module.weight.shape[-1]
        if a.shape[-1] != d:
            raise ValueError(f"{type(module).__name__}: input shape {tuple(a.shape)} does not end "
                             f"with the weight's size {d}.")
        x = a.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
        return cast(x.to(a.dtype), accumulation_dtype(a))

    def dims(self, module, activation, output):
        p = module.weight.shape[-1]
        T = output.numel() // (output.shape[0] * p) if output.shape[0] else 1
        return LayerDims(T=T, D=1, p=p, ghost_capable=False)

    def _grads_one_call(self, module, a, g):
        if not trainable(module, "weight"):
            return {}
        B, d = g.shape[0], module.weight.shape[-1]
        G = cast(g, accumulation_dtype(g)).reshape(B, -1, d)
        return {"weight": (G * self._normalized(module, a).reshape(B, -1, d)).sum(1)}


#: transformers' RMSNorm classes whose forward is ``LlamaRMSNorm.forward`` (checked in the tests)
HF_RMSNORMS = tuple(
    f"transformers.models.{m}.modeling_{m}.{c}RMSNorm" for m, c in (
        ("llama", "Llama"), ("mistral", "Mistral"), ("mixtral", "Mixtral"), ("qwen2", "Qwen2"),
        ("qwen2_moe", "Qwen2Moe"), ("qwen3", "Qwen3"), ("qwen3_moe", "Qwen3Moe"),
        ("phi3", "Phi3"), ("granite", "Granite"), ("smollm3", "SmolLM3")))


class InstanceNormRule(GroupNormRule):
    """``nn.InstanceNorm1d/2d/3d(affine=True)``: GroupNorm with one channel per group, i.e.
    ``x̂_{c} = (x_c − mean(x_c)) / √(var(x_c) + ε)`` over each sample's channel c (all positions);
    per-sample ``∂L_i/∂γ_c = Σ_pos g_c x̂_c``, ``∂L_i/∂β_c = Σ_pos g_c``."""

    module_types = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)

    def check(self, module):
        if module.track_running_stats:
            raise ValueError(
                f"{type(module).__name__}(track_running_stats=True) normalises by statistics of "
                "earlier batches in eval mode and updates them from the data in training mode; "
                "build it with track_running_stats=False "
                "(private_engine.guards.buffers.drop_running_stats does it in place).")

    def _normalized(self, module, a):
        B, C = a.shape[:2]
        if a.dim() != module._get_no_batch_dim() + 1 or C != module.num_features:
            raise ValueError(
                f"{type(module).__name__}: expected a batched input (B, {module.num_features}, "
                f"*spatial) of {module._get_no_batch_dim() + 1} dimensions, got shape "
                f"{tuple(a.shape)}. Unbatched inputs cannot be clipped per sample: add a batch "
                "dimension.")
        x = cast(a, accumulation_dtype(a))
        # GroupNorm with C groups of one channel: the statistics of each sample's channel
        return F.group_norm(x, C, unit_weight((C,), x), None, module.eps).reshape(B, C, -1)

    def dims(self, module, activation, output):
        T = math.prod(output.shape[2:])
        return LayerDims(T=T, D=1, p=module.num_features, ghost_capable=False)


register_rule(LayerNormRule())
register_rule(GroupNormRule())
register_rule(RMSNormRule())
register_named_rule(RMSNormRule(), "timm.layers.norm.RmsNorm")
register_named_rule(HFRMSNormRule(), *HF_RMSNORMS)
register_rule(InstanceNormRule())
