"""Layer rule for Opacus' ``SequenceBias`` (``DPMultiheadAttention(add_bias_kv=True)``).

``SequenceBias`` appends one learned vector b ∈ R^E as an extra sequence position:
``y = [x; b]``. With the output gradient g_i ∈ R^{(L+1)×E} of sample i (batch-first), the
per-sample gradient is the gradient at the appended position, ``∂L_i/∂b = g_{i,L}`` (summed over
calls), so ``‖∂L_i/∂b‖² = ‖Σ_c g^c_{i,L}‖²``.

The module sees the batch in dimension 1 unless built with ``batch_first=True`` (inside
``DPMultiheadAttention`` it always gets sequence-first keys and values), so the recorded tensors
are only batch-first after :class:`private_engine.opacus_compat.module.PrivateModule` moves
them; the native engine does not, hence :meth:`SequenceBiasRule.check` accepts only modules
prepared by ``make_private``. The rule is registered when the Opacus-compatible door is imported
(it is the only way in).
"""
from __future__ import annotations

from typing import Dict

import torch
from opacus.layers.dp_multihead_attention import SequenceBias
from torch import nn

from ..foundation.dtypes import accumulation_dtype
from ..guards.model_check import clipped_layers
from ..layers.base import LayerDims, LayerRule, trainable
from ..layers.registry import register_rule

#: attribute make_private sets on SequenceBias modules for the duration of its validation only (the
#: native engine, which does not move their tensors to batch-first, keeps refusing them)
PREPARED = "_private_engine_batch_dim_moved"


class SequenceBiasRule(LayerRule):
    module_types = (SequenceBias,)
    param_names = ("bias",)

    def check(self, module):
        if not getattr(module, PREPARED, False):
            raise ValueError(
                "opacus' SequenceBias (DPMultiheadAttention(add_bias_kv=True)) is supported "
                "through the Opacus-compatible API only: "
                "private_engine.opacus_compat.PrivacyEngine(accountant=...).make_private(...)."
            )

    def dims(self, module, activation, output):
        return LayerDims(T=1, D=1, p=module.bias.shape[0], ghost_capable=False)

    def per_sample_grads(self, module, calls) -> Dict[str, torch.Tensor]:
        if not trainable(module, "bias"):
            return {}
        return {"bias": sum(g[:, -1].to(accumulation_dtype(g)) for _, g in calls)}

    def ghost_norm_sq(self, module, calls):
        return self.instantiated_norm_sq(module, calls)


register_rule(SequenceBiasRule())


def clipped_layers_for_door(module: nn.Module, scan):
    """``clipped_layers(module, strict=True)`` (rules check their modules; shared parameters
    refused), with Opacus' ``SequenceBias`` accepted: ``PrivateModule`` moves its recorded tensors
    to batch-first. The mark that :class:`SequenceBiasRule` checks is set for this
    check only, so the native engine still refuses these modules afterwards (it does not move
    them)."""
    marked = [m for m in module.modules()
              if isinstance(m, SequenceBias) and PREPARED not in m.__dict__]
    for m in marked:
        setattr(m, PREPARED, True)
    try:
        return clipped_layers(module, strict=True, scan=scan)
    finally:
        for m in marked:
            delattr(m, PREPARED)
