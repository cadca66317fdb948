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

The parts: this module wires the guards and the clipping core to the model and keeps Opacus'
``GradSampleModule`` face and the criterion flow; :mod:`.plain_backward` runs the plain backward
flow; :mod:`.forward_checks` the checks at the end of each forward; :mod:`.release_state` keeps
the clipped sums' ledger that the optimizer reads before it releases them; :mod:`.layouts` says
where Opacus' layers see the batch.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..capture.recorder import RecordedLayer
from ..clipping.batch import check_per_sample_loss, clip_batch
from ..clipping.clipper import PerSampleClipper
from ..clipping.plan import is_book_keeping
from ..guards.batch_flow import BatchFlow
from ..guards.buffers import BufferGuard
from ..guards.separability import SeparabilityProbe
from ..guards.state import StepStateGuard
from ..foundation.randomness import SecretModelRandomness
from .forward_checks import ForwardChecks, is_dp_rnn, reject_packed_sequence
from .layouts import layer_batch_dim, to_batch_first
from .plain_backward import PlainBackward, add_grad
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
        extra = dict(model=module, traced=traced, fallbacks=fallbacks) if (traced or fallbacks) \
            else {}
        self.clipper = PerSampleClipper(layers, self._params, mode=mode,
                                        max_grad_norm=1.0 if self.per_layer else self.max_grad_norm,
                                        **extra)
        if self.clipper.probe is not None:  # this module runs its own probe (from the outputs)
            self.clipper.probe.remove()
            self.clipper.probe = None
        if self.clipper.batch_flow is not None:  # and its own batch flow (ending with the forward)
            self.clipper.batch_flow.remove()
            self.clipper.batch_flow = None
        self.recorder = self.clipper.recorder
        self.recorder.on_layer_ready = self._on_layer_ready_plain
        #: the parameter-entry tracer (None when the layer rules cover every parameter) and the
        #: torch.func fallback modules
        self.tracer = self.clipper.tracer
        self.fallbacks = self.clipper.fallbacks
        self._set_capturing(True)
        self._norms_by_param: Dict[int, float] = {}
        self._dp_optimizer = None
        #: the clipped sums in p.grad, as the optimizer reads them before it releases them
        self.release = ReleaseState()
        #: the plain loss.backward() flow (book-keeping during the ordinary backward)
        self.plain_backward = PlainBackward(self)
        #: the checks at the end of each forward (eval records, batch flow, probe, graph)
        self.forward_checks = ForwardChecks(self)
        self._hooks_enabled = True
        #: inside criterion_backward: its own backward passes leave the parameter gradients alone
        self._in_criterion = False
        self._hook_model(module)
        self._install_guards(module)
        #: torch DDP: its require_backward_grad_sync before make_private (restored by remove_hooks)
        self._ddp_grad_sync: Optional[bool] = None
        if isinstance(wrapper, DistributedDataParallel):
            self._stop_ddp_grad_sync(wrapper)

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

    def _install_guards(self, module: nn.Module) -> None:
        """The guards on the wrapped model (buffers, separability, batch flow, state between
        steps) and the secret randomness of its training forwards."""
        #: refuses a training forward that changes a buffer from the data (a release without noise)
        self.buffer_guard = BufferGuard(module).install()
        #: checks, at the first forward of each input signature, that the model is sample-separable
        self.probe = SeparabilityProbe(module, batch_dim=0 if self.batch_first else None)
        self.probe.install()
        #: follows the batch through every op of every forward and loss: the outputs are checked at
        #: the forward's end, the loss when the backward starts. With batch_first=False the model's
        #: inputs may hold the batch in dim 0 or 1: the first recorded layer, whose convention is
        #: known, opens the step's region
        self.batch_flow = BatchFlow(module, openers=None if self.batch_first else {
            layer.module: self._layer_batch_dim(layer) for layer in self.recorder.layers}
        ).install()
        self.recorder.batch_flow = self.batch_flow
        #: refuses a step during which a parameter or buffer changed outside the optimizer (recorded
        #: now and after every optimizer step)
        self.state_guard = StepStateGuard(module).install()
        self.state_guard.arm()
        #: the randomness of training forwards (dropout) from a secret generator
        self.model_randomness = SecretModelRandomness(module).install()

    def _stop_ddp_grad_sync(self, wrapper: DistributedDataParallel) -> None:
        """Torch DDP: no all-reduce of raw gradients in its backward (the DP optimizer
        all-reduces the clipped sums)."""
        self._ddp_grad_sync = wrapper.require_backward_grad_sync
        _no_ddp_grad_sync(wrapper, ())
        # before every forward (no_sync() restores the flag it found, a user may set it)
        self._param_handles.append(wrapper.register_forward_pre_hook(_no_ddp_grad_sync))

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
            self._module.require_backward_grad_sync = self._ddp_grad_sync
            self._ddp_grad_sync = None
        self.clipper.remove()
        self.buffer_guard.remove()
        self.probe.remove()
        self.batch_flow.remove()
        self.state_guard.remove()
        self.model_randomness.remove()

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
        if self._in_criterion:  # the criterion flow's own backward passes
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

    def _on_layer_ready_criterion(self, layer: RecordedLayer) -> None:
        self._to_batch_first(layer)
        self.clipper.on_layer_ready(layer)

    def _on_layer_ready_plain(self, layer: RecordedLayer) -> None:
        self.plain_backward.on_layer_ready(layer)

    # -- criterion flow ---------------------------------------------------------------------------
    def criterion_backward(self, loss_per_sample: torch.Tensor) -> None:
        """``p.grad += Σ_i C_i ∂L_i/∂p`` from per-sample losses: one physical batch through the
        clipping core (:func:`private_engine.clipping.batch.clip_batch`; book-keeping, one
        backward)."""
        self.model_randomness.end()
        self.plain_backward.sixteen_bit = False  # the criterion flow's losses have no 1/n
        try:
            self.batch_flow.check_loss(loss_per_sample)
            check_per_sample_loss(loss_per_sample, name="the per-sample loss")
            fresh = self.release.start_backward()
            self._check_trainable(self._module.parameters())
            if self.per_layer:
                raise ValueError("clipping='per_layer' is not supported with "
                                 "grad_sample_mode='ghost' (as in Opacus).")
        except BaseException:
            self.recorder.reset()
            raise
        if not fresh:  # refused at the next step; nothing is clipped into the stale p.grad
            self.recorder.reset()
            return
        self.recorder.on_layer_ready = self._on_layer_ready_criterion
        self.clipper.max_grad_norm = self.current_max_grad_norm()
        capturing = self.recorder.capturing  # False after disable_hooks(): restored as left
        self._in_criterion = True
        try:
            batch = clip_batch(self.clipper, loss_per_sample, names=self._names)
        finally:
            self.recorder.on_layer_ready = self._on_layer_ready_plain
            self._set_capturing(capturing)
            self._in_criterion = False
        if batch.size:
            self.release.clipped_at.add(self.clipper.max_grad_norm)
            self.release.last_norms = batch.norms
            # dropped samples have norm 0 here: their factor 1 is taken off the count
            self.release.count_unclipped(self.clipper.clip_factors(batch.norms), batch.dropped)
            for p, g in zip(self._params, batch.sums.own_grads()):
                add_grad(p, g)
        self.release.backward_passes += 1


def _no_ddp_grad_sync(ddp: DistributedDataParallel, inputs) -> None:
    """Forward pre-hook on a torch DDP wrapper: no reducer work in the coming backward (DDP's
    ``no_sync()`` state). The reducer would all-reduce the raw gradients, which our hooks replace
    by zeros, and at the end of the backward copy that average over our clipped sums in ``p.grad``.
    The DP optimizer's step all-reduces the clipped sums instead."""
    ddp.require_backward_grad_sync = False

