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

In the book-keeping modes, a group of Embeddings and Linears sharing one weight is normed by the
joint ghost norm instead when the memory rule of the mode picks the ghost norm for the stacked
rows (:mod:`.tied_ghost`): ``T×T`` Grams with the cross terms, no ``V×d`` per-sample matrix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..guards.model_check import tied_layers
from ..layers.ruled import RuledLayer
from .tied_ghost import certified_joint_norm_sq, ghost_capable

PerParameter = Dict[int, Tuple[nn.Parameter, torch.Tensor]]


def add_per_parameter(sums: PerParameter, p: nn.Parameter, grad: torch.Tensor) -> None:
    """``sums[p] += grad`` for per-sample gradients ``(B, *p.shape)`` of one use of ``p`` (the
    first use stored as is; a sum is formed in the wider of the two dtypes)."""
    held = sums.get(id(p))
    sums[id(p)] = (p, grad if held is None else held[1] + grad)


@dataclass
class TiedGroup:
    """Ruled layers linked by shared parameters, and what the running norm pass holds of them."""

    members: List[RuledLayer]
    #: the joint ghost norm (True) or instantiation (False) for this pass; None: not decided yet
    use_ghost: Optional[bool] = None
    #: ``[(module, rule, pairs)]`` of the members normed jointly
    pairs: list = field(default_factory=list)

    @property
    def ghost_capable(self) -> bool:
        """Embeddings and Linears sharing one weight (:func:`.tied_ghost.ghost_capable`)."""
        return ghost_capable([(m, r) for _, m, r in self.members])


class TiedGroups:
    """The layers of a model that share trainable parameters, and the per-sample gradients of the
    running norm pass summed per parameter."""

    def __init__(self, layers: Sequence[RuledLayer]):
        by_name = {n: RuledLayer(n, m, r) for n, m, r in layers}
        #: groups of layers linked by shared parameters (empty: no tied weights)
        self.groups: List[TiedGroup] = [TiedGroup([by_name[n] for n in names])
                                        for names in tied_layers(layers)]
        self._group_of: Dict[int, TiedGroup] = {id(m): g for g in self.groups
                                                for _, m, _ in g.members}
        self._sums: PerParameter = {}

    def covers(self, module: nn.Module) -> bool:
        """True when ``module`` shares a parameter with another ruled layer."""
        return id(module) in self._group_of

    def group(self, module: nn.Module) -> TiedGroup:
        """The group of a covered module."""
        return self._group_of[id(module)]

    def add(self, module: nn.Module, grads: Dict[str, torch.Tensor]) -> None:
        """Add one layer's per-sample gradients ``{name: (B, *shape)}``: ``G_i += G_i^k`` for each
        of its parameters (the sum is formed in the wider of the two dtypes)."""
        for name, g in grads.items():
            add_per_parameter(self._sums, getattr(module, name), g)

    def add_param(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Add per-sample gradients ``(B, *p.shape)`` of ``p`` from another use (the
        parameter-entry tracer following a ruled layer applied to a batch-free constant)."""
        add_per_parameter(self._sums, p, grad)

    def take(self) -> List[Tuple[nn.Parameter, torch.Tensor]]:
        """The summed per-sample gradients ``[(parameter, G (B, *shape))]`` (and forget them)."""
        out, self._sums = list(self._sums.values()), {}
        return out

    def joint_norms(self) -> List[torch.Tensor]:
        """The certified squared norms of the groups normed jointly in this pass (and forget
        their records)."""
        terms = [certified_joint_norm_sq(g.pairs) for g in self.groups if g.use_ghost and g.pairs]
        self.reset()
        return terms

    def reset(self) -> None:
        """Forget what a norm pass held."""
        self._sums = {}
        for g in self.groups:
            g.use_ghost, g.pairs = None, []
