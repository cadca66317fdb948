"""Per-sample clipping: clip functions, per-sample norms over all layers, the weighted second backward.

Algorithm (seed 002, Algorithm 1 and Fig. 1, "ghost clipping" / "mixed ghost clipping"):

1. **Norm pass.** Backpropagate ``Σ_i L_i`` computing *activation* gradients only (autograd is
   asked for the gradients at the first trainable layers' outputs, so no weight gradient is
   formed). At each layer, from the recorded input ``a`` and output gradient ``g``, add the
   layer's per-sample ``‖∂L_i/∂θ_l‖²`` (ghost norm or instantiation, per the plan) to
   ``‖g_i‖² = Σ_l ‖∂L_i/∂θ_l‖²``.
2. **Clip factors** ``C_i = C(‖g_i‖, R)`` from a clipping function.
3. **Weighted pass.** ``∇_θ Σ_i C_i·L_i = Σ_i C_i·g_i`` — the clipped gradient sum — by one
   ordinary backward of the re-weighted loss (``C_i`` treated as constants).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .fallback import FallbackModule, warn_fallback
from .hooks import LayerRecorder, RecordedLayer
from .plan import LayerDecision, check_mode, decide
from .layers.base import trainable
from .layers.linear import LinearRule
from .tracer import ParamTracer
from .validation import _scan

ClipFn = Callable[[torch.Tensor, float], torch.Tensor]

ABADI_EPS = 1e-6
AUTOMATIC_GAMMA = 0.01


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


def decided_norm_sq(name: str, module: nn.Module, rule, dims, pairs, mode: str):
    """``(decision, ‖∂L_i/∂θ‖² per sample)`` of one layer: the mixed-clipping decision of seed 002
    (eq. 4.1, ghost iff ``2T² < pD`` in mode "mixed") on the dimensions of its calls, then the ghost norm
    ``⟨a aᵀ, g gᵀ⟩`` or the instantiated ``‖gᵀ a‖²_F`` accordingly, from ``pairs = [(a, g)]``."""
    decision = decide(name, module, dims, mode)
    contrib = rule.ghost_norm_sq(module, pairs) if decision.use_ghost else rule.instantiated_norm_sq(module, pairs)
    return decision, contrib


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


class PerSampleClipper:
    """Computes per-sample gradient norms and the clipped gradient sum for one physical batch."""

    def __init__(self, layers: Sequence[Tuple[str, nn.Module, object]], params: Sequence[nn.Parameter],
                 *, mode: str = "mixed", clipping_fn: Union[str, ClipFn] = "abadi", max_grad_norm: float = 1.0,
                 model: Optional[nn.Module] = None):
        self.mode = check_mode(mode)
        self.clip_fn, self.user_clip_fn = resolve_clipping_fn(clipping_fn)
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}.")
        self.max_grad_norm = float(max_grad_norm)
        self.params = list(params)
        self.recorder = LayerRecorder(layers, on_layer_ready=self._on_layer_ready)
        #: when True, the per-sample gradients of traced parameters and fallback modules of the last norm
        #: pass are kept in ``last_extra_grads = {param name: (B, *shape)}`` (tests, book-keeping)
        self.keep_extra_grads = False
        self.last_extra_grads: Dict[str, torch.Tensor] = {}
        self.tracer: Optional[ParamTracer] = None
        self.fallbacks: List[FallbackModule] = []
        if model is not None:
            _, traced, fallbacks, _ = _scan(model)
            if traced or fallbacks:  # the tracer also tells the fallbacks the batch size and batched inputs
                self.tracer = ParamTracer(model, traced)
                self.tracer.recorder = self.recorder
                self.tracer.linear_layers = {id(l.module.weight): l for l in self.recorder.layers
                                             if isinstance(l.rule, LinearRule) and trainable(l.module, "weight")}
                self.fallbacks = [FallbackModule(n, m, self.tracer) for n, m in fallbacks]
                self.recorder.extras = [self.tracer, *self.fallbacks]
                warn_fallback([f"{n or '(the model)'} ({type(m).__name__})" for n, m in fallbacks])
        self.last_plan: List[LayerDecision] = []
        self._norm_sq: Optional[torch.Tensor] = None
        self._batch_size = 0
        self._plan: List[LayerDecision] = []

    # -- norm pass ---------------------------------------------------------------------------
    def _on_layer_ready(self, layer: RecordedLayer) -> None:
        pairs = layer.pairs()
        B = self._batch_size
        try:
            for a, g in pairs:
                if a.shape[0] != g.shape[0] or a.shape[0] % max(B, 1) or B == 0 or \
                        (a.shape[0] != B and not layer.rows_ok()) or layer.batch_moved():
                    raise ValueError(
                        f"layer {layer.name} saw a batch of {a.shape[0]} but the loss has {B} values; "
                        'the loss must have one value per sample: compute it with reduction="none" and sum '
                        "per-token or per-element losses per sample (e.g. loss.view(B, -1).sum(1)). Inputs must be "
                        "batch-first (batch dimension 0); a layer may see k·B rows (Swin windows) only when they "
                        "come from batch-first tensors without moving dim 0."
                    )
            dims = [c.dims for c in layer.calls if c.fired and c.grad is not None]
            if any(a.shape[0] != B for a, _ in pairs) and isinstance(layer.rule, LinearRule):
                # k·B rows, k consecutive per sample (Swin windows): merged into positions, (k·B, T, d) ->
                # (B, k·T, d), exact for ghost norm and instantiation
                dims = [replace(d, T=d.T * (a.shape[0] // B)) for d, (a, _) in zip(dims, pairs)]
                pairs = [(a.reshape(B, -1, a.shape[-1]), g.reshape(B, -1, g.shape[-1])) for a, g in pairs]
            if any(a.shape[0] != B for a, _ in pairs):
                contrib, dims = self._rows_norm_sq(layer, pairs, dims)
                decision = decide(layer.name, layer.module, dims, self.mode)
            else:
                decision, contrib = decided_norm_sq(layer.name, layer.module, layer.rule, dims, pairs, self.mode)
            self._plan.append(decision)
            self._norm_sq = contrib if self._norm_sq is None else self._norm_sq + contrib.to(self._norm_sq.dtype)
        finally:
            layer.release()

    def _rows_norm_sq(self, layer: RecordedLayer, pairs, dims):
        """Norms of a (non-Linear) layer that sees ``k·B`` rows, k consecutive rows per sample (LeViT's
        ``flatten(0, 1)`` tokens): per-sample gradients instantiated per row, the k rows of each sample
        summed, ``∂L_i/∂θ = Σ_{r ∈ rows(i)} G_r``."""
        B = self._batch_size
        total = {}
        for a, g in pairs:
            for name, grad in layer.rule.per_sample_grads(layer.module, [(a, g)]).items():
                grad = grad.reshape(B, grad.shape[0] // B, *grad.shape[1:]).sum(1)
                total[name] = grad if name not in total else total[name] + grad
        contrib = sum(g.reshape(B, -1).pow(2).sum(1) for g in total.values())
        return contrib, [replace(d, ghost_capable=False) for d in dims]

    def per_sample_norms(self, loss: torch.Tensor) -> torch.Tensor:
        """``‖g_i‖ = (Σ_l ‖∂L_i/∂θ_l‖²)^{1/2}`` for every sample, from one activation-only backward."""
        self._batch_size = loss.shape[0]
        self._norm_sq = None
        self._plan = []
        total = loss.sum()
        self._set_capturing(True)
        try:
            sinks = self.recorder.sink_edges()
            if self.tracer is not None:  # off the data path: ask for them explicitly
                sinks += self.tracer.entry_edges() + [e for fb in self.fallbacks for e in fb.out_edges()]
            if sinks:
                torch.autograd.grad(total, inputs=sinks, retain_graph=True, allow_unused=True)
            unfired = self.recorder.unfired_edges()
            if unfired:  # layers not reached from the first ones (e.g. inputs that require grad)
                torch.autograd.grad(total, inputs=unfired, retain_graph=True, allow_unused=True)
            self.recorder.finish_unfired()
            self._extra_norms()
        finally:
            self._set_capturing(False)
            self.recorder.reset()
        self.last_plan = list(reversed(self._plan))
        if self._norm_sq is None:
            return torch.zeros(loss.shape[0], dtype=torch.float32, device=loss.device)
        return self._norm_sq.sqrt()

    def _set_capturing(self, on: bool) -> None:
        self.recorder.capturing = on
        for extra in self.recorder.extras:
            extra.capturing = on

    def _add(self, name: str, layer_type: str, numel: int, contrib: torch.Tensor) -> None:
        if contrib.shape[0] != self._batch_size:
            raise ValueError(f"{name} saw a batch of {contrib.shape[0]} but the loss has {self._batch_size} values; "
                             "the loss must have one value per sample (batch-first inputs).")
        self._plan.append(LayerDecision(name=name, layer_type=layer_type, T=1, D=1, p=numel, ghost_cost=0,
                                        instantiate_cost=numel, use_ghost=False, ghost_capable=False))
        self._norm_sq = contrib if self._norm_sq is None else self._norm_sq + contrib.to(self._norm_sq.dtype)

    def _extra_norms(self) -> None:
        """Add the per-sample norms of traced parameters and fallback modules (always instantiated)."""
        self.last_extra_grads = {}
        if self.tracer is None:
            return
        if self.keep_extra_grads:
            self.last_extra_grads.update(self.tracer.per_sample_grads())
        for pid, g in self.tracer.grads.items():
            self._add(self.tracer.names[pid], "param-entry", g[0].numel(), g.reshape(g.shape[0], -1).pow(2).sum(1))
        for fb in self.fallbacks:
            if not fb.calls:
                continue
            grads = fb.per_sample_grads(self._batch_size)
            if self.keep_extra_grads:
                prefix = f"{fb.name}." if fb.name else ""
                self.last_extra_grads.update({prefix + n: g for n, g in grads.items()})
            if grads:
                sq = sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads.values())
                self._add(fb.name, f"fallback:{type(fb.module).__name__}", sum(g[0].numel() for g in grads.values()),
                          sq)

    def extra_weighted_grads(self, factors: torch.Tensor) -> Dict[str, torch.Tensor]:
        """``{name: Σ_i C_i ∂L_i/∂θ}`` for traced parameters and fallback modules, from the per-sample
        gradients of the last norm pass (book-keeping; needs ``keep_extra_grads = True``)."""
        if not self.keep_extra_grads:
            raise RuntimeError("set clipper.keep_extra_grads = True before the norm pass to keep per-sample gradients.")
        return {n: torch.tensordot(factors.to(g.dtype), g, dims=1) for n, g in self.last_extra_grads.items()}

    def clip_factors(self, norms: torch.Tensor) -> torch.Tensor:
        """``C_i = C(‖g_i‖, R)``; a user clip function is checked to keep ``‖C_i g_i‖ ≤ R``."""
        factors = self.clip_fn(norms, self.max_grad_norm)
        if self.user_clip_fn:
            if not isinstance(factors, torch.Tensor) or factors.shape != norms.shape:
                raise ValueError("a custom clipping_fn must return one factor per sample (same shape as norms).")
            if bool(((factors < 0) | (factors * norms > self.max_grad_norm * (1 + 1e-6))).any()):
                raise ValueError(
                    "the custom clipping_fn returned factors with C_i < 0 or C_i·‖g_i‖ > max_grad_norm; the "
                    "sensitivity would exceed max_grad_norm and the privacy guarantee would not hold."
                )
        return factors

    # -- weighted pass -----------------------------------------------------------------------
    def clipped_grad_sum(self, loss: torch.Tensor, factors: torch.Tensor) -> List[torch.Tensor]:
        """``Σ_i C_i·∂L_i/∂θ`` for every parameter by one backward of ``Σ_i C_i·L_i``."""
        weighted = (loss * factors.detach().to(loss.dtype)).sum()
        grads = torch.autograd.grad(weighted, self.params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]

    def remove(self) -> None:
        self.recorder.remove()
