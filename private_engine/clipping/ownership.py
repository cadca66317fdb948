"""Which parameters the layer rules own, and which of them the parameter tracer follows too."""
from __future__ import annotations

from typing import Optional, Sequence, Set, Tuple

from torch import nn

#: ``(layer name, module, parameter name, parameter)`` of every ruled layer as built
RuledParam = Tuple[str, nn.Module, str, nn.Parameter]


def check_unmoved(ruled: Sequence[RuledParam]) -> None:
    """Refuse a ruled layer whose parameter was replaced after the engine was built (weights tied
    later, ``tie_weights()``): which layers share a tensor decides how their norms are formed,
    and uses normed apart would lose their cross terms."""
    moved = [f"{n}.{pn}" if n else pn for n, m, pn, p in ruled
             if m._parameters.get(pn) is not p]
    if moved:
        raise ValueError(
            f"parameter(s) {moved} were replaced after the engine was built (e.g. weights tied "
            "by tie_weights() or an assignment): the engine groups layers that share a "
            "tensor when it is built. Tie or replace weights first, then build the engine "
            "(or call make_private). Nothing was updated.")


def handed_modules(tracer: Optional[object], ruled: Sequence[RuledParam],
                   ruled_ids: Set[int]) -> Set[int]:
    """Ids of the ruled modules whose parameters the tracer also follows (the layer was applied to
    a batch-free constant as well: its per-sample gradients are then summed with the tracer's
    before the norm, as for a tied weight). A few per model at most: the tracer's parameters are
    scanned, not the layers. Formed once per norm pass, after the forward that handed them
    over."""
    if tracer is None:
        return set()
    ids = {pid for pid in tracer.tracked if pid in ruled_ids}  # type: ignore[attr-defined]
    return {id(m) for _, m, _, p in ruled if id(p) in ids} if ids else set()
