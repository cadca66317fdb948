"""Matmuls and reductions accumulated in at least float32, written into a given buffer when there
is one: the products and per-sample weighted sums the clipping math is built from."""
from __future__ import annotations

from typing import Optional

import torch

from .dtypes import accumulation_dtype, cast, cast_down


def wide_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated *and returned* in ≥ float32: 16-bit operands on CUDA by a matmul with a
    float32 result (no rounding of the sum to 16 bits, which would be an error relative to the whole
    batch's sum), elsewhere by widening the operands."""
    if a.element_size() == 2 and a.is_floating_point():
        if a.is_cuda:
            try:
                return torch.mm(a, b, out_dtype=torch.float32)
            except (RuntimeError, TypeError):  # a torch without out_dtype
                pass
        return a.float().mm(b.float())
    return a.mm(b)


def wide_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched :func:`wide_mm`."""
    if a.element_size() == 2 and a.is_floating_point():
        if a.is_cuda:
            try:
                return torch.bmm(a, b, out_dtype=torch.float32)
            except (RuntimeError, TypeError):
                pass
        return a.float().bmm(b.float())
    return a.bmm(b)


def mm_into(out: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in ``out`` when given — written by the matmul itself when the dtypes agree, else
    copied (a cast) — or else as a new tensor in ≥ float32; 16-bit products are accumulated and
    returned in float32 (:func:`wide_mm`)."""
    if out is None:
        return cast(wide_mm(a, b), accumulation_dtype(a))
    if out.dtype == a.dtype:
        return torch.mm(a, b, out=out)
    return out.copy_(wide_mm(a, b))


def sum_into(out: Optional[torch.Tensor], t: torch.Tensor, dims) -> torch.Tensor:
    """``t.sum(dims)`` accumulated in ≥ float32, in ``out`` when given (by the reduction itself
    when it has that dtype)."""
    acc = accumulation_dtype(t)
    if out is None:
        return t.sum(dims, dtype=acc)
    if out.dtype == acc:
        return torch.sum(t, dims, dtype=acc, out=out)
    return out.copy_(t.sum(dims, dtype=acc))


def put_into(out: Optional[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into ``out`` when given, else ``value`` in ≥ float32 (itself when it
    already is)."""
    if out is None:
        return cast(value, accumulation_dtype(value))
    return out.copy_(value)


def scale_samples(t: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``diag(C)·t``: sample i's slice ``t[i]`` (dim 0) times ``C_i``, in ``t``'s dtype (a new
    tensor); the factors are rounded toward zero to that dtype
    (:func:`private_engine.foundation.dtypes.cast_down`), so the cast never raises a clip factor."""
    return t * cast_down(factors, t.dtype).reshape(-1, *([1] * (t.dim() - 1)))


def weighted_sum_into(out: Optional[torch.Tensor], rows: torch.Tensor,
                      factors: torch.Tensor) -> torch.Tensor:
    """``Σ_i C_i s_i`` of per-sample rows ``rows = [s_i]: (B, n)`` (one matrix-vector product
    ``sᵀC``; factors rounded toward zero to ``rows``' dtype, 16-bit rows accumulated and returned in
    float32), into ``out`` when given (by the product itself when it has that dtype)."""
    f = cast_down(factors, rows.dtype)
    if rows.element_size() == 2:
        return put_into(out, wide_mm(f.reshape(1, -1), rows).reshape(-1))
    if out is not None and out.dtype == rows.dtype:
        return torch.mv(rows.t(), f, out=out)
    return put_into(out, rows.t().mv(f))
