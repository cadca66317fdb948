"""Rounding-error bounds that make per-sample norms *certified* upper bounds.

A sample is private only if what is released for it, ``C_i·ĝ_i``, has norm at most R. The engine
computes ``ĝ_i``'s norm in floating point, and the release ``ĝ_i`` itself is a floating-point
computation; an adversary who controls one sample can choose values that make a sum of many terms
of both signs cancel (a ghost norm ``⟨a aᵀ, g gᵀ⟩`` that rounds to 0 while the true norm is 10⁵).
So every norm the engine clips by is an upper bound of the exact norm of the released quantity,
with every rounding error on the way included.

The model of floating-point arithmetic is the standard one (Higham, "Accuracy and Stability of
Numerical Algorithms", 2nd ed., 2002, §2.2 and Lemma 3.1/§3.1): every operation returns the exact
result times ``(1 + δ)`` with ``|δ| ≤ u`` (``u`` the unit roundoff of the dtype), and a sum of
``n`` terms in *any* order satisfies ``|fl(Σ x_k) − Σ x_k| ≤ γ_{n−1}·Σ|x_k|`` with
``γ_n = n·u / (1 − n·u)``. Products of two float32 (or bfloat16/float16) numbers are exact in
float64, so quantities formed in float64 from such operands carry only float64 summation errors.

The *mass* of a sample at a layer is ``M_i = Σ_t ‖ã_{i,t}‖·‖g_{i,t}‖`` (``ã_t`` the input at
position t with a constant 1 appended when the bias is trained, ``g_t`` the output gradient). It
bounds the per-sample gradient (``‖Σ_t g_t ã_tᵀ‖_F ≤ M``, the triangle inequality) and the
element-wise absolute product (``‖|g|ᵀ|ã|‖_F ≤ M``) that every rounding bound of that gradient is
proportional to. For honest data ``M ≈ √T·‖G‖``; a crafted sample has ``M ≫ ‖G‖``, and the
bounds below then grow with ``M`` rather than with the (cancelled) value.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

_UNIT = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
         torch.float16: 2.0 ** -11}
#: unit roundoff of TensorFloat-32 operands (10 explicit mantissa bits), used by CUDA float32
#: matmuls/convolutions when torch.backends.{cuda.matmul,cudnn}.allow_tf32 is set
TF32_UNIT = 2.0 ** -11


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u`` of a floating dtype: 2⁻⁵³ (float64), 2⁻²⁴ (float32), 2⁻¹¹ (float16), 2⁻⁸ (bfloat16)."""
    return _UNIT[dtype]


def gamma(n: int, u: float) -> float:
    """``γ_n = n·u / (1 − n·u)`` (Higham 2002, Lemma 3.1): the relative error bound of ``n``
    successive roundings; ``inf`` when ``n·u ≥ 1/2`` (no bound)."""
    nu = max(n, 0) * u
    return nu / (1.0 - nu) if nu < 0.5 else math.inf


def accumulator_unit(dtype: torch.dtype) -> float:
    """Unit roundoff of the accumulator a matmul or reduction uses for operands of ``dtype``:
    float64 stays float64; float32, bfloat16 and float16 accumulate in float32."""
    return unit_roundoff(torch.float64 if dtype == torch.float64 else torch.float32)


def operand_unit(dtype: torch.dtype, device: torch.device, conv: bool = False) -> float:
    """Relative rounding of one float32 operand *inside* a matmul (``conv=False``) or convolution
    kernel, as torch's precision switches allow it: on CUDA TF32 (10 mantissa bits, ``u = 2⁻¹¹``)
    under ``backends.cuda.matmul.allow_tf32`` / ``backends.cudnn.allow_tf32`` or
    ``fp32_precision = "tf32"``; on the CPU oneDNN's
    ``backends.mkldnn.{matmul,conv}.fp32_precision`` ("bf16": bfloat16 operands, ``u = 2⁻⁸``;
    "tf32"), which ``torch.set_float32_matmul_precision`` ("medium", "high") also sets. 0 for
    IEEE float32 and for every other dtype. Pessimistic: the coarsest rounding that any level of
    the switch (operation, backend, global) allows, since a kernel may honour either. A legacy
    ``allow_tf32`` flag torch refuses to read (its legacy and current APIs mixed) counts as set."""
    if dtype != torch.float32:
        return 0.0
    return max((_PRECISION_UNIT.get(p, TF32_UNIT) for p in _fp32_precisions(device.type, conv)),
               default=0.0)


#: relative operand rounding of each value of torch's ``fp32_precision`` switches
_PRECISION_UNIT = {"none": 0.0, "ieee": 0.0, "tf32": TF32_UNIT, "bf16": 2.0 ** -8}


def _fp32_precisions(device_type: str, conv: bool) -> Tuple[str, ...]:
    """The values of the float32 precision switches that govern a matmul (or convolution) on
    ``device_type``: the operation's, its backend's, the global one and, on CUDA, the legacy
    ``allow_tf32`` flag ("tf32" when set); "unknown" where torch refuses to say."""
    backends = torch.backends
    operation = "conv" if conv else "matmul"
    chain: list
    if device_type == "cuda":
        chain = ([getattr(backends.cudnn, "conv"), backends.cudnn] if conv  # not in torch's stubs
                 else [backends.cuda.matmul])
        legacy = (backends.cudnn, "allow_tf32") if conv else (backends.cuda.matmul, "allow_tf32")
    elif device_type == "cpu":
        chain = [getattr(backends.mkldnn, operation), backends.mkldnn]
        legacy = None
    else:
        return ()
    found = []
    for switch in chain + [backends]:
        try:
            found.append(str(getattr(switch, "fp32_precision", "none")))
        except RuntimeError:
            found.append("unknown")
    if legacy is not None:
        try:
            found.append("tf32" if getattr(*legacy) else "ieee")
        except RuntimeError:
            found.append("unknown")
    return tuple(found)


def release_coefficient(dtype: torch.dtype, device: torch.device, rows: int,
                        conv: bool = False) -> float:
    """``c`` such that a clipped sum formed from kept activations and output gradients,
    ``Gᵀ·diag(C)·A`` summed over ``rows`` positions of the whole batch, releases for sample i at
    most ``C_i·(‖G_iᵀ A_i‖_F + c·M_i)``.

    One operand is scaled by ``C`` in ``dtype`` (relative error ``u``), TF32 may round both
    operands (``2·u_tf32``), and the product is accumulated over ``rows`` terms in the
    accumulator (``γ_{rows+1}``, any summation order: the sample's share of the rounding is at
    most ``γ·C_i·‖|g_i|ᵀ|ã_i|‖_F ≤ γ·C_i·M_i``). Rounding of the *other* samples' terms does not
    depend on sample i beyond its clipped contribution and is not part of this bound.
    """
    tf32 = operand_unit(dtype, device, conv)
    return unit_roundoff(dtype) + 2 * tf32 + gamma(rows + 1, accumulator_unit(dtype))


def instantiation_coefficient(dtype: torch.dtype, device: torch.device, positions: int,
                              conv: bool = False) -> float:
    """``c`` with ``‖G̃_i − G_i‖_F ≤ c·M_i`` for a per-sample gradient ``G̃_i = fl(g_iᵀ a_i)``
    instantiated by a matmul over the sample's ``positions`` in ``dtype``: the accumulation
    (``γ_{T+1}``), TF32 operand rounding, and the rounding of the result to ``dtype``."""
    out = unit_roundoff(dtype) if dtype != torch.float64 else 0.0
    return (gamma(positions + 1, accumulator_unit(dtype)) + 2 * operand_unit(dtype, device, conv)
            + out)


def gram_coefficient(width_a: int, width_g: int, positions: int, gram_unit: float) -> float:
    """``c`` with ``|ν̃_i − ‖G_i‖²_F| ≤ c·M_i²`` for the ghost norm ``ν̃_i = ⟨Ã Ãᵀ, G Gᵀ⟩``:
    Gram entries formed over ``width_a`` / ``width_g`` columns with unit roundoff ``gram_unit``
    (``|ΔÃ_ts| ≤ γ·‖ã_t‖‖ã_s‖``, Cauchy–Schwarz) and their inner product in float64, an element-wise
    product summed over s and then over t (``γ^{(64)}_{2T}``). With both errors the bound is ``(γ_a
    + γ_g + γ_a·γ_g)·M² + γ^{(64)}_{2T+1}·(1 + γ_a)(1 + γ_g)·M²``; doubled for margin."""
    ga, gg = gamma(width_a, gram_unit), gamma(width_g, gram_unit)
    inner = gamma(2 * positions + 1, unit_roundoff(torch.float64))
    return 2.0 * (ga + gg + ga * gg + inner * (1 + ga) * (1 + gg))


def certified_ghost(nu: torch.Tensor, mass: torch.Tensor, c_nu: float,
                    c_rel: float, underflow: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Certified squared norm from a ghost norm: ``(√(max(ν̃, 0) + c_ν·M² + U) + c_r·M)²``.

    ``√(ν̃ + c_ν M² + U) ≥ ‖G‖`` (the ghost norm's own rounding, and ``U`` its products that
    underflowed: :func:`ghost_underflow`), ``+ c_r·M`` the release's
    (:func:`release_coefficient`). A negative ``ν̃`` (cancellation) is clamped: the bound holds
    all the same, so a crafted sample is clipped, never makes the step fail."""
    nu, mass = nu.double(), mass.double()
    base = nu.clamp(min=0) + c_nu * mass * mass
    if underflow is not None:
        base = base + underflow
    return (base.sqrt() + c_rel * mass).square()


#: the smallest positive normal number of float64 (2⁻¹⁰²²) and of float32 (2⁻¹²⁶): the most an
#: operation whose result lies below the normal range loses, flushed to zero or not. With gradual
#: underflow it loses at most half the subnormal step (Higham 2002, §2.4: ``fl(x∘y) = (x∘y)(1+δ)
#: + η``; sums of subnormals are exact); with flush-to-zero — ``torch.set_flush_denormal(True)``
#: on the CPU, device kernels built to flush — a result below the smallest normal number becomes
#: 0 (products, squares and sums alike). Inputs read as zero when subnormal change every kernel's
#: operands alike: what is released and what is bounded are formed from the same values.
ETA64 = 2.0 ** -1022
ETA32 = 2.0 ** -126
#: what a float32-accumulating tensor-core product may lose per term: the NVIDIA tensor cores are
#: not specified to keep subnormal results (Fasi, Higham, Mikaitis & Pranesh 2021, "Numerical
#: behavior of NVIDIA tensor cores": no subnormal support in some formats and paths), so a flushed
#: product loses up to the smallest normal float32, 2⁻¹²⁶
ETA_TENSOR_CORE = 2.0 ** -126


def gram_eta(gram_unit: float) -> float:
    """The absolute loss per product of the Grams ``ã ãᵀ``, ``g gᵀ`` formed at ``gram_unit``
    (:func:`private_engine.layers.base.gram_unit`): float64 Grams of float64 operands may
    underflow (``ETA64``); float32-accumulated Grams of 16-bit CUDA operands may flush
    (``ETA_TENSOR_CORE``)."""
    return ETA64 if gram_unit == unit_roundoff(torch.float64) else ETA_TENSOR_CORE


def ghost_underflow(a_sum: torch.Tensor, g_sum: torch.Tensor, width_a: int, width_g: int,
                    positions: int, eta: float) -> torch.Tensor:
    """``U``: what products lost below the normal range can take from a ghost norm ``ν̃ =
    ⟨Ã, G̃⟩`` of Grams ``Ã = ã ãᵀ`` (``width_a`` columns) and ``G̃ = g gᵀ`` (``width_g``).

    Each Gram entry sums ``width`` products, each losing at most ``eta``: ``|ΔÃ_ts| ≤ width_a·η``,
    which meets ``|G_ts| ≤ ‖g_t‖‖g_s‖`` in the inner product, so the ghost norm loses at most
    ``η·(width_a·(Σ_t‖g_t‖)² + width_g·(Σ_t‖ã_t‖)²)`` to the Grams' underflow, and
    ``2T²·2⁻¹⁰²²`` to its own float64 products (every factor raised by 2 for the cross terms and
    the rounding of the bound itself). ``a_sum``, ``g_sum``: upper bounds of ``Σ_t ‖ã_t‖`` and
    ``Σ_t ‖g_t‖`` per sample (:func:`row_norms64`, which count their own underflow)."""
    a_sum, g_sum = a_sum.double(), g_sum.double()
    lost = (width_a * g_sum.square() + width_g * a_sum.square()) * (2 * eta)
    return lost + 4.0 * positions * positions * ETA64


def certified_instantiated(norm_sq: torch.Tensor, mass: Optional[torch.Tensor], c_inst: float,
                           c_rel: float, terms: int) -> torch.Tensor:
    """Certified squared norm from an instantiated per-sample gradient ``G̃`` whose squared norm
    ``norm_sq`` was summed in float64 over ``terms`` elements:
    ``(‖G̃‖·(1 + γ^{(64)}_terms) + (c_inst + c_rel)·M)²``. ``mass=None``: the release is ``G̃``
    itself (kept, or recomputed identically), so only the float64 summation error remains."""
    own = 1 + gamma(terms + 2, unit_roundoff(torch.float64))
    norm = norm_sq.double().clamp(min=0).sqrt() * own
    if mass is None:
        return norm.square()
    return (norm + (c_inst + c_rel) * mass.double()).square()


#: elements whose squares are summed in float32 before the float64 sum (:func:`norm_sq64`)
SQUARE_BLOCK = 64
#: absolute slack per element for squares below float32's normal range: each is lost (flushed to
#: zero) or rounded by less than the smallest normal number, 2⁻¹²⁶ (``ETA32``)
_UNDERFLOW = ETA32


def _norms32(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Euclidean norms over ``dim`` computed in float32 (float64 stays float64), as float64."""
    if t.dtype == torch.float64:
        return torch.linalg.vector_norm(t, dim=dim)
    dtype = None if t.dtype == torch.float32 else torch.float32
    return torch.linalg.vector_norm(t, dim=dim, dtype=dtype).double()


def norm_sq64(t: torch.Tensor) -> torch.Tensor:
    """An upper bound (float64) of ``‖t_i‖²`` per leading index, rounding included.

    float64 tensors: summed in float64 (relative error ``γ^{(64)}_n``, covered by the callers),
    raised by ``n·2⁻¹⁰²²`` for squares below float64's normal range (a sample of values near 1e-160
    would otherwise get a norm of 0).
    Others, without a float64 copy of ``t`` (one would cost twice its memory and, on the CPU, 25×
    the time): the squares of each block of ``SQUARE_BLOCK`` consecutive elements are summed in
    float32 — positive terms, so the block's norm is exact to ``(1 + γ_L)(1 + u)`` whatever the
    order — and the blocks' squared norms are summed in float64; the result is raised by that factor
    and by ``n·2⁻¹²⁶`` for squares below float32's normal range (``ETA32``). A value so large that
    its square overflows float32 (|x| > 1.8e19) gives ``inf``: the engine then drops the sample."""
    B = t.shape[0]
    flat = t.reshape(B, -1)
    n = flat.shape[1]
    if flat.dtype == torch.float64:
        return torch.linalg.vector_norm(flat, dim=1).square() + n * ETA64
    m = n // SQUARE_BLOCK
    total: Optional[torch.Tensor] = None  # the sum of the parts below (0 + x is x: no zeros)
    if m:
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        blocks = flat.as_strided((B, m, SQUARE_BLOCK), (flat.stride(0), SQUARE_BLOCK, 1))
        total = _norms32(blocks, 2).square().sum(1)
    if n > m * SQUARE_BLOCK:
        tail = _norms32(flat[:, m * SQUARE_BLOCK:], 1).square()
        total = tail if total is None else total + tail
    if total is None:
        total = torch.zeros(B, dtype=torch.float64, device=t.device)
    u = unit_roundoff(torch.float32)
    factor = (1 + gamma(SQUARE_BLOCK, u)) * (1 + u) ** 2
    return total * factor + n * _UNDERFLOW


def row_norms64(t: torch.Tensor) -> torch.Tensor:
    """An upper bound (float64) of the Euclidean norms over the last dimension, ``(…, k) -> (…)``:
    computed in float32 (float64 stays float64) and raised by ``(1 + γ_{k+2})`` and the underflow
    slack — the rounding of a sum of k positive squares and of the square root."""
    norms = _norms32(t, -1)
    k = t.shape[-1]
    if t.dtype == torch.float64:
        return norms + (k * ETA64) ** 0.5
    return norms * (1 + gamma(k + 2, unit_roundoff(torch.float32))) + (k * _UNDERFLOW) ** 0.5


def pair_norms(a: torch.Tensor, g: torch.Tensor, bias: bool,
               weight: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Upper bounds (float64, ``(N, T)``) of ``‖ã_{i,t}‖`` and ``‖g_{i,t}‖`` for ``a: (N, T, D)``,
    ``g: (N, T, p)``; ``ã_t = (a_t, 1)`` with a trained bias, ``ã_t = 1`` when only the bias is
    trained."""
    ng = row_norms64(g)
    if not weight:
        return torch.ones_like(ng), ng
    na = row_norms64(a)
    if bias:
        na = (na.square() + 1).sqrt()
    return na, ng


def mass_of(na: torch.Tensor, ng: torch.Tensor, width: int) -> torch.Tensor:
    """``M_i = Σ_t ‖ã_{i,t}‖·‖g_{i,t}‖`` (float64, ``(N,)``) from :func:`pair_norms`: positive
    terms summed in float64, raised by ``γ_{T+2}`` (and the float64 row norms by the same order)
    and by ``T·2⁻¹⁰²²`` for products below the normal range."""
    slack = 1 + gamma(ng.shape[-1] + width + 4, unit_roundoff(torch.float64))
    return (na * ng).sum(1) * slack + ng.shape[-1] * ETA64


def pair_mass(a: torch.Tensor, g: torch.Tensor, bias: bool, weight: bool = True) -> torch.Tensor:
    """``M_i = Σ_t ‖ã_{i,t}‖·‖g_{i,t}‖`` for ``a: (N, T, D)``, ``g: (N, T, p)`` (float64, ``(N,)``):
    :func:`mass_of` of :func:`pair_norms`."""
    na, ng = pair_norms(a, g, bias, weight)
    return mass_of(na, ng, a.shape[-1])


def ghost_may_underflow(operand: torch.Tensor, gram_unit: float) -> bool:
    """Whether a ghost norm's products can fall below the normal range: float64 operands (their
    float64 products can), or 16-bit CUDA operands (float32-accumulated Grams). Products of
    float32 or 16-bit values formed in float64 cannot (the smallest, ``(2⁻¹⁴⁹)² = 2⁻²⁹⁸``, and
    the inner product's ``2⁻⁵⁹⁶`` are normal float64 numbers)."""
    return operand.dtype == torch.float64 or gram_unit != unit_roundoff(torch.float64)
