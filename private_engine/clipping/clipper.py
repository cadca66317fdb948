"""The clipping core: certified per-sample norms over all layers, and the clipped sums.

Algorithm (Bu, Mao & Xu 2022, "Scalable and Efficient Training of Large Convolutional Neural
Networks with Differential Privacy", Algorithm 1, "mixed ghost clipping"):

1. **Norm pass.** Backpropagate ``Σ_i L_i`` computing *activation* gradients only (autograd is
   asked for the gradients at the first trainable layers' outputs, so no weight gradient is
   formed). At each layer, from the recorded input ``a`` and output gradient ``g``, add the
   layer's per-sample ``‖∂L_i/∂θ_l‖²`` (ghost norm or instantiation, per the plan) to
   ``‖g_i‖² = Σ_l ‖∂L_i/∂θ_l‖²``. Every term is a *certified upper bound* of the squared norm of
   what the clipped sum releases for the sample, rounding included
   (:mod:`private_engine.layers.rounding`), summed in float64.
2. **Clip factors** ``C_i = C(‖g_i‖, R)`` from a clipping function (:mod:`.functions`).
3. **Clipped sum** ``Σ_i C_i·g_i``, layer by layer, from the very ``(a, g)`` the norms came from:
   ``gᵀ·diag(C)·a`` (one matmul per layer, ``LayerRule.weighted_grads``) or ``Σ_i C_i G_i`` of
   instantiated per-sample gradients; when, depends on the release strategy (:mod:`.release`,
   book-keeping, one backward; or :mod:`.two_pass`, a second backward).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from ..capture.graph_walk import GraphWalk
from ..capture.recorder import LayerRecorder, RecordedLayer
from ..capture.setup import LayerRoute
from ..foundation.dtypes import cast
from ..guards.batch_flow import BatchFlow
from ..guards.model_check import ruled_parameters
from ..guards.separability import SeparabilityProbe
from ..layers.base import sum_per_sample
from ..layers.ghost_stack import HELD_GRADIENTS, GhostBoundStack
from ..layers.norm_stack import LayerNormGradStack
from ..layers.precision import without_autocast
from ..layers.rounding import gamma
from ..layers.ruled import KeptPairs, RuledLayer
from .extras import ExtraGrads, extra_grads
from .functions import ClipFn, clip_factors, finite_factors, resolve_clipping_fn
from .grad_sums import GradSums
from .kept import group_kept_grads
from .ownership import check_unmoved, handed_modules
from .plan import DEFAULT_CLIPPING_MODE, LayerDecision, check_mode, decide, is_book_keeping
from .release import BookKeeping, ReleaseStrategy
from .rows import check_rows, merged_rows, rows_grads
from .sums import BufferKey, SumBuilder
from .tied import TiedGroups
from .tied_ghost import joint_ghost_chosen
from .two_pass import TwoPass


class PerSampleClipper:
    """Certified per-sample gradient norms and the clipped gradient sum of one physical batch.

    Args:
        layers: ``[(name, module, rule)]`` recorded by the layer rules.
        params: every parameter whose clipped sum is formed (in this order).
        mode: the clipping mode (:data:`private_engine.clipping.plan.CLIPPING_MODES`).
        clipping_fn: a name or a callable ``(norms, R) -> factors`` (:mod:`.functions`).
        max_grad_norm: R.
        recorder: the capture of ``layers`` (with the parameter-entry tracer and fallback modules
            among its extras) whose recorded layers reach :meth:`on_layer_ready`.
        route: the recorder's layer-ready route (a pass may divert it, :mod:`.release`).
        probe / batch_flow: the separability probe and the batch flow this clipper checks at the
            norm pass and on the loss, or None when the door runs them itself.

    Built by :func:`private_engine.clipping.assembly.assemble_clipping_core`.
    """

    def __init__(self, layers: Sequence[RuledLayer],
                 params: Sequence[nn.Parameter], *, mode: str = DEFAULT_CLIPPING_MODE,
                 clipping_fn: Union[str, ClipFn] = "abadi", max_grad_norm: float = 1.0,
                 recorder: LayerRecorder, route: LayerRoute,
                 probe: Optional[SeparabilityProbe] = None,
                 batch_flow: Optional[BatchFlow] = None):
        self.mode = check_mode(mode)
        self.clip_fn, self.user_clip_fn = resolve_clipping_fn(clipping_fn)
        if not 0 < max_grad_norm < float("inf"):
            raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm}.")
        self.max_grad_norm = float(max_grad_norm)
        self.params = list(params)
        self._param_ids = {id(p) for p in self.params}
        #: ruled layers sharing parameters (tied weights): instantiated, summed per parameter
        self.tied = TiedGroups(layers)
        #: every ruled layer's parameters as built: ``[(layer name, module, name, parameter)]``
        self._ruled = ruled_parameters(layers)
        self._ruled_ids = {id(p) for _, _, _, p in self._ruled}
        #: ruled modules the tracer also follows in the running norm pass
        #: (:func:`.ownership.handed_modules`)
        self._handed: set = set()
        self.recorder = recorder
        self.route = route
        #: the parameter-entry tracer and the torch.func fallback modules (None / empty when the
        #: layer rules cover every parameter)
        self.tracer = self.recorder.tracer
        self.fallbacks = [e for e in self.recorder.extras if e is not self.tracer]
        #: checks that the model and loss are sample-separable at the first step of each input
        #: signature
        self.probe = probe
        #: follows the batch through every op of each step's forward and loss (checked when the
        #: loss arrives: :meth:`check_loss`)
        self.batch_flow = batch_flow
        #: book-keeping (one backward, :mod:`.release`) or two passes (:mod:`.two_pass`)
        self.book_keeping = is_book_keeping(self.mode)
        self.strategy: ReleaseStrategy = (BookKeeping(self.mode) if self.book_keeping
                                          else TwoPass(self.mode))
        self.last_plan: List[LayerDecision] = []
        self.batch_size = 0
        #: per-layer (B,) certified squared norms (float64) of the running norm pass
        self._norm_terms: List[torch.Tensor] = []
        #: ghost bounds of Linear layers formed together at the end of the norm pass (two-pass
        #: modes: while the output gradients held for them stay within ``HELD_GRADIENTS``)
        self.ghost_bounds = GhostBoundStack(None if self.book_keeping else HELD_GRADIENTS)
        #: LayerNorms' per-sample gradients instantiated together at the end of the norm pass
        self.norm_grads = LayerNormGradStack()
        self._plan: List[LayerDecision] = []
        #: kept by the norm pass for the clipped sums: [(module, rule, [(a, g)])] and
        #: [(parameter, G (B, *shape))], then the latter side by side: [([parameters], (B, n))]
        self._kept_pairs: List[KeptPairs] = []
        self._kept_grads: list = []
        self._kept_groups: list = []
        #: where the clipped sums of a step live, and their writing (:mod:`.sums`)
        self.sums = SumBuilder(self.params)

    # -- norm pass ---------------------------------------------------------------------------
    def start_pass(self, batch_size: int) -> None:
        """Begin the norm pass of a physical batch of ``batch_size`` samples (drops what an earlier
        one kept)."""
        check_unmoved(self._ruled)
        self._handed = handed_modules(self.tracer, self._ruled, self._ruled_ids)
        self.batch_size = batch_size
        self._norm_terms = []
        self.ghost_bounds.clear()
        self.norm_grads.clear()
        self._plan = []
        self._kept_pairs, self._kept_grads, self._kept_groups = [], [], []
        self.tied.reset()
        self.strategy.start()

    def _handed_over(self, module: nn.Module) -> bool:
        """True when the tracer also follows this ruled layer's parameters
        (:func:`.ownership.handed_modules`; formed once per norm pass)."""
        return id(module) in self._handed

    def keep_pairs(self, module: nn.Module, rule, pairs) -> None:
        """Keep a layer's ``(a, g)`` for its clipped sum ``gᵀ·diag(C)·a``."""
        self._kept_pairs.append(KeptPairs(module, rule, pairs))

    def keep_grads(self, module: nn.Module, grads: Dict[str, torch.Tensor]) -> None:
        """Keep a layer's per-sample gradients for their norm and clipped sum ``Σ_i C_i G_i``."""
        self._kept_grads.extend((getattr(module, name), g) for name, g in grads.items())

    @without_autocast
    def on_layer_ready(self, layer: RecordedLayer) -> None:
        """One recorded layer's output gradients have all arrived: its certified per-sample norm
        term, and what its clipped sum needs kept (per the release strategy)."""
        pairs = layer.pairs()
        B = self.batch_size
        keep_calls = False
        try:
            check_rows(layer, pairs, self.batch_size)
            dims = [c.dims for c in layer.calls if c.fired and c.grad is not None]
            pairs, k = merged_rows(layer, pairs, self.batch_size)
            if k > 1:
                dims = [replace(d, T=d.T * k, io_size=d.io_size * k) for d in dims]
            handed = self._handed_over(layer.module)
            tied = handed or self.tied.covers(layer.module)
            rows = any(a.shape[0] != B for a, _ in pairs)  # k·B rows (Swin windows, LeViT)
            if tied and not handed and self._tied_ghost(self.tied.group(layer.module)):
                # normed with the other uses of its weight at the end of the pass
                decision = replace(decide(layer.name, layer.module, dims, self.mode),
                                   use_ghost=True)
                self.keep_pairs(layer.module, layer.rule, pairs)
                self.tied.group(layer.module).pairs.append((layer.module, layer.rule, pairs))
                contrib = None
            elif tied or rows:
                # instantiated (per row and summed per sample), kept for the clipped sum; a tied
                # layer's gradients are summed with the other uses of its parameters first
                if rows:
                    grads, dims = rows_grads(layer, pairs, dims, self.batch_size)
                else:
                    grads = layer.rule.per_sample_grads(layer.module, pairs)
                    dims = [replace(d, ghost_capable=False) for d in dims]
                decision = decide(layer.name, layer.module, dims, self.mode)
                if tied:
                    self.tied.add(layer.module, grads)
                else:
                    self.keep_grads(layer.module, grads)
                contrib = None
                keep_calls = self.strategy.rows_layer(layer)
            else:
                decision, contrib, keep_calls = self.strategy.layer_norm(self, layer, pairs,
                                                                         dims, k)
            self._plan.append(decision)
            if contrib is not None:
                self._norm_terms.append(contrib)
        finally:
            if keep_calls:  # the second pass needs the activations and edges, not this gradient
                layer.clear_grads()
            else:
                layer.release()

    def _tied_ghost(self, group) -> bool:
        """Whether a tied group is normed by its joint ghost norm in this pass
        (:func:`.tied_ghost.joint_ghost_chosen`; decided once, at its first layer)."""
        if group.use_ghost is None:
            group.use_ghost = self.book_keeping and joint_ghost_chosen(
                group, self.recorder.layers, self.batch_size, self.mode, self._handed)
        return group.use_ghost

    def per_sample_norms(self, loss: torch.Tensor,
                         walk: Optional[GraphWalk] = None) -> torch.Tensor:
        """Certified ``‖g_i‖ ≥ (Σ_l ‖release_i^l‖²)^{1/2}`` for every sample (float64), from one
        activation-only backward.

        Autograd is asked for the gradients at the outputs of the leading recorded calls (no
        recorded call below them; :func:`private_engine.capture.graph_walk.walk_graph`) and at the
        tracer's entries and fallback outputs, so the backward runs through every recorded call
        computing activation gradients only. The graph is retained when the release strategy
        needs a second backward.
        """
        self.start_pass(loss.shape[0])
        if walk is None:
            walk = self.recorder.walk(loss, self.params)
        if self.probe is not None and self.probe.pending:  # first step of an input signature
            self._set_capturing(False)  # the probe's backward passes are not recorded
            try:
                self.probe.check(loss, self.probe_targets())
            except BaseException:
                self.recorder.reset()
                raise
        total = loss.sum()
        self._set_capturing(True)
        ok = False
        inputs: list = []
        try:
            inputs = list(walk.leading_edges)
            if self.tracer is not None:  # off the data path: ask for them explicitly
                inputs += self.tracer.entry_edges()
                inputs += [e for fb in self.fallbacks for e in fb.out_edges()]
            if inputs:
                torch.autograd.grad(total, inputs=inputs,
                                    retain_graph=self.strategy.retain_graph, allow_unused=True)
            missed = [layer.name for layer in self.recorder.layers for c in layer.calls
                      if not c.fired and c.edge.node in walk.reached]
            if missed:  # would leave their gradients out of norms and sums: never silently
                raise RuntimeError(
                    f"internal error: the norm pass did not reach recorded calls of {missed}.")
            self.recorder.finish_unfired()  # calls the loss does not depend on contribute nothing
            norms = self.end_norm_pass(loss.device)
            ok = True
        finally:
            self._set_capturing(False)
            if not ok:
                self._kept_pairs, self._kept_grads, self._kept_groups = [], [], []
                self.ghost_bounds.clear()
                self.norm_grads.clear()
                self.tied.reset()
            self.strategy.norm_pass_done(self, inputs, ok)
        return norms

    def probe_targets(self, layout=None) -> list:
        """The recorded outputs the separability probe compares row by row: every recorded layer
        call, tracer entry and fallback output, ``(name, edge)``; with ``layout(layer) -> batch
        dim`` (the Opacus door's sequence-first layers), ``(name, edge, batch dim, output shape)``
        for the layer calls."""
        targets = []
        for layer in self.recorder.layers:
            for c in layer.calls:
                if c.edge is not None:
                    targets.append((layer.name, c.edge) if layout is None else
                                   (layer.name, c.edge, layout(layer), c.output_shape))
        if self.tracer is not None:
            targets += [(e.name, e.edge) for e in self.tracer.entries if e.edge is not None]
            targets += [(fb.name, e) for fb in self.fallbacks for e in fb.out_edges()]
        return targets

    @without_autocast
    def end_norm_pass(self, device: torch.device) -> torch.Tensor:
        """Finish a norm pass whose layers have all been handed to :meth:`on_layer_ready`: the
        traced parameters' and fallback modules' norms, the kept per-sample gradients grouped, and
        ``‖g_i‖ = (Σ_l N_l²)^{1/2}``: the sum in float64 raised by ``γ^{(64)}_{L+2}`` (L terms, any
        order), the square root by one more ulp."""
        self._norm_terms.extend(self.strategy.changed_terms())
        for module, grads in self.norm_grads.take():
            self.keep_grads(module, grads)
        self._keep_extra_grads()
        self._kept_grads.extend(self.tied.take())
        self._norm_terms.extend(self.tied.joint_norms())
        items, self._kept_grads = self._kept_grads, []
        self._kept_groups, terms = group_kept_grads(items, self.batch_size,
                                                    key=self.buffer_group)
        self._norm_terms.extend(terms)
        self.last_plan = list(reversed(self._plan))
        B = self.batch_size
        blocks = self.ghost_bounds.take()
        if not self._norm_terms and not blocks:
            return torch.zeros(B, dtype=torch.float64, device=device)
        terms, self._norm_terms = self._norm_terms, []
        count = len(terms) + sum(b.shape[0] for b in blocks)
        if blocks:  # (L, B) blocks and (B,) terms: one reduction over all of them
            rows = blocks + [cast(t, torch.float64).unsqueeze(0) for t in terms]
            norm_sq = (rows[0] if len(rows) == 1 else torch.cat(rows)).sum(0)
        else:
            norm_sq = sum_per_sample(terms, terms[0])
        norm_sq = norm_sq * (1 + gamma(count + 2, 2.0 ** -53))
        return norm_sq.sqrt() * (1 + 2.0 ** -51)

    def _set_capturing(self, on: bool) -> None:
        self.recorder.capturing = on
        for extra in self.recorder.extras:
            extra.capturing = on

    def _keep_extra_grads(self) -> None:
        """Keep the per-sample gradients of traced parameters and fallback modules
        (:func:`.extras.extra_grads`): a ruled layer's parameter also used on a constant is summed
        with its layer's (as a tied weight); the others are kept and planned as instantiated."""
        tied, extras = extra_grads(self.tracer, self.fallbacks, self._ruled_ids, self.batch_size)
        for p, g in tied:
            self.tied.add_param(p, g)
        for extra in extras:
            self._keep_extra(extra.name, extra.layer_type, extra.grads, extra.params)

    def _keep_extra(self, name: str, layer_type: str, grads: Sequence[torch.Tensor],
                    params: Sequence[nn.Parameter]) -> None:
        """Keep one traced parameter's or fallback module's per-sample gradients, planned as
        instantiated."""
        self._plan.append(ExtraGrads(name, layer_type, list(grads), list(params)).decision())
        self._kept_grads.extend(zip(params, grads))

    # -- clip factors ------------------------------------------------------------------------
    def clip_factors(self, norms: torch.Tensor) -> torch.Tensor:
        """``C_i = C(‖g_i‖, R)`` (:func:`private_engine.clipping.functions.clip_factors`)."""
        return clip_factors(self.clip_fn, norms, self.max_grad_norm, checked=self.user_clip_fn)

    def finite_factors(self, norms: torch.Tensor, loss: Optional[torch.Tensor] = None):
        """``(norms, factors, keep, dropped)``: :func:`.functions.finite_factors` with this
        clipper's clipping function (non-finite norms or losses dropped, ``C_i = 0``)."""
        return finite_factors(self.clip_factors, norms, loss)

    # -- clipped sums ------------------------------------------------------------------------
    def clipped_grad_sum(self, loss: torch.Tensor, factors: torch.Tensor,
                         keep: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """``[Σ_i C_i·∂L_i/∂θ for θ in params]`` (:meth:`clipped_sums`; one tensor of its own per
        parameter)."""
        return self.clipped_sums(loss, factors, keep).own_grads()

    @without_autocast
    def clipped_sums(self, loss: Optional[torch.Tensor], factors: torch.Tensor,
                     keep: Optional[torch.Tensor] = None) -> GradSums:
        """``Σ_i C_i·∂L_i/∂θ`` for every parameter, in flat buffers
        (:mod:`private_engine.clipping.grad_sums`).

        From what the norm pass kept: ``gᵀ·diag(C)·a`` per kept layer
        (``LayerRule.weighted_grads``, written by its matmul straight into the parameter's view
        of a flat buffer) and ``Gᵀ C`` per group of kept per-sample gradients (one matrix-vector
        product into the group's contiguous segment); each kept tensor is released as soon as its
        term is formed. Then the release strategy writes what it holds back (two-pass modes: the
        recorded layers' sums during a second backward of ``loss``). ``keep`` (bool ``(B,)``):
        samples whose rows take part; the others are zeroed first, so that an inf/NaN row cannot
        reach the sum through ``0·inf``.
        """
        factors = factors.detach()
        try:
            layout = self.sums.layout(self._kept_groups, self._kept_pairs)
            buffers, writer = self.sums.write_kept(layout, factors, keep, self._kept_groups,
                                                   self._kept_pairs)
            self.strategy.release(self, loss, factors, keep, writer.pair_weighted)
            return self.sums.finish(layout, buffers, writer)
        finally:
            self.release()

    @without_autocast
    def clipped_sums_by_buffer(self, factors: torch.Tensor, keep: Optional[torch.Tensor],
                               sink: Callable[[BufferKey, List[torch.Tensor], List[torch.Tensor]],
                                              None],
                               order: Callable[[BufferKey], Any]) -> None:
        """The clipped sums of :meth:`clipped_sums` formed one flat buffer at a time (book-keeping
        modes, with a ``buffer_group``: FSDP2, one buffer per unit and dtype): for each buffer, in
        the order of ``order((group key, device, dtype))`` (the same on every rank whatever its
        batch), the kept
        terms of its parameters are written into it (``gᵀ·diag(C)·a`` per kept layer, ``Gᵀ C``
        per kept group), the parameters the loss does not reach zeroed, and
        ``sink((group key, device, dtype), parameters, sums)`` called; the buffer is then
        dropped. Only one
        buffer of sums is held at a time besides what ``sink`` keeps. Requires every kept layer's
        parameters to lie in one buffer (:meth:`kept_layers_in_one_buffer`) and a strategy that
        writes nothing after the kept terms (book-keeping)."""
        if self.strategy.retain_graph:
            raise RuntimeError("internal error: sums by buffer need a book-keeping mode.")
        try:
            self.sums.by_buffer(factors.detach(), keep, self._kept_groups, self._kept_pairs,
                                sink, order)
        finally:
            self.release()

    def kept_layers_in_one_buffer(self) -> bool:
        """Whether every recorded layer's trainable parameters fall in one flat buffer (one
        ``buffer_group`` key and accumulation dtype): what :meth:`clipped_sums_by_buffer`
        needs."""
        return self.sums.in_one_buffer(self.recorder.layers)

    @property
    def buffer_group(self):
        """A key per parameter: parameters of different keys get different flat buffers (FSDP2:
        the unit, :class:`private_engine.optim.sharded.ShardedDataParallel`); None: one buffer
        per (device, dtype)."""
        return self.sums.buffer_group

    @buffer_group.setter
    def buffer_group(self, group) -> None:
        self.sums.buffer_group = group

    def release(self) -> None:
        """Drop every record and everything a norm pass kept (after an error, or when done)."""
        self._kept_pairs, self._kept_grads, self._kept_groups = [], [], []
        self.ghost_bounds.clear()
        self.norm_grads.clear()
        self.tied.reset()
        self.strategy.reset()
        self.recorder.reset()

    def install(self) -> None:
        """(Re-)install the recording hooks, the separability probe and the batch flow."""
        self.recorder.install()
        if self.probe is not None:
            self.probe.install()
        if self.batch_flow is not None:
            self.batch_flow.install()

    def remove(self) -> None:
        """Remove the recording hooks, the separability probe and the batch flow."""
        self.recorder.remove()
        if self.probe is not None:
            self.probe.remove()
        if self.batch_flow is not None:
            self.batch_flow.remove()

    def check_loss(self, loss: torch.Tensor) -> None:
        """Refuse a loss vector whose entry i depends on other samples than i, followed through
        every op of the step (:class:`private_engine.guards.batch_flow.BatchFlow`), before
        anything is computed from it."""
        if self.batch_flow is not None and isinstance(loss, torch.Tensor):
            try:
                self.batch_flow.check_loss(loss)
            except BaseException:
                self.release()
                raise
