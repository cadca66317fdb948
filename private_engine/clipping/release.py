"""How the clipped sum of a physical batch is released: the interface of the two strategies of the
clipping core, book-keeping, and what both use to compare operands.

* :class:`BookKeeping` (modes "bk", "bk_mixed", "bk_mixopt"; Bu, Mao & Xu 2023, "Differentially
  Private Optimization on Large Model at Small Cost"): the norm pass keeps, per layer, either the
  recorded ``(a, g)`` or the instantiated per-sample gradients ``G_i``, and the clipped sums are
  formed from them at its end — one backward in all.
* :class:`~private_engine.clipping.two_pass.TwoPass` (modes "mixed", "ghost", "per_sample";
  Bu, Mao & Xu 2022, "Scalable and Efficient Training of Large Convolutional Neural Networks with
  Differential Privacy", in :mod:`.two_pass`): the norm pass keeps the norms, and a second
  activation-only backward on ``Σ_i C_i·L_i`` writes the clipped sums.

Either way a sample's clip factor multiplies that sample's rows at every layer, and what is
released is what was normed. Both implement :class:`ReleaseStrategy`, the interface the clipper
drives; :meth:`ReleaseStrategy.layer_norm` answers with a :class:`NormedLayer`.
"""
from __future__ import annotations

from typing import (
    TYPE_CHECKING,
    Callable,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Sequence,
)

import torch
from torch import nn

from ..capture.recorder import RecordedLayer
from ..layers.base import Call, LayerDims, LayerRule
from .fingerprints import fingerprint_pairs
from .kept import per_sample_numel
from .plan import LayerDecision, decide, keeps_grads

if TYPE_CHECKING:
    from .clipper import PerSampleClipper

#: writes one layer's clipped sum: ``write(module, rule, calls, per-sample weights)``
WriteSum = Callable[[nn.Module, LayerRule, Sequence[Call], torch.Tensor], None]



class NormedLayer(NamedTuple):
    """What the norm pass learns of one layer (:meth:`ReleaseStrategy.layer_norm`)."""

    #: ghost norm or instantiation, and why
    decision: LayerDecision
    #: the certified ``‖∂L_i/∂θ‖²`` (float64, ``(B,)``); None when it is formed at the end of the
    #: pass: kept per-sample gradients (normed with the other kept gradients) or a ghost bound
    #: handed to the clipper's ``ghost_bounds`` (formed with those of the other layers)
    norm_sq: Optional[torch.Tensor]
    #: keep the layer's recorded calls for a second backward
    keep_calls: bool


class ReleaseStrategy(Protocol):
    """How the clipped sums of a physical batch are formed from what the norm pass saw."""

    #: whether the norm pass's backward keeps the graph (for a second backward)
    retain_graph: bool

    def start(self) -> None:
        """A new norm pass begins."""

    def layer_norm(self, clipper: "PerSampleClipper", layer: RecordedLayer,
                   pairs: Sequence[Call], dims: Sequence[LayerDims], merged: int) -> NormedLayer:
        """Norm one recorded layer, keeping what its clipped sum will need."""

    def rows_layer(self, layer: RecordedLayer) -> bool:
        """A layer seeing k·B rows whose per-sample gradients were kept: keep its calls?"""

    def changed_terms(self) -> List[torch.Tensor]:
        """At the end of the norm pass, before the norms are summed: certified ``(B,)`` terms for
        the layers whose kept operands changed since they were normed (added to their first
        terms: the sum still bounds what is released)."""

    def norm_pass_done(self, clipper: "PerSampleClipper", inputs: list, ok: bool) -> None:
        """The norm pass is over (``ok``: its norms will be released; ``inputs``: the edges its
        backward asked autograd for)."""

    def release(self, clipper: "PerSampleClipper", loss: Optional[torch.Tensor],
                factors: torch.Tensor, keep: Optional[torch.Tensor], write: WriteSum) -> None:
        """Write the clipped sums the clipper has not written from what it kept."""

    def reset(self) -> None:
        """Drop what a norm pass left."""



def same_tensors(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> bool:
    """Bitwise equality of two lists of tensors (NaN equal to NaN)."""
    def equal(x, y):
        return x.shape == y.shape and bool(
            torch.equal(x, y) or torch.allclose(x, y, rtol=0.0, atol=0.0, equal_nan=True))

    return len(xs) == len(ys) and all(equal(x, y) for x, y in zip(xs, ys))


def same_bits(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> bool:
    """Whether two lists of contiguous tensors of equal shapes and dtypes hold the same bytes:
    one comparison of their bytes laid end to end (one host synchronisation for all). Equal
    bytes are equal tensors (:func:`same_tensors`); unequal bytes may still be equal values
    (``-0.0`` and ``0.0``, NaNs of other payloads): the caller then compares them value by
    value."""
    if not xs or len(xs) != len(ys):
        return len(xs) == len(ys)
    device = xs[0].device
    if any(x.shape != y.shape or x.dtype != y.dtype or x.device != device
           or y.device != device or not x.is_contiguous() or not y.is_contiguous()
           for x, y in zip(xs, ys)):
        return False

    def laid(ts):
        return torch.cat([t.reshape(-1).view(torch.uint8) for t in ts])

    return bool(torch.equal(laid(xs), laid(ys)))


class BookKeeping:
    """One backward: what each layer's clipped sum needs is kept by the norm pass."""

    #: the norm pass frees the graph as it goes: nothing needs it afterwards
    retain_graph = False

    def __init__(self, mode: str):
        self.mode = mode
        #: layers normed as soon as their gradient arrived whose ``(a, g)`` are kept for the
        #: clipped sum at the end of the pass: ``(module, rule, pairs, use_ghost, fingerprints)``
        self._normed: list = []

    def start(self) -> None:
        """A new norm pass begins."""
        self._normed = []

    def layer_norm(self, clipper: "PerSampleClipper", layer: RecordedLayer,
                   pairs: Sequence[Call], dims: Sequence[LayerDims], merged: int) -> NormedLayer:
        """``(decision, certified ‖∂L_i/∂θ‖² or None, keep the calls)`` of one layer, keeping what
        its clipped sum needs: ``(a, g)`` for a ghost layer; for an instantiated one the per-sample
        gradients ``G_i`` when they are at most ``KEEP_GRADS_SLACK`` times ``(a, g)`` per sample
        (:func:`~private_engine.clipping.plan.keeps_grads`; always in "bk_mixopt", which puts time
        first) — their norm is then taken at the end of the pass with
        the other kept gradients (None) — else ``(a, g)`` again (one matmul ``gᵀ·diag(C)·a`` at
        the end instead of a contraction of ``G``)."""
        module, rule = layer.module, layer.rule
        decision = decide(layer.name, module, dims, self.mode)
        if decision.use_ghost:
            clipper.keep_pairs(module, rule, pairs)
            defer = getattr(rule, "defer_ghost_norm_sq", None)
            if defer is not None and defer(module, pairs, clipper.ghost_bounds):
                return NormedLayer(decision, None, False)  # formed at the end of the pass
            self._normed.append((module, rule, pairs, True, fingerprint_pairs(pairs)))
            return NormedLayer(decision, rule.certified_norm_sq(module, pairs, True), False)
        defer = getattr(rule, "defer_per_sample_grads", None)
        if defer is not None and defer(module, pairs, clipper.norm_grads):
            return NormedLayer(decision, None, False)  # kept at the end of the pass
        grads = rule.per_sample_grads(module, pairs)
        grad_size = sum(per_sample_numel(g) for g in grads.values())
        pair_size = sum(per_sample_numel(a) + per_sample_numel(g) for a, g in pairs)
        if keeps_grads(self.mode, grad_size, pair_size):
            clipper.keep_grads(module, grads)
            return NormedLayer(decision, None, False)
        contrib = rule.certified_norm_sq(module, pairs, False, grads=grads)
        del grads
        clipper.keep_pairs(module, rule, pairs)
        self._normed.append((module, rule, pairs, False, fingerprint_pairs(pairs)))
        return NormedLayer(decision, contrib, False)

    def rows_layer(self, layer: RecordedLayer) -> bool:
        """A layer seeing k·B rows whose per-sample gradients were kept: keep its calls?"""
        return False

    def changed_terms(self) -> List[torch.Tensor]:
        """The certified norm terms again of the layers whose kept ``(a, g)`` — what their clipped
        sums are formed from — changed after they were normed (model code writing an activation
        or gradient through ``.data`` during the backward): ``‖release_i‖²`` of such a layer is
        below the new term, so the per-sample norm, which also holds its first, still bounds the
        step's release."""
        normed, self._normed = self._normed, []
        now = [fingerprint_pairs(pairs) for _, _, pairs, _, _ in normed]
        if same_bits([f for fs in now for f in fs], [f for n in normed for f in n[4]]):
            return []  # every layer's operands as they were normed: one look for all of them
        return [rule.certified_norm_sq(module, pairs, use_ghost)
                for (module, rule, pairs, use_ghost, prints), fs in zip(normed, now)
                if not same_tensors(fs, prints)]

    def norm_pass_done(self, clipper: "PerSampleClipper", inputs: list, ok: bool) -> None:
        self._normed = []
        clipper.recorder.reset()

    def release(self, clipper: "PerSampleClipper", loss: Optional[torch.Tensor],
                factors: torch.Tensor, keep: Optional[torch.Tensor], write: WriteSum) -> None:
        """Nothing left to release: every kept term was written by the clipper."""

    def reset(self) -> None:
        """Drop what a norm pass left."""
        self._normed = []
