"""The comparison of the separability probe: two backward passes from the roots, one with every
sample's cotangent weighted by ``2^{e_j}``, and the verdict at every comparison point (rows whose
weighted gradient is not ``2^{e_{m//k}}`` times the plain one)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .fingerprints import (
    DEFAULT_TOLERANCE,
    TOLERANCES,
    Fingerprints,
    compare_rows,
    overflowed_rows,
    samples_reached,
)
from .graph import ComparisonPoint, graph_dtypes, leading_points, tf32_allowed, walk_graph

#: exponent ranges ``(lo, hi)`` of the weights 2^e, tried in turn while the weighted pass
#: overflows (float16: both passes are scaled up first, the weights only scale down)
_RANGES_WIDE = ((0, 15), (0, 4), (-4, 0))
_RANGES_FP16 = ((-4, 0),)


@dataclass
class Comparison:
    """The verdict of :func:`compare_points`."""

    #: ``[(point, bad rows, compared rows)]`` of the points whose rows disagree
    bad: List[Tuple[ComparisonPoint, int, int]]
    #: False when some rows could not be compared (not finite)
    complete: bool
    #: names of the points whose gradient reached fewer than two samples
    silent: List[str]
    #: ``(scale, r, tol)`` of the last weighted pass: common scale 2^s, sample weights, tolerance
    weights: Tuple[float, torch.Tensor, float]


def sample_weights(gen: torch.Generator, B: int, lo: int, hi: int) -> torch.Tensor:
    """``2^{e_j}`` with ``e`` a random arrangement of ``lo + (j mod (hi - lo + 1))``."""
    levels = hi - lo + 1
    e = (torch.arange(B) % levels)[torch.randperm(B, generator=gen)] + lo
    return torch.pow(2.0, e.double())


def compare_points(gen: torch.Generator, roots, cotangents, B: int,
                   points: List[ComparisonPoint]) -> Comparison:
    """The plain and the weighted backward passes from ``roots`` (cotangents ``cotangents(w)`` for
    the per-sample weights ``w``), compared at every point (see :class:`Comparison`).

    The tolerance follows the lowest precision among the gradients of the graph (autograd's
    input metadata), the compared gradients and the roots. Float16 gradients lose the
    exactness of the scaling in their subnormal range (|g| < 6.1e-5): when float16 is
    involved, both passes are scaled by a common 2^s (as a GradScaler would) that brings the
    largest compared entry to about 2^11 (s ≥ 0; lowered by 4 while the scaled pass
    overflows), and the sample weights are 2^e with e ≤ 0, so the weighted pass cannot
    overflow where the plain one did not."""
    fp = Fingerprints(gen)
    # autograd is asked only for the model inputs and the points with no other point below
    # them; the others are fingerprinted by a pre-hook on their node as the backward passes
    # through, so their gradients are freed as in an ordinary backward (asking for every
    # point would hold all of them at once: a peak of one more activation per layer)
    asked = leading_points(points, [t.grad_fn for t in roots])

    def prints(weights):
        out: List[Optional[dict]] = [None] * len(points)

        def record(i, g):
            p = points[i]
            per_dim = {d: fp(g, B, d, p.shape) for d in p.dims}
            out[i] = {d: q for d, q in per_dim.items() if q is not None}

        def hook_for(i):
            nr = getattr(points[i].target, "output_nr", 0)

            def hook(grad_outputs):
                if out[i] is None and nr < len(grad_outputs):
                    record(i, grad_outputs[nr])
            return hook

        handles = [points[i].node.register_prehook(hook_for(i))
                   for i in range(len(points)) if i not in asked]
        try:
            idx = sorted(asked)
            grads = list(torch.autograd.grad(roots, [points[i].target for i in idx],
                                             cotangents(weights), retain_graph=True,
                                             allow_unused=True))
        finally:
            for h in handles:
                h.remove()
        for k, i in enumerate(idx):
            record(i, grads[k])
            grads[k] = None
        return [q if q is not None else {} for q in out]

    ones = torch.ones(B, dtype=torch.float64)
    plain = prints(ones)
    scale = 1.0
    dtypes = graph_dtypes(walk_graph([t.grad_fn for t in roots])[0])
    dtypes |= {q.dtype for qs in plain for q in qs.values()} | {t.dtype for t in roots}
    # one rounding flip in a low-precision op shows downstream at its precision
    tol = max(TOLERANCES.get(dt, DEFAULT_TOLERANCE) for dt in dtypes)
    if tf32_allowed(roots):
        tol = max(tol, TOLERANCES[torch.float16])
    if torch.float16 in dtypes:
        ranges = _RANGES_FP16
        amax = max((q.amax for qs in plain for q in qs.values()), default=0.0)
        shift = min(int(math.floor(math.log2(2.0 ** 11 / amax))), 24) if amax else 0
        while shift > 0:
            scaled = prints(ones * 2.0 ** shift)
            if sum(overflowed_rows(q0.get(d), q1.get(d)) for q0, q1 in zip(plain, scaled)
                   for d in q0) == 0:
                plain, scale = scaled, 2.0 ** shift
                break
            shift -= 4
    else:
        ranges = _RANGES_WIDE
    results: list = []
    overflow = 0
    for lo, hi in ranges:
        r = sample_weights(gen, B, lo, hi)
        weights = (scale, r, tol)
        weighted = prints(r * scale)
        results, overflow = [], 0
        for p, q0, q1 in zip(points, plain, weighted):
            # per candidate layout; the point is per-sample when it is so along one of them
            verdicts = [compare_rows(q0[d], q1[d], r, tol) for d in q0
                        if d in q1 and q0[d].k == q1[d].k]
            if not verdicts:
                continue
            passed = [v for v in verdicts if v[0] == 0]
            overflow += sum(v[2] for v in (passed or verdicts))
            if not passed:
                nbad, ncmp, _ = min(verdicts)
                results.append((p, nbad, ncmp))
        if not overflow:
            break
    # rows that could not be compared (not finite): the signature is probed again next time
    complete = not overflow and all(bool(q.finite.all()) for qs in plain for q in qs.values())
    # points whose gradient reached fewer than two samples show nothing about mixing
    silent = [p.name for p, qs in zip(points, plain) if samples_reached(qs, B) < 2]
    return Comparison(results, complete, silent, weights)
