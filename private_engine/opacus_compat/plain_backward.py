"""The plain ``loss.backward()`` flow of :class:`~.module.PrivateModule`: book-keeping clipping
(mode "bk_mixed") by the clipping core during the ordinary backward.

Each recorded layer is handed to the clipper as soon as its output gradient arrives (certified
per-sample norm by ghost norm or instantiation, per the layerwise rule of "bk_mixed"; what the
clipped sum needs kept); the raw parameter gradients are discarded by the module's parameter
hooks; at the end of the backward (an autograd callback) the clip factors follow from the
certified norms and ``p.grad += Σ_i C_i g_iᵀ a_i`` is written — no second backward. With
``clipping="per_layer"`` the layers' inputs and output gradients are kept instead and clipped
per parameter tensor at the end. A batch-mean loss (``loss_reduction="mean"``) is refused here in
16-bit precision (:meth:`PlainBackward.check_mean_loss`).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import nn

from ..capture.recorder import RecordedLayer
from ..clipping.per_layer import per_layer_clipped_sums

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


class PlainBackward:
    """The state of one plain backward of ``module`` (a :class:`~.module.PrivateModule`) and its
    steps: :meth:`on_layer_ready` per recorded layer, :meth:`finish` at the end."""

    def __init__(self, module):
        self.module = module
        self.reset()

    def reset(self) -> None:
        """Forget the backward in progress."""
        self.stored: List[Tuple[RecordedLayer, list]] = []  # per_layer clipping only
        self.callback_queued = False
        #: a layer's recorded call received its output gradient in this backward (a batch, maybe
        #: empty)
        self.saw_batch = False
        #: the clipper's norm pass of this backward has begun (its batch size is the first layer's)
        self.started = False
        #: a training forward of this backward ran under 16-bit autocast or in 16-bit floats, or a
        #: recorded output gradient is 16-bit (a batch-mean loss is then refused: check_mean_loss)
        self.sixteen_bit = False

    def queue_finish(self) -> None:
        """Have :meth:`finish` run at the end of the current backward (once)."""
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def on_layer_ready(self, layer: RecordedLayer) -> None:
        """One layer of a plain backward, handed to the clipper (certified norm, what the sum needs
        kept)."""
        m = self.module
        m._to_batch_first(layer)
        try:
            m.batch_flow.check_root()  # the backward's loss (once: the region ends here)
        except BaseException:
            m.recorder.reset()
            raise
        finally:
            m.model_randomness.end()
        pairs = layer.pairs()
        if pairs:
            self.saw_batch = True
            self.queue_finish()
            if any(g.dtype in SIXTEEN_BIT for _, g in pairs):
                self.sixteen_bit = True
        if not pairs or pairs[0][1].shape[0] == 0:  # nothing reached, or an empty Poisson batch
            layer.release()
            return
        if m.per_layer:
            self.stored.append((RecordedLayer(layer.name, layer.module, layer.rule), pairs))
            layer.release()
            return
        if not self.started:
            m.clipper.start_pass(pairs[0][1].shape[0])
            self.started = True
        m.clipper.on_layer_ready(layer)

    def finish(self) -> None:
        """End of a plain backward: certified norms from the clipper, clip factors, then
        ``Σ_i C_i g_iᵀ a_i``."""
        m = self.module
        try:
            try:
                fresh = m.release.start_backward()
                m._check_trainable(m._module.parameters())
                self.check_mean_loss()
            except BaseException:
                m.recorder.reset()
                raise
            if not fresh:  # refused at the next step; nothing is clipped into the stale p.grad
                m.recorder.reset()
                return
            m.recorder.finish_unfired()  # layers the loss does not reach contribute nothing
            extras = self.extras_fired()
            if not (self.started or self.stored or extras):
                m.recorder.reset()
                if not self.saw_batch:  # parameter gradients but no recorded call: not a new batch
                    raise ValueError(
                        "this backward reached no recorded layer call: it went through a graph "
                        "whose records were already used (a second backward through a retained "
                        "graph, or a backward after autograd.grad on the same output) or whose "
                        "forward ran in eval mode. Run the forward again (in train mode) before "
                        "each backward."
                    )
                m.release.backward_passes += 1
                return
            # the tracer's and fallbacks' per-sample gradients are read before their records go
            if m.per_layer:
                extra = self.extra_grads()
                m.recorder.reset()
                self.write_per_layer(extra)
            else:
                if not self.started:  # only traced parameters / fallback modules were reached
                    m.clipper.start_pass(m.tracer.batch_size)
                    self.started = True
                norms = m.clipper.end_norm_pass(m._params[0].device)
                m.recorder.reset()
                self.write_flat(norms)
            m.release.backward_passes += 1
        except BaseException:
            m.clipper.release()
            raise
        finally:
            self.reset()

    def check_mean_loss(self) -> None:
        """Refuse a plain backward of a batch-mean loss (``loss_reduction="mean"``) in 16-bit
        floats. Its output gradients reach the layers as ``ĝ_i = fl16(g_i / n)`` and are clipped
        as ``n·ĝ_i``; unless ``n`` is a power of two and nothing underflows,
        ``n·fl16(g_i/n) ≠ fl16(g_i)`` (relative error of the order of the unit roundoff u, 2⁻⁸
        for bfloat16, 2⁻¹¹ for float16), so an honest sample's clipped term differs
        between neighbouring batches of ``n`` and ``n − 1`` samples, and one sample moves the
        release by more than R. A sum loss (``g_i`` whatever ``n``) or the criterion flow (per-
        sample losses) has no ``n`` in its gradients. The refusal depends on the precision, never
        on the batch size or the data."""
        if self.module.loss_reduction == "mean" and self.sixteen_bit:
            raise ValueError(
                "a plain loss.backward() of a batch-mean loss in 16-bit precision (autocast or "
                "16-bit weights) cannot be clipped to max_grad_norm exactly: the 1/batch-size "
                "scaling of every sample's gradient is rounded to 16 bits differently for "
                "batches of n and n-1 samples; nothing was released. Backpropagate a sum loss "
                "(e.g. nn.CrossEntropyLoss(reduction=\"sum\")) with "
                "make_private(loss_reduction=\"sum\"), or use grad_sample_mode=\"ghost\" and "
                "the criterion make_private returns.")

    def mean_scale(self, batch: int) -> float:
        """``loss_reduction="mean"``: the recorded output gradients are those of ``(1/B) Σ_i L_i``,
        so norms and sums are taken of ``B·g`` (as Opacus does); 1 for "sum"."""
        return float(batch) if self.module.loss_reduction == "mean" else 1.0

    def extras_fired(self) -> bool:
        """Whether this backward reached a traced parameter's entry or a fallback module's output
        (a batch to clip even when it reached no ruled layer)."""
        tracer = self.module.tracer
        if tracer is None or not tracer.batch_size:
            return False
        return (any(e.fired for e in tracer.entries)
                or any(g is not None for fb in self.module.fallbacks for c in fb.calls
                       for g in c.grads))

    def extra_grads(self) -> List[Tuple[nn.Parameter, torch.Tensor]]:
        """``[(parameter, (B, *shape) per-sample gradients)]`` of the traced parameters and the
        fallback modules' parameters in this backward (per-layer clipping)."""
        if not self.extras_fired():
            return []
        tracer = self.module.tracer
        tracked = {name: p for name, p in tracer.tracked.values()}
        out = [(tracked[n], g) for n, g in tracer.per_sample_grads().items()]
        for fb in self.module.fallbacks:
            if fb.calls:
                owned = dict(fb.params)
                out += [(owned[n], g)
                        for n, g in fb.per_sample_grads(tracer.batch_size).items()]
        return out

    def write_flat(self, norms: torch.Tensor) -> None:
        """``p.grad += Σ_i C_i g_i`` from the certified norms of the norm pass just ended."""
        m = self.module
        clipper = m.clipper
        batch = clipper.batch_size
        scale = self.mean_scale(batch)
        norms = norms * scale
        clipper.max_grad_norm = m.current_max_grad_norm()
        m.release.clipped_at.add(clipper.max_grad_norm)
        norms, factors, keep, _ = clipper.finite_factors(norms)
        m.release.last_norms = norms.detach()
        m.release.count_unclipped(factors, None if keep is None else ~keep)
        grads = clipper.clipped_sums(None, factors * scale, keep=keep).own_grads()
        for p, g in zip(m._params, grads):
            add_grad(p, g)

    def write_per_layer(self, extra: Sequence[Tuple[nn.Parameter, torch.Tensor]] = ()) -> None:
        """Per-layer clipping by the clipping core
        (:func:`private_engine.clipping.per_layer.per_layer_clipped_sums`); ``extra``: the traced
        parameters' and fallback modules' per-sample gradients."""
        m = self.module
        batch = self.stored[0][1][0][1].shape[0] if self.stored else extra[0][1].shape[0]
        for p, g in per_layer_clipped_sums(self.stored, m._norms_by_param,
                                           self.mean_scale(batch), m._names, extra=extra):
            add_grad(p, g)


def add_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """``p.grad += g`` (in ``p``'s dtype; ``p.grad = g`` when there is none)."""
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)
