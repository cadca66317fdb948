"""The criterion flow of :class:`~.module.PrivateModule` (``grad_sample_mode="ghost"``): the
wrapped criterion's ``backward()`` hands the per-sample losses ``L_i`` to :class:`CriterionFlow`,
which forms ``p.grad += Σ_i C_i ∂L_i/∂p`` by book-keeping from one backward (Bu et al. 2023,
"Differentially Private Optimization on Large Model at Small Cost"; mode "bk_mixed"), through
the clipping core's :func:`private_engine.clipping.batch.clip_batch`."""
from __future__ import annotations

import torch

from ..capture.recorder import RecordedLayer
from ..clipping.batch import check_per_sample_loss, clip_batch
from .plain_backward import add_grad


class CriterionFlow:
    """The criterion flow of ``module`` (a :class:`~.module.PrivateModule`): :meth:`backward`
    per per-sample loss vector."""

    def __init__(self, module):
        self.module = module
        #: inside :meth:`backward`: its own backward passes leave the parameter gradients alone
        self.running = False

    def on_layer_ready(self, layer: RecordedLayer) -> None:
        """One finished layer of the criterion's backward: its tensors moved to batch-first, then
        the clipper's norm pass."""
        m = self.module
        m._to_batch_first(layer)
        m.clipper.on_layer_ready(layer)

    def backward(self, loss_per_sample: torch.Tensor) -> None:
        """``p.grad += Σ_i C_i ∂L_i/∂p`` from per-sample losses: one physical batch through the
        clipping core (:func:`private_engine.clipping.batch.clip_batch`; book-keeping, one
        backward)."""
        m = self.module
        m.model_randomness.end()
        m.plain_backward.sixteen_bit = False  # the criterion flow's losses have no 1/n
        try:
            m.batch_flow.check_loss(loss_per_sample)
            check_per_sample_loss(loss_per_sample, name="the per-sample loss")
            fresh = m.release.start_backward()
            m._check_trainable(m._module.parameters())
            if m.per_layer:
                raise ValueError("clipping='per_layer' is not supported with "
                                 "grad_sample_mode='ghost' (as in Opacus).")
        except BaseException:
            m.recorder.reset()
            raise
        if not fresh:  # refused at the next step; nothing is clipped into the stale p.grad
            m.recorder.reset()
            return
        m.clipper.max_grad_norm = m.current_max_grad_norm()
        capturing = m.recorder.capturing  # False after disable_hooks(): restored as left
        self.running = True
        try:
            with m.core.route.diverted(self.on_layer_ready):
                batch = clip_batch(m.clipper, loss_per_sample, names=m._names)
        finally:
            m._set_capturing(capturing)
            self.running = False
        if batch.size:
            m.release.clipped_at.add(m.clipper.max_grad_norm)
            m.release.last_norms = batch.norms
            # dropped samples have norm 0 here: their factor 1 is taken off the count
            m.release.count_unclipped(m.clipper.clip_factors(batch.norms), batch.dropped)
            for p, g in zip(m._params, batch.sums.own_grads()):
                add_grad(p, g)
        m.release.backward_passes += 1
