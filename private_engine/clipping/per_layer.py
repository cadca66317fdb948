"""Per-layer clipping (Opacus' ``clipping="per_layer"``): one threshold ``R_k`` per parameter
tensor k, ``C_{i,k} = min(1, R_k / (‖G_i^k‖ + 1e-6))``, from instantiated per-sample gradients
(a tied tensor's per-sample gradient is the sum of its uses); the release is ``Σ_i C_{i,k} G_i^k``
of those very tensors, so the certified norm is ``‖G_i^k‖`` summed in float64
(:func:`private_engine.layers.base.certified_kept`). Sensitivity: ``(Σ_k R_k²)^{1/2}``."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from ..capture.recorder import RecordedLayer
from ..foundation.dtypes import cast_down
from ..layers.base import certified_kept
from ..layers.precision import without_autocast
from .functions import abadi_clip
from .tied import PerParameter, add_per_parameter


@without_autocast
def per_layer_clipped_sums(stored: Sequence[Tuple[RecordedLayer, list]],
                           thresholds: Dict[int, float], scale: float, names: Dict[int, str],
                           extra: Sequence[Tuple[nn.Parameter, torch.Tensor]] = ()
                           ) -> List[Tuple[nn.Parameter, torch.Tensor]]:
    """``[(parameter, Σ_i C_{i,k} G_i^k)]`` for recorded layers ``stored = [(layer, pairs)]`` and
    ``extra = [(parameter, G (B, *shape))]``, per-sample gradients instantiated elsewhere (the
    parameter-entry tracer, torch.func fallback modules).

    ``thresholds``: ``{id(parameter): R_k}``. ``scale``: the factor by which the recorded output
    gradients are multiplied first (B for a mean-reduced loss). A sample whose norm is not finite
    gets ``C_{i,k} = 0`` and its rows are zeroed.
    """
    batches = {g.shape[0] for _, pairs in stored for _, g in pairs}
    batches |= {g.shape[0] for _, g in extra}
    if len(batches) > 1:
        raise ValueError(
            f"layers saw different batch sizes {sorted(batches)} in one backward; inputs must "
            "be batch-first (batch dimension 0) and each backward must come from one forward "
            "pass."
        )
    summed: PerParameter = {}
    for layer, pairs in stored:  # a tied parameter's per-sample gradient: the sum of its uses
        for name, grad in layer.rule.per_sample_grads(layer.module, pairs).items():
            add_per_parameter(summed, getattr(layer.module, name), grad)
    for p, grad in extra:
        add_per_parameter(summed, p, grad)
    out = []
    for p, grad in summed.values():
        r = thresholds.get(id(p))
        if r is None:
            raise RuntimeError(
                f"no per-layer max_grad_norm bound for parameter {names.get(id(p))}.")
        norms = certified_kept([grad], grad).sqrt() * scale
        ok = torch.isfinite(norms)
        factors = torch.where(ok, abadi_clip(torch.where(ok, norms, 0.0), r), 0.0) * scale
        grad = torch.where(ok.reshape(-1, *([1] * (grad.dim() - 1))), grad, 0.0)
        out.append((p, torch.tensordot(cast_down(factors, grad.dtype), grad, dims=1)))
    return out
