"""Per-sample gradients of what no layer rule covers: parameters followed by the parameter tracer
and modules clipped by ``torch.func`` (:func:`private_engine.guards.model_check.scan_model`).
They are always instantiated; their norm is taken with the other kept gradients and their clipped
sum is ``Σ_i C_i G_i`` of these very tensors, in every mode."""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from .kept import per_sample_numel
from .plan import LayerDecision
from .rows import check_extra_rows


class ExtraGrads(NamedTuple):
    """The per-sample gradients ``(B, *shape)`` of one traced parameter or fallback module."""

    name: str
    layer_type: str
    grads: List[torch.Tensor]
    params: List[nn.Parameter]

    def decision(self) -> LayerDecision:
        """The plan's entry: instantiated, ``p`` elements per sample."""
        numel = sum(per_sample_numel(g) for g in self.grads)
        return LayerDecision(name=self.name, layer_type=self.layer_type, T=1, D=1, p=numel,
                             ghost_cost=0, instantiate_cost=numel, use_ghost=False,
                             ghost_capable=False)


def extra_grads(tracer: Optional[object], fallbacks: Sequence, ruled_ids: Set[int], B: int
                ) -> Tuple[List[Tuple[nn.Parameter, torch.Tensor]], List[ExtraGrads]]:
    """``(tied, extras)``: the tracer's per-sample gradients of ruled layers' parameters (also
    used on a batch-free constant: summed with their layer's, as tied weights) and everything
    else the tracer and the fallback modules formed, each checked to have ``B`` rows."""
    tied: List[Tuple[nn.Parameter, torch.Tensor]] = []
    extras: List[ExtraGrads] = []
    if tracer is None:
        return tied, extras
    params = {name: p for name, p in tracer.tracked.values()}  # type: ignore[attr-defined]
    for name, g in tracer.per_sample_grads().items():  # type: ignore[attr-defined]
        p = params[name]
        check_extra_rows(name, g, B)
        if id(p) in ruled_ids:  # a ruled layer's parameter, also used on a constant
            tied.append((p, g))
        else:
            extras.append(ExtraGrads(name, "param-entry", [g], [p]))
    for fb in fallbacks:
        if not fb.calls:
            continue
        grads = fb.per_sample_grads(B)
        if grads:
            owned = dict(fb.params)
            first = next(iter(grads.values()))
            check_extra_rows(fb.name, first, B)
            extras.append(ExtraGrads(fb.name, f"fallback:{type(fb.module).__name__}",
                                     list(grads.values()), [owned[n] for n in grads]))
    return tied, extras
