"""Row clipping and normalisation of the DP heads, exact in floating point for every finite record.

Clipping and normalisation hold for every finite record, whatever its magnitude (subnormal,
near the largest float, mixed): a row is first scaled by its largest magnitude,
``u = x/max_j|x_j|`` (so ``1 ≤ ‖u‖ ≤ √d`` and no square under- or overflows), and the clipping
norm is shrunk by a rounding margin ``(d + 16)·eps`` so that the computed clipped row has
``‖x̃‖ ≤ C`` in floating point, not only in exact arithmetic (:func:`clip_rows`,
:func:`normalize_rows`, :func:`row_scales`, :func:`rounding_margin`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["RowScales", "row_scales", "row_norms", "rounding_margin", "clip_rows", "normalize_rows",
           "check_clip_norm"]


class RowScales(NamedTuple):
    """Each row ``x_i`` of a matrix as ``s_i·u_i`` (:func:`row_scales`)."""

    #: ``s_i = max_j |x_ij|`` (1 for a zero row), shape (n,)
    scales: torch.Tensor
    #: ``u_i = x_i / s_i``, entries in [−1, 1], shape (n, d)
    unit: torch.Tensor


def row_scales(X: torch.Tensor) -> RowScales:
    """``RowScales(s, U)``: ``s_i = max_j |x_ij|`` (1 for a zero row) and ``U = X / s`` row-wise.

    Every ``|u_ij| ≤ 1`` and a nonzero row's largest is exactly 1, so ``1 ≤ ‖u_i‖₂ ≤ √d``: the
    squares in ``‖u_i‖`` neither overflow (rows near the largest float) nor all underflow
    (subnormal rows), and ``‖x_i‖ = s_i·‖u_i‖`` (the scaling of LAPACK's ``dnrm2``; Higham,
    "Accuracy and Stability of Numerical Algorithms", §27.5). A zero row gives ``u_i = 0``.
    """
    s = torch.amax(X.abs(), dim=1)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return RowScales(s, X / s[:, None])


def row_norms(X: torch.Tensor) -> torch.Tensor:
    """``‖x_i‖₂`` for every row ``x_i`` of X, as ``s_i·‖u_i‖`` (:func:`row_scales`): exact to
    rounding for every finite row; ``inf`` only where the norm itself exceeds the dtype's range."""
    s, U = row_scales(X)
    return s * torch.linalg.vector_norm(U, dim=1)


def rounding_margin(k: int, dtype: torch.dtype) -> float:
    """``(k + 16)·eps``: relative shrink of a clipping bound that absorbs the rounding of
    clipping a vector of ``k`` entries in ``dtype``.

    The computed ``‖u‖`` of :func:`row_scales`'s ``u`` has relative error at most about
    ``(k/2 + 2)·u`` (squares, any summation order, square root; Higham, Lemma 3.1, with
    ``u = eps/2`` the unit roundoff), and scaling by ``C/‖u‖`` adds two more roundings: a
    computed clipped row is within ``(1 + (k/2 + 5)·u)`` of the bound. Shrinking the bound by
    ``(k + 16)·eps`` (four times that, covering second-order terms) makes ``‖x̃‖ ≤ C`` hold
    for the floating-point result. In float64 this is ≈ 1e-13 for k = 512. A margin above 1 %
    (float32 with more than about 84,000 entries) is refused with a ValueError: fit in float64.
    """
    margin = (int(k) + 16) * torch.finfo(dtype).eps
    if margin > 1e-2:
        raise ValueError(f"{k} features are too many to clip exactly in {dtype} (rounding margin "
                         f"{margin:.3g}); fit with dtype=torch.float64.")
    return margin


def clip_rows(X: torch.Tensor, C: float) -> torch.Tensor:
    """``clip(x) = x·min(1, C/‖x‖₂)`` row-wise (Mehta et al., Alg. 1 line 1), for every finite x.

    Computed on ``u = x/max|x|`` (:func:`row_scales`) against ``C' = C·(1 − m)``,
    ``m = rounding_margin(d)``: a row with ``‖u‖ ≤ C'/s`` (``‖x‖ ≤ C'``) is returned unchanged,
    any other becomes ``u·C'/‖u‖``, so the floating-point result has ``‖x̃‖ ≤ C`` whether x is
    subnormal, near the largest float, or mixes both (no square is formed of x itself, so
    nothing under- or overflows; ``C'/s`` is 0 or inf only where the answer is clear: ``s`` is
    then far above C, resp. ``‖x‖ ≤ √d·s`` far below it). Zero rows stay zero.
    """
    s, U = row_scales(X)
    nu = torch.linalg.vector_norm(U, dim=1)
    bound = float(C) * (1.0 - rounding_margin(X.shape[1], X.dtype))
    keep = nu <= bound / s
    factor = bound / torch.where(nu > 0, nu, torch.ones_like(nu))
    return torch.where(keep[:, None], X, U * factor[:, None])


def normalize_rows(X: torch.Tensor) -> torch.Tensor:
    """``φ(x) = x/‖x‖₂`` row-wise (zero rows stay zero): a per-example map, free of privacy cost.

    Computed as ``u·(1 − m)/‖u‖`` with ``u = x/max|x|`` (:func:`row_scales`) and
    ``m = rounding_margin(d)``, so ``1 − 2m ≤ ‖φ(x)‖ ≤ 1`` in floating point for every finite
    nonzero x: subnormal rows (whose squares would underflow) and rows near the largest float
    (whose squares would overflow) included.
    """
    _, U = row_scales(X)
    nu = torch.linalg.vector_norm(U, dim=1)
    scale = (1.0 - rounding_margin(X.shape[1], X.dtype)) / torch.where(nu > 0, nu,
                                                                       torch.ones_like(nu))
    return U * scale[:, None]


def check_clip_norm(name: str, value: float, n: int, dtype: torch.dtype) -> float:
    """``float(value)`` if it is a usable clipping norm C for ``n`` examples in ``dtype``, else a
    ValueError naming it: ``C > 0`` finite, ``C²`` not below the smallest normal number (the
    Gram sensitivity C² and its noise would lose their precision) and ``(n + 1)·C²`` finite (the
    clipped sums stay finite)."""
    try:
        C = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number > 0, got {value!r}.") from None
    info = torch.finfo(dtype)
    if not (C > 0 and math.isfinite(C)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    if C * C < info.tiny or (n + 1) * C * C > info.max:
        raise ValueError(
            f"{name}={value!r} is out of range for {dtype} with {n} examples: C² must lie in "
            f"[{info.tiny:.3g}, {info.max / (n + 1):.3g}]. Rescale the features (and C) or fit "
            "in float64.")
    return C
