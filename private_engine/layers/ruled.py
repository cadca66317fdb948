"""The typed records in which the capture and clipping stages pass ruled modules around: a module
with its name and its :class:`~private_engine.layers.base.LayerRule` (:class:`RuledLayer`), and the
recorded calls of one such module kept for its clipped sum (:class:`KeptPairs`).

Both are named tuples: they unpack as ``name, module, rule = layer`` and
``module, rule, pairs = kept``, as the plain tuples they replace did.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from torch import nn

from .base import Call, LayerRule


class RuledLayer(NamedTuple):
    """A module whose direct trainable parameters a layer rule clips."""

    #: qualified name of the module in its model ("" for the model itself)
    name: str
    module: nn.Module
    rule: LayerRule


class KeptPairs(NamedTuple):
    """A ruled module's recorded ``(a, g)`` calls, kept by the norm pass for its clipped sum
    ``Σ_i C_i·∂L_i/∂θ = gᵀ·diag(C)·a``."""

    module: nn.Module
    rule: LayerRule
    #: the module's calls in one forward, ``[(activation a, output gradient g), …]``
    pairs: Sequence[Call]
