"""Per-row fingerprints of a gradient and the row comparison of the separability probe.

A gradient with k·B rows along its batch dimension is reduced to two float64 numbers per row:
its norm and its projection on a random vector (shared by both passes of one comparison), so
only one pass's gradients are alive at a time. :func:`compare_rows` tells the rows whose
weighted fingerprint is not ``2^{e_j}`` times the plain one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

#: relative tolerance of the row comparison by the lowest precision in the graph (default:
#: DEFAULT_TOLERANCE); float32 on CUDA with TF32 allowed counts as float16 (same mantissa)
TOLERANCES = {torch.float16: 2e-2, torch.bfloat16: 5e-2}
DEFAULT_TOLERANCE = 1e-5
#: float64 elements converted at a time by a fingerprint
_CHUNK = 1 << 24
#: absolute floor of the comparison, relative to the tensor's largest row (subnormal rounding)
_FLOOR = 1e-3


@dataclass
class RowPrint:
    """Per-row fingerprint of one gradient: norms and a random projection (in float64)."""

    norm: torch.Tensor
    proj: torch.Tensor
    finite: torch.Tensor
    k: int
    dtype: torch.dtype
    amax: float  # largest finite |entry|


def rows_of(g: torch.Tensor, B: int, bd: int) -> Optional[Tuple[torch.Tensor, int]]:
    """``(g as (rows, -1) with the batch dimension first, k)`` or None when rows are not k·B."""
    if not g.is_floating_point() or g.dim() <= bd or B <= 0:
        return None
    if bd:
        g = g.movedim(bd, 0)
    rows = g.shape[0]
    if rows == 0 or rows % B:
        return None
    return g.reshape(rows, -1), rows // B


def is_batched(g: Optional[torch.Tensor], B: int, bd: int) -> bool:
    """Heuristic of the diagnostic pass: a gradient is per-sample along ``bd`` when its size
    there is k·B (k == 1 for a 1-D tensor: a reduced ``(d,)`` tensor with d a multiple of B is
    not)."""
    if g is None or not g.is_floating_point() or g.dim() <= bd:
        return False
    rows = g.shape[bd]
    return rows > 0 and rows % B == 0 and (g.dim() > 1 or rows == B)


class Fingerprints:
    """Random projection vectors shared by both passes of one comparison."""

    def __init__(self, gen: torch.Generator):
        self.gen = gen
        self.vectors: Dict[tuple, torch.Tensor] = {}

    def __call__(self, g: Optional[torch.Tensor], B: int, bd: int = 0,
                 shape: Optional[tuple] = None) -> Optional[RowPrint]:
        if g is None:
            return None
        g = g.detach()
        if shape is not None and g.numel() == math.prod(shape):
            g = g.reshape(shape)
        rk = rows_of(g, B, bd)
        if rk is None:
            return None
        x, k = rk
        # in float32 (float64 stays), without a copy of a float32 gradient: a float64 copy of every
        # compared gradient would be a large transient (and, through the allocator's caching, a
        # lasting one); scaling by a power of two stays exact in float32 too. Rows whose norm
        # overflows float32 (|x| > 1.8e19) read as not finite: not compared (no verdict)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        key = (x.shape[1], x.device, work)
        u = self.vectors.get(key)
        if u is None:
            u = torch.randn(x.shape[1], generator=self.gen, dtype=torch.float64)
            u = self.vectors[key] = u.to(device=x.device, dtype=work)
        low = None if x.dtype == work else work
        row_max = torch.linalg.vector_norm(x, ord=float("inf"), dim=1, dtype=low).double()
        finite_max = row_max[torch.isfinite(row_max)]
        amax = float(finite_max.max()) if finite_max.numel() else 0.0
        if work == torch.float32 and amax * math.sqrt(max(x.shape[1], 1)) > 1e18:
            # entries whose squares or sums overflow float32: bounded float64 copies instead
            norms, projs = [], []
            step = max(1, _CHUNK // max(x.shape[1], 1))
            u64 = u.double()
            for start in range(0, x.shape[0], step):
                c = x[start:start + step].double()
                norms.append(torch.linalg.vector_norm(c, dim=1))
                projs.append(c @ u64)
            norm, proj = torch.cat(norms), torch.cat(projs)
        else:
            norm = torch.linalg.vector_norm(x, dim=1, dtype=low).double()
            proj = (x.to(work) @ u).double()
        finite = torch.isfinite(norm) & torch.isfinite(proj)
        return RowPrint(norm, proj, finite, k, g.dtype, amax)


def samples_compared(plain: Dict[int, "RowPrint"], weighted: Dict[int, "RowPrint"],
                     B: int) -> int:
    """The most samples with a row that is compared at a point (finite in both passes and not
    zero in the plain one), over its layouts: a point shows mixing only when it is at least 2."""
    best = 0
    for d, q in plain.items():
        w = weighted.get(d)
        if w is None or w.k != q.k:
            continue
        rows = (q.norm > 0) & q.finite & w.finite
        best = max(best, int(rows.reshape(B, q.k).any(1).sum()))
    return best


def compare_rows(plain: RowPrint, weighted: RowPrint, r: torch.Tensor,
             tol: Optional[float] = None) -> Tuple[int, int, int]:
    """``(bad rows, compared rows, overflowed rows)`` of ``weighted`` against ``r·plain``.

    Row m (sample m // k) passes when ``|n_w − ρ n| ≤ τ ρ n + a`` and
    ``|p_w − ρ p| ≤ τ ρ n + a`` with ρ = r_{m//k}, n the row norm, p its projection, τ the
    tolerance (default: that of the gradient's dtype) and ``a = 1e-3·τ·max_m ρ n`` (an absolute
    floor for rows of subnormal size)."""
    rho = r.to(plain.norm.device, plain.norm.dtype).repeat_interleave(plain.k)
    ok = plain.finite & weighted.finite
    overflow = plain.finite & ~weighted.finite
    if tol is None:
        tol = TOLERANCES.get(plain.dtype, DEFAULT_TOLERANCE)
    scale = torch.where(ok, rho * plain.norm, torch.zeros_like(plain.norm))
    thr = tol * scale + _FLOOR * tol * scale.max()
    bad = ok & (((weighted.norm - rho * plain.norm).abs() > thr)
                | ((weighted.proj - rho * plain.proj).abs() > thr))
    counts = torch.stack([bad.sum(), ok.sum(), overflow.sum()]).tolist()
    return counts[0], counts[1], counts[2]


def overflowed_rows(plain: Optional[RowPrint], other: Optional[RowPrint]) -> int:
    """Rows finite in ``plain`` but not in ``other``."""
    if plain is None or other is None or plain.k != other.k:
        return 0
    return int((plain.finite & ~other.finite).sum())
