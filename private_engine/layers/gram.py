"""Certified ghost norms from Gram matrices formed in the fast path (float32 matmuls, or 16-bit
operands accumulated in float32), with an a-posteriori bound of their rounding.

The ghost norm of a layer is ``ν_i = ⟨Ã_i, G_i⟩ = Σ_{t,s} A_ts·G_ts`` with ``A = ã ãᵀ`` (``ã_t``
the input at position t, with a constant 1 appended when the bias is trained) and ``G = g gᵀ``
(Bu, Mao & Xu 2022, "Scalable and Efficient Training of Large Convolutional Neural Networks with
Differential Privacy", eq. 2.7). Forming ``A`` and ``G`` in float64 (exact products of float32 or
16-bit values) certifies easily but costs float64 matmuls, 1/15 to 1/64 of the float32 rate on a
GPU. Here they are formed by float32-accumulating matmuls, and the rounding is bounded per
sample from the computed matrices themselves.

Error model (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 2002, §2.2, §3.1):
a Gram entry ``Ã_ts = fl(Σ_k ã_tk ã_sk)`` over ``w`` columns satisfies
``|Ã_ts − A_ts| ≤ γ_w·Σ_k |ã_tk||ã_sk| + w·η ≤ γ_w·n_t n_s + w·η`` (``γ_n = n·u/(1 − n·u)``,
Cauchy–Schwarz with ``n_t ≥ ‖ã_t‖``; ``η`` the absolute loss of a product below the normal range).

* float32 operands on the CPU, and 16-bit operands widened to float32 there: products and sums
  rounded to nearest (or fused), ``u = 2⁻²⁴``, ``γ_w`` covering both (Higham 2002, eq. 3.5),
  ``η = 2⁻¹²⁶`` (what a product or sum below the normal range loses, flushed to zero or not:
  :data:`.rounding.ETA32`); float32 on CUDA when TF32 is off likewise.
* 16-bit operands on CUDA (tensor cores), the pessimistic model of Fasi, Higham, Mikaitis &
  Pranesh 2021, "Numerical behavior of NVIDIA tensor cores": products exact; each block of ``b``
  products is added to the float32 accumulator with the significands aligned to the largest
  exponent and *truncated*, without extra alignment bits, and the result normalised by
  truncation. Every one of the ``b + 1`` aligned terms then loses less than one unit in the last
  place of the largest, and the normalisation another, so a block adds at most
  ``(b + 2)·2⁻²³`` times the absolute sum so far; over ``⌈w/b⌉`` blocks that is at most
  ``3w + 3`` such errors for any ``1 ≤ b ≤ w``: ``γ_{3w+3}`` at ``u = 2⁻²³``, and
  ``η = 2⁻¹²⁶`` (subnormal products may be flushed).
* any other float32 setting (TF32 on CUDA, implicit bfloat16 in the CPU's matmuls): no fast path,
  the Grams are formed in float64 as before.

The loss below the normal range is folded into ``γ``: with row norms raised to
``n'_t = n_t + c_a``, ``γ_a·c_a² = 2·w_a·η``, ``γ_a·n'_t n'_s ≥ γ_a·n_t n_s + 2·w_a·η``, so
``|E_ts| ≤ γ_a·n'_t n'_s`` for ``E = Ã − A`` (and ``|F_ts| ≤ γ_g·m'_t m'_s`` for ``F = G̃ − G``,
``m_t ≥ ‖g_t‖``). Since ``ν = Σ (Ã − E)(G̃ − F)``,

``|ν − Σ Ã G̃| ≤ γ_a·n'ᵀ|G̃|n' + γ_g·m'ᵀ|Ã|m' + γ_a γ_g·M'²``,  ``M' = Σ_t n'_t m'_t``.

``n'ᵀ|G̃|n'`` weighs each Gram entry by the row norms rather than ``M²``'s products of norms: for
most honest layers it is a few times ``ν`` where ``M²`` is about ``T·ν``, which is what keeps the
bound within 10⁻³ of the norm.

The rest is float32 work on the ``(…, T, T)`` Grams and float64 work on ``(…, T)`` rows only
(:func:`ghost_terms`; Higham 2002, §3.1, every sum in any order, ``η' = 2⁻¹²⁶`` the most one
float32 product or sum loses below the normal range, results flushed to zero included, as in
the Grams' own model):

* ``ν̃ = Σ_t r_t`` in float64 over float32 row dot products ``r_t = fl(Σ_s Ã_ts G̃_ts)``
  (:func:`row_dots`): ``|r_t − Σ_s Ã_ts G̃_ts| ≤ γ_T·Σ_s |Ã_ts||G̃_ts| + 4T·η'`` (``T`` products
  and ``T − 1`` additions, each loss carried through at most ``T`` roundings, ``(1 + γ_T) ≤ 2``),
  and the float64 sum adds ``γ^{(64)}_T·Σ_t |r_t|``, so
  ``|ν̃ − Σ Ã G̃| ≤ κ_T·Σ |Ã||G̃| + 8T²·η'`` with ``κ_T = γ_T + γ^{(64)}_T(1 + γ_T)``.
  ``Σ |Ã||G̃|`` is formed the same way from the absolute values (:func:`row_dots` again, once the
  weighted forms below have taken them in place): non-negative terms, so its computed value
  ``S`` has ``Σ |Ã||G̃| ≤ ρ_T·(S + 4T²·η')`` and ``κ_T·Σ |Ã||G̃| ≤ κ_Tρ_T·S + 4T²·η'``.
* the bilinear forms ``n'ᵀ|G̃|n'``, ``m'ᵀ|Ã|m'`` (:func:`weighted_form`): the absolute values
  taken in place, ``y = |G̃| v + c`` by a float32 matrix–vector product and one float32 addition
  of ``c = 8T·η'`` (element-wise products and a sum where a float32 matmul may round its
  operands, :func:`.rounding.operand_unit`), with ``v = fl32(w) ≥ w`` (the float64 weights
  ``w`` carry a factor ``1 + 2⁻²³``, and ``(1 + 2u)(1 − u)(1 − 2⁻⁵²) ≥ 1`` at ``u = 2⁻²⁴``
  covers their float64 roundings and the one to float32), then ``W = Σ_t w_t y_t`` in float64.
  Every term is non-negative: ``fl(Σ_s |G̃_ts| v_s) ≥ (1 − γ_T)·Σ_s |G̃_ts| v_s − 4T·η'``, so
  ``y_t ≥ (1 − γ_{T+1})·Σ_s |G̃_ts| v_s`` (``c`` covers the loss, and the sum is normal), and the
  float64 products and sum lose at most ``γ^{(64)}_T``: the exact form of the weights ``w`` is at
  most ``ρ_T·W``, ``ρ_T = 1 + 2(γ_{T+1} + γ^{(64)}_T) ≥ 1/((1 − γ_{T+1})(1 − γ^{(64)}_T))``. The
  weights carry ``√ρ_T`` (:func:`_floored`), so ``W`` itself is at least the exact form of the
  weights without it. A weight or a product above float32's range gives ``inf`` (a non-finite
  slack).

So ``slack = W_G + W_A + κ_Tρ_T·S + (Σ_t n2_t m2_t)² + 12T²·η' + 4T²·2⁻¹⁰²²``
(:func:`ghost_slack`) with ``W_G``, ``W_A`` the computed forms of the scaled weights
``n2 = √(γ_a·margin·ρ_T)·n'``, ``m2 = √(γ_g·margin·ρ_T)·m'`` (:func:`_floored`; ``W_G`` is at
least ``γ_a·margin`` times ``n'ᵀ|G̃|n'``).
``margin = 1 + 2γ^{(64)}_{T²+8}`` (:func:`_margin`) covers the few float64 roundings of the
slack's own assembly. The temporaries are float32 ``(…, T)`` rows and float64 ``(…, T)``
weights — no float64 ``(…, T, T)`` tensor — and, where float32 matmuls may round their operands,
one float32 ``(…, T, T)`` product at a time. A ``ν̃`` that is not finite is NaN, never clamped to
0, and a bound that is not finite is never kept (:func:`tight`).

A sample whose bound is not finite (a value so large that a float32 Gram entry, one of the row
dot products or a weighted row overflows) or loose (slack above ``LOOSE`` times the ghost norm,
and above what the release's own rounding term ``c_r·M`` already leaves uncertain: :func:`tight`)
gets a second try, for that sample only. Loose honest samples are those whose Gram of one side is
nearly diagonal while the other is dense: image patches of mean-zero (noise) inputs, or the
nearly orthogonal LayerNorm outputs of a ViT's early blocks, beside output gradients nearly equal
at every position. The slack is then dominated by ``γ_a·n'ᵀ|G̃|n'`` (``γ_a`` charged on every
off-diagonal entry of ``Ã``, weighted by a dense ``|G̃|``), about ``T·γ_a·ν``: ViT-Tiny at 224²
with noise inputs, 7·10⁻³·ν for the 16×16 patch embedding (``D = 768``, ``T = 196``; 98 % of the
slack), 0.9 to 1.3·10⁻³·ν for ``qkv`` (77 %; the other side's form 17 %, ``κρS`` 6 %). The
``qkv`` bounds are kept, their slack below twice the release term (``c_r·M ≈ 1.5·10⁻³·√ν`` at
batch 16); the patch embedding's is not (``c_r·M ≈ 2.4·10⁻³·√ν``). The second try, where the
per-sample gradients take no more products than the Grams
(:func:`instantiation_pays`, as for those layers), forms them by a float32 matmul and bounds
``ν = ‖g_iᵀ ã_i‖²`` from their norm and the mass (:func:`instantiated_ghost_bound`: relative
slack about ``2γ_T·M/√ν``, 3·10⁻⁴ there; a convolution forms them as its first try instead of
the Grams, ``gradients_first`` of :func:`certified_ghost_sq`); elsewhere, Grams in blocks of
``CHUNK`` columns by float32 matmuls, the blocks' Grams summed in float64, which divides ``γ``
by ``width/CHUNK`` for the same float32 FLOPs. A sample still loose (cancellation built into a
crafted sample) gets the float64 Grams. Picking the samples costs one host synchronisation
(:func:`refine`; one per step for the stacked layers), on every device.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Tuple, Union

import torch

from .precision import without_autocast
from .rounding import (
    ETA32,
    ETA64,
    ETA_TENSOR_CORE,
    gamma,
    gram_coefficient,
    norm_sq64,
    operand_unit,
    unit_roundoff,
)

#: the slack above which a fast bound is computed again (:func:`second_try`): 2⁻¹⁰ of ``ν`` (a
#: squared norm), so a kept fast bound is within 5·10⁻⁴ of the norm — or within the release's own
#: rounding term where that is larger (:func:`tight`)
LOOSE = 2.0 ** -10
#: a slack below this (a squared norm of 8·10⁻²²) is not worth a second try, loose or not: a sample
#: whose gradient at the layer is zero or tiny, whose slack is the underflow terms of float32
#: (the row-norm floors of :func:`_floored`: about ``2⁻¹²⁶·T²·w`` times the other side's Gram
#: entries, 10⁻³⁰ to 10⁻²⁹ for a zero gradient beside ordinary activations)
NEGLIGIBLE = 2.0 ** -70
#: columns per block of the second try's Grams (:func:`_gram_chunked`)
CHUNK = 64
#: Gram entries (samples × blocks × T²) the second try forms at once (:func:`_gram_chunked`):
#: 2²³, i.e. 32 MiB of float32 Grams, added one block at a time into the float64 total;
#: the other blocks wait, so that a wide layer's second try over many samples holds a few blocks'
#: Grams, not all of them, while a few loose samples take all their blocks in one group
GRAM_ENTRIES_AT_ONCE = 1 << 23
#: device types whose second-try block Grams are added into the float64 total one by one
#: (:func:`_gram_chunked`; elsewhere one reduction per group)
ADDED_ONE_BY_ONE = ("cpu",)
#: device types on which ``Σ_s |X_ts|·v_s`` is one L1-norm reduction of the products
#: (:func:`_abs_rows`; elsewhere an in-place absolute value and a sum, faster on the CPU)
L1_IN_ONE_PASS = ("cuda",)
#: unit roundoff of the pessimistic tensor-core accumulation (truncation, float32)
TENSOR_CORE_UNIT = 2.0 ** -23


def tensor_core_gamma(width: int) -> float:
    """Relative bound of a tensor-core dot product of ``width`` exact products accumulated in
    float32 with truncated alignment and normalisation (module docstring): ``γ_{3w+3}`` at
    ``u = 2⁻²³``."""
    return gamma(3 * width + 3, TENSOR_CORE_UNIT)


def fast_gram_model(t: torch.Tensor) -> Optional[Tuple[bool, float]]:
    """``(tensor_core, η)`` of the fast Gram path for operands like ``t``, or None when there is
    none (float64 operands, TF32 or implicit bfloat16 float32 matmuls)."""
    if t.dtype == torch.float64 or not t.is_floating_point():
        return None
    if t.device.type == "cuda":
        if t.element_size() == 2:
            return True, ETA_TENSOR_CORE
    return (False, ETA32) if operand_unit(torch.float32, t.device) == 0.0 else None


def _gram32(t: torch.Tensor, rows: Optional[int] = None) -> torch.Tensor:
    """``t tᵀ`` per sample as float32 ``(N, T, T)``: a float32 bmm, 16-bit operands accumulated in
    float32 (tensor cores on CUDA, with rows padded for their kernels; on the CPU widened to
    float32 once, the same tensor for both factors: exact). ``rows``: the first ``T`` rows of
    ``t`` are the operand, the others zero padding (:func:`.base.pad_positions`)."""
    from ..foundation.matmul import wide_bmm
    from .base import aligned_positions

    T = t.shape[1] if rows is None else rows
    if t.element_size() == 2:
        if t.device.type == "cuda":
            p = aligned_positions(t)
            out = wide_bmm(p, p.transpose(1, 2))
        else:
            p = t.float()
            out = torch.bmm(p, p.transpose(1, 2))
        return out[:, :T, :T] if out.shape[1] != T else out
    if t.shape[1] != T:
        t = t[:, :T]
    return torch.bmm(t, t.transpose(1, 2))


def _gram_chunked(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """``t tᵀ`` per sample as float64 ``(N, T, T)``: the columns split into ``⌈w/chunk⌉`` blocks
    (zero-padded: exact), each block's Gram formed by a batched float32 matmul
    (:func:`_gram32`) — :func:`blocks_at_once` blocks at a time, so that at most that many blocks'
    Grams live at once, not all ``⌈w/chunk⌉`` of them — and summed in float64, each float32 Gram
    widened exactly: on the CPU added one by one into the total inside the addition (a reduction
    with a float64 result would first copy the group to float64; the group is laid out
    block-major, so each block's Grams are one contiguous operand), on other devices by one
    reduction per group, which widens as it reads (one kernel, not one per block). A block's Gram
    meets at most ``b − 1`` float64 additions in the first case and ``k − 1 + ⌈b/k⌉ ≤ b`` in the
    second (``b`` blocks, ``k`` at once; any order of summing ``k`` terms adds to each at most
    ``k − 1`` times), within the ``γ^{(64)}_{b+1}`` of :func:`gram_gamma`."""
    N, T, w = t.shape
    blocks = -(-w // chunk)
    if blocks * chunk != w:
        t = torch.nn.functional.pad(t, (0, blocks * chunk - w))
    parts = t.reshape(N, T, blocks, chunk)
    total: Optional[torch.Tensor] = None
    at_once = blocks_at_once(N, T, blocks)
    for first in range(0, blocks, at_once):
        k = min(at_once, blocks - first)
        group = parts[:, :, first:first + k].permute(2, 0, 1, 3).reshape(k * N, T, chunk)
        grams = _gram32(group).reshape(k, N, T, T)
        if t.device.type not in ADDED_ONE_BY_ONE:
            part = grams.sum(0, dtype=torch.float64)
            total = part if total is None else total.add_(part)
            continue
        for j in range(k):
            total = grams[j].double() if total is None else total.add_(grams[j])
    assert total is not None  # w ≥ 1: one block at least
    return total


def blocks_at_once(samples: int, positions: int, blocks: int) -> int:
    """Blocks whose Grams :func:`_gram_chunked` forms at once for ``samples`` operands of
    ``positions`` rows: ``GRAM_ENTRIES_AT_ONCE / (samples·positions²)``, at least one, at most
    ``blocks``."""
    return max(1, min(blocks, GRAM_ENTRIES_AT_ONCE // max(1, samples * positions * positions)))


def gram_gamma(width: int, tensor_core: bool, chunk: Optional[int] = None) -> float:
    """Relative bound ``γ`` of a Gram entry over ``width`` exact products (module docstring):
    ``γ_w`` at ``u = 2⁻²⁴`` (or the tensor cores' ``γ_{3w+3}`` at ``2⁻²³``) for one float32
    accumulation; with ``chunk``, blocks of ``chunk`` products accumulated so and the blocks' sums
    added in float64, ``γ_chunk + 2·γ^{(64)}_{blocks+1}`` (the float64 sum's error is at most
    ``γ^{(64)}`` of the blocks' absolute values, each within ``1 + γ_chunk`` of its absolute
    sum)."""
    n = width if chunk is None else min(chunk, width)
    own = tensor_core_gamma(n) if tensor_core else gamma(n, unit_roundoff(torch.float32))
    if chunk is None:
        return own
    return own + 2 * gamma(-(-width // chunk) + 1, unit_roundoff(torch.float64))


def _margin(T: int) -> float:
    """``1 + 2·γ^{(64)}_{T²+8}``: the relative rounding of the slack's own float64 terms (products
    of float64 values, sums of at most ``T²`` non-negative terms: :func:`weighted_abs_sum` rounds
    each term at most ``2T + 1`` times), doubled."""
    return 1 + 2 * gamma(T * T + 8, unit_roundoff(torch.float64))


def _floored(norms: torch.Tensor, width: int, eta: float, g: float) -> torch.Tensor:
    """``weight_scale(γ, T)·(n + c)`` with ``γ·c² = 2·width·η``: row norms raised so that
    ``γ·n'_t n'_s`` also covers what a Gram entry of ``width`` products loses below the normal
    range (``(n_t + c)(n_s + c) ≥ n_t n_s + c²``), and scaled so that the weighted forms of them
    carry ``γ``, the margin and the forms' own rounding (:func:`weight_scale`)."""
    return (norms + math.sqrt(2 * width * eta / g)).mul_(weight_scale(g, norms.shape[-1]))


def weight_scale(g: float, T: int) -> float:
    """``√(γ·margin·ρ_T)·(1 + 2⁻²³)``: the factor of the floored row norms ``n'`` in the weights of
    the slack's bilinear forms (module docstring; :func:`_margin`, :func:`form_constants`), the
    last factor keeping their float32 rounding above ``√(γ·margin·ρ_T)·n'``."""
    return math.sqrt(g * _margin(T) * form_constants(T).rho) * WEIGHT_RAISE


#: the factor on the float64 weights that keeps their float32 rounding above the exact weight
#: (:func:`weighted_form`)
WEIGHT_RAISE = 1 + 2.0 ** -23


class FormConstants(NamedTuple):
    """What the float32 arithmetic of the slack needs besides the layer's ``γ`` (module
    docstring): ``rho = ρ_T``, ``kappa = κ_T``, the float32 term ``row_loss = 8T·η'`` added to
    each row of a weighted form and ``absolute = 12T²·η' + 4T²·2⁻¹⁰²²``."""

    rho: float
    kappa: float
    row_loss: float
    absolute: float


@functools.lru_cache(maxsize=64)
def form_constants(T: int) -> FormConstants:
    """:class:`FormConstants` for ``T`` positions (Higham 2002, §3.1): ``ρ_T = 1 + 2(γ_{T+1} +
    γ^{(64)}_T)``, ``κ_T = γ_T + γ^{(64)}_T(1 + γ_T)`` (``γ`` at ``u = 2⁻²⁴``)."""
    u32, u64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)
    g32 = gamma(T, u32)
    return FormConstants(rho=1 + 2 * (gamma(T + 1, u32) + gamma(T, u64)),
                         kappa=g32 + gamma(T, u64) * (1 + g32),
                         row_loss=8.0 * T * ETA32,
                         absolute=12.0 * T * T * ETA32 + 4.0 * T * T * ETA64)


def ieee_matmul(device: torch.device) -> bool:
    """Whether float32 matmuls on ``device`` keep their operands in float32
    (:func:`.rounding.operand_unit` is 0: no TF32, no implicit bfloat16)."""
    return operand_unit(torch.float32, device) == 0.0


def row_dots(x: torch.Tensor, y: torch.Tensor, ieee: Optional[bool] = None) -> torch.Tensor:
    """``ν̃ = Σ_t fl32(Σ_s x_ts y_ts)`` over the last two dimensions of float32 ``x``, ``y``: the
    row dot products in float32 (:func:`row_dots32`) and their sum in float64. Rounding: the
    module docstring (``κ_T`` and ``8T²·η'``); a product above float32's range gives ``inf`` or
    NaN. ``ieee``: :func:`ieee_matmul` as the caller read it (read here when None)."""
    return row_dots32(x, y, ieee).sum(-1, dtype=torch.float64)


def row_dots32(x: torch.Tensor, y: torch.Tensor, ieee: Optional[bool] = None) -> torch.Tensor:
    """``fl32(Σ_s x_ts y_ts)`` per row t of float32 ``x``, ``y``: one batched matmul of ``1 × T``
    rows by ``T × 1`` columns where float32 matmuls are IEEE (:func:`ieee_matmul`), else
    element-wise products and a sum."""
    if ieee_matmul(x.device) if ieee is None else ieee:
        return torch.matmul(x.unsqueeze(-2), y.unsqueeze(-1)).squeeze(-1).squeeze(-1)
    return torch.mul(x, y).sum(-1)


def weighted_form(X: torch.Tensor, w: torch.Tensor, row_loss: float,
                  ieee: Optional[bool] = None) -> torch.Tensor:
    """``W = Σ_t w_t·fl32(Σ_s |X_ts|·v_s + row_loss)`` in float64 for a float32 ``X`` (its absolute
    value taken *in place*: the caller's temporary), float64 weights ``w ≥ 0`` from
    :func:`_floored` and ``v = fl32(w)``: the row sums by :func:`weighted_rows32`, the products
    by ``w`` widened to float64 inside one multiplication. ``ρ_T·W`` is at least
    ``Σ_{t,s} w_t|X_ts|w_s`` (module docstring); ``inf`` or NaN where a weight, a product or a
    row leaves float32's range, or ``X`` is not finite. ``ieee``: as for :func:`row_dots`."""
    rows = weighted_rows32(X, w, ieee)
    return torch.mul(rows.add_(row_loss), w).sum(-1)


def weighted_rows32(X: torch.Tensor, w: torch.Tensor,
                    ieee: Optional[bool] = None) -> torch.Tensor:
    """``fl32(Σ_s |X_ts|·fl32(w_s))`` per row t of a float32 ``X`` (its absolute value taken *in
    place*): one batched float32 matrix–vector product (element-wise products and a sum where
    matmuls may round float32 operands)."""
    v = w.float()
    X = X.abs_()
    if ieee_matmul(X.device) if ieee is None else ieee:
        return torch.matmul(X, v.unsqueeze(-1)).squeeze(-1)
    return torch.mul(X, v.unsqueeze(-2)).sum(-1)


def ghost_slack(wg: torch.Tensor, wa: torch.Tensor, cross: torch.Tensor, mag: torch.Tensor,
                c: FormConstants) -> torch.Tensor:
    """``W_G + W_A + κ_Tρ_T·S + cross² + absolute`` (module docstring) from the weighted forms
    ``W_G``, ``W_A`` (:func:`weighted_form`), ``S`` the computed ``Σ |Ã||G̃|`` (:func:`row_dots` of
    the absolute values) and ``cross = Σ_t n2_t m2_t``; NaN or ``inf`` when any of them is."""
    return torch.add(wg, wa).add_(mag, alpha=c.kappa * c.rho).addcmul_(cross, cross).add_(
        c.absolute)


def inner64(x: torch.Tensor, y: torch.Tensor, dims: Tuple[int, ...]) -> torch.Tensor:
    """``Σ x∘y`` over ``dims`` in float64, the products formed in float64 (exact for float32
    factors) and summed by one reduction: ``x`` widened to float64 once, ``y`` read as it is
    (float32 values widen exactly inside the product; no float64 copy of ``y``)."""
    x64 = x.double()
    return (x64.mul_(y) if x64 is not x else x64 * y).sum(dims)


def weighted_abs_sum(n: torch.Tensor, G: torch.Tensor, m: torch.Tensor, A: torch.Tensor,
                     one_pass: Optional[bool] = None) -> torch.Tensor:
    """``Σ_{t,s} (n_t n_s·|G_ts| + m_t m_s·|A_ts|)`` per sample (over the last two dimensions of
    ``G``, ``A``; ``n``, ``m`` float64 and non-negative) as two bilinear forms,
    ``Σ_t (n_t·Σ_s |G_ts|·n_s + m_t·Σ_s |A_ts|·m_s)``, in float64: one product per Gram entry
    (float32 Grams widen exactly inside it) and one reduction of it (:func:`_abs_rows`), no
    ``(…, T, T)`` outer product of the weights.

    Rounding (Higham 2002, §3.1; every term non-negative): a term ``n_t·|G_ts|·n_s`` meets one
    rounded product, ``T − 1`` additions in its row sum, one product by ``n_t``, one addition of
    the two forms' rows and ``T − 1`` additions over t, so the result is at least
    ``(1 − γ^{(64)}_{2T+1})`` times the exact sum, within the ``1 − γ^{(64)}_{T²+2}`` that
    :func:`_margin` covers (``2T + 1 ≤ T² + 2``). The products neither underflow nor lose
    anything below float64's normal range: the weights are floored (:func:`_floored`) far above
    it."""
    rows = _abs_rows(G, n, one_pass).mul_(n)
    return rows.addcmul_(_abs_rows(A, m, one_pass), m).sum(-1)


def _abs_rows(X: torch.Tensor, v: torch.Tensor, one_pass: Optional[bool] = None) -> torch.Tensor:
    """``Σ_s |X_ts|·v_s`` per row t in float64 for ``v ≥ 0``: the products ``X_ts·v_s`` and the
    sum of their absolute values — with ``one_pass`` (the default on ``L1_IN_ONE_PASS``: CUDA)
    by one L1-norm reduction, no separate absolute-value pass over the ``(…, T, T)`` products;
    else (the default on the CPU, faster there) by an in-place absolute value and a sum."""
    y = X * v.unsqueeze(-2)
    if one_pass is None:
        one_pass = y.device.type in L1_IN_ONE_PASS
    return torch.linalg.vector_norm(y, ord=1, dim=-1) if one_pass else y.abs_().sum(-1)


def fast_ghost_bound(a: torch.Tensor, g: torch.Tensor, bias: bool, na: torch.Tensor,
                     ng: torch.Tensor, tensor_core: bool, eta: float,
                     chunk: Optional[int] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(bound, slack, ν̃)``: a float64 upper bound of ``ν_i = ⟨ã ãᵀ, g gᵀ⟩`` per sample from
    Grams formed in float32 (module docstring), ``(max(ν̃, 0) + slack)·(1 + 2⁻⁵⁰)`` (the last
    factor: the float64 addition), the slack, and the computed ghost norm ``max(ν̃, 0)``.

    One float32 Gram per side: :func:`ghost_terms` (``ν̃`` by float32 row dot products, the slack
    from float32 matrix–vector products, :func:`ghost_slack`). With ``chunk`` (the second try):
    Grams formed in blocks of that many columns whose float32 Grams are summed in float64
    (:func:`gram_gamma`: a bound ``width/chunk`` times tighter, for the same float32 FLOPs), their
    inner product and weighted forms in float64 (:func:`inner64`, :func:`weighted_abs_sum`),
    ``slack = γ_a·n'ᵀ|G̃|n' + γ_g·m'ᵀ|Ã|m' + (γ_aγ_g + γ^{(64)}_{T²+2}(1 + γ_a)(1 + γ_g))·M'²``
    (times :func:`_margin`, plus ``4T²·2⁻¹⁰²²``).

    ``a: (N, T, D)``, ``g: (N, T, p)`` of one non-float64 dtype; ``na``, ``ng``: float64 ``(N, T)``
    upper bounds of ``‖ã_t‖`` (bias column included) and ``‖g_t‖``, raised by the underflow floor
    (:func:`_floored`: ``U`` of the module docstring folded into ``γ``)."""
    T = a.shape[1]
    wa, wg = a.shape[2] + bias, g.shape[2]
    ga, gg = gram_gamma(wa, tensor_core, chunk), gram_gamma(wg, tensor_core, chunk)
    n2, m2 = _floored(na, wa, eta, ga), _floored(ng, wg, eta, gg)
    if chunk is None:
        aat, ggt = _gram32(a), _gram32(g)
        if bias:
            aat.add_(1)  # one more float32 addition: the w_a-th term of the sum
        nu, slack = ghost_terms(aat, ggt, n2, m2, form_constants(T))
        return (nu + slack).mul_(1 + 2.0 ** -50), slack, nu
    aat, ggt = _gram_chunked(a, chunk), _gram_chunked(g, chunk)
    if bias:
        aat.add_(1)  # one more float64 addition
    # one reduction of T² products (rounded once for the blocked float64 Grams)
    nu = inner64(aat, ggt, (1, 2)).clamp_(min=0)
    weighted = weighted_abs_sum(n2, ggt, m2, aat)
    del aat, ggt
    inner = gamma(T * T + 2, unit_roundoff(torch.float64)) * (1 + ga) * (1 + gg)
    # (Σ n2·m2)² ≥ γ_aγ_g·margin²·M'²
    cross = (n2 * m2).sum(1)
    slack = torch.addcmul(weighted, cross, cross, value=1 + inner / (ga * gg)).add_(
        4.0 * T * T * ETA64)
    return (nu + slack).mul_(1 + 2.0 ** -50), slack, nu


def grow_of(g: float, c: FormConstants) -> float:
    """``1 + κ_T·(1 + γ)/γ``: the factor of a weighted form (of weights carrying ``γ``) that also
    bounds the rounding of row sums of the Gram it weighs (:func:`certified_token_ghost_sq`)."""
    return 1 + c.kappa * (1 + g) / g


def ghost_terms(aat: torch.Tensor, ggt: torch.Tensor, n2: torch.Tensor, m2: torch.Tensor,
                c: FormConstants) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(max(ν̃, 0), slack)`` over the last two dimensions of the float32 Grams ``aat``, ``ggt``
    (``(…, T, T)``; their absolute values are taken *in place*: temporaries of the caller) with
    the scaled weights ``n2``, ``m2`` (:func:`_floored`, ``(…, T)`` float64): ``ν̃`` by
    :func:`row_dots`, the weighted forms (:func:`weighted_form`), ``Σ |Ã||G̃|`` by :func:`row_dots`
    of the absolute values, and :func:`ghost_slack`. Float32 passes over the Grams: two row dot
    products (matmuls, or element-wise products and sums), two absolute values, two
    matrix–vector products; nothing of ``(…, T, T)`` in float64. A ``ν̃`` that is not finite (row
    dot products that overflowed, with either sign) is returned as NaN, never clamped to 0: the
    sample's bound is then NaN and it gets its second try (:func:`refine`)."""
    ieee = ieee_matmul(aat.device)  # the precision switches, read once for the four passes
    nu = _nonnegative_or_nan(row_dots(aat, ggt, ieee))
    wg = weighted_form(ggt, n2, c.row_loss, ieee)
    wa = weighted_form(aat, m2, c.row_loss, ieee)
    mag = row_dots(aat, ggt, ieee)  # Σ |Ã||G̃|: both are absolute values now
    cross = (n2 * m2).sum(-1)
    return nu, ghost_slack(wg, wa, cross, mag, c)


def _nonnegative_or_nan(x: torch.Tensor) -> torch.Tensor:
    """``max(x, 0)`` for finite ``x``; NaN for ``±inf`` and NaN (a computed ghost norm that
    overflowed is never clamped to 0 or kept as ``inf``: :func:`tight` then refuses it)."""
    return torch.nan_to_num(x, nan=math.nan, posinf=math.nan, neginf=math.nan).clamp_(min=0)


def float64_ghost_bound(a: torch.Tensor, g: torch.Tensor, bias: bool,
                        mass: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``ν_i`` from Grams formed in float64 (exact products of float32 or 16-bit
    values): ``max(ν̃, 0) + c·M²`` (:func:`private_engine.layers.rounding.gram_coefficient`)."""
    from .base import gram_inner_float64

    c_nu = gram_coefficient(a.shape[2] + bias, g.shape[2], a.shape[1],
                            unit_roundoff(torch.float64))
    nu = gram_inner_float64(a, g, bias)
    return nu.clamp(min=0) + c_nu * mass * mass


@without_autocast
def certified_ghost_sq(a: torch.Tensor, g: torch.Tensor, bias: bool, na: torch.Tensor,
                       ng: torch.Tensor, c_rel: float = 0.0,
                       gradients_first: bool = False) -> Optional[torch.Tensor]:
    """A float64 upper bound ``(N,)`` of the ghost norm ``⟨ã ãᵀ, g gᵀ⟩``, every rounding included,
    from fast Grams (:func:`fast_ghost_bound`) with a second try (:func:`second_try`) for the
    samples whose fast bound is loose or not finite; None when the operands have no fast path
    (:func:`fast_gram_model`: the caller keeps its float64 path). ``c_rel``: the release
    coefficient the caller adds to the norm (``c_r·M``, :func:`.rounding.certified_ghost`), which
    sets how loose a kept bound may be (:func:`release_term`, :func:`tight`).

    ``gradients_first``: where the per-sample gradients take fewer products than the Grams
    (:func:`instantiation_pays`), they are the first try (:func:`instantiated_ghost_bound`: no
    ``(N, T, T)`` Gram at all), the float64 Grams the second; their slack, ``≈ 2γ_{T+1}·M·√ν``,
    is below the ``2c_r·M·√ν`` that :func:`tight` allows whenever ``c_r ≥ γ_{T+1}`` (a release
    over the batch's ``B·T`` rows), so only samples whose gradient cancels below its own rounding
    take the second."""
    model = fast_gram_model(a)
    if model is None or a.shape[1] == 1:
        return None
    release = release_term(na, ng, c_rel)
    if gradients_first and instantiation_pays(a.shape[1], a.shape[2] + bias, g.shape[2], model):
        bound, slack, nu = instantiated_ghost_bound(a, g, bias, na, ng)
        return refine(bound, slack, nu,
                      lambda idx: exact_ghost_bound(a, g, bias, na, ng, idx),
                      loose_floor(a.shape[1]), release)
    bound, slack, nu = fast_ghost_bound(a, g, bias, na, ng, *model)
    return refine(bound, slack, nu,
                  lambda idx: second_try(a, g, bias, na, ng, model, idx, c_rel),
                  loose_floor(a.shape[1]), release)


def release_term(na: torch.Tensor, ng: torch.Tensor, c_rel: float) -> Optional[torch.Tensor]:
    """``c_r·Σ_t n_t m_t`` per sample (row of ``na``, ``ng``): the release's own rounding bound,
    which the caller adds to the norm (:func:`.rounding.certified_ghost`), without the mass's
    rounding raise (it only sets how loose a kept bound may be, :func:`tight`); None for
    ``c_rel = 0``."""
    return (na * ng).sum(-1).mul_(c_rel) if c_rel else None


def loose_floor(T: int) -> float:
    """The slack below which a fast bound of ``T`` positions is kept, loose or not:
    ``NEGLIGIBLE`` plus the absolute terms of the float32 arithmetic (:func:`form_constants`),
    which a zero or tiny gradient gets whatever its value."""
    return NEGLIGIBLE + form_constants(T).absolute


def exact_ghost_bound(a: torch.Tensor, g: torch.Tensor, bias: bool, na: torch.Tensor,
                      ng: torch.Tensor, idx: Union[torch.Tensor, slice]) -> torch.Tensor:
    """:func:`float64_ghost_bound` of the samples ``idx`` (indices or a slice), with their mass
    ``M_i = Σ_t n_t m_t·(1 + γ^{(64)}_{T+4})`` from the row-norm bounds ``na``, ``ng``."""
    mass = (na[idx] * ng[idx]).sum(1) * (1 + gamma(na.shape[1] + 4,
                                                     unit_roundoff(torch.float64)))
    return float64_ghost_bound(a[idx], g[idx], bias, mass)


def second_try(a: torch.Tensor, g: torch.Tensor, bias: bool, na: torch.Tensor,
               ng: torch.Tensor, model: Tuple[bool, float], idx: torch.Tensor,
               c_rel: float = 0.0) -> torch.Tensor:
    """The bounds of the samples ``idx`` whose fast bound was loose or not finite: the
    per-sample gradients where they take fewer products than the Grams
    (:func:`instantiation_pays`, :func:`instantiated_ghost_bound`), else Grams in blocks of
    ``CHUNK`` columns (:func:`fast_ghost_bound` with ``chunk``) — float64 Grams at once for
    operands narrower than two blocks —, then float64 Grams (:func:`exact_ghost_bound`) for those
    still loose (``c_rel``: as for :func:`certified_ghost_sq`)."""
    if (max(a.shape[2], g.shape[2]) < 2 * CHUNK
            and not instantiation_pays(a.shape[1], a.shape[2] + bias, g.shape[2], model)):
        return exact_ghost_bound(a, g, bias, na, ng, idx)
    return second_try_rows(a[idx], g[idx], bias, na[idx], ng[idx], model, c_rel)


def second_try_rows(a: torch.Tensor, g: torch.Tensor, bias: bool, na: torch.Tensor,
                    ng: torch.Tensor, model: Tuple[bool, float],
                    c_rel: float = 0.0) -> torch.Tensor:
    """:func:`second_try` of every sample (row of dim 0) of ``a``, ``g``, ``na``, ``ng``: the
    per-sample gradients (:func:`instantiated_ghost_bound`) where :func:`instantiation_pays`,
    else Grams in blocks of ``CHUNK`` columns; then float64 Grams for those still loose. On
    ``FLOAT64_SECOND_TRY`` devices (the CPU) the float64 Grams are formed at once instead of the
    blocked ones (:func:`float64_rows`). Each
    sample's bound is its own (the rows are independent), so the rows may be those of several
    layers with equal widths, positions, bias and fast-Gram model."""
    if instantiation_pays(a.shape[1], a.shape[2] + bias, g.shape[2], model):
        b2, s2, n2 = instantiated_ghost_bound(a, g, bias, na, ng)
    elif a.device.type in FLOAT64_SECOND_TRY:
        return float64_rows(a, g, bias, na, ng)
    else:
        b2, s2, n2 = fast_ghost_bound(a, g, bias, na, ng, *model, chunk=CHUNK)
    return refine(b2, s2, n2, lambda j: exact_ghost_bound(a, g, bias, na, ng, j), NEGLIGIBLE,
                  release_term(na, ng, c_rel))


#: device types whose second try forms float64 Grams at once rather than float32 Grams in
#: blocks (:func:`second_try_rows`): on the CPU a float64 matmul costs about what the blocked
#: float32 Grams and their float64 sums do (2-core AMD EPYC: 40 against 38 ms for 8 samples of
#: 197 positions, 768 and 2304 wide; 58 against 69 ms at 3072 and 768), with two operations per
#: side instead of one per block, and the bound it gives is the tighter, final one
FLOAT64_SECOND_TRY = ("cpu",)
#: bytes of float64 operands and Grams one run of :func:`float64_rows` holds (64 MiB)
FLOAT64_ROWS_BYTES = 1 << 26


def float64_rows(a: torch.Tensor, g: torch.Tensor, bias: bool, na: torch.Tensor,
                 ng: torch.Tensor) -> torch.Tensor:
    """:func:`exact_ghost_bound` of every sample (row of dim 0): float64 Grams, their inner
    product ``max(ν̃, 0) + c_ν·M²`` (:func:`float64_ghost_bound`), formed for runs of samples
    whose float64 operands and Grams take at most ``FLOAT64_ROWS_BYTES`` (one sample at least)."""
    N, T = a.shape[0], a.shape[1]
    per = max(1, FLOAT64_ROWS_BYTES // (8 * T * (a.shape[2] + g.shape[2] + 2 * T)))
    if per >= N:
        return exact_ghost_bound(a, g, bias, na, ng, slice(None))
    return torch.cat([exact_ghost_bound(a, g, bias, na, ng, slice(s, s + per))
                      for s in range(0, N, per)])


def instantiation_pays(T: int, wa: int, p: int, model: Tuple[bool, float]) -> bool:
    """Whether a second try forms the per-sample gradients ``g_iᵀ ã_i`` (``p·w_a`` entries of
    ``T`` products each) rather than Grams (``T²`` entries of ``w_a + p`` products): where
    ``p·w_a ≤ T·(w_a + p)`` — the patch embeddings and token-wise Linears of vision transformers
    (ViT-Tiny at 224²: 147 456 against 188 356 products per position for the patch embedding,
    111 168 against 151 493 for ``qkv``) — and the Grams' model is IEEE float32 accumulation
    (not the tensor cores', whose per-sample gradients would carry their pessimistic ``γ``)."""
    return not model[0] and p * wa <= T * (wa + p)


#: per-sample gradient entries (samples × ``p·w_a``) :func:`instantiated_ghost_bound` forms at once
#: (32 MiB of float32)
GRADIENT_ENTRIES_AT_ONCE = 1 << 23


def instantiated_ghost_bound(a: torch.Tensor, g: torch.Tensor, bias: bool, na: torch.Tensor,
                             ng: torch.Tensor
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(bound, slack, ν̃)``: a float64 upper bound of ``ν_i = ‖g_iᵀ ã_i‖²_F`` per sample from the
    per-sample gradient formed by a float32 matmul (16-bit operands widened to float32: exact),
    with ``ν̃`` the computed bound of ``‖G̃_i‖²`` and ``slack = bound − ν̃``.

    ``G̃ = fl(gᵀ a)`` (and the bias column ``fl(Σ_t g_t)``), every entry a sum of ``T`` products
    in any order (Higham 2002, §3.1): ``|G̃_kl − G_kl| ≤ γ_{T+1}·Σ_t |g_tk||ã_tl| + 4T·η`` (``η =
    2⁻¹²⁶`` for each product or sum below the normal range, carried through at most ``T``
    roundings), so ``‖G̃ − G‖_F ≤ γ_{T+1}·‖|g|ᵀ|ã|‖_F + 4T·η·√(p·w_a)`` and
    ``‖|g|ᵀ|ã|‖_F ≤ Σ_t ‖ã_t‖‖g_t‖ ≤ M = Σ_t n_t m_t·(1 + γ^{(64)}_{T+4})`` (the triangle
    inequality; ``na``, ``ng`` the row-norm bounds ``n_t ≥ ‖ã_t‖``, ``m_t ≥ ‖g_t‖``). With
    ``S ≥ ‖G̃‖²`` from :func:`.rounding.norm_sq64` (its rounding included):
    ``ν ≤ (√S + γ_{T+1}·M + 4T·η·√(p·w_a))²``, times ``1 + 2⁻⁴⁸`` for the float64 square root,
    products, sums and square of this assembly. An entry that overflows gives ``inf`` or NaN:
    a bound that is never kept (:func:`tight`).

    Per-sample gradients of ``GRADIENT_ENTRIES_AT_ONCE`` entries at a time; a second try only
    (:func:`second_try_rows`): where ``‖G‖`` is far below ``M`` (positions built to cancel) the
    bound is loose, and the float64 Grams follow."""
    N, T, p = g.shape
    wa = a.shape[2] + bias
    a32 = a if a.dtype == torch.float32 else a.float()
    g32 = g if g.dtype == torch.float32 else g.float()
    per = max(1, GRADIENT_ENTRIES_AT_ONCE // (p * wa))
    parts = []
    for s in range(0, N, per):
        gs = g32[s:s + per]
        sq = norm_sq64(torch.bmm(gs.transpose(1, 2), a32[s:s + per]))
        if bias:
            sq = sq + norm_sq64(gs.sum(1))
        parts.append(sq)
    nu = parts[0] if len(parts) == 1 else torch.cat(parts)
    mass = (na * ng).sum(1) * (1 + gamma(T + 4, unit_roundoff(torch.float64)))
    lost = 4.0 * T * ETA32 * math.sqrt(p * wa)
    root = nu.sqrt().mul_(1 + 2.0 ** -51).add_(mass, alpha=gamma(T + 1, unit_roundoff(
        torch.float32))).add_(lost)
    bound = root.square_().mul_(1 + 2.0 ** -48)
    return bound, (bound - nu).clamp_(min=0), nu


def refine(bound: torch.Tensor, slack: torch.Tensor, nu: torch.Tensor, exact,
           floor: float = NEGLIGIBLE, release: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``bound`` with the samples whose fast bound is not finite or loose (:func:`tight`, with
    ``floor`` and the release term ``release``) replaced by ``exact(indices)`` (a tighter try), on
    every device: one host synchronisation reads whether any is. A loose bound is an upper bound
    all the same, but under the pessimistic tensor-core model of 16-bit CUDA Grams an honest
    sample's fast bound can be several times 10⁻³ above its norm; the tighter try keeps it within
    about 5·10⁻⁴. A non-finite bound (a float32 product or weighted row that overflowed where the
    float64 Grams of the tighter try do not) is never kept."""
    ok = tight(bound, slack, nu, floor, release)
    if bool(ok.all()):
        return bound
    idx = (~ok).nonzero().squeeze(1)
    return bound.index_put((idx,), exact(idx))


def tight(bound: torch.Tensor, slack: torch.Tensor, nu: torch.Tensor,
          floor: float = NEGLIGIBLE, release: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which fast bounds are kept: finite, with ``slack ≤ max(LOOSE·ν̃, floor, 2r·√ν̃)`` (False
    for NaN slacks, for a NaN ``ν̃``, and for an infinite slack through the bound it makes
    infinite, ``bound ≥ slack``, even where an infinite ``r`` would allow it).

    ``r = release`` (:func:`release_term`, omitted: 0) is the release's own rounding bound
    ``c_r·M``, which the caller adds to the norm, ``(√(ν̃ + slack) + r)²``
    (:func:`.rounding.certified_ghost`). A slack of at most ``2r·√ν̃`` raises the norm bound
    ``√(ν̃ + slack) ≤ √ν̃ + r`` by no more than that term, which no second try removes: the clip
    factor is then as precise as the release's rounding allows (the released bound at most
    ``√ν̃ + 2r`` against ``√ν̃ + r`` after a tighter try). Whatever is kept, the bound is
    ``ν̃ + slack``: an upper bound of the norm, so the choice is one of precision, never of
    privacy. ViT-Tiny's ``qkv`` at 224² (noise inputs, batch 16): ``r ≈ 1.5·10⁻³·√ν``, slack
    ``0.9–1.3·10⁻³·ν``: kept."""
    allowed = (LOOSE * nu).clamp_(min=floor)
    if release is not None:
        allowed = torch.maximum(allowed, nu.sqrt().mul_(release).mul_(2))
    return (slack <= allowed).logical_and_(bound < math.inf)


@without_autocast
def certified_token_ghost_sq(ids: torch.Tensor, g: torch.Tensor,
                             ng: torch.Tensor) -> Optional[torch.Tensor]:
    """A float64 upper bound ``(N,)`` of an embedding's ghost norm ``ν = Σ_{t,s} 1[x_t = x_s]·G_ts``
    (``ids: (N, T)`` token ids, ``g: (N, T, p)``, ``ng`` float64 upper bounds of ``‖g_t‖``) from
    the Gram ``G̃ = g gᵀ`` formed in float32; the float64 Gram for the samples whose bound is
    loose or not finite; None when ``g`` has no fast path.

    The token-equality side ``S`` is exact, so ``|ν − Σ S G̃| ≤ γ_p·m'ᵀ S m'`` (module docstring;
    ``m'`` the row norms raised by the underflow floor, :func:`_floored`). ``G̃`` masked by ``S``
    in place (a product by 1 or 0: exact), ``ν̃`` its float32 row sums summed in float64 (within
    ``κ_T·Σ S|G̃| + 8T²·η'`` of ``Σ S G̃``, and ``Σ S|G̃| ≤ (1 + γ_p)·m'ᵀ S m'``), and the form
    ``W = m2ᵀ S m2`` by :func:`weighted_form` of ``S`` as float32 (at least ``γ_p·margin`` times
    ``m'ᵀ S m'``): ``slack = W·(1 + κ_g) + 8T²·η' + 4T²·2⁻¹⁰²²``, ``κ_g = κ_T(1 + γ_p)/γ_p``."""
    model = fast_gram_model(g)
    T, p = g.shape[1], g.shape[2]
    if model is None or T == 1:
        return None
    tensor_core, eta = model
    gg = gram_gamma(p, tensor_core)
    c = form_constants(T)
    same = ids.unsqueeze(2) == ids.unsqueeze(1)
    raw = _gram32(g).mul_(same).sum(-1).sum(-1, dtype=torch.float64)
    nu = _nonnegative_or_nan(raw)
    m2 = _floored(ng, p, eta, gg)
    weighted = weighted_form(same.float(), m2, c.row_loss)
    slack = weighted.mul_(grow_of(gg, c)).add_(c.absolute)
    bound = (nu + slack).mul_(1 + 2.0 ** -50)

    def exact(idx: torch.Tensor) -> torch.Tensor:
        gi = g[idx].double()
        nu64 = torch.bmm(gi, gi.transpose(1, 2)).mul_(same[idx]).sum(2).sum(1)
        m = ng[idx].sum(1) * (1 + gamma(T + 4, unit_roundoff(torch.float64)))
        c_nu = gram_coefficient(1, p, T, unit_roundoff(torch.float64))
        return nu64.clamp(min=0) + c_nu * m * m

    return refine(bound, slack, nu, exact, loose_floor(T))
