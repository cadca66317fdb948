"""The two-pass release (modes "mixed", "ghost", "per_sample"; Bu, Mao & Xu 2022, "Scalable and
Efficient Training of Large Convolutional Neural Networks with Differential Privacy"): norms
first, the clipped sums during a second activation-only backward on ``Σ_i C_i·L_i``.

The norm pass keeps only the norms (and the per-sample gradients of layers where they are no
larger than the layer's input and output gradient: elementwise-affine norms, released as kept;
and, within two budgets, the ``(a, g)`` of the ghost Linears whose bounds the clipper's
``ghost_bounds`` forms at its end and of the last other layers it reaches, whose bounds are formed
then too: released from them as book-keeping does). The second backward recomputes each other
layer's output gradient and writes its clipped sum as soon as it arrives; it must reproduce each
layer's output gradient and find its activation unchanged, bit for bit (row fingerprints per
layer); where either changed (a non-deterministic kernel, a write through ``.data``), that
layer's factors are lowered to its recomputed bound, so the certificate still holds.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Deque, Dict, List, NamedTuple, Optional, Sequence

import torch

from ..capture.recorder import RecordedLayer
from ..layers.base import Call, LayerDims
from ..layers.ghost_stack import HELD_GRADIENTS
from .fingerprints import fingerprint_pairs
from .kept import per_sample_numel
from .plan import decide
from .release import NormedLayer, WriteSum, same_tensors

if TYPE_CHECKING:
    from .clipper import PerSampleClipper
#: the most output-gradient elements a two-pass norm pass holds for the last layers it normed at
#: once (besides the ghost-bound stack's ``HELD_GRADIENTS``): released from these operands, they
#: spare the second backward the bottom of the network (:class:`TwoPass`)
HELD_LOWEST = HELD_GRADIENTS

class SecondPass(NamedTuple):
    """What the second backward of :class:`TwoPass` writes with."""

    clipper: "PerSampleClipper"
    #: the clip factors ``C_i``
    factors: torch.Tensor
    write: WriteSum


@dataclass
class FirstPass:
    """What a two-pass norm pass remembers of one layer for the second pass."""

    use_ghost: bool
    #: k of a Linear seeing k·B rows, merged into positions (1 otherwise)
    merged: int
    fingerprints: List[torch.Tensor]
    #: the certified squared norms the clip factors were computed from (None: released from
    #: what the norm pass kept, not by the second pass)
    bound: Optional[torch.Tensor]


@dataclass
class HeldLayer:
    """A layer normed at once whose ``(a, g)`` the two-pass norm pass holds to its end."""

    layer: RecordedLayer
    pairs: Sequence[Call]
    first: FirstPass
    #: output-gradient elements held
    size: int

class TwoPass:
    """Norms first; the clipped sums during a second activation-only backward."""

    #: the graph is kept for the second backward
    retain_graph = True

    def __init__(self, mode: str):
        self.mode = mode
        #: per recorded layer (keyed by id), what the second pass needs
        self.first: Dict[int, FirstPass] = {}
        #: while the second pass runs: what it writes with, and the layers it wrote (by id)
        self._second: Optional[SecondPass] = None
        self._written: set = set()
        #: the last layers left to the second pass, their operands held and their bounds not yet
        #: formed (:meth:`_hold`); the bounds of those dropped since; then the layers held at the
        #: end of the pass, released from these operands (:meth:`norm_pass_done`)
        self._held: Deque[HeldLayer] = deque()
        self._held_size = 0
        self._dropped: List[torch.Tensor] = []
        self._ended: List[HeldLayer] = []

    def start(self) -> None:
        self.reset()

    def layer_norm(self, clipper: "PerSampleClipper", layer: RecordedLayer,
                   pairs: Sequence[Call], dims: Sequence[LayerDims], merged: int) -> NormedLayer:
        """``(decision, certified ‖∂L_i/∂θ‖², keep the calls)``. A ghost Linear's bound is handed
        to the clipper's ``ghost_bounds`` while the output gradients held for it stay within the
        stack's limit; the stack holds its ``(a, g)`` to the end of the pass and forms the bound
        from them as they are then, and the clipped sum ``gᵀ·diag(C)·a`` is formed from the same
        tensors right after the clip factors (kept as book-keeping keeps them; no model code runs
        in between): the second pass neither recomputes nor compares them."""
        decision = decide(layer.name, layer.module, dims, self.mode)
        if not decision.use_ghost and self._keep_instantiated(clipper, layer, pairs, dims):
            # released as the kept gradients themselves: the second pass skips the layer
            self.first[id(layer)] = FirstPass(False, merged, [], None)
            return NormedLayer(decision, None, True)
        defer = getattr(layer.rule, "defer_ghost_norm_sq", None)
        if decision.use_ghost and defer is not None and \
                defer(layer.module, pairs, clipper.ghost_bounds):
            clipper.keep_pairs(layer.module, layer.rule, pairs)
            self.first[id(layer)] = FirstPass(True, merged, [], None)
            return NormedLayer(decision, None, False)
        first = FirstPass(decision.use_ghost, merged, [], None)
        self.first[id(layer)] = first
        if self._hold(layer, pairs, first):
            return NormedLayer(decision, None, True)  # bound formed when dropped or at the end
        self._bound(first, layer, pairs)
        return NormedLayer(decision, first.bound, True)

    def _hold(self, layer: RecordedLayer, pairs: Sequence[Call], first: FirstPass) -> bool:
        """Hold the operands of a layer left to the second pass, its bound not yet formed;
        dropping those of the layers held before it while more than ``HELD_LOWEST``
        output-gradient elements are held (all of them, and False — not held — when this one's
        alone are more). A layer dropped gets its bound and fingerprints then and stays a layer
        of the second pass. The layers held at the end of the pass — the last ones the backward
        reached: in a chain, the lowest — get their bounds from their operands as they are then
        and are released from the same operands right after the clip factors (no model code
        runs in between, as for the ghost-bound stack's layers); the second backward stops above
        them."""
        size = sum(g.numel() for _, g in pairs)
        if size > HELD_LOWEST:
            while self._held:
                self._drop()
            return False
        self._held.append(HeldLayer(layer, pairs, first, size))
        self._held_size += size
        while self._held_size > HELD_LOWEST:
            self._drop()
        return True

    def _drop(self) -> None:
        """Stop holding the earliest held layer: its bound and fingerprints from its operands as
        they are now (compared by the second pass)."""
        h = self._held.popleft()
        self._held_size -= h.size
        self._dropped.append(self._bound(h.first, h.layer, h.pairs))

    @staticmethod
    def _bound(first: FirstPass, layer: RecordedLayer, pairs: Sequence[Call]) -> torch.Tensor:
        """A second-pass layer's certified bound and fingerprints, from its operands as they are
        now."""
        first.bound = layer.rule.certified_norm_sq(layer.module, pairs, first.use_ghost)
        first.fingerprints = fingerprint_pairs(pairs)
        return first.bound

    @staticmethod
    def _keep_instantiated(clipper: "PerSampleClipper", layer: RecordedLayer,
                           pairs: Sequence[Call], dims: Sequence[LayerDims]) -> bool:
        """Keep an instantiated layer's per-sample gradients ``G_i`` from the norm pass when they
        are no larger per sample than its input and output gradient together (elementwise-affine
        norms: ``2p`` against ``2T·p``), so that the second pass neither recomputes them nor
        compares the layer's output gradient: their norm is taken with the other kept gradients
        at the end of the pass and the release is ``Σ_i C_i G_i`` of these very tensors. A
        LayerNorm's are formed with those of the other LayerNorms of its shape
        (:class:`private_engine.layers.norm_stack.LayerNormGradStack`). False (nothing kept)
        for larger gradients, which the second pass forms from ``(a, g)``."""
        module, rule = layer.module, layer.rule
        pair_size = sum(per_sample_numel(a) + per_sample_numel(g) for a, g in pairs)
        if max((d.instantiate_cost for d in dims), default=0) > pair_size:
            return False
        defer = getattr(rule, "defer_per_sample_grads", None)
        if defer is not None and defer(module, pairs, clipper.norm_grads):
            return True
        grads = rule.per_sample_grads(module, pairs)
        if sum(per_sample_numel(g) for g in grads.values()) > pair_size:
            return False
        clipper.keep_grads(module, grads)
        return True

    def rows_layer(self, layer: RecordedLayer) -> bool:
        self.first[id(layer)] = FirstPass(False, 1, [], None)
        return True

    def changed_terms(self) -> List[torch.Tensor]:
        """The certified norm terms not formed when their layers were normed: those of the layers
        dropped from the held ones (:meth:`_drop`), and those of the layers still held, from
        their operands as they are now — the operands they are released from
        (:meth:`norm_pass_done`). The second pass compares the other layers' operands with their
        norm's (:meth:`_on_layer_released`)."""
        held, self._held, self._held_size = list(self._held), deque(), 0
        terms, self._dropped = self._dropped, []
        self._ended = held
        return terms + [h.layer.rule.certified_norm_sq(h.layer.module, h.pairs, h.first.use_ghost)
                        for h in held]

    def norm_pass_done(self, clipper: "PerSampleClipper", inputs: list, ok: bool) -> None:
        if ok:
            ended, self._ended = self._ended, []
            for h in ended:  # released from the operands held: the second pass skips them
                clipper.keep_pairs(h.layer.module, h.layer.rule, h.pairs)
                h.first.bound = None
                h.layer.release()
            for extra in clipper.recorder.extras:  # their per-sample gradients are kept
                extra.reset()
        else:
            self.reset()
            clipper.recorder.reset()

    def release(self, clipper: "PerSampleClipper", loss: Optional[torch.Tensor],
                factors: torch.Tensor, keep: Optional[torch.Tensor], write: WriteSum) -> None:
        """Backpropagate ``Σ_i L_i`` again, activation gradients only, and write each recorded
        layer's clipped sum from ``(a, g)`` as its output gradient arrives. Autograd is asked for
        the gradients at the outputs of the layers whose sums are left to this pass
        (:meth:`second_pass_layers`) only: the backward stops at the lowest of them, and is not
        run when there is none (every layer released from the per-sample gradients the norm pass
        kept)."""
        recorder = clipper.recorder
        layers = self.second_pass_layers(recorder.layers)
        edges: list = [c.edge for layer in layers for c in layer.calls if c.edge is not None]
        if not edges:
            return
        if loss is None:
            raise RuntimeError("internal error: the second pass needs the loss.")
        self._second = SecondPass(clipper, factors, write)
        self._written = set()
        recorder.rearm()
        recorder.capturing = True
        try:
            with clipper.route.diverted(self._on_layer_released):
                torch.autograd.grad(loss.sum(), inputs=edges, allow_unused=True)
                recorder.finish_unfired()
            missed = [layer.name for layer in layers if id(layer) not in self._written]
            if missed:  # their sums would be left out of the release: never silently
                raise RuntimeError("internal error: the second backward did not reach recorded "
                                   f"layers {missed}.")
        finally:
            recorder.capturing = False
            self._second = None

    def second_pass_layers(self, layers: Sequence[RecordedLayer]) -> List[RecordedLayer]:
        """The recorded layers whose clipped sums the second backward writes: those normed with a
        certified bound (not released from kept per-sample gradients)."""
        return [layer for layer in layers
                if (first := self.first.get(id(layer))) is not None and first.bound is not None]

    def _on_layer_released(self, layer: RecordedLayer) -> None:
        """One layer's clipped sum ``gᵀ·diag(C)·a``. The output gradient and the activation must
        be the norm pass's, bit for bit (:func:`.fingerprints.fingerprint_pairs`); if either
        changed, the layer's certified bound is computed again and its factors lowered to
        ``C_i·min(1, N_i/N'_i)`` for this layer, so that its release stays within what the clip
        factors were computed for."""
        second = self._second
        try:
            if second is None:
                raise RuntimeError("internal error: a layer was released outside the second pass.")
            clipper, factors, write = second
            first = self.first.get(id(layer))
            if first is None or first.bound is None:  # per-sample gradients kept: released so
                return
            pairs = layer.pairs()
            if first.merged > 1:
                B = clipper.batch_size
                pairs = [(a.reshape(B, -1, a.shape[-1]), g.reshape(B, -1, g.shape[-1]))
                         for a, g in pairs]
            weights = factors
            self._written.add(id(layer))
            if not same_tensors(fingerprint_pairs(pairs), first.fingerprints):
                again = layer.rule.certified_norm_sq(layer.module, pairs, first.use_ghost)
                ratio = torch.where(again > first.bound, (first.bound / again).sqrt(),
                                    torch.ones_like(again))
                weights = factors * ratio.to(factors.dtype)
            write(layer.module, layer.rule, pairs, weights)
        finally:
            layer.release()

    def reset(self) -> None:
        self.first = {}
        self._held, self._held_size, self._dropped, self._ended = deque(), 0, [], []
