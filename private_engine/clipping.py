"""Per-sample clipping: clip functions, certified per-sample norms over all layers, clipped sums.

Algorithm (seed 002, Algorithm 1 and Fig. 1, "ghost clipping" / "mixed ghost clipping"):

1. **Norm pass.** Backpropagate ``Σ_i L_i`` computing *activation* gradients only (autograd is
   asked for the gradients at the first trainable layers' outputs, so no weight gradient is
   formed). At each layer, from the recorded input ``a`` and output gradient ``g``, add the
   layer's per-sample ``‖∂L_i/∂θ_l‖²`` (ghost norm or instantiation, per the plan) to
   ``‖g_i‖² = Σ_l ‖∂L_i/∂θ_l‖²``. Every term is a *certified upper bound* of the squared norm of
   what the clipped sum releases for the sample, rounding included
   (:mod:`private_engine.layers.rounding`), summed in float64.
2. **Clip factors** ``C_i = C(‖g_i‖, R)`` from a clipping function.
3. **Clipped sum** ``Σ_i C_i·g_i``, layer by layer, from the very ``(a, g)`` the norms came from:
   ``gᵀ·diag(C)·a`` (one matmul per layer, ``LayerRule.weighted_grads``) or ``Σ_i C_i G_i`` of
   instantiated per-sample gradients.

Book-keeping modes ("bk", "bk_mixed", "bk_mixopt"; Bu et al. 2023, "Differentially Private
Optimization on Large Model at Small Cost") keep, per layer, either ``(a, g)`` or the instantiated
``G_i`` during the norm pass and form the clipped sums at its end: one backward in all. The
two-pass modes ("mixed", "ghost", "per_sample"; seed 002) keep nothing but the norms: a second
activation-only backward recomputes each layer's output gradient and writes its clipped sum as
soon as it arrives. Either way a sample's clip factor multiplies the rows of that sample at every
layer — never a loss entry that might belong to another row — and what is released is what was
normed: a second backward must reproduce each layer's output gradients bit for bit (checked per
layer by a float64 fingerprint; where a non-deterministic kernel changed them, that layer's
factors are lowered to its recomputed bound, so the certificate still holds).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .fallback import FallbackModule, warn_fallback
from .grad_sums import FlatLayout, GradSums
from .hooks import GraphWalk, LayerRecorder, RecordedLayer
from .separability import SeparabilityProbe
from .plan import DEFAULT_CLIPPING_MODE, LayerDecision, check_mode, decide, is_book_keeping
from .layers.base import certified_kept, sum_per_sample, trainable, weighted_sum_into
from .layers.rounding import gamma
from .layers.linear import LinearRule
from .tracer import ParamTracer
from .validation import _scan

ClipFn = Callable[[torch.Tensor, float], torch.Tensor]

ABADI_EPS = 1e-6
AUTOMATIC_GAMMA = 0.01
#: book-keeping: small kept per-sample gradients are laid side by side (copied) in groups of at most this many
#: elements for their norms and clipped sums; on CUDA, where each operation is a kernel launch that costs more
#: host time than copying a few MiB, a gradient is "small" up to ``KEPT_SMALL_CUDA`` elements; on the CPU, where
#: the copy costs more than the operations it saves, up to ``KEPT_SMALL_CPU``. Larger ones stay alone (no copy).
KEPT_GROUP_ELEMENTS = 1 << 22
KEPT_SMALL_CUDA = 1 << 20
KEPT_SMALL_CPU = 1 << 14


def abadi_clip(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Abadi et al. (2016) clipping: ``C_i = min(1, R / (‖g_i‖ + 1e-6))``.

    The 1e-6 guard matches Opacus, so ``‖C_i g_i‖ ≤ R`` and results agree with it exactly.
    """
    return (max_grad_norm / (norms + ABADI_EPS)).clamp(max=1.0)


def automatic_clip(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Automatic clipping (Bu et al., 2022, "Automatic clipping"): ``C_i = R / (‖g_i‖ + γ)``, γ = 0.01.

    Every sample is normalised; ``‖C_i g_i‖ = R·‖g_i‖/(‖g_i‖+γ) < R``.
    """
    return max_grad_norm / (norms + AUTOMATIC_GAMMA)


def global_clip(norms: torch.Tensor, max_grad_norm: float, threshold: Optional[float] = None) -> torch.Tensor:
    """Global clipping (Bu et al., 2021): ``C_i = (R / Z)·1{‖g_i‖ < Z}`` with threshold Z (default Z = R).

    Samples with norm below Z are kept, rescaled by R/Z; others are dropped, so ``‖C_i g_i‖ < R``.
    """
    z = max_grad_norm if threshold is None else threshold
    return (norms < z).to(norms.dtype) * (max_grad_norm / z)


CLIPPING_FUNCTIONS: Dict[str, ClipFn] = {"abadi": abadi_clip, "automatic": automatic_clip, "global": global_clip}


def resolve_clipping_fn(clipping_fn: Union[str, ClipFn]) -> Tuple[ClipFn, bool]:
    """The clip function for a name or callable, and whether it is user-supplied (then checked)."""
    if callable(clipping_fn):
        return clipping_fn, True
    if clipping_fn not in CLIPPING_FUNCTIONS:
        raise ValueError(
            f"clipping_fn must be one of {sorted(CLIPPING_FUNCTIONS)} or a callable (norms, max_grad_norm) -> "
            f"factors; got {clipping_fn!r}."
        )
    return CLIPPING_FUNCTIONS[clipping_fn], False


@functools.lru_cache(maxsize=None)
def _takes_out_of(cls: type) -> bool:
    try:
        return "out" in inspect.signature(cls.weighted_grads).parameters
    except (TypeError, ValueError):
        return False


def _takes_out(rule) -> bool:
    """True when ``rule.weighted_grads`` accepts ``out=`` (every built-in rule; a rule registered by a user may
    override it with the older ``(module, calls, factors)`` signature)."""
    return _takes_out_of(type(rule))


def _per_sample_numel(t: torch.Tensor) -> int:
    """Elements per sample (row of dim 0) of ``t``, from its shape (``t[0].numel()`` would dispatch an op)."""
    return t.numel() // t.shape[0] if t.shape[0] else 0


def _rows_kept(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``t`` with the rows (dim 0, one per sample) of dropped samples set to zero (integer ids kept)."""
    if not t.is_floating_point():
        return t
    return torch.where(keep.reshape(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))


def _fingerprints(pairs) -> List[torch.Tensor]:
    """Per call, ``Σ_j g_{r,j}`` of every row r of the output gradient in float64: what a second
    backward must reproduce for the first pass's norms to certify its release (a non-deterministic
    kernel changes it)."""
    return [g.reshape(g.shape[0], -1).sum(1, dtype=torch.float64) for _, g in pairs]


def _same(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> bool:
    def equal(x, y):
        return x.shape == y.shape and bool(
            torch.equal(x, y) or torch.allclose(x, y, rtol=0.0, atol=0.0, equal_nan=True))

    return len(xs) == len(ys) and all(equal(x, y) for x, y in zip(xs, ys))


def check_per_sample_loss(loss, *, name: str = "loss") -> torch.Tensor:
    """Validate a per-sample loss vector ``(B,)`` (reduction="none")."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of per-sample losses, got {type(loss).__name__}.")
    if loss.dim() != 1:
        raise ValueError(
            f"{name} must hold one value per sample (shape (B,)); got shape {tuple(loss.shape)}. "
            'Compute it with reduction="none", e.g. F.cross_entropy(logits, y, reduction="none").'
        )
    if loss.numel() and not loss.requires_grad:
        raise ValueError(f"{name} does not require grad: it must come from the model's forward pass with grad enabled.")
    return loss


@dataclass
class _FirstPass:
    """What a two-pass norm pass remembers of one layer for the second pass."""

    use_ghost: bool
    #: k of a Linear seeing k·B rows, merged into positions (1 otherwise)
    merged: int
    fingerprints: List[torch.Tensor]
    #: the certified squared norms the clip factors were computed from (None: per-sample gradients
    #: kept)
    bound: Optional[torch.Tensor]


class PerSampleClipper:
    """Certified per-sample gradient norms and the clipped gradient sum of one physical batch."""

    def __init__(self, layers: Sequence[Tuple[str, nn.Module, object]], params: Sequence[nn.Parameter],
                 *, mode: str = DEFAULT_CLIPPING_MODE, clipping_fn: Union[str, ClipFn] = "abadi",
                 max_grad_norm: float = 1.0, model: Optional[nn.Module] = None):
        self.mode = check_mode(mode)
        self.clip_fn, self.user_clip_fn = resolve_clipping_fn(clipping_fn)
        if not 0 < max_grad_norm < float("inf"):
            raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm}.")
        self.max_grad_norm = float(max_grad_norm)
        self.params = list(params)
        self.recorder = LayerRecorder(layers, on_layer_ready=self._on_layer_ready)
        #: when True, the per-sample gradients of traced parameters and fallback modules of the last norm
        #: pass are kept in ``last_extra_grads = {param name: (B, *shape)}`` (tests)
        self.keep_extra_grads = False
        self.last_extra_grads: Dict[str, torch.Tensor] = {}
        self.tracer: Optional[ParamTracer] = None
        self.fallbacks: List[FallbackModule] = []
        if model is not None:
            _, traced, fallbacks, _ = _scan(model)
            if traced or fallbacks:  # the tracer also tells the fallbacks the batch size and batched inputs
                self.tracer = ParamTracer(model, traced, opaque=[m for _, m in fallbacks])
                self.tracer.recorder = self.recorder
                self.tracer.linear_layers = {id(l.module.weight): l for l in self.recorder.layers
                                             if isinstance(l.rule, LinearRule) and trainable(l.module, "weight")}
                self.fallbacks = [FallbackModule(n, m, self.tracer) for n, m in fallbacks]
                self.recorder.extras = [self.tracer, *self.fallbacks]
                self.recorder.tracer = self.tracer
                warn_fallback([f"{n or '(the model)'} ({type(m).__name__})" for n, m in fallbacks])
        #: checks that the model and loss are sample-separable at the first step of each input
        #: signature
        self.probe: Optional[SeparabilityProbe] = None
        if model is not None:
            self.probe = SeparabilityProbe(model)
            self.probe.install()
        self.last_plan: List[LayerDecision] = []
        #: per-layer (B,) certified squared norms (float64) of the running norm pass, summed once at
        #: its end
        self._norm_terms: List[torch.Tensor] = []
        self._batch_size = 0
        self._plan: List[LayerDecision] = []
        #: book-keeping: one backward, the clipped sum from what the norm pass kept
        self.book_keeping = is_book_keeping(self.mode)
        #: kept by the norm pass: [(module, rule, [(a, g)])] (book-keeping) and [(parameter, G (B,
        #: *shape))]
        #: (book-keeping's instantiated layers; traced parameters, fallback modules and k·B-row
        #: layers in every mode)
        self._kept_pairs: list = []
        self._kept_grads: list = []
        #: the kept per-sample gradients at the end of the norm pass, side by side: [([parameters], (B, n))]
        self._kept_groups: list = []
        #: two-pass modes: per recorded layer, what the second pass needs (keyed by
        #: id(RecordedLayer))
        self._first: Dict[int, _FirstPass] = {}
        #: two-pass modes: the edges the norm pass asked autograd for (the second pass asks for them
        #: again)
        self._leading: list = []
        #: while the second pass runs: (factors, keep, write)
        self._second = None
        #: where the clipped sums of a step live (rebuilt when which parameters are kept how
        #: changes)
        self._layout: Optional[FlatLayout] = None
        self._layout_key: tuple = ()
        self._param_ids = {id(p) for p in self.params}

    # -- norm pass ---------------------------------------------------------------------------
    def start_pass(self, batch_size: int) -> None:
        """Begin the norm pass of a physical batch of ``batch_size`` samples (drops what an earlier
        one kept)."""
        self._batch_size = batch_size
        self._norm_terms = []
        self._plan = []
        self._kept_pairs, self._kept_grads, self._kept_groups = [], [], []
        self._first, self._leading = {}, []

    def _check_rows(self, layer: RecordedLayer, pairs) -> None:
        B = self._batch_size
        for a, g in pairs:
            if a.shape[0] != g.shape[0] or a.shape[0] % max(B, 1) or B == 0 or \
                    (a.shape[0] != B and not layer.rows_ok()) or layer.batch_moved():
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
        B = self._batch_size
        if not (isinstance(layer.rule, LinearRule) and any(a.shape[0] != B for a, _ in pairs)):
            return pairs, 1
        k = pairs[0][0].shape[0] // B
        return [(a.reshape(B, -1, a.shape[-1]), g.reshape(B, -1, g.shape[-1])) for a, g in pairs], k

    def _on_layer_ready(self, layer: RecordedLayer) -> None:
        pairs = layer.pairs()
        B = self._batch_size
        keep_calls = False
        try:
            self._check_rows(layer, pairs)
            dims = [c.dims for c in layer.calls if c.fired and c.grad is not None]
            pairs, k = self._merged(layer, pairs)
            if k > 1:
                dims = [replace(d, T=d.T * k, io_size=d.io_size * k) for d in dims]
            if any(a.shape[0] != B for a, _ in pairs):
                # instantiated per row and summed per sample, in every mode kept for the clipped sum
                grads, dims = self._rows_grads(layer, pairs, dims)
                decision = decide(layer.name, layer.module, dims, self.mode)
                self._keep_grads(layer.module, grads)
                contrib = None
                if not self.book_keeping:
                    self._first[id(layer)] = _FirstPass(False, 1, [], None)
                    keep_calls = True
            elif self.book_keeping:
                decision, contrib = self._book_keep(layer, dims, pairs)
            else:
                decision = decide(layer.name, layer.module, dims, self.mode)
                contrib = layer.rule.certified_norm_sq(layer.module, pairs, decision.use_ghost)
                self._first[id(layer)] = _FirstPass(decision.use_ghost, k, _fingerprints(pairs),
                                                    contrib)
                keep_calls = True
            self._plan.append(decision)
            if contrib is not None:
                self._norm_terms.append(contrib)
        finally:
            if keep_calls:  # the second pass needs the activations and edges, not this gradient
                layer.clear_grads()
            else:
                layer.release()

    def _book_keep(self, layer: RecordedLayer, dims, pairs):
        """Norm of one layer in a book-keeping mode, keeping what its clipped sum needs: ``(a, g)`` for a
        ghost layer; for an instantiated one the per-sample gradients ``G_i`` when they are no
        larger than ``(a, g)`` per sample (always in "bk_mixopt", which puts time first), else ``(a,
        g)`` again (the clipped sum is then one matmul ``gᵀ·diag(C)·a`` at the end instead of a
        contraction of ``G``). Returns ``(decision, certified ‖∂L_i/∂θ‖² per sample)``, or
        ``(decision, None)`` when the per-sample gradients are kept: their norms are taken at the
        end of the pass, all kept gradients side by side (:meth:`_group_kept_grads`)."""
        module, rule = layer.module, layer.rule
        decision = decide(layer.name, module, dims, self.mode)
        if decision.use_ghost:
            self._kept_pairs.append((module, rule, pairs))
            return decision, rule.certified_norm_sq(module, pairs, True)
        grads = rule.per_sample_grads(module, pairs)
        grad_size = sum(_per_sample_numel(g) for g in grads.values())
        pair_size = sum(_per_sample_numel(a) + _per_sample_numel(g) for a, g in pairs)
        if self.mode == "bk_mixopt" or grad_size <= pair_size:
            self._keep_grads(module, grads)
            return decision, None
        contrib = rule.certified_norm_sq(module, pairs, False, grads=grads)
        del grads
        self._kept_pairs.append((module, rule, pairs))
        return decision, contrib

    def _keep_grads(self, module: nn.Module, grads: Dict[str, torch.Tensor]) -> None:
        self._kept_grads.extend((getattr(module, name), g) for name, g in grads.items())

    def _rows_grads(self, layer: RecordedLayer, pairs, dims):
        """Per-sample gradients of a (non-Linear) layer that sees ``k·B`` rows, k consecutive rows per sample
        (LeViT's ``flatten(0, 1)`` tokens): instantiated per row, the k rows of each sample summed,
        ``∂L_i/∂θ = Σ_{r ∈ rows(i)} G_r``."""
        B = self._batch_size
        total = {}
        for a, g in pairs:
            for name, grad in layer.rule.per_sample_grads(layer.module, [(a, g)]).items():
                grad = grad.reshape(B, grad.shape[0] // B, *grad.shape[1:]).sum(1)
                total[name] = grad if name not in total else total[name] + grad
        return total, [replace(d, ghost_capable=False) for d in dims]

    def per_sample_norms(self, loss: torch.Tensor, walk: Optional[GraphWalk] = None) -> torch.Tensor:
        """Certified ``‖g_i‖ ≥ (Σ_l ‖release_i^l‖²)^{1/2}`` for every sample (float64), from one
        activation-only backward.

        Autograd is asked for the gradients at the outputs of the leading recorded calls (no recorded
        call below them; :meth:`LayerRecorder.walk`) and at the tracer's entries and fallback outputs, so
        the backward runs through every recorded call computing activation gradients only. In a
        book-keeping mode the graph is freed as the backward goes (nothing needs it afterwards); otherwise
        it is retained for the second pass of :meth:`clipped_sums`.
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
                inputs += self.tracer.entry_edges() + [e for fb in self.fallbacks for e in fb.out_edges()]
            if inputs:
                torch.autograd.grad(total, inputs=inputs, retain_graph=not self.book_keeping, allow_unused=True)
            missed = [layer.name for layer in self.recorder.layers for c in layer.calls
                      if not c.fired and c.edge.node in walk.reached]
            if missed:  # would leave their gradients out of norms and sums: never silently
                raise RuntimeError(f"internal error: the norm pass did not reach recorded calls of {missed}.")
            self.recorder.finish_unfired()  # calls the loss does not depend on contribute nothing
            norms = self.end_norm_pass(loss.device)
            ok = True
        finally:
            self._set_capturing(False)
            if ok and not self.book_keeping:
                self._leading = inputs  # asked for again by the second pass (extras stay silent)
                for extra in self.recorder.extras:  # their per-sample gradients are kept
                    extra.reset()
            else:
                if not ok:
                    self._kept_pairs, self._kept_grads, self._kept_groups = [], [], []
                    self._first, self._leading = {}, []
                self.recorder.reset()
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

    def end_norm_pass(self, device: torch.device) -> torch.Tensor:
        """Finish a norm pass whose layers have all been handed to :meth:`_on_layer_ready`: the
        traced parameters' and fallback modules' norms, the kept per-sample gradients grouped, and
        ``‖g_i‖ = (Σ_l N_l²)^{1/2}``: the sum in float64 raised by ``γ^{(64)}_{L+2}`` (L terms, any
        order), the square root by one more ulp."""
        self._extra_norms()
        self._group_kept_grads()
        self.last_plan = list(reversed(self._plan))
        B = self._batch_size
        if not self._norm_terms:
            return torch.zeros(B, dtype=torch.float64, device=device)
        terms, self._norm_terms = self._norm_terms, []
        norm_sq = sum_per_sample(terms, terms[0]) * (1 + gamma(len(terms) + 2, 2.0 ** -53))
        return norm_sq.sqrt() * (1 + 2.0 ** -51)

    def _set_capturing(self, on: bool) -> None:
        self.recorder.capturing = on
        for extra in self.recorder.extras:
            extra.capturing = on

    def _add(self, name: str, layer_type: str, grads: Sequence[torch.Tensor], params: Sequence[nn.Parameter]) -> None:
        """One plan row for instantiated per-sample gradients ``grads`` (of ``params``, each ``(B, *shape)``) of a
        traced parameter or fallback module, kept: their norm is taken at the end of the pass with
        the other kept gradients, and their clipped sum is ``Σ_i C_i G_i`` of these very tensors
        (every mode)."""
        rows = grads[0].shape[0]
        if rows != self._batch_size:
            raise ValueError(f"{name} saw a batch of {rows} but the loss has {self._batch_size} values; "
                             "the loss must have one value per sample (batch-first inputs).")
        numel = sum(_per_sample_numel(g) for g in grads)
        self._plan.append(LayerDecision(name=name, layer_type=layer_type, T=1, D=1, p=numel, ghost_cost=0,
                                        instantiate_cost=numel, use_ghost=False, ghost_capable=False))
        self._kept_grads.extend(zip(params, grads))

    def _extra_norms(self) -> None:
        """Keep the per-sample gradients of traced parameters and fallback modules (always
        instantiated)."""
        self.last_extra_grads = {}
        if self.tracer is None:
            return
        if self.keep_extra_grads:
            self.last_extra_grads.update(self.tracer.per_sample_grads())
        for pid, g in self.tracer.grads.items():
            self._add(self.tracer.names[pid], "param-entry", [g], [self.tracer.tracked[pid][1]])
        for fb in self.fallbacks:
            if not fb.calls:
                continue
            grads = fb.per_sample_grads(self._batch_size)
            if self.keep_extra_grads:
                prefix = f"{fb.name}." if fb.name else ""
                self.last_extra_grads.update({prefix + n: g for n, g in grads.items()})
            if grads:
                params = dict(fb.params)
                self._add(fb.name, f"fallback:{type(fb.module).__name__}", list(grads.values()),
                          [params[n] for n in grads])

    def _group_kept_grads(self) -> None:
        """End of the norm pass: the kept per-sample gradients ``G`` (LayerNorm affine parameters,
        instantiated layers, traced parameters, fallback modules), the small ones laid side by side
        as ``(B, n)`` matrices of at most ``KEPT_GROUP_ELEMENTS`` elements (one dtype and device
        each; a large one stays alone, uncopied; see ``KEPT_SMALL_CUDA``), so that their certified
        squared norms ``Σ_θ ‖G_i^θ‖²`` are one reduction per group
        (:func:`private_engine.layers.base.certified_kept`), and their clipped sums one
        matrix-vector product ``Gᵀ C`` per group (:meth:`clipped_sums`) — not one of each per
        parameter. Each original is released as soon as its group is formed."""
        B = self._batch_size
        items, self._kept_grads = self._kept_grads, []
        groups: list = []
        current: list = []
        size = 0

        def flush():
            if not current:
                return
            params = [p for p, _ in current]
            if len(current) == 1:
                mat = current[0][1].reshape(B, -1)
            else:
                mat = torch.cat([G.reshape(B, -1) for _, G in current], 1)
            current.clear()
            self._norm_terms.append(certified_kept([mat], mat))
            groups.append((params, mat))

        for k in range(len(items)):
            p, G = items[k]
            items[k] = None
            small = G.numel() <= (KEPT_SMALL_CUDA if G.is_cuda else KEPT_SMALL_CPU)
            if current and (not small or G.dtype != current[0][1].dtype or G.device != current[0][1].device
                            or size + G.numel() > KEPT_GROUP_ELEMENTS):
                flush()
                size = 0
            current.append((p, G))
            size += G.numel()
            if not small:
                flush()
                size = 0
        flush()
        self._kept_groups = groups

    def extra_weighted_grads(self, factors: torch.Tensor) -> Dict[str, torch.Tensor]:
        """``{name: Σ_i C_i ∂L_i/∂θ}`` for traced parameters and fallback modules, from the per-sample
        gradients of the last norm pass (needs ``keep_extra_grads = True``)."""
        if not self.keep_extra_grads:
            raise RuntimeError("set clipper.keep_extra_grads = True before the norm pass to keep per-sample gradients.")
        return {n: torch.tensordot(factors.to(g.dtype), g, dims=1) for n, g in self.last_extra_grads.items()}

    def clip_factors(self, norms: torch.Tensor) -> torch.Tensor:
        """``C_i = C(‖g_i‖, R)``; a user clip function is checked to keep ``‖C_i g_i‖ ≤ R``."""
        factors = self.clip_fn(norms, self.max_grad_norm)
        if self.user_clip_fn:
            if not isinstance(factors, torch.Tensor) or factors.shape != norms.shape:
                raise ValueError("a custom clipping_fn must return one factor per sample (same shape as norms).")
            too_big = factors * norms > self.max_grad_norm * (1 + 1e-6)
            bad = ~torch.isfinite(factors) | (factors < 0) | too_big
            if bool(bad.any()):
                raise ValueError(
                    "the custom clipping_fn returned factors that are not finite, or with C_i < 0 "
                    "or C_i·‖g_i‖ > max_grad_norm (norms are ≥ 0, possibly 0); the sensitivity "
                    "would exceed max_grad_norm and the privacy guarantee would not hold."
                )
        return factors

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

    # -- clipped sums ------------------------------------------------------------------------------
    def clipped_grad_sum(self, loss: torch.Tensor, factors: torch.Tensor,
                         keep: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """``[Σ_i C_i·∂L_i/∂θ for θ in params]`` (:meth:`clipped_sums`; one tensor of its own per parameter)."""
        return self.clipped_sums(loss, factors, keep).own_grads()

    def clipped_sums(self, loss: Optional[torch.Tensor], factors: torch.Tensor,
                     keep: Optional[torch.Tensor] = None) -> GradSums:
        """``Σ_i C_i·∂L_i/∂θ`` for every parameter, in flat buffers
        (:mod:`private_engine.grad_sums`).

        From what the norm pass kept: ``gᵀ·diag(C)·a`` per kept layer (``LayerRule.weighted_grads``,
        written by its matmul straight into the parameter's view of a flat buffer) and ``Gᵀ C`` per
        group of kept per-sample gradients (one matrix-vector product into the group's contiguous
        segment); each kept tensor is released as soon as its term is formed. Two-pass modes: the
        recorded layers' sums are written during a second activation-only backward of ``loss`` (the
        norm pass's loss, its graph retained), layer by layer as their output gradients arrive.
        ``keep`` (bool ``(B,)``): samples whose rows take part; the others (non-finite loss or norm)
        are zeroed first, so that an inf/NaN row cannot reach the sum through ``0·inf``.
        """
        factors = factors.detach()
        try:
            layout = self._flat_layout()
            buffers, views = layout.allocate(layout.params)
            view_of = {id(p): v for p, v in zip(layout.params, views)}
            written: set = set()

            def put(p, g):  # a term computed outside the buffer (rare: a parameter kept twice, a foreign rule)
                v = view_of[id(p)]
                if id(p) in written:
                    v.add_(g.reshape(v.shape))
                else:
                    v.copy_(g.reshape(v.shape))
                    written.add(id(p))

            def write(module, rule, pairs, weights):
                if keep is not None:
                    pairs = [(_rows_kept(a, keep), _rows_kept(g, keep)) for a, g in pairs]
                targets = {}
                for name in rule.param_names:
                    p = getattr(module, name, None)
                    if isinstance(p, nn.Parameter) and id(p) in view_of and id(p) not in written:
                        targets[name] = view_of[id(p)]
                if _takes_out(rule):
                    result = rule.weighted_grads(module, pairs, weights, out=targets)
                else:  # a user rule written against the signature without out=: its sums are copied in
                    result = rule.weighted_grads(module, pairs, weights)
                for name, g in result.items():
                    p = getattr(module, name)
                    if targets.get(name) is g:
                        written.add(id(p))
                    else:
                        put(p, g)

            while self._kept_groups:
                params, mat = self._kept_groups.pop(0)
                if keep is not None:
                    mat = _rows_kept(mat, keep)
                seg = layout.segment(buffers, params)
                if seg is not None and not any(id(p) in written for p in params):
                    weighted_sum_into(seg, mat, factors)
                    written.update(id(p) for p in params)
                else:
                    sums = weighted_sum_into(None, mat, factors)
                    offset = 0
                    for p in params:
                        put(p, sums[offset:offset + p.numel()])
                        offset += p.numel()
                del mat
            while self._kept_pairs:
                module, rule, pairs = self._kept_pairs.pop()
                write(module, rule, pairs, factors)
                del pairs
            if not self.book_keeping:
                self._second_pass(loss, factors, keep, write)
            for seg in layout.segments(buffers, [p for p in layout.params if id(p) not in written]):
                seg.zero_()  # parameters the loss does not reach
        finally:
            self.release()
        return GradSums(grads=[view_of[id(p)] for p in self.params], buffers=buffers, layout=layout)

    def _second_pass(self, loss: Optional[torch.Tensor], factors: torch.Tensor, keep,
                     write) -> None:
        """Two-pass modes: backpropagate ``Σ_i L_i`` again, activation gradients only, and write
        each recorded layer's clipped sum from ``(a, g)`` as its output gradient arrives
        (:meth:`_on_layer_released`)."""
        recorder = self.recorder
        saved = recorder.on_layer_ready
        recorder.on_layer_ready = self._on_layer_released
        self._second = (factors, keep, write)
        recorder.rearm()
        recorder.capturing = True
        try:
            if self._leading:
                if loss is None:
                    raise RuntimeError("internal error: the second pass needs the loss.")
                torch.autograd.grad(loss.sum(), inputs=self._leading, allow_unused=True)
            recorder.finish_unfired()
        finally:
            recorder.capturing = False
            recorder.on_layer_ready = saved
            self._second = None

    def _on_layer_released(self, layer: RecordedLayer) -> None:
        """Second pass: one layer's clipped sum ``gᵀ·diag(C)·a``. The output gradient must be the
        norm pass's, bit for bit (compared by fingerprint); if a non-deterministic kernel changed
        it, the layer's certified bound is computed again and its factors lowered to ``C_i·min(1,
        (N_i/N'_i))`` for this layer, so that its release stays within what the clip factors were
        computed for."""
        factors, keep, write = self._second
        try:
            first = self._first.get(id(layer))
            if first is None or first.bound is None:  # per-sample gradients kept: released as such
                return
            pairs = layer.pairs()
            if first.merged > 1:
                B = self._batch_size
                pairs = [(a.reshape(B, -1, a.shape[-1]), g.reshape(B, -1, g.shape[-1]))
                         for a, g in pairs]
            weights = factors
            if not _same(_fingerprints(pairs), first.fingerprints):
                again = layer.rule.certified_norm_sq(layer.module, pairs, first.use_ghost)
                ratio = torch.where(again > first.bound, (first.bound / again).sqrt(),
                                    torch.ones_like(again))
                weights = factors * ratio.to(factors.dtype)
            write(layer.module, layer.rule, pairs, weights)
        finally:
            layer.release()

    def _flat_layout(self) -> FlatLayout:
        """The flat-buffer layout for what this norm pass kept: the parameters of the kept per-sample gradient
        groups first, in group order (each group's sums are then one contiguous segment), then those of the kept
        ``(a, g)`` pairs in the order they are summed, then the rest (zeroed together). The same kinds of layers
        kept the same way at every step give the same layout object, so accumulated sums add buffer by buffer."""
        order = [p for params, _ in self._kept_groups for p in params]
        order += [getattr(m, n) for m, rule, _ in reversed(self._kept_pairs) for n in rule.param_names
                  if isinstance(getattr(m, n, None), nn.Parameter)]
        seen: set = set()
        order = [p for p in order if id(p) in self._param_ids and not (id(p) in seen or seen.add(id(p)))]
        key = tuple(id(p) for p in order)
        if self._layout is None or key != self._layout_key:
            rest = [p for p in self.params if id(p) not in seen]
            self._layout, self._layout_key = FlatLayout(order + rest), key
        return self._layout

    def release(self) -> None:
        """Drop every record and everything a norm pass kept (after an error, or when done)."""
        self._kept_pairs, self._kept_grads, self._kept_groups = [], [], []
        self._first, self._leading = {}, []
        self.recorder.reset()

    def install(self) -> None:
        """(Re-)install the recording hooks and the separability probe."""
        self.recorder.install()
        if self.probe is not None:
            self.probe.install()

    def remove(self) -> None:
        self.recorder.remove()
        if self.probe is not None:
            self.probe.remove()
