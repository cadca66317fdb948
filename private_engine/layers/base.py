"""The layer-rule interface (:class:`LayerRule`, :class:`LayerDims`) and the numerical helpers the
rules share: the per-layer math of per-sample gradient norms and clipped sums.

A *rule* knows, for one family of ``nn.Module`` s, how to turn the recorded input activation
``a`` and the gradient of the layer output ``g`` (both batch-first, one slice per sample) into

* the layer dimensions ``(T, D, p)`` used by the mixed-clipping decision (Bu, Mao & Xu 2022,
  "Scalable and Efficient Training of Large Convolutional Neural Networks with Differential
  Privacy", eq. 4.1),
* the per-sample squared gradient norm ``‖∂L_i/∂W‖²`` by the **ghost norm**
  ``⟨a_i a_iᵀ, g_i g_iᵀ⟩`` (Bu, Mao & Xu 2022, eq. 2.7) — never forming the per-sample gradient,
* the per-sample squared gradient norm by **instantiating** ``G_i = g_iᵀ a_i`` (p×D),
* the per-sample gradients themselves (kept by the instantiated path, summed over rows for
  layers that see several rows per sample, and used by tests),
* the clipped sum ``Σ_i C_i·∂L_i/∂θ`` and a certified upper bound of what it releases per sample.

Bias terms are included in both norms: ``‖Σ_t g_{i,t}‖²``. Only parameters with
``requires_grad=True`` contribute, so a frozen weight with a trainable bias costs only the bias.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple, Type

import torch
from torch import nn

from ..foundation.dtypes import cast, cast_down
from ..foundation.matmul import put_into, wide_bmm
from .rounding import (
    accumulator_unit,
    certified_instantiated,
    gamma,
    norm_sq64,
    operand_unit,
    unit_roundoff,
)


@dataclass(frozen=True)
class LayerDims:
    """Dimensions of one layer call for the decision rule of Bu, Mao & Xu 2022, eq. (4.1).

    ``T``: output positions per sample (H_out·W_out, sequence length, 1 for a plain vector);
    ``D``: fan-in of one output unit (input channels per group × kernel size);
    ``p``: output channels; ``groups``: independent weight blocks (grouped convolutions).
    ``ghost_capable``: False for layers whose per-sample gradient is no larger than the
    activation itself (elementwise-affine norms), where instantiation is always cheaper.
    """

    T: int
    D: int
    p: int
    groups: int = 1
    ghost_capable: bool = True
    #: width of the activation side of the ghost Gram matrix when it is not D (Embedding: 1, the
    #: equality of token ids); enters only the time cost (``clipping.plan.ghost_time``)
    gram_D: Optional[int] = None
    #: elements per sample of the call's input and output (what book-keeping keeps for a ghost
    #: layer: the activation and the output gradient); set by the recorder, 0 when unknown
    io_size: int = 0

    @property
    def ghost_cost(self) -> int:
        """Memory per sample of the ghost norm: two T×T Gram matrices per group, ``2·T²``."""
        return 2 * self.T * self.T * self.groups

    @property
    def instantiate_cost(self) -> int:
        """Memory per sample of the instantiated per-sample weight gradient, ``p·D``."""
        return self.p * self.D


Call = Tuple[torch.Tensor, torch.Tensor]  # (activation a, output gradient g) of one forward call


class LayerRule:
    """Base class of a layer rule; subclasses implement the math for one module family.

    Every norm method takes *all* calls of the module in one forward pass, ``calls = [(a, g), …]``:
    a layer applied c times has per-sample gradient ``Σ_c G_i^c`` whose norm has cross terms, so
    calls are concatenated along the position axis (ghost) or summed (instantiation), never
    normed one by one.
    """

    #: module classes this rule applies to (looked up along the class hierarchy)
    module_types: Tuple[Type[nn.Module], ...] = ()
    #: names of the direct parameters the rule clips
    param_names: Tuple[str, ...] = ("weight", "bias")

    def check(self, module: nn.Module) -> None:
        """Raise a clear error if this module instance uses a feature the rule cannot clip."""

    def dims(self, module: nn.Module, activation: torch.Tensor, output: torch.Tensor) -> LayerDims:
        """Dimensions (T, D, p) of one forward call, from shapes only (no device work)."""
        raise NotImplementedError

    def ghost_norm_sq(self, module: nn.Module, calls: Sequence[Call]) -> torch.Tensor:
        """Per-sample ‖∂L_i/∂θ‖² over the module's trainable parameters, by ghost norm."""
        raise NotImplementedError

    def per_sample_grads(self, module: nn.Module, calls: Sequence[Call]) -> Dict[str, torch.Tensor]:
        """Per-sample gradients ``{param_name: (B, *param.shape)}`` of trainable parameters."""
        raise NotImplementedError

    def weighted_grads(self, module: nn.Module, calls: Sequence[Call], factors: torch.Tensor,
                       out: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
        """Clipped gradient sum ``{param_name: Σ_i C_i·∂L_i/∂θ}`` straight from the recorded calls.

        Book-keeping (Bu et al. 2023): with the output gradients of one backward kept,
        ``Σ_i C_i g_iᵀ a_i = gᵀ·diag(C)·a`` needs no second backward. ``factors`` is ``(B,)``, one
        clip factor per sample. ``out`` (optional): ``{param_name: tensor of the parameter's
        shape}`` to write the sums into (the engine's flat buffers); the returned tensors are then
        those. This default contracts the instantiated per-sample gradients with ``C``; rules
        override it with one matmul.
        """
        out = out or {}
        return {name: put_into(out.get(name),
                               torch.tensordot(cast_down(factors, grad.dtype), grad, dims=1))
                for name, grad in self.per_sample_grads(module, calls).items()}

    def instantiated_norm_sq(self, module: nn.Module, calls: Sequence[Call]) -> torch.Tensor:
        """Per-sample ‖∂L_i/∂θ‖² by instantiating the per-sample gradients, ``Σ_θ ‖G_i^θ‖²_F``."""
        return sum_per_sample([row_norm_sq(grad)
                               for grad in self.per_sample_grads(module, calls).values()],
                              calls[0][1])

    def certified_norm_sq(self, module: nn.Module, calls: Sequence[Call], use_ghost: bool,
                          grads: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """A certified upper bound (float64, ``(B,)``) of ``‖what weighted_grads releases for sample
        i‖²`` at ``C_i = 1``: every rounding of the norm's computation and of the release included
        (:mod:`private_engine.layers.rounding`), so that ``‖release_i‖ ≤ C_i·√(bound)`` for any
        ``C_i ≥ 0``.

        This default serves rules whose :meth:`weighted_grads` is the base class's: the release is
        ``Σ_i C_i G̃_i`` of the very per-sample gradients ``G̃`` whose norm is taken here
        (``grads``, or recomputed identically), so the bound is ``‖G̃_i‖²`` summed in float64 times
        the rounding of the weighted sum over the batch, ``(1 + γ_{B+1})²``. A rule that overrides
        :meth:`weighted_grads` with another formula must override this method too (the engine
        refuses it otherwise)."""
        grads = self.per_sample_grads(module, calls) if grads is None else grads
        return certified_kept(list(grads.values()), calls[0][1])


def trainable(module: nn.Module, name: str) -> bool:
    """True when ``module.<name>`` is a parameter that requires a gradient."""
    param = getattr(module, name, None)
    return isinstance(param, nn.Parameter) and param.requires_grad


def flatten_positions(t: torch.Tensor, features: int) -> torch.Tensor:
    """Reshape a batch-first tensor ``(B, *positions, features)`` to ``(B, T, features)``."""
    return t.reshape(t.shape[0], -1, features)


def gram_inner(a: torch.Tensor, g: torch.Tensor, bias: bool = False) -> torch.Tensor:
    """Ghost norm ``⟨a aᵀ, g gᵀ⟩`` per leading index for ``a: (N, T, D)``, ``g: (N, T, p)``, in
    float64.

    With ``bias=True`` it is ``⟨a aᵀ + 1 1ᵀ, g gᵀ⟩ = ‖gᵀa‖²_F + ‖Σ_t g_t‖²``: the norm of a
    layer's weight *and* bias gradient together, since the bias gradient ``gᵀ1`` has
    ``‖gᵀ1‖² = 1ᵀ g gᵀ 1 = ⟨1 1ᵀ, g gᵀ⟩`` (Bu, Mao & Xu 2022, eq. 2.7 with a constant input
    column) — one in-place add on the Gram instead of a reduction, a norm and a sum.
    With T = 1 this is ``(‖a‖² + [bias])·‖g‖²`` (no Gram matrices needed).

    The sum has terms of both signs and a crafted sample can make it cancel, so it is formed where
    its rounding is provably small against ``M² = (Σ_t ‖ã_t‖‖g_t‖)²`` (:func:`gram_unit`,
    :func:`private_engine.layers.rounding.gram_coefficient`): the Gram matrices in float64 (products
    of float32 or 16-bit values are exact there), or, for 16-bit CUDA operands, by a matmul that
    accumulates and returns float32; their inner product always in float64. The certified norms
    form the Grams in float32 and bound their rounding per sample instead
    (:func:`private_engine.layers.gram.certified_ghost_sq`).
    """
    if a.shape[1] == 1:
        a_sq = row_norm_sq(a)
        return (a_sq + 1 if bias else a_sq) * row_norm_sq(g)
    if gram_unit(a) == unit_roundoff(torch.float64):
        return gram_inner_float64(a, g, bias)
    # 16-bit CUDA operands: exact products accumulated in float32 by the tensor cores
    a, g = aligned_positions(a), aligned_positions(g)
    aat = wide_bmm(a, a.transpose(1, 2)).double()
    ggt = wide_bmm(g, g.transpose(1, 2)).double()
    if bias:
        aat.add_(1)  # zero-padded rows of g (aligned_positions) keep the padding out of the sum
    # ⟨aaᵀ, ggᵀ⟩ as a sum over s, then over t (in place: no third T×T temporary): two reductions of
    # T terms, so a rounding error of at most γ_{2T} of the absolute sum, against γ_{T²} for one
    # flat dot product
    return aat.mul_(ggt).sum(2).sum(1)


def gram_inner_float64(a: torch.Tensor, g: torch.Tensor, bias: bool = False) -> torch.Tensor:
    """:func:`gram_inner` with both Gram matrices formed in float64 (exact products of float32 or
    16-bit values) and their inner product summed over s, then over t."""
    a, g = a.double(), g.double()
    aat = torch.bmm(a, a.transpose(1, 2))
    if bias:
        aat.add_(1)
    return aat.mul_(torch.bmm(g, g.transpose(1, 2))).sum(2).sum(1)


def gram_unit(t: torch.Tensor) -> float:
    """Unit roundoff of the ghost Gram matrices of ``t`` (:func:`gram_inner`): float64 (2⁻⁵³),
    except for 16-bit operands on CUDA, whose Grams a float32-accumulating matmul forms (2⁻²⁴)."""
    if t.device.type == "cuda" and t.element_size() == 2:
        return unit_roundoff(torch.float32)
    return unit_roundoff(torch.float64)


#: on CUDA, 16-bit batched matmuls whose row count T is not a multiple of this get padded
#: (``aligned_positions``)
CUDA_ROW_ALIGNMENT = 8


def aligned_positions(t: torch.Tensor) -> torch.Tensor:
    """``t: (N, T, k)`` zero-padded to ``T' = ⌈T/8⌉·8`` rows for a 16-bit CUDA tensor, else ``t``
    itself.

    The ghost Gram ``t tᵀ`` is (N, T, T); with T = 197 (ViT at 224²) its rows are 394 bytes, not
    16-byte aligned, and cuBLAS falls back from the Hopper/Ampere tensor-core kernels to a slow
    generic one. Zero rows add zero rows and columns to both Grams, so ``⟨a aᵀ, g gᵀ⟩`` is
    unchanged — exactly.
    """
    if t.device.type != "cuda" or t.element_size() != 2:
        return t
    return pad_positions(t, aligned_count(t.shape[1]))


def aligned_count(T: int) -> int:
    """``⌈T/8⌉·8``: the rows of a 16-bit CUDA Gram operand after :func:`aligned_positions`."""
    return -(-T // CUDA_ROW_ALIGNMENT) * CUDA_ROW_ALIGNMENT


def pad_positions(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t: (…, T, k)`` with zero rows appended up to ``rows`` (``t`` itself when ``rows == T``):
    one copy of ``t`` into a new tensor whose appended rows alone are zeroed (the same tensor as
    ``torch.nn.functional.pad``'s, which fills the whole of it before the copy)."""
    T = t.shape[-2]
    if rows == T:
        return t
    out = t.new_empty((*t.shape[:-2], rows, t.shape[-1]))
    out[..., :T, :].copy_(t)
    out[..., T:, :].zero_()
    return out


def row_norm_sq(t: torch.Tensor) -> torch.Tensor:
    """``‖t_i‖²`` for every leading index i, squares summed in float64 (exact squares of float32
    values, relative error ``γ^{(64)}_n``: tight enough to certify) without a full-size
    temporary."""
    return norm_sq64(t)


def certified_kept(grads: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Certified squared norms of per-sample gradients ``grads = [(B, *shape)]`` released as
    themselves, ``Σ_i C_i G̃_i`` (a kept gradient, or one recomputed identically): ``Σ_θ ‖G̃_i^θ‖²``
    in float64 times ``(1 + γ_{n+2}^{(64)})²`` for its own summation and ``(1 + γ_{B+1} +
    2·u_TF32)²`` for the rounding the weighted sum over the batch can attribute to sample i (any
    order; Higham 2002, §3.1)."""
    if not grads:
        return zeros_like_batch(like)
    B = grads[0].shape[0]
    terms = sum(g.numel() // max(B, 1) for g in grads)
    ns = sum_per_sample([norm_sq64(g) for g in grads], like)
    g0 = grads[0]
    release = 1 + gamma(B + 1, accumulator_unit(g0.dtype)) + 2 * operand_unit(g0.dtype, g0.device)
    return certified_instantiated(ns, None, 0.0, 0.0, terms) * (release * release)


def sum_per_sample(terms: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``Σ_k terms[k]`` of per-sample ``(B,)`` vectors, in the widest of their dtypes; zeros like
    ``like``'s batch when there is none. One term is returned as is and many are stacked and summed
    by one reduction, so a layer or a whole model costs one or two kernel launches here, not one
    per term."""
    if not terms:
        return zeros_like_batch(like)
    if len(terms) == 1:
        return terms[0]
    if len(terms) == 2:
        return terms[0] + terms[1]
    dtype = terms[0].dtype
    for t in terms[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.stack([cast(t, dtype) for t in terms]).sum(0)


def zeros_like_batch(g: torch.Tensor) -> torch.Tensor:
    """A zero per-sample vector (float64: the dtype of certified norms)."""
    return torch.zeros(g.shape[0], dtype=torch.float64, device=g.device)
