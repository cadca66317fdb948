"""Per-sample gradients of many LayerNorms, instantiated together at the end of a norm pass.

A LayerNorm's per-sample gradients ``∂L_i/∂γ = Σ_t g_t ⊙ x̂_t`` and ``∂L_i/∂β = Σ_t g_t``
(:class:`private_engine.layers.normalization.LayerNormRule`) cost four small operations per layer
(x̂ recomputed, a product, two reductions): on a GPU, four kernel launches per layer for a few
hundred bytes of result. A transformer's LayerNorms mostly share one shape (a ViT-B's 25), so
:class:`LayerNormGradStack` keeps each layer's recorded input and output gradient and, at the end
of the norm pass, forms the gradients of all layers of one shape by the same four operations on
their stacked operands: x̂ is normalised row by row and the sums run over each sample's positions,
so each layer's gradients are the ones its own operations would give. They are then kept, normed
and summed like any instantiated per-sample gradient (the release is ``Σ_i C_i G_i`` of these very
tensors). At most ``HELD_ELEMENTS`` operand elements are held at a time: a layer that would
exceed it first has the layers held so far instantiated (their operands freed, their gradients
kept until the end of the pass), so that a model whose LayerNorms' operands exceed it together
(a ViT-B's 25 at batch 8 and 197 positions hold 60 M elements) costs one set of operations per
group of layers that fits, not one per layer; a layer larger than it alone is instantiated at
once. On the CPU, where an operation's fixed cost is microseconds and stacking
copies the operands once more, only layers whose operands have at most ``CPU_LAYER_ELEMENTS``
elements are stacked (ViT-Tiny's, 16 × 197 × 192, cost 2–3 % of a step stacked).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..foundation.dtypes import accumulation_dtype, cast
from .precision import without_autocast

#: the most operand elements (inputs and output gradients) held for later instantiation
HELD_ELEMENTS = 1 << 24
#: on the CPU, the most elements of one layer's operand for it to be stacked
CPU_LAYER_ELEMENTS = 1 << 16


class _Pending(NamedTuple):
    module: nn.LayerNorm
    a: torch.Tensor
    g: torch.Tensor
    names: Tuple[str, ...]

    def key(self) -> tuple:
        """Layers of one key are instantiated by one set of operations."""
        m = self.module
        return (tuple(self.a.shape), tuple(self.g.shape), self.a.dtype, self.g.dtype,
                self.a.device, tuple(m.normalized_shape), float(m.eps), self.names)


class LayerNormGradStack:
    """Deferred per-sample LayerNorm gradients: :meth:`add` per layer during the norm pass,
    :meth:`take` at its end."""

    def __init__(self) -> None:
        self._pending: List[_Pending] = []
        self._held = 0
        #: the gradients of layers instantiated before the end of the pass (the held operands
        #: reached ``HELD_ELEMENTS``), in the order they were added
        self._done: List[Tuple[nn.Module, Dict[str, torch.Tensor]]] = []

    def __len__(self) -> int:
        return len(self._done) + len(self._pending)

    def add(self, module: nn.LayerNorm, a: torch.Tensor, g: torch.Tensor,
            names: Tuple[str, ...]) -> bool:
        """Keep one LayerNorm call's input ``a`` and output gradient ``g`` (batch-first, ending
        with ``normalized_shape``) for the gradients of the parameters ``names``; the layers held
        so far are instantiated first when the held operands would exceed ``HELD_ELEMENTS``.
        False (nothing kept) when ``a`` and ``g`` differ in shape, when the layer's operands alone
        exceed ``HELD_ELEMENTS``, or on the CPU when its operand has more than
        ``CPU_LAYER_ELEMENTS`` elements."""
        size = a.numel() + g.numel()
        if size > HELD_ELEMENTS or a.shape != g.shape:
            return False
        if a.device.type == "cpu" and a.numel() > CPU_LAYER_ELEMENTS:
            return False
        if self._held + size > HELD_ELEMENTS:
            self._done.extend(self._instantiate_pending())
        self._held += size
        self._pending.append(_Pending(module, a, g, names))
        return True

    def clear(self) -> None:
        """Drop what was kept (a failed norm pass)."""
        self._pending, self._held, self._done = [], 0, []

    def take(self) -> List[Tuple[nn.Module, Dict[str, torch.Tensor]]]:
        """``[(module, {name: G (B, *normalized_shape)})]`` for every kept layer, in the order
        they were added; the layers are forgotten."""
        out = self._done + self._instantiate_pending()
        self.clear()
        return out

    @without_autocast
    def _instantiate_pending(self) -> List[Tuple[nn.Module, Dict[str, torch.Tensor]]]:
        """The gradients of the held layers (in the order they were added), one set of
        operations per key; the held operands are released."""
        pending = self._pending
        self._pending, self._held = [], 0
        groups: Dict[tuple, List[int]] = {}
        for i, p in enumerate(pending):
            groups.setdefault(p.key(), []).append(i)
        out: List = [None] * len(pending)
        for idx in groups.values():
            first = pending[idx[0]]
            grads = _instantiate(first.module, [pending[i].a for i in idx],
                                 [pending[i].g for i in idx], first.names)
            for j, i in enumerate(idx):
                out[i] = (pending[i].module, {n: t[j] for n, t in grads.items()})
        return out


def _instantiate(module: nn.LayerNorm, As: List[torch.Tensor], Gs: List[torch.Tensor],
                 names: Tuple[str, ...]) -> Dict[str, torch.Tensor]:
    """``{name: (L, B, *normalized_shape)}``: ``Σ_t g ⊙ x̂`` (weight) and ``Σ_t g`` (bias) of L
    LayerNorm calls of one shape, from their stacked inputs and output gradients (in ≥ float32)."""
    from .normalization import unit_weight

    shape = tuple(module.normalized_shape)
    L, B = len(As), As[0].shape[0]
    a = As[0].unsqueeze(0) if L == 1 else torch.stack(As)
    g = Gs[0].unsqueeze(0) if L == 1 else torch.stack(Gs)
    G = cast(g, accumulation_dtype(g)).reshape(L * B, -1, *shape)
    out = {}
    if "weight" in names:
        x = cast(a, accumulation_dtype(a))
        xhat = F.layer_norm(x, shape, unit_weight(shape, x), None, module.eps)
        out["weight"] = (G * xhat.reshape(L * B, -1, *shape)).sum(1).reshape(L, B, *shape)
    if "bias" in names:
        out["bias"] = G.sum(1).reshape(L, B, *shape)
    return out
