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
   instantiated per-sample gradients; when, depends on the release strategy (:mod:`.release`:
   book-keeping, one backward; or a second backward).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..capture.graph_walk import GraphWalk
from ..capture.recorder import LayerRecorder, RecordedLayer
from ..capture.setup import build_capture
from ..guards.batch_flow import BatchFlow
from ..guards.model_check import ruled_parameters
from ..guards.separability import SeparabilityProbe
from ..layers.base import accumulation_dtype, cast, sum_per_sample, weighted_sum_into
from ..layers.ghost_stack import GhostBoundStack
from ..layers.norm_stack import LayerNormGradStack
from ..layers.linear import LinearRule
from ..layers.rounding import cast_down, gamma
from ..layers.ruled import KeptPairs, RuledLayer
from .functions import ClipFn, clip_factors, resolve_clipping_fn
from .grad_sums import FlatLayout, GradSums
from .kept import group_kept_grads, kept_pair_params, per_sample_numel, rows_kept
from .plan import (DEFAULT_CLIPPING_MODE, LayerDecision, check_mode, decide, is_book_keeping,
                   use_ghost)
from .release import strategy_for
from .tied import TiedGroups
from .tied_ghost import joint_dims
from ..layers.precision import without_autocast


class PerSampleClipper:
    """Certified per-sample gradient norms and the clipped gradient sum of one physical batch.

    Args:
        layers: ``[(name, module, rule)]`` recorded by the layer rules.
        params: every parameter whose clipped sum is formed (in this order).
        mode: the clipping mode (:data:`private_engine.clipping.plan.CLIPPING_MODES`).
        clipping_fn: a name or a callable ``(norms, R) -> factors`` (:mod:`.functions`).
        max_grad_norm: R.
        model: the model, for the separability probe, the parameter tracer and the fallbacks.
        traced / fallbacks: parameters clipped by the tracer and modules clipped by ``torch.func``
            (:func:`private_engine.guards.model_check.scan_model`).
    """

    def __init__(self, layers: Sequence[RuledLayer],
                 params: Sequence[nn.Parameter], *, mode: str = DEFAULT_CLIPPING_MODE,
                 clipping_fn: Union[str, ClipFn] = "abadi", max_grad_norm: float = 1.0,
                 model: Optional[nn.Module] = None,
                 traced: Sequence[Tuple[str, nn.Parameter]] = (),
                 fallbacks: Sequence[Tuple[str, nn.Module]] = ()):
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
        #: ruled modules the tracer also follows in the running norm pass (:meth:`_find_handed`)
        self._handed: set = set()
        self.recorder: LayerRecorder = build_capture(layers, model, traced, fallbacks,
                                                     on_layer_ready=self.on_layer_ready)
        #: the parameter-entry tracer and the torch.func fallback modules (None / empty when the
        #: layer rules cover every parameter)
        self.tracer = self.recorder.tracer
        self.fallbacks = [e for e in self.recorder.extras if e is not self.tracer]
        #: checks that the model and loss are sample-separable at the first step of each input
        #: signature
        self.probe: Optional[SeparabilityProbe] = None
        #: follows the batch through every op of each step's forward and loss (checked when the
        #: loss arrives: :meth:`check_loss`)
        self.batch_flow: Optional[BatchFlow] = None
        if model is not None:
            self.probe = SeparabilityProbe(model)
            self.probe.install()
            self.batch_flow = BatchFlow(model).install()
            self.recorder.batch_flow = self.batch_flow
        #: book-keeping (one backward) or two passes (:mod:`.release`)
        self.book_keeping = is_book_keeping(self.mode)
        self.strategy = strategy_for(self.mode, self.book_keeping)
        self.last_plan: List[LayerDecision] = []
        self.batch_size = 0
        #: per-layer (B,) certified squared norms (float64) of the running norm pass
        self._norm_terms: List[torch.Tensor] = []
        #: ghost bounds of Linear layers formed together at the end of the norm pass
        self.ghost_bounds = GhostBoundStack()
        #: LayerNorms' per-sample gradients instantiated together at the end of the norm pass
        self.norm_grads = LayerNormGradStack()
        self._plan: List[LayerDecision] = []
        #: kept by the norm pass for the clipped sums: [(module, rule, [(a, g)])] and
        #: [(parameter, G (B, *shape))], then the latter side by side: [([parameters], (B, n))]
        self._kept_pairs: List[KeptPairs] = []
        self._kept_grads: list = []
        self._kept_groups: list = []
        #: where the clipped sums of a step live (rebuilt when which parameters are kept how
        #: changes)
        self._layout: Optional[FlatLayout] = None
        self._layout_key: tuple = ()
        #: a key per parameter: parameters of different keys get different flat buffers (FSDP2:
        #: the unit, :class:`private_engine.optim.sharded.ShardedDataParallel`); None: one
        #: buffer per (device, dtype)
        self.buffer_group = None

    # -- norm pass ---------------------------------------------------------------------------
    def start_pass(self, batch_size: int) -> None:
        """Begin the norm pass of a physical batch of ``batch_size`` samples (drops what an earlier
        one kept)."""
        self._check_ruled_params()
        self._handed = self._find_handed()
        self.batch_size = batch_size
        self._norm_terms = []
        self.ghost_bounds.clear()
        self.norm_grads.clear()
        self._plan = []
        self._kept_pairs, self._kept_grads, self._kept_groups = [], [], []
        self.tied.reset()
        self.strategy.start()

    def _check_ruled_params(self) -> None:
        """Refuse a ruled layer whose parameter was replaced after the engine was built (weights
        tied later, ``tie_weights()``): which layers share a tensor decides how their norms are
        formed, and uses normed apart would lose their cross terms."""
        moved = [f"{n}.{pn}" if n else pn for n, m, pn, p in self._ruled
                 if m._parameters.get(pn) is not p]
        if moved:
            raise ValueError(
                f"parameter(s) {moved} were replaced after the engine was built (e.g. weights tied "
                "by tie_weights() or an assignment): the engine groups layers that share a "
                "tensor when it is built. Tie or replace weights first, then build the engine "
                "(or call make_private). Nothing was updated.")

    def _handed_over(self, module: nn.Module) -> bool:
        """True when the tracer also follows this ruled layer's parameters (the layer was applied
        to a batch-free constant as well): its per-sample gradients are then summed with the
        tracer's before the norm, as for a tied weight. The set of such layers is formed once per
        norm pass, after the forward that handed them over."""
        return id(module) in self._handed

    def _find_handed(self) -> set:
        """Ids of the ruled modules whose parameters the tracer follows (a few per model at
        most: the tracer's parameters are scanned, not the layers)."""
        if self.tracer is None:
            return set()
        ids = {pid for pid in self.tracer.tracked if pid in self._ruled_ids}
        return {id(m) for _, m, _, p in self._ruled if id(p) in ids} if ids else set()

    def keep_pairs(self, module: nn.Module, rule, pairs) -> None:
        """Keep a layer's ``(a, g)`` for its clipped sum ``gᵀ·diag(C)·a``."""
        self._kept_pairs.append(KeptPairs(module, rule, pairs))

    def keep_grads(self, module: nn.Module, grads: Dict[str, torch.Tensor]) -> None:
        """Keep a layer's per-sample gradients for their norm and clipped sum ``Σ_i C_i G_i``."""
        self._kept_grads.extend((getattr(module, name), g) for name, g in grads.items())

    def _check_rows(self, layer: RecordedLayer, pairs) -> None:
        B = self.batch_size
        for a, g in pairs:
            if a.shape[0] != g.shape[0] or a.shape[0] % max(B, 1) or B == 0 or \
                    (a.shape[0] != B and not layer.rows_ok()) or layer.batch_moved():
                if a.shape[0] != g.shape[0]:
                    raise ValueError(
                        f"layer {layer.name}: the first dimension of its input "
                        f"({a.shape[0]}) differs from its output's ({g.shape[0]}): the layer "
                        "was applied to a tensor that is not batch-first. Inputs of clipped "
                        "layers must have the batch in dimension 0.")
                if a.shape[0] == 1 < B:
                    raise ValueError(
                        f"layer {layer.name} saw a batch of 1 but the loss has {B} values: its "
                        "input is shared by all samples and broadcast later, so its output "
                        "gradient is already summed over the batch and per-sample norms cannot "
                        "be formed. A shared row of no sample's data (Hugging Face's default "
                        "position_ids) is expanded to the batch while the engine follows the "
                        "step's batch (batch-first inputs); here it was not. Give the layer one "
                        "row per sample, e.g. position_ids=torch.arange(T).expand(B, T), or "
                        "freeze the layer (requires_grad_(False)).")
                raise ValueError(
                    f"layer {layer.name} saw a batch of {a.shape[0]} but the loss has {B} values; "
                    'the loss must have one value per sample: compute it with reduction="none" '
                    "and sum per-token or per-element losses per sample (e.g. "
                    "loss.view(B, -1).sum(1)). Inputs must be batch-first (batch dimension 0); a "
                    "layer may see k·B rows (Swin windows) only when they come from batch-first "
                    "tensors without moving dim 0."
                )

    def _merged(self, layer: RecordedLayer, pairs) -> Tuple[list, int]:
        """A Linear seeing k·B rows, k consecutive per sample (Swin windows): the rows merged into
        positions, ``(k·B, T, d) -> (B, k·T, d)``, exact for ghost norm, instantiation and clipped
        sum. ``(pairs, k)``."""
        B = self.batch_size
        if not (isinstance(layer.rule, LinearRule) and any(a.shape[0] != B for a, _ in pairs)):
            return pairs, 1
        k = pairs[0][0].shape[0] // B
        return [(a.reshape(B, -1, a.shape[-1]), g.reshape(B, -1, g.shape[-1]))
                for a, g in pairs], k

    @without_autocast
    def on_layer_ready(self, layer: RecordedLayer) -> None:
        """One recorded layer's output gradients have all arrived: its certified per-sample norm
        term, and what its clipped sum needs kept (per the release strategy)."""
        pairs = layer.pairs()
        B = self.batch_size
        keep_calls = False
        try:
            self._check_rows(layer, pairs)
            dims = [c.dims for c in layer.calls if c.fired and c.grad is not None]
            pairs, k = self._merged(layer, pairs)
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
                    grads, dims = self._rows_grads(layer, pairs, dims)
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
        """Whether a tied group is normed by its joint ghost norm in this pass (decided once, at
        its first layer): book-keeping modes, Embeddings and Linears sharing one weight, every
        recorded call with one row per sample, and the mode's rule picking the ghost norm for
        the stacked rows (:func:`private_engine.clipping.tied_ghost.joint_dims`)."""
        if group.use_ghost is None:
            group.use_ghost = False
            if self.book_keeping and group.ghost_capable and \
                    not any(self._handed_over(m) for _, m, _ in group.members):
                ids = {id(m) for _, m, _ in group.members}
                recs = [r for r in self.recorder.layers if id(r.module) in ids]
                calls = [c for r in recs for c in r.calls]
                if calls and all(c.activation is not None and
                                 c.activation.shape[0] == self.batch_size for c in calls):
                    dims = joint_dims([(r.module, r.rule, [c.dims for c in r.calls])
                                       for r in recs])
                    group.use_ghost = use_ghost(dims, self.mode)
        return group.use_ghost

    def _rows_grads(self, layer: RecordedLayer, pairs, dims):
        """Per-sample gradients of a (non-Linear) layer that sees ``k·B`` rows, k consecutive rows
        per sample (LeViT's ``flatten(0, 1)`` tokens): instantiated per row, the k rows of each
        sample summed, ``∂L_i/∂θ = Σ_{r ∈ rows(i)} G_r``."""
        B = self.batch_size
        total: Dict[str, torch.Tensor] = {}
        for a, g in pairs:
            for name, grad in layer.rule.per_sample_grads(layer.module, [(a, g)]).items():
                grad = grad.reshape(B, grad.shape[0] // B, *grad.shape[1:]).sum(1)
                total[name] = grad if name not in total else total[name] + grad
        return total, [replace(d, ghost_capable=False) for d in dims]

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
        """Keep the per-sample gradients of traced parameters and fallback modules (always
        instantiated; their norm is taken with the other kept gradients, their clipped sum is
        ``Σ_i C_i G_i`` of these very tensors, in every mode)."""
        if self.tracer is None:
            return
        params = {name: p for name, p in self.tracer.tracked.values()}
        for name, g in self.tracer.per_sample_grads().items():
            p = params[name]
            if id(p) in self._ruled_ids:  # a ruled layer's parameter, also used on a constant
                self._check_extra_rows(name, g)
                self.tied.add_param(p, g)
            else:
                self._keep_extra(name, "param-entry", [g], [p])
        for fb in self.fallbacks:
            if not fb.calls:
                continue
            grads = fb.per_sample_grads(self.batch_size)
            if grads:
                owned = dict(fb.params)
                self._keep_extra(fb.name, f"fallback:{type(fb.module).__name__}",
                                 list(grads.values()), [owned[n] for n in grads])

    def _check_extra_rows(self, name: str, grad: torch.Tensor) -> None:
        rows = grad.shape[0]
        if rows != self.batch_size:
            raise ValueError(
                f"{name} saw a batch of {rows} but the loss has {self.batch_size} values; the "
                "loss must have one value per sample (batch-first inputs).")

    def _keep_extra(self, name: str, layer_type: str, grads: Sequence[torch.Tensor],
                    params: Sequence[nn.Parameter]) -> None:
        self._check_extra_rows(name, grads[0])
        numel = sum(per_sample_numel(g) for g in grads)
        self._plan.append(LayerDecision(name=name, layer_type=layer_type, T=1, D=1, p=numel,
                                        ghost_cost=0, instantiate_cost=numel, use_ghost=False,
                                        ghost_capable=False))
        self._kept_grads.extend(zip(params, grads))

    # -- clip factors ------------------------------------------------------------------------
    def clip_factors(self, norms: torch.Tensor) -> torch.Tensor:
        """``C_i = C(‖g_i‖, R)`` (:func:`private_engine.clipping.functions.clip_factors`)."""
        return clip_factors(self.clip_fn, norms, self.max_grad_norm, checked=self.user_clip_fn)

    def finite_factors(self, norms: torch.Tensor, loss: Optional[torch.Tensor] = None):
        """``(norms, factors, keep, dropped)``: clip factors for certified ``norms``, with every
        sample whose norm (or loss) is not finite dropped — ``C_i = 0``, and ``keep`` (bool
        ``(B,)``, None when nothing was dropped) tells :meth:`clipped_sums` to zero its rows. A
        per-sample decision: one sample (a crafted value that overflows the forward, a float16
        overflow) never makes the step fail. ``dropped`` is a Python int (one host sync)."""
        ok = torch.isfinite(norms)
        if loss is not None:
            ok = ok & torch.isfinite(loss.detach())
        dropped = int((~ok).sum())
        if not dropped:
            return norms, self.clip_factors(norms), None, 0
        norms = torch.where(ok, norms, torch.zeros_like(norms))
        factors = torch.where(ok, self.clip_factors(norms), torch.zeros_like(norms))
        return norms, factors, ok, dropped

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
            layout = self._flat_layout()
            buffers, views = layout.allocate(layout.params)
            writer = _SumWriter(dict(zip(map(id, layout.params), views)), factors, keep)
            while self._kept_groups:
                params, mat = self._kept_groups.pop(0)
                writer.group(params, mat, layout.segment(buffers, params))
                del mat
            while self._kept_pairs:
                module, rule, pairs = self._kept_pairs.pop()
                writer.pair(module, rule, pairs)
                del pairs
            self.strategy.release(self, loss, factors, keep, writer.pair_weighted)
            unwritten = [p for p in layout.params if id(p) not in writer.written]
            for seg in layout.segments(buffers, unwritten):
                seg.zero_()  # parameters the loss does not reach
        finally:
            self.release()
        return GradSums(grads=[writer.view_of[id(p)] for p in self.params], buffers=buffers,
                        layout=layout)

    @without_autocast
    def clipped_sums_by_buffer(self, factors: torch.Tensor, keep: Optional[torch.Tensor],
                               sink: Callable[[object, List[torch.Tensor], List[torch.Tensor]],
                                              None],
                               order: Callable[[object], Any]) -> None:
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
        factors = factors.detach()
        try:
            layout = self._flat_layout()
            buffer_of = {id(p): slot[0] for p, slot in
                         ((p, layout.slots[id(p)]) for p in layout.params)}
            groups: Dict[int, list] = {}
            for params, mat in self._kept_groups:
                groups.setdefault(buffer_of[id(params[0])], []).append((params, mat))
            pairs: Dict[int, list] = {}
            for module, rule, kept in reversed(self._kept_pairs):
                ps = [buffer_of[id(p)] for p in _rule_params(module, rule)
                      if id(p) in buffer_of]
                if len(set(ps)) > 1:
                    raise RuntimeError("internal error: a kept layer's parameters span buffers.")
                if ps:
                    pairs.setdefault(ps[0], []).append((module, rule, kept))
            self._kept_groups, self._kept_pairs = [], []
            for b in sorted(range(layout.num_buffers), key=lambda b: order(layout.key_of(b))):
                buffer, views = layout.allocate_buffer(b)
                params = layout.buffer_params(b)
                writer = _SumWriter(dict(zip(map(id, params), views)), factors, keep)
                for ps, mat in groups.pop(b, []):
                    writer.group(ps, mat, layout.segment([buffer if k == b else None
                                                          for k in range(layout.num_buffers)],
                                                         ps))
                    del mat
                for module, rule, kept in pairs.pop(b, []):
                    writer.pair(module, rule, kept)
                    del kept
                for p, v in zip(params, views):
                    if id(p) not in writer.written:
                        v.zero_()  # parameters the loss does not reach
                sink(layout.key_of(b), params, views)
                del buffer, views, writer
        finally:
            self.release()

    def kept_layers_in_one_buffer(self) -> bool:
        """Whether every recorded layer's trainable parameters fall in one flat buffer (one
        ``buffer_group`` key and accumulation dtype): what :meth:`clipped_sums_by_buffer`
        needs."""

        for layer in self.recorder.layers:
            keys = {(self.buffer_group(p) if self.buffer_group else None, p.device,
                     accumulation_dtype(p))
                    for p in _rule_params(layer.module, layer.rule) if id(p) in self._param_ids}
            if len(keys) > 1:
                return False
        return True

    def _flat_layout(self) -> FlatLayout:
        """The flat-buffer layout for what this norm pass kept: the parameters of the kept
        per-sample gradient groups first, in group order (each group's sums are then one
        contiguous segment), then those of the kept ``(a, g)`` pairs in the order they are
        summed, then the rest (zeroed together). The same kinds of layers kept the same way at
        every step give the same layout object, so accumulated sums add buffer by buffer."""
        order = [p for params, _ in self._kept_groups for p in params]
        order += kept_pair_params(list(reversed(self._kept_pairs)))
        seen: set = set()
        order = [p for p in order
                 if id(p) in self._param_ids and not (id(p) in seen or seen.add(id(p)))]
        key = tuple(id(p) for p in order)
        if self._layout is None or key != self._layout_key:
            rest = [p for p in self.params if id(p) not in seen]
            self._layout, self._layout_key = FlatLayout(order + rest, self.buffer_group), key
        return self._layout

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


def _rule_params(module: nn.Module, rule) -> List[nn.Parameter]:
    """The parameters a layer rule writes sums for (those of ``rule.param_names`` the module
    holds)."""
    return [p for p in (getattr(module, n, None) for n in rule.param_names)
            if isinstance(p, nn.Parameter)]


class _SumWriter:
    """Writes clipped-sum terms into the views of a flat buffer: ``view_of`` maps id(parameter)
    to its view; a parameter's first term is written (by the layer's matmul ``out=`` the view,
    or copied), later ones (a weight kept twice: tied uses) added. ``keep`` (bool ``(B,)``):
    rows of dropped samples are zeroed before any product (no ``0·inf``)."""

    def __init__(self, view_of: Dict[int, torch.Tensor], factors: torch.Tensor,
                 keep: Optional[torch.Tensor]):
        self.view_of = view_of
        self.factors = factors
        self.keep = keep
        self.written: set = set()
        #: the factors rounded toward zero to each accumulation dtype, formed once
        self._cast: Dict[torch.dtype, torch.Tensor] = {}

    def factors_like(self, t: torch.Tensor) -> torch.Tensor:
        """The clip factors rounded toward zero (:func:`private_engine.layers.rounding.cast_down`)
        to the accumulation dtype of ``t`` (float64 stays float64, else float32), once per step and
        dtype: a rule that needs a narrower dtype rounds them again toward zero, which gives the
        same factors as one rounding (each grid is a subset of the wider one)."""
        dtype = accumulation_dtype(t)
        found = self._cast.get(dtype)
        if found is None:
            found = self._cast[dtype] = cast_down(self.factors, dtype)
        return found

    def put(self, p, g) -> None:
        """A term computed outside the buffer, written or added into ``p``'s view."""
        v = self.view_of[id(p)]
        if id(p) in self.written:
            v.add_(g.reshape(v.shape))
        else:
            v.copy_(g.reshape(v.shape))
            self.written.add(id(p))

    def group(self, params, mat, seg) -> None:
        """``Gᵀ C`` of a kept group ``(B, n)``: straight into ``seg`` (its parameters' contiguous
        segment, None when they are not one) when none was written yet, else through ``put``."""
        if self.keep is not None:
            mat = rows_kept(mat, self.keep)
        factors = self.factors_like(mat)
        if seg is not None and not any(id(p) in self.written for p in params):
            weighted_sum_into(seg, mat, factors)
            self.written.update(id(p) for p in params)
            return
        sums = weighted_sum_into(None, mat, factors)
        offset = 0
        for p in params:
            self.put(p, sums[offset:offset + p.numel()])
            offset += p.numel()

    def pair(self, module, rule, pairs) -> None:
        """``gᵀ·diag(C)·a`` of a kept layer, by its rule's ``weighted_grads``."""
        self.pair_weighted(module, rule, pairs, self.factors)

    def pair_weighted(self, module, rule, pairs, weights) -> None:
        """``gᵀ·diag(w)·a`` of a layer (the release strategy's second pass passes its own
        weights)."""
        if weights is self.factors and pairs:
            weights = self.factors_like(pairs[0][1])
        if self.keep is not None:
            pairs = [(rows_kept(a, self.keep), rows_kept(g, self.keep)) for a, g in pairs]
        targets = {}
        for name in rule.param_names:
            p = getattr(module, name, None)
            if isinstance(p, nn.Parameter) and id(p) in self.view_of and \
                    id(p) not in self.written:
                targets[name] = self.view_of[id(p)]
        for name, g in rule.weighted_grads(module, pairs, weights, out=targets).items():
            p = getattr(module, name)
            if targets.get(name) is g:
                self.written.add(id(p))
            else:
                self.put(p, g)
