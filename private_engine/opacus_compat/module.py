"""The module returned by ``make_private``: the user's model plus our per-sample clipping.

With ``wrap_model=False`` the same object is returned as the "hooks" handle (Opacus returns a
``GradSampleHooks``): the hooks sit on the user's model, which is then used directly, and
``cleanup()`` removes them.

Distributed training: for a model wrapped in DPDDP or torch DDP the hooks sit on the wrapped
``wrapper.module`` and ``_module`` is the wrapper (Opacus' ``GradSampleModule(DPDDP(model))``
face). Each rank's backward leaves the clipped sum of its own samples; the distributed optimizer
(:mod:`.optimizer`) all-reduces it.

Opacus returns a ``GradSampleModule`` that fills ``p.grad_sample`` (one gradient per sample)
and lets its optimizer clip. We return :class:`PrivateModule` instead: a thin wrapper with the
same face (``_module``, ``state_dict`` keys prefixed ``_module.``, ``forbid_grad_accumulation``,
attribute fallback to the wrapped model) whose backward leaves in ``p.grad`` exactly what
Opacus' optimizer would have summed::

    p.grad += Σ_i C_i · ∂L_i/∂p,     C_i = min(1, R / (‖∂L_i/∂θ‖ + 1e-6))      (flat clipping)

where ``L_i`` is sample i's loss (for ``loss_reduction="mean"`` the mean loss's output
gradients are rescaled by the physical batch size B, as Opacus does). The optimizer
(:mod:`.optimizer`) then only adds noise and divides by the expected batch size — Opacus' code.

Two flows fill ``p.grad``:

* **criterion flow** (``grad_sample_mode="ghost"``): the wrapped criterion's ``backward()`` runs
  the engine's activation-only norm pass on the per-sample losses, then forms ``Σ_i C_i ∂L_i/∂θ``
  by book-keeping (Bu et al. 2023, "Differentially Private Optimization on Large Model at Small
  Cost") from what that single backward kept (mode "bk_mixed";
  :class:`private_engine.clipping.clipper.PerSampleClipper`, through
  :func:`private_engine.clipping.batch.clip_batch`).
* **plain backward** (every other mode, or any ``loss.backward()``): book-keeping (mode
  "bk_mixed") by the same clipper during the ordinary backward, the raw parameter gradients
  discarded, ``Σ_i C_i g_iᵀ a_i`` written at its end (:mod:`.plain_backward`).

``clipping="per_layer"``: one threshold R_k per parameter tensor (Opacus' definition), clip
factor ``C_{i,k} = min(1, R_k / (‖∂L_i/∂θ_k‖ + 1e-6))`` from instantiated per-sample gradients.

The parts: this module keeps Opacus' ``GradSampleModule`` face and wires the clipping core and
the guards of a step (one assembly with the native engine's,
:func:`private_engine.clipping.assembly.assemble_clipping_core`) to the model;
:mod:`.plain_backward` runs the plain backward flow; :mod:`.criterion_flow` the criterion flow;
:mod:`.forward_checks` the checks at the end of each forward; :mod:`.release_state` keeps the
clipped sums' ledger that the optimizer reads before it releases them; :mod:`.layouts` says where
Opacus' layers see the batch; :mod:`.ddp` turns torch DDP's backward all-reduce off.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..capture.fallback import FallbackModule
from ..capture.recorder import LayerRecorder, RecordedLayer
from ..capture.tracer import ParamTracer
from ..clipping.assembly import assemble_clipping_core
from ..clipping.clipper import PerSampleClipper
from ..clipping.plan import is_book_keeping
from ..foundation.randomness import SecretModelRandomness
from ..guards.batch_flow import BatchFlow
from ..guards.separability import SeparabilityProbe
from ..guards.state import StepStateGuard
from .criterion_flow import CriterionFlow
from .ddp import DDPGradSync
from .forward_checks import ForwardChecks, is_dp_rnn, reject_packed_sequence
from .layouts import layer_batch_dim, to_batch_first
from .plain_backward import PlainBackward
from .release_state import ReleaseState


class PrivateModule(nn.Module):
    """``nn.Module`` wrapper that leaves the clipped per-sample gradient sum in ``p.grad``.

    Args:
        module: the user's model (kept as ``self._module``).
        layers: ``[(name, module, rule)]`` covering every trainable parameter (validated).
        max_grad_norm: R (flat) or a list ``[R_k]``, one per optimizer parameter (per_layer;
            bound by :meth:`bind_per_layer_norms` when the optimizer is known).
        loss_reduction: "mean" or "sum": how the plain ``loss`` reduces per-sample losses.
        mode: the engine's book-keeping clipping mode ("bk_mixed" by default): a plain backward is
            one pass.
        wrapper: distributed training: the DPDDP or DDP wrapper whose ``.module`` is ``module``.
            It is kept as ``self._module`` (the forward goes through it; ``state_dict`` keys are
            ``_module.module.…``, as Opacus'); the hooks sit on ``module``. A torch DDP's
            backward all-reduce is turned off while the hooks are on (``remove_hooks`` restores
            it): its reducer would average raw, unclipped gradients into ``p.grad``; the DP
            optimizer all-reduces the clipped sums instead.
        traced / fallbacks: parameters used outside a ruled layer (``x @ self.w``,
            ``F.linear(x, self.w)``, tokens, gammas) and modules clipped by ``torch.func``, as found
            by :func:`private_engine.guards.model_check.scan_model`: the clipping core's
            parameter-entry tracer and fallback modules give their per-sample gradients, exactly
            as in the native engine (batch-first inputs only).
    """

    def __init__(self, module: nn.Module, layers, *, max_grad_norm, loss_reduction: str = "mean",
                 mode: str = "bk_mixed", batch_first: bool = True,
                 wrapper: Optional[nn.Module] = None, traced: Sequence = (),
                 fallbacks: Sequence = ()):
        super().__init__()
        if not is_book_keeping(mode):
            raise ValueError("PrivateModule clips in a plain backward, so it needs a book-keeping "
                             f"mode, not {mode!r}.")
        if wrapper is not None and getattr(wrapper, "module", None) is not module:
            raise ValueError("wrapper.module must be the module whose layers are hooked.")
        self._module = wrapper if wrapper is not None else module
        self.loss_reduction = loss_reduction
        self.batch_first = batch_first
        self.per_layer = isinstance(max_grad_norm, (list, tuple))
        self.max_grad_norm = None if self.per_layer else float(max_grad_norm)
        #: the parameters clipped here (trainable at make_private); each has a _discard_raw_grad
        #: hook
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._param_ids = frozenset(id(p) for p in self._params)
        self._names = {id(p): n for n, p in module.named_parameters()}
        if (traced or fallbacks) and not batch_first:
            names = [n for n, _ in traced] + [f"{n or '(the model)'} (torch.func fallback)"
                                              for n, _ in fallbacks]
            raise ValueError(
                f"make_private(batch_first=False): {names} are clipped by the parameter-entry "
                "tracer or the torch.func fallback, which need batch-first inputs (the batch in "
                "dimension 0). Use batch_first=True with batch-first inputs, or freeze them "
                "(requires_grad_(False)).")
        #: the clipping core and the guards of a step; this module runs the separability probe
        #: (from the outputs) and the batch flow (ending with the forward) itself, and hands the
        #: finished layers of a plain backward to its flow (:meth:`_on_layer_ready_plain`)
        self.core = assemble_clipping_core(
            module, layers, self._params, traced=traced, fallbacks=fallbacks, mode=mode,
            max_grad_norm=1.0 if self.per_layer else self.max_grad_norm,
            clipper_runs_checks=False,
            layer_batch_dim=None if batch_first else self._layer_batch_dim,
            on_layer_ready=self._on_layer_ready_plain)
        self._set_capturing(True)
        self._norms_by_param: Dict[int, float] = {}
        self._dp_optimizer = None
        #: the clipped sums in p.grad, as the optimizer reads them before it releases them
        self.release = ReleaseState()
        #: the plain loss.backward() flow (book-keeping during the ordinary backward)
        self.plain_backward = PlainBackward(self)
        #: the checks at the end of each forward (eval records, batch flow, probe, graph)
        self.forward_checks = ForwardChecks(self)
        #: the criterion flow (grad_sample_mode="ghost": per-sample losses, one backward)
        self.criterion_flow = CriterionFlow(self)
        self._hooks_enabled = True
        self._hook_model(module)
        self.state_guard.arm()  # the state the first step starts from
        #: torch DDP: its backward all-reduce of raw gradients turned off (restored by
        #: remove_hooks)
        self._ddp_grad_sync: Optional[DDPGradSync] = (
            DDPGradSync(wrapper) if isinstance(wrapper, DistributedDataParallel) else None)

    def _hook_model(self, module: nn.Module) -> None:
        """The hooks of the clipping: each parameter's raw gradient is discarded, each forward is
        checked at its end; Opacus' DP RNNs refuse a ``PackedSequence``."""
        self._param_handles = [p.register_hook(self._discard_raw_grad) for p in self._params]
        # on the wrapped model itself, so that they also run when make_private(wrap_model=False)
        # is used
        self._param_handles.append(
            module.register_forward_pre_hook(self.forward_checks.eval_snapshot))
        self._param_handles.append(
            module.register_forward_hook(self.forward_checks.after_forward))
        self._param_handles += [m.register_forward_pre_hook(reject_packed_sequence)
                                for m in module.modules() if is_dp_rnn(m)]

    # -- the clipping core (:func:`private_engine.clipping.assembly.assemble_clipping_core`) ----
    @property
    def clipper(self) -> PerSampleClipper:
        """Certified per-sample norms, clip factors and clipped sums."""
        return self.core.clipper

    @property
    def recorder(self) -> LayerRecorder:
        """The layer recorder (its finished layers go through ``core.route``)."""
        return self.core.recorder

    @property
    def tracer(self) -> Optional[ParamTracer]:
        """The parameter-entry tracer (None when the layer rules cover every parameter)."""
        return self.core.tracer

    @property
    def fallbacks(self) -> List[FallbackModule]:
        """The torch.func fallback modules."""
        return self.core.fallbacks

    @property
    def probe(self) -> SeparabilityProbe:
        """Checks, at the first forward of each input signature, that the model is
        sample-separable (from its outputs: :mod:`.forward_checks`)."""
        return self.core.probe

    @property
    def batch_flow(self) -> BatchFlow:
        """Follows the batch through every op of every forward and loss: the outputs are checked
        at the forward's end, the loss when the backward starts. With batch_first=False the
        model's inputs may hold the batch in dim 0 or 1: the first recorded layer, whose
        convention is known, opens the step's region."""
        return self.core.batch_flow

    @property
    def state_guard(self) -> StepStateGuard:
        """Refuses a step during which a parameter or buffer changed outside the optimizer
        (recorded at make_private and after every optimizer step)."""
        return self.core.state_guard

    @property
    def model_randomness(self) -> SecretModelRandomness:
        """The randomness of training forwards (dropout) from a secret generator."""
        return self.core.model_randomness

    # -- opacus GradSampleModule face ---------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """:meth:`torch.nn.Module.load_state_dict`, then the state guard records the loaded
        weights as the state the next step starts from (weights loaded on purpose between steps,
        as ``load_checkpoint`` does, are not a change made by the data)."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if not self.release.hooks_removed:
            self.state_guard.arm()
        return result

    def _set_capturing(self, on: bool) -> None:
        """Whether backward passes are recorded: the layer recorder, the tracer, the fallbacks."""
        self.recorder.capturing = on
        for extra in self.recorder.extras:
            extra.capturing = on

    def _layer_batch_dim(self, layer: RecordedLayer) -> int:
        return layer_batch_dim(layer, self.batch_first)

    def __getattr__(self, item):
        try:
            return super().__getattr__(item)
        except AttributeError as e:
            submodules = dict(self.named_children())
            if "_module" in submodules and hasattr(submodules["_module"], item):
                return getattr(submodules["_module"], item)
            raise e

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` of the wrapped model and the count of accumulated backward passes."""
        super().zero_grad(set_to_none)
        self.optimizer_zero_grad()

    def forbid_grad_accumulation(self) -> None:
        """Poisson sampling: every backward must be followed by ``optimizer.step()`` (as in
        Opacus)."""
        self.release.grad_accumulation_allowed = False

    def allow_grad_accumulation(self) -> None:
        self.release.grad_accumulation_allowed = True

    def disable_hooks(self) -> None:
        """Backward passes compute ordinary (unclipped) gradients until :meth:`enable_hooks`; the
        optimizer refuses to step on them (as Opacus' does) until ``zero_grad()``."""
        self._hooks_enabled = False
        self._set_capturing(False)

    def enable_hooks(self) -> None:
        self._hooks_enabled = True
        self._set_capturing(True)

    def remove_hooks(self) -> None:
        """Remove every hook; the wrapped module is back to a plain ``nn.Module``. Its gradients are
        then ordinary, unclipped ones: the DP optimizer refuses to step on them (as Opacus' does,
        for want of per-sample gradients); call ``make_private`` again to train privately."""
        for h in self._param_handles:
            h.remove()
        self._param_handles = []
        self.release.hooks_removed = True
        if self._ddp_grad_sync is not None:
            self._ddp_grad_sync.restore()
            self._ddp_grad_sync = None
        self.core.remove()

    cleanup = remove_hooks

    def bind_optimizer(self, optimizer) -> None:
        """The DP optimizer whose ``max_grad_norm`` is the clipping threshold (Opacus' grad-clip
        schedulers change it there; clipping and noise must use the same R)."""
        self._dp_optimizer = optimizer

    def current_max_grad_norm(self) -> float:
        """R for flat clipping: the bound optimizer's ``max_grad_norm`` (else the make_private
        value)."""
        opt = self._dp_optimizer
        return float(opt.max_grad_norm) if opt is not None else self.max_grad_norm

    def bind_per_layer_norms(self, params: Sequence[nn.Parameter],
                             max_grad_norms: Sequence[float]) -> None:
        """Per-layer clipping: ``R_k`` for each parameter, in the optimizer's parameter order."""
        if len(params) != len(max_grad_norms):
            raise ValueError(
                "clipping='per_layer' needs one max_grad_norm per optimizer parameter: the "
                f"optimizer has {len(params)} parameter tensors but max_grad_norm has "
                f"{len(max_grad_norms)} values."
            )
        self._norms_by_param = {id(p): float(r) for p, r in zip(params, max_grad_norms)}

    # -- the clipped sums in p.grad, as the optimizer sees them -------------------------------
    @property
    def backward_passes(self) -> int:
        """Backward passes whose clipped sums are in p.grad since the optimizer consumed them."""
        return self.release.backward_passes

    @property
    def last_norms(self) -> Optional[torch.Tensor]:
        """Per-sample gradient norms ‖g_i‖ of the last backward (flat clipping)."""
        return self.release.last_norms

    @property
    def sample_count(self) -> int:
        """Samples clipped since the optimizer last consumed p.grad (flat clipping)."""
        return self.release.sample_count

    @property
    def unclipped_count(self) -> Optional[torch.Tensor]:
        """Samples left unclipped (clip factor 1) since the optimizer last consumed p.grad (flat
        clipping; read by the adaptive-clipping optimizer)."""
        return self.release.unclipped_count

    @property
    def grad_accumulation_allowed(self) -> bool:
        return self.release.grad_accumulation_allowed

    def optimizer_consumed(self) -> None:
        """Called by the optimizer after it read p.grad (``pre_step``)."""
        self.release.optimizer_consumed()

    def optimizer_zero_grad(self) -> None:
        self.release.optimizer_zero_grad()

    def check_releasable(self, params: Sequence[torch.Tensor]) -> None:
        """Called by the optimizer before it reads ``p.grad`` (``pre_step``): refuse to release
        gradients this module did not clip (Opacus raises in both cases too)."""
        self.release.check_clipped()
        self._check_trainable(params)
        self.batch_flow.end()  # the step's region, closed in its backward, leaves the stack here
        self.model_randomness.end()
        self.state_guard.check(self.batch_flow.written_storages)
        self.release.check_threshold(self.current_max_grad_norm())

    def _check_trainable(self, params) -> None:
        """Every trainable parameter in ``params`` must be one clipped here (trainable at
        make_private)."""
        new = [p for p in params if p.requires_grad and id(p) not in self._param_ids]
        if new:
            raise ValueError(
                f"parameter(s) {[self._names.get(id(p), tuple(p.shape)) for p in new]} became "
                "trainable after make_private (requires_grad_(True) or "
                "optimizer.add_param_group): their gradients are not clipped. "
                "Call make_private again with the new set of trainable parameters."
            )

    # -- backward passes ----------------------------------------------------------------------
    def _discard_raw_grad(self, grad: torch.Tensor):
        """Tensor hook on each parameter: its unclipped gradient is replaced by zeros (the clipped
        sum is added at the end of the backward)."""
        if self.criterion_flow.running:  # the criterion flow's own backward passes
            return None
        if self.tracer is not None and self.tracer.in_vjp:  # the tracer's per-sample vjp
            return None
        # disable_hooks(): an ordinary gradient, never released by the optimizer
        if not self._hooks_enabled:
            self.release.unclipped_grads = True
            return None
        self.plain_backward.queue_finish()
        return torch.zeros_like(grad)

    def _to_batch_first(self, layer: RecordedLayer) -> None:
        to_batch_first(layer, self.batch_first)

    def _on_layer_ready_plain(self, layer: RecordedLayer) -> None:
        self.plain_backward.on_layer_ready(layer)

    # -- criterion flow ---------------------------------------------------------------------------
    def criterion_backward(self, loss_per_sample: torch.Tensor) -> None:
        """``p.grad += Σ_i C_i ∂L_i/∂p`` from per-sample losses (:mod:`.criterion_flow`)."""
        self.criterion_flow.backward(loss_per_sample)
