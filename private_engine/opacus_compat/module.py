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
  "bk_mixed") by the same clipper. During the ordinary backward each layer is handed to the
  clipper as soon as its output gradient arrives (certified per-sample norm by ghost norm or
  instantiation, per the layerwise rule of "bk_mixed"; what the clipped sum needs kept), the raw
  parameter gradients are discarded (a tensor hook on each parameter), and at the end of the
  backward (an autograd callback) the clipper writes ``Σ_i C_i g_iᵀ a_i`` — no second backward,
  and no clipping code of its own here.
  A batch-mean loss (``loss_reduction="mean"``) is refused here in 16-bit precision: its ``1/n``
  is rounded to 16 bits with every sample's output gradient (:meth:`_check_mean_loss`).

``clipping="per_layer"``: one threshold R_k per parameter tensor (Opacus' definition), clip
factor ``C_{i,k} = min(1, R_k / (‖∂L_i/∂θ_k‖ + 1e-6))`` from instantiated per-sample gradients.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from opacus.layers.dp_multihead_attention import SequenceBias
from opacus.layers.dp_rnn import RNNLinear
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..guards.buffers import BufferGuard
from ..capture.graph_walk import outside_error
from ..clipping.batch import check_per_sample_loss, clip_batch
from ..clipping.clipper import PerSampleClipper
from ..clipping.per_layer import per_layer_clipped_sums
from ..clipping.plan import is_book_keeping
from ..guards.batch_flow import BatchFlow
from ..guards.separability import SeparabilityProbe
from ..guards.state import StepStateGuard
from ..randomness import SecretModelRandomness
from ..capture.recorder import RecordedLayer


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
        #: layer call counts at the start of an eval-mode forward (its records are dropped at its
        #: end)
        self._eval_marks: Optional[List[int]] = None
        self.grad_accumulation_allowed = True
        #: set when a backward with hooks disabled left unclipped gradients in p.grad (cleared by
        #: zero_grad)
        self._unclipped_grads = False
        #: set by remove_hooks()/cleanup(): nothing is clipped any more, so the optimizer refuses to
        #: step
        self._hooks_removed = False
        #: the thresholds R the clipped sums now in p.grad were clipped at (flat clipping)
        self._clipped_at: set = set()
        #: backward passes whose clipped sums are in p.grad since the optimizer last consumed them
        self.backward_passes = 0
        self._consumed = False
        #: per-sample gradient norms ‖g_i‖ of the last backward (flat clipping)
        self.last_norms: Optional[torch.Tensor] = None
        #: samples clipped, and those left unclipped (clip factor 1), since the optimizer last
        #: consumed p.grad (flat clipping; read by the adaptive-clipping optimizer)
        self.sample_count = 0
        self.unclipped_count: Optional[torch.Tensor] = None
        #: a backward ran after optimizer.step() without zero_grad(): p.grad holds the noised
        #: gradient of the last step, so the next step is refused (as Opacus' is) until zero_grad()
        self._stale_grads = False
        self._reset_plain()
        self._graph_checked = False
        self._param_handles = [p.register_hook(self._discard_raw_grad) for p in self._params]
        # on the wrapped model itself, so that they also run when make_private(wrap_model=False)
        # is used
        self._param_handles.append(module.register_forward_pre_hook(self._eval_snapshot))
        self._param_handles.append(module.register_forward_hook(self._check_graph_hook))
        self._param_handles += [m.register_forward_pre_hook(_reject_packed_sequence)
                                for m in module.modules() if _is_dp_rnn(m)]
        #: refuses a training forward that changes a buffer from the data (a release without noise)
        self.buffer_guard = BufferGuard(module).install()
        #: checks, at the first forward of each input signature, that the model is sample-separable
        self.probe = SeparabilityProbe(module, batch_dim=0 if batch_first else None)
        self.probe.install()
        #: follows the batch through every op of every forward and loss: the outputs are checked at
        #: the forward's end, the loss when the backward starts. With batch_first=False the model's
        #: inputs may hold the batch in dim 0 or 1: the first recorded layer, whose convention is
        #: known, opens the step's region
        self.batch_flow = BatchFlow(module, openers=None if batch_first else {
            layer.module: self._layer_batch_dim(layer) for layer in self.recorder.layers}
        ).install()
        self.recorder.batch_flow = self.batch_flow
        #: refuses a step during which a parameter or buffer changed outside the optimizer (recorded
        #: now and after every optimizer step)
        self.state_guard = StepStateGuard(module).install()
        self.state_guard.arm()
        #: the randomness of training forwards (dropout) from a secret generator
        self.model_randomness = SecretModelRandomness(module).install()
        self._hooks_enabled = True
        #: inside criterion_backward: its own backward passes leave the parameter gradients alone
        self._in_criterion = False
        #: torch DDP: its require_backward_grad_sync before make_private (restored by remove_hooks)
        self._ddp_grad_sync: Optional[bool] = None
        if isinstance(wrapper, DistributedDataParallel):
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
        if not self._hooks_removed:
            self.state_guard.arm()
        return result

    def _set_capturing(self, on: bool) -> None:
        """Whether backward passes are recorded: the layer recorder, the tracer, the fallbacks."""
        self.recorder.capturing = on
        for extra in self.recorder.extras:
            extra.capturing = on

    def _eval_snapshot(self, module, inputs) -> None:
        self._eval_marks = (None if module.training else
                            [len(layer.calls) for layer in self.recorder.layers]
                            + [len(self.tracer.entries) if self.tracer is not None else 0]
                            + [len(fb.calls) for fb in self.fallbacks])

    def _drop_eval_records(self) -> None:
        """A forward in eval mode is not recorded (as in Opacus): its calls (and tracer entries,
        fallback calls) are dropped right away, so evaluating without ``torch.no_grad()`` does not
        pile up activations."""
        marks = self._eval_marks
        n = len(self.recorder.layers)
        for layer, mark in zip(self.recorder.layers, marks[:n]):
            for c in layer.calls[mark:]:
                c.activation = c.grad = c.edge = c.input_node = None
            del layer.calls[mark:]
        if self.tracer is not None:
            self.tracer.drop_entries(marks[n])
        for fb, mark in zip(self.fallbacks, marks[n + 1:]):
            del fb.calls[mark:]
        self._eval_marks = None

    def _check_graph_hook(self, module, inputs, out) -> None:
        if self._eval_marks is not None:
            self._drop_eval_records()
            self.batch_flow.end()
            return
        if torch.is_grad_enabled() and _sixteen_bit_forward(out, self._params):
            self._sixteen_bit = True
        try:
            self.batch_flow.check_outputs(out)
        except BaseException:
            self.recorder.reset()
            raise
        if self.probe.pending and torch.is_grad_enabled():
            self._check_separable(out)
        if not self._graph_checked and torch.is_grad_enabled():
            self._check_graph(out)

    def _layer_batch_dim(self, layer: RecordedLayer) -> int:
        """Where a recorded layer sees the batch (what :meth:`_to_batch_first` moves)."""
        m = layer.module
        if isinstance(m, SequenceBias):
            return 0 if m.batch_first else 1
        return 0 if (self.batch_first or type(m) is RNNLinear) else 1

    def _check_separable(self, out) -> None:
        """The separability probe from the model's outputs (this door has no per-sample losses:
        mixing inside the user's loss function is not seen here; docs/migrating-from-opacus.md)."""
        owners = [self.recorder, *self.recorder.extras]
        saved = [o.capturing for o in owners]
        for o in owners:
            o.capturing = False  # the probe's backward passes are not recorded
        try:
            batch = None
            if not self.batch_first:
                dims = [(c.output_shape, self._layer_batch_dim(layer))
                        for layer in self.recorder.layers for c in layer.calls]
                batch = min((shape[d] for shape, d in dims if len(shape) > d), default=None)
            self.probe.check_outputs(out, self.clipper.probe_targets(self._layer_batch_dim),
                                     batch_dim=0 if self.batch_first else None, batch_size=batch)
        except BaseException:
            self.recorder.reset()
            raise
        finally:
            for o, c in zip(owners, saved):
                o.capturing = c

    def _check_graph(self, out) -> None:
        """Once, on the first forward with grad: every trainable parameter must reach the output
        only through a recorded call of its layer (a tied weight in ``F.linear(h, emb.weight)``
        would otherwise be missing from the per-sample norms of a plain backward)."""
        tensors = [t for t in _flatten(out)
                   if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        outside, custom = {}, {}
        for t in tensors:
            walk = self.recorder.walk(t, self._params)
            for p in walk.outside:
                outside[id(p)] = self._names.get(id(p))
            for i, function in walk.custom_functions.items():
                custom[self._names.get(i)] = function
        if outside:
            self.recorder.reset()
            raise outside_error(sorted(outside.values()), custom)
        self._graph_checked = bool(tensors)

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
        self.grad_accumulation_allowed = False

    def allow_grad_accumulation(self) -> None:
        self.grad_accumulation_allowed = True

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
        self._hooks_removed = True
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

    def optimizer_consumed(self) -> None:
        """Called by the optimizer after it read p.grad (``pre_step``)."""
        self._consumed = True
        self.backward_passes = 0
        self._clipped_at = set()
        self._reset_counts()

    def optimizer_zero_grad(self) -> None:
        self._consumed = False
        self.backward_passes = 0
        self._unclipped_grads = False
        self._stale_grads = False
        self._clipped_at = set()
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.sample_count = 0
        self.unclipped_count = None

    def _count_unclipped(self, factors: torch.Tensor, dropped=None) -> None:
        """Add a batch to :attr:`sample_count` and :attr:`unclipped_count`: samples whose clip
        factor is 1 (``‖g_i‖ + 1e-6 ≤ R``, Opacus' ``AdaClipDPOptimizer`` count), without the
        dropped ones (``dropped``: a bool mask of them, or their number when they are among the
        factors with factor 1). No host synchronisation."""
        unclipped = (factors >= 1)
        if isinstance(dropped, torch.Tensor):
            unclipped = unclipped & ~dropped
        count = unclipped.sum()
        if isinstance(dropped, int):
            count = count - dropped
        self.sample_count += factors.shape[0]
        self.unclipped_count = count if self.unclipped_count is None \
            else self.unclipped_count + count

    def check_releasable(self, params: Sequence[torch.Tensor]) -> None:
        """Called by the optimizer before it reads ``p.grad`` (``pre_step``): refuse to release
        gradients this module did not clip (Opacus raises in both cases too)."""
        if self._hooks_removed:
            raise ValueError(
                "the privacy hooks of this module were removed (remove_hooks()/cleanup()), so its "
                "gradients are not clipped; nothing was released. Call make_private again to train "
                "privately."
            )
        if self._stale_grads:
            raise ValueError(
                "Gradients haven't been cleared since the last optimizer step: a backward ran "
                "after optimizer.step() without optimizer.zero_grad(), so p.grad mixes the noised "
                "gradient of the last step with new clipped sums; nothing was released. Call "
                "optimizer.zero_grad() after every optimizer.step()."
            )
        if self._unclipped_grads:
            raise ValueError(
                "p.grad holds unclipped gradients: a backward ran while the hooks were disabled "
                "(disable_hooks()). Call optimizer.zero_grad() before the next private step, or "
                "enable_hooks() before the backward."
            )
        self._check_trainable(params)
        self.batch_flow.end()  # the step's region, closed in its backward, leaves the stack here
        self.model_randomness.end()
        self.state_guard.check(self.batch_flow.written_storages)
        if self._clipped_at and self._clipped_at != {self.current_max_grad_norm()}:
            raise ValueError(
                "the gradients in p.grad were clipped at max_grad_norm "
                f"{sorted(self._clipped_at)} but the optimizer would add noise for "
                f"{self.current_max_grad_norm()}: max_grad_norm "
                "changed between backward passes of one logical batch. Change it after "
                "optimizer.step() (a grad-clip scheduler steps after the optimizer).")

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

    def _start_backward(self) -> bool:
        """Checks at the start of a backward's clipping. Returns False when p.grad still holds the
        noised gradient of the last step (no ``zero_grad()`` since ``step()``): the backward is
        not clipped, and the next step raises (Opacus refuses at that step too)."""
        if self._consumed:
            self._stale_grads = True
            return False
        if not self.grad_accumulation_allowed and self.backward_passes > 0:
            raise ValueError(
                "Poisson sampling is not compatible with grad accumulation. You need to call "
                "optimizer.step() after every forward/backward pass or consider using "
                "BatchMemoryManager."
            )
        return True

    # -- plain loss.backward(): book-keeping ----------------------------------------------------
    def _reset_plain(self) -> None:
        self._stored: List[Tuple[RecordedLayer, list]] = []  # per_layer clipping only
        self._callback_queued = False
        #: a layer's recorded call received its output gradient in this backward (a batch, maybe
        #: empty)
        self._saw_batch = False
        #: the clipper's norm pass of this backward has begun (its batch size is the first layer's)
        self._started = False
        #: a training forward of this backward ran under 16-bit autocast or in 16-bit floats, or a
        #: recorded output gradient is 16-bit (a batch-mean loss is then refused: _check_mean_loss)
        self._sixteen_bit = False

    def _queue_finish(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_plain)

    def _discard_raw_grad(self, grad: torch.Tensor):
        """Tensor hook on each parameter: its unclipped gradient is replaced by zeros (the clipped
        sum is added at the end of the backward)."""
        if self._in_criterion:  # the criterion flow's own backward passes
            return None
        if self.tracer is not None and self.tracer.in_vjp:  # the tracer's per-sample vjp
            return None
        # disable_hooks(): an ordinary gradient, never released by the optimizer
        if not self._hooks_enabled:
            self._unclipped_grads = True
            return None
        self._queue_finish()
        return torch.zeros_like(grad)

    def _to_batch_first(self, layer: RecordedLayer) -> None:
        """``batch_first=False``: move the batch dimension (1) of every recorded input and output
        gradient to the front, except for Opacus' ``RNNLinear`` (called per time step on (B, H)) —
        Opacus' own convention. ``SequenceBias`` follows its own ``batch_first`` attribute."""
        if isinstance(layer.module, SequenceBias):
            if layer.module.batch_first:
                return
        elif self.batch_first or type(layer.module) is RNNLinear:
            return
        for c in layer.calls:
            if c.activation is not None and c.activation.dim() > 1:
                c.activation = c.activation.movedim(1, 0)
            if c.grad is not None and c.grad.dim() > 1:
                c.grad = c.grad.movedim(1, 0)

    def _on_layer_ready_criterion(self, layer: RecordedLayer) -> None:
        self._to_batch_first(layer)
        self.clipper.on_layer_ready(layer)

    def _on_layer_ready_plain(self, layer: RecordedLayer) -> None:
        """One layer of a plain backward, handed to the clipper (certified norm, what the sum needs
        kept)."""
        self._to_batch_first(layer)
        try:
            self.batch_flow.check_root()  # the backward's loss (once: the region ends here)
        except BaseException:
            self.recorder.reset()
            raise
        finally:
            self.model_randomness.end()
        pairs = layer.pairs()
        if pairs:
            self._saw_batch = True
            self._queue_finish()
            if any(g.dtype in _SIXTEEN_BIT for _, g in pairs):
                self._sixteen_bit = True
        if not pairs or pairs[0][1].shape[0] == 0:  # nothing reached, or an empty Poisson batch
            layer.release()
            return
        if self.per_layer:
            self._stored.append((RecordedLayer(layer.name, layer.module, layer.rule), pairs))
            layer.release()
            return
        if not self._started:
            self.clipper.start_pass(pairs[0][1].shape[0])
            self._started = True
        self.clipper.on_layer_ready(layer)

    def _finish_plain(self) -> None:
        """End of a plain backward: certified norms from the clipper, clip factors, then
        ``Σ_i C_i g_iᵀ a_i``."""
        try:
            try:
                fresh = self._start_backward()
                self._check_trainable(self._module.parameters())
                self._check_mean_loss()
            except BaseException:
                self.recorder.reset()
                raise
            if not fresh:  # refused at the next step; nothing is clipped into the stale p.grad
                self.recorder.reset()
                return
            self.recorder.finish_unfired()  # layers the loss does not reach contribute nothing
            extras = self._extras_fired()
            if not (self._started or self._stored or extras):
                self.recorder.reset()
                if not self._saw_batch:  # parameter gradients but no recorded call: not a new batch
                    raise ValueError(
                        "this backward reached no recorded layer call: it went through a graph "
                        "whose records were already used (a second backward through a retained "
                        "graph, or a backward after autograd.grad on the same output) or whose "
                        "forward ran in eval mode. Run the forward again (in train mode) before "
                        "each backward."
                    )
                self.backward_passes += 1
                return
            # the tracer's and fallbacks' per-sample gradients are read before their records go
            if self.per_layer:
                extra = self._extra_grads()
                self.recorder.reset()
                self._write_per_layer(extra)
            else:
                if not self._started:  # only traced parameters / fallback modules were reached
                    self.clipper.start_pass(self.tracer.batch_size)
                    self._started = True
                norms = self.clipper.end_norm_pass(self._params[0].device)
                self.recorder.reset()
                self._write_flat(norms)
            self.backward_passes += 1
        except BaseException:
            self.clipper.release()
            raise
        finally:
            self._reset_plain()

    def _check_mean_loss(self) -> None:
        """Refuse a plain backward of a batch-mean loss (``loss_reduction="mean"``) in 16-bit
        floats. Its output gradients reach the layers as ``ĝ_i = fl16(g_i / n)`` and are clipped
        as ``n·ĝ_i``; unless ``n`` is a power of two and nothing underflows,
        ``n·fl16(g_i/n) ≠ fl16(g_i)`` (relative error of the order of the unit roundoff u, 2⁻⁸
        for bfloat16, 2⁻¹¹ for float16), so an honest sample's clipped term differs
        between neighbouring batches of ``n`` and ``n − 1`` samples, and one sample moves the
        release by more than R. A sum loss (``g_i`` whatever ``n``) or the criterion flow (per-
        sample losses) has no ``n`` in its gradients. The refusal depends on the precision, never
        on the batch size or the data."""
        if self.loss_reduction == "mean" and self._sixteen_bit:
            raise ValueError(
                "a plain loss.backward() of a batch-mean loss in 16-bit precision (autocast or "
                "16-bit weights) cannot be clipped to max_grad_norm exactly: the 1/batch-size "
                "scaling of every sample's gradient is rounded to 16 bits differently for "
                "batches of n and n-1 samples; nothing was released. Backpropagate a sum loss "
                "(e.g. nn.CrossEntropyLoss(reduction=\"sum\")) with "
                "make_private(loss_reduction=\"sum\"), or use grad_sample_mode=\"ghost\" and "
                "the criterion make_private returns.")

    def _mean_scale(self, batch: int) -> float:
        """``loss_reduction="mean"``: the recorded output gradients are those of ``(1/B) Σ_i L_i``,
        so norms and sums are taken of ``B·g`` (as Opacus does); 1 for "sum"."""
        return float(batch) if self.loss_reduction == "mean" else 1.0

    def _extras_fired(self) -> bool:
        """Whether this backward reached a traced parameter's entry or a fallback module's output
        (a batch to clip even when it reached no ruled layer)."""
        if self.tracer is None or not self.tracer.batch_size:
            return False
        return (any(e.fired for e in self.tracer.entries)
                or any(g is not None for fb in self.fallbacks for c in fb.calls for g in c.grads))

    def _extra_grads(self) -> List[Tuple[nn.Parameter, torch.Tensor]]:
        """``[(parameter, (B, *shape) per-sample gradients)]`` of the traced parameters and the
        fallback modules' parameters in this backward (per-layer clipping)."""
        if not self._extras_fired():
            return []
        tracked = {name: p for name, p in self.tracer.tracked.values()}
        out = [(tracked[n], g) for n, g in self.tracer.per_sample_grads().items()]
        for fb in self.fallbacks:
            if fb.calls:
                owned = dict(fb.params)
                out += [(owned[n], g)
                        for n, g in fb.per_sample_grads(self.tracer.batch_size).items()]
        return out

    def _write_flat(self, norms: torch.Tensor) -> None:
        """``p.grad += Σ_i C_i g_i`` from the certified norms of the norm pass just ended."""
        clipper = self.clipper
        batch = clipper.batch_size
        scale = self._mean_scale(batch)
        norms = norms * scale
        clipper.max_grad_norm = self.current_max_grad_norm()
        self._clipped_at.add(clipper.max_grad_norm)
        norms, factors, keep, _ = clipper.finite_factors(norms)
        self.last_norms = norms.detach()
        self._count_unclipped(factors, None if keep is None else ~keep)
        grads = clipper.clipped_sums(None, factors * scale, keep=keep).own_grads()
        for p, g in zip(self._params, grads):
            _add_grad(p, g)

    def _write_per_layer(self, extra: Sequence[Tuple[nn.Parameter, torch.Tensor]] = ()) -> None:
        """Per-layer clipping by the clipping core
        (:func:`private_engine.clipping.per_layer.per_layer_clipped_sums`); ``extra``: the traced
        parameters' and fallback modules' per-sample gradients."""
        batch = self._stored[0][1][0][1].shape[0] if self._stored else extra[0][1].shape[0]
        for p, g in per_layer_clipped_sums(self._stored, self._norms_by_param,
                                           self._mean_scale(batch), self._names, extra=extra):
            _add_grad(p, g)

    # -- criterion flow ---------------------------------------------------------------------------
    def criterion_backward(self, loss_per_sample: torch.Tensor) -> None:
        """``p.grad += Σ_i C_i ∂L_i/∂p`` from per-sample losses: one physical batch through the
        clipping core (:func:`private_engine.clipping.batch.clip_batch`; book-keeping, one
        backward)."""
        self.model_randomness.end()
        self._sixteen_bit = False  # the criterion flow's per-sample losses have no 1/n
        try:
            self.batch_flow.check_loss(loss_per_sample)
            check_per_sample_loss(loss_per_sample, name="the per-sample loss")
            fresh = self._start_backward()
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
            self._clipped_at.add(self.clipper.max_grad_norm)
            self.last_norms = batch.norms
            # dropped samples have norm 0 here: their factor 1 is taken off the count
            self._count_unclipped(self.clipper.clip_factors(batch.norms), batch.dropped)
            for p, g in zip(self._params, batch.sums.own_grads()):
                _add_grad(p, g)
        self.backward_passes += 1


_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def _sixteen_bit_forward(out, params: Sequence[torch.Tensor]) -> bool:
    """Whether a forward computes in 16-bit floats: under autocast to float16/bfloat16 on the
    device of its outputs or parameters, with a 16-bit parameter, or with a 16-bit output."""
    tensors = [t for t in _flatten(out) if isinstance(t, torch.Tensor)]
    devices = {t.device.type for t in [*tensors, *params[:1]]}
    if any(torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d) in _SIXTEEN_BIT
           for d in devices):
        return True
    return any(t.dtype in _SIXTEEN_BIT for t in [*tensors, *params])


def _add_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


def _no_ddp_grad_sync(ddp: DistributedDataParallel, inputs) -> None:
    """Forward pre-hook on a torch DDP wrapper: no reducer work in the coming backward (DDP's
    ``no_sync()`` state). The reducer would all-reduce the raw gradients, which our hooks replace
    by zeros, and at the end of the backward copy that average over our clipped sums in ``p.grad``.
    The DP optimizer's step all-reduces the clipped sums instead."""
    ddp.require_backward_grad_sync = False


def _is_dp_rnn(module: nn.Module) -> bool:
    from opacus.layers.dp_rnn import DPRNNBase
    return isinstance(module, DPRNNBase)


def _reject_packed_sequence(module, inputs):
    """DPLSTM/DPGRU/DPRNN on a PackedSequence call their linear maps with a batch that shrinks
    over time; per-sample bookkeeping across those calls is not implemented."""
    if inputs and isinstance(inputs[0], nn.utils.rnn.PackedSequence):
        raise TypeError(
            f"{type(module).__name__} was given a PackedSequence, which private_engine does not "
            "support yet. Pad the batch instead (torch.nn.utils.rnn.pad_packed_sequence / "
            "pad_sequence, batch_first=True) and "
            "pick each sequence's last valid output, or mask the padded positions in the loss."
        )


def _flatten(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flatten(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flatten(o)]
    return []
