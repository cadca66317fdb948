"""The comparison of the separability probe: a fixed sequence of backward passes from the roots
(plain, float16 only: plain scaled by a common power of two, and weighted: every sample's
cotangent times ``2^{e_j}``), and the verdict at every comparison point (rows whose weighted
gradient is not ``2^{e_{m//k}}`` times the plain one)."""
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
    samples_compared,
)
from .graph import ComparisonPoint, graph_dtypes, leading_points, tf32_allowed, walk_graph

#: levels of the sample weights 2^e: 16 (e in hi-15..hi, hi ≤ 15) in the wide exponent range of
#: float32, bfloat16 and float64; 5 (e in -4..0) when float16 is involved
_LEVELS_WIDE, _LEVELS_FP16 = 16, 5
#: float32/bfloat16/float64: the weighted compared entries stay below max / 2^_MARGIN_WIDE (room
#: for larger gradients between the compared points)
_MARGIN_WIDE = 8
#: float16: the common scale brings the largest compared entry to about 2^11 and the largest
#: gradient entering any node of the graph to at most 2^14 (float16 overflows at 2^16)
_FP16_TARGET, _FP16_NODE_TARGET, _FP16_MAX_SHIFT = 11, 14, 24


@dataclass
class Comparison:
    """The verdict of :func:`compare_points`."""

    #: ``[(point, bad rows, compared rows)]`` of the points whose rows disagree
    bad: List[Tuple[ComparisonPoint, int, int]]
    #: False when some rows could not be compared (not finite in one of the passes)
    complete: bool
    #: names of the points where fewer than two samples were compared (rows finite in both
    #: passes and not zero): no verdict there
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

    The passes are a fixed sequence that no sample's data changes (tensor hooks of the model run
    at every pass, so their number and order are seen by model code): float32, bfloat16 and
    float64 run two, the plain pass (weights 1) and the weighted one (weights ``r_j = 2^{e_j}``);
    float16 runs three, the plain pass, the plain pass scaled by a common ``2^s`` and the
    weighted one (weights ``2^s·r_j``). What the data decides is only the scales, after the
    plain pass:

    * float16 gradients lose the exactness of the scaling in their subnormal range
      (|g| < 6.1e-5): as a GradScaler would, ``s ≥ 0`` is the largest integer with
      ``2^s·a ≤ 2^11`` (``a`` the largest compared entry of the plain pass) and
      ``2^s·a_node ≤ 2^14`` (``a_node`` the largest gradient entry that entered a node of the
      graph in the plain pass, so that the scaled pass stays below float16's 2^16), ``s ≤ 24``;
      ``e_j ∈ {-4, …, 0}``, so the weighted pass cannot overflow where the scaled one did not.
      The scaled pass is the baseline of the comparison unless it overflowed where the plain one
      did not (an overflow inside a kernel), and then the plain pass is, with ``s = 0``;
    * otherwise ``e_j ∈ {h - 15, …, h}`` with ``h = min(15, ⌊log2 max⌋ - 8 - ⌈log2 a⌉)`` (max:
      the largest finite value of the lowest-range dtype of the graph), so the weighted compared
      entries stay below ``max / 2^8``.

    Rows that are not finite in the baseline or the weighted pass are not compared; a point has a
    verdict when at least two samples' rows are compared there (:func:`samples_compared`). The
    tolerance follows the lowest precision among the gradients of the graph (autograd's input
    metadata), the compared gradients and the roots."""
    fp = Fingerprints(gen)
    # autograd is asked only for the model inputs and the points with no other point below
    # them; the others are fingerprinted by a pre-hook on their node as the backward passes
    # through, so their gradients are freed as in an ordinary backward (asking for every
    # point would hold all of them at once: a peak of one more activation per layer)
    asked = leading_points(points, [t.grad_fn for t in roots])
    nodes = walk_graph([t.grad_fn for t in roots])[0]
    dtypes = graph_dtypes(nodes) | {t.dtype for t in roots}

    def prints(weights, node_max=None):
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

        def watch(grad_outputs):
            for g in grad_outputs:
                if (isinstance(g, torch.Tensor) and g.is_floating_point() and g.numel()
                        and g.layout == torch.strided):
                    node_max.append(torch.linalg.vector_norm(g.detach(), ord=float("inf")))

        handles = [points[i].node.register_prehook(hook_for(i))
                   for i in range(len(points)) if i not in asked]
        if node_max is not None:
            handles += [n.register_prehook(watch) for n in nodes if not hasattr(n, "variable")]
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
    node_max: list = []
    # float16 known from the graph's metadata: the plain pass also notes the largest gradient
    # entering every node (one reduction per node, no pass more)
    plain = prints(ones, node_max if torch.float16 in dtypes else None)
    scale = 1.0
    dtypes |= {q.dtype for qs in plain for q in qs.values()}
    # one rounding flip in a low-precision op shows downstream at its precision
    tol = max(TOLERANCES.get(dt, DEFAULT_TOLERANCE) for dt in dtypes)
    if tf32_allowed(roots):
        tol = max(tol, TOLERANCES[torch.float16])
    amax = max((q.amax for qs in plain for q in qs.values()), default=0.0)
    if torch.float16 in dtypes:
        lo, hi = 1 - _LEVELS_FP16, 0
        shift = fp16_shift(amax, finite_max(node_max))
        scaled = prints(ones * 2.0 ** shift)
        if sum(overflowed_rows(q0.get(d), q1.get(d)) for q0, q1 in zip(plain, scaled)
               for d in q0) == 0:
            plain, scale = scaled, 2.0 ** shift
        del scaled
    else:
        hi = wide_top(amax, dtypes)
        lo = hi - _LEVELS_WIDE + 1
    r = sample_weights(gen, B, lo, hi)
    weighted = prints(r * scale)
    results: list = []
    overflow = 0
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
    # rows that could not be compared (not finite): no verdict for this batch
    complete = not overflow and all(bool(q.finite.all()) for qs in plain for q in qs.values())
    # points where fewer than two samples' rows are compared show nothing about mixing
    silent = [p.name for p, q0, q1 in zip(points, plain, weighted)
              if samples_compared(q0, q1, B) < 2]
    return Comparison(results, complete, silent, (scale, r, tol))


def finite_max(values: List[torch.Tensor]) -> float:
    """The largest finite one of the scalar tensors ``values`` (0 when none is)."""
    if not values:
        return 0.0
    v = torch.stack([x.to(values[0].device, torch.float32) for x in values])
    v = v[torch.isfinite(v)]
    return float(v.max()) if v.numel() else 0.0


def fp16_shift(amax: float, node_max: float) -> int:
    """The exponent ``s`` of the common scale of float16 passes: the largest integer in
    ``[0, 24]`` with ``2^s·amax ≤ 2^11`` and ``2^s·node_max ≤ 2^14`` (0 for ``amax = 0``)."""
    if not amax > 0:
        return 0
    s = math.floor(math.log2(2.0 ** _FP16_TARGET / amax))
    if node_max > 0:
        s = min(s, math.floor(math.log2(2.0 ** _FP16_NODE_TARGET / node_max)))
    return max(0, min(s, _FP16_MAX_SHIFT))


def wide_top(amax: float, dtypes) -> int:
    """The largest weight exponent outside float16, ``h = min(15, ⌊log2 max⌋ - 8 - ⌈log2
    amax⌉)``, with max the largest finite value of the floating dtype of ``dtypes`` with the
    narrowest range: ``2^h·amax ≤ max / 2^8``."""
    tops = [math.floor(math.log2(torch.finfo(dt).max)) for dt in dtypes if dt.is_floating_point]
    if not amax > 0:
        return _LEVELS_WIDE - 1
    top = min(tops, default=127) - _MARGIN_WIDE - math.ceil(math.log2(amax))
    return min(_LEVELS_WIDE - 1, top)
