"""Tied weights: one trainable tensor used by several ruled layers (GPT-2's ``wte`` and
``lm_head``, BERT's word embeddings and MLM decoder, a Linear reused under two names).

The per-sample gradient of a shared tensor ``W`` is the sum of its uses,
``∂L_i/∂W = Σ_k G_i^k``, so ``‖∂L_i/∂W‖² = Σ_k ‖G_i^k‖² + 2·Σ_{k<l} ⟨G_i^k, G_i^l⟩``: normed
use by use, the cross terms would be missing and a sample whose uses point the same way would be
clipped to up to ``√K·R`` (K uses). Every layer of a tied group is therefore *instantiated*, in
every mode: its per-sample gradients ``G_i^k`` are summed per parameter into ``G_i``, and ``G_i``
is kept, normed and released as ``Σ_i C_i G_i`` like any kept per-sample gradient
(:func:`private_engine.layers.base.certified_kept`: the release is the very tensor that was
normed, so the certificate needs no term for the cross products). Memory per sample: the shared
tensor's size (``V·d`` for a tied vocabulary matrix).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Set, Tuple

import torch
from torch import nn

from ..guards.model_check import tied_layers


class TiedGroups:
    """The layers of a model that share trainable parameters, and the per-sample gradients of the
    running norm pass summed per parameter."""

    def __init__(self, layers: Sequence[Tuple[str, nn.Module, object]]):
        #: groups of layer names linked by shared parameters (empty: no tied weights)
        self.groups: List[List[str]] = tied_layers(layers)
        grouped = {n for g in self.groups for n in g}
        self._modules: Set[int] = {id(m) for n, m, _ in layers if n in grouped}
        self._sums: Dict[int, Tuple[nn.Parameter, torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self._modules)

    def covers(self, module: nn.Module) -> bool:
        """True when ``module`` shares a parameter with another ruled layer."""
        return id(module) in self._modules

    def add(self, module: nn.Module, grads: Dict[str, torch.Tensor]) -> None:
        """Add one layer's per-sample gradients ``{name: (B, *shape)}``: ``G_i += G_i^k`` for each
        of its parameters (the sum is formed in the wider of the two dtypes)."""
        for name, g in grads.items():
            p = getattr(module, name)
            held = self._sums.get(id(p))
            self._sums[id(p)] = (p, g if held is None else held[1] + g)

    def take(self) -> List[Tuple[nn.Parameter, torch.Tensor]]:
        """The summed per-sample gradients ``[(parameter, G (B, *shape))]`` (and forget them)."""
        out, self._sums = list(self._sums.values()), {}
        return out

    def reset(self) -> None:
        """Forget the sums of an abandoned norm pass."""
        self._sums = {}
