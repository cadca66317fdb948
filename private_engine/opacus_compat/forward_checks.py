"""What :class:`~.module.PrivateModule` checks at the end of each forward of the wrapped model:
an eval-mode forward's records are dropped (as in Opacus, nothing is recorded in eval mode), the
outputs' batch flow, the separability probe from the outputs (first forward of each input
signature), and, once, that every trainable parameter reaches the outputs only through a recorded
call of its layer. Also the forward pre-hooks that refuse what the door cannot clip (a
``PackedSequence`` given to Opacus' DP RNNs)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import nn

from ..capture.graph_walk import outside_error
from .plain_backward import SIXTEEN_BIT


@dataclass
class EvalMarks:
    """How many records there were when an eval-mode forward began: calls per recorded layer,
    tracer entries, calls per fallback module (those after them are the forward's, dropped)."""

    layer_calls: List[int]
    tracer_entries: int
    fallback_calls: List[int]


class ForwardChecks:
    """The forward hooks of ``module`` (a :class:`~.module.PrivateModule`) on its wrapped model:
    :meth:`eval_snapshot` before, :meth:`after_forward` after each forward."""

    def __init__(self, module):
        self.module = module
        #: layer call counts at the start of an eval-mode forward (its records are dropped at its
        #: end)
        self.eval_marks: Optional[EvalMarks] = None
        #: the graph check (:meth:`check_graph`) passed on a forward with grad
        self.graph_checked = False

    def eval_snapshot(self, model, inputs) -> None:
        """Forward pre-hook: in eval mode, the record counts to go back to at the forward's end."""
        m = self.module
        self.eval_marks = None if model.training else EvalMarks(
            [len(layer.calls) for layer in m.recorder.layers],
            len(m.tracer.entries) if m.tracer is not None else 0,
            [len(fb.calls) for fb in m.fallbacks])

    def drop_eval_records(self, marks: EvalMarks) -> None:
        """A forward in eval mode is not recorded (as in Opacus): its calls (and tracer entries,
        fallback calls) are dropped right away, so evaluating without ``torch.no_grad()`` does not
        pile up activations."""
        m = self.module
        for layer, mark in zip(m.recorder.layers, marks.layer_calls):
            for c in layer.calls[mark:]:
                c.activation = c.grad = c.edge = c.input_node = None
            del layer.calls[mark:]
        if m.tracer is not None:
            m.tracer.drop_entries(marks.tracer_entries)
        for fb, mark in zip(m.fallbacks, marks.fallback_calls):
            del fb.calls[mark:]
        self.eval_marks = None

    def after_forward(self, model, inputs, out) -> None:
        """Forward hook: the checks of the forward's end (module doc)."""
        m = self.module
        if self.eval_marks is not None:
            self.drop_eval_records(self.eval_marks)
            m.batch_flow.end()
            return
        if torch.is_grad_enabled() and sixteen_bit_forward(out, m._params):
            m.plain_backward.sixteen_bit = True
        try:
            m.batch_flow.check_outputs(out)
        except BaseException:
            m.recorder.reset()
            raise
        if m.probe.pending and torch.is_grad_enabled():
            self.check_separable(out)
        if not self.graph_checked and torch.is_grad_enabled():
            self.check_graph(out)

    def check_separable(self, out) -> None:
        """The separability probe from the model's outputs (this door has no per-sample losses:
        mixing inside the user's loss function is not seen here; docs/migrating-from-opacus.md)."""
        m = self.module
        owners = [m.recorder, *m.recorder.extras]
        saved = [o.capturing for o in owners]
        for o in owners:
            o.capturing = False  # the probe's backward passes are not recorded
        try:
            batch = None
            if not m.batch_first:
                dims = [(c.output_shape, m._layer_batch_dim(layer))
                        for layer in m.recorder.layers for c in layer.calls]
                batch = min((shape[d] for shape, d in dims if len(shape) > d), default=None)
            m.probe.check_outputs(out, m.clipper.probe_targets(m._layer_batch_dim),
                                  batch_dim=0 if m.batch_first else None, batch_size=batch)
        except BaseException:
            m.recorder.reset()
            raise
        finally:
            for o, c in zip(owners, saved):
                o.capturing = c

    def check_graph(self, out) -> None:
        """Once, on the first forward with grad: every trainable parameter must reach the output
        only through a recorded call of its layer (a tied weight in ``F.linear(h, emb.weight)``
        would otherwise be missing from the per-sample norms of a plain backward)."""
        m = self.module
        tensors = [t for t in flatten_outputs(out)
                   if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        outside, custom = {}, {}
        for t in tensors:
            walk = m.recorder.walk(t, m._params)
            for p in walk.outside:
                outside[id(p)] = m._names.get(id(p))
            for i, function in walk.custom_functions.items():
                custom[m._names.get(i)] = function
        if outside:
            m.recorder.reset()
            raise outside_error(sorted(outside.values()), custom)
        self.graph_checked = bool(tensors)


def sixteen_bit_forward(out, params: Sequence[torch.Tensor]) -> bool:
    """Whether a forward computes in 16-bit floats: under autocast to float16/bfloat16 on the
    device of its outputs or parameters, with a 16-bit parameter, or with a 16-bit output."""
    tensors = [t for t in flatten_outputs(out) if isinstance(t, torch.Tensor)]
    devices = {t.device.type for t in [*tensors, *params[:1]]}
    if any(torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d) in SIXTEEN_BIT
           for d in devices):
        return True
    return any(t.dtype in SIXTEEN_BIT for t in [*tensors, *params])


def is_dp_rnn(module: nn.Module) -> bool:
    """Whether ``module`` is one of Opacus' DP RNNs (DPLSTM, DPGRU, DPRNN)."""
    from opacus.layers.dp_rnn import DPRNNBase
    return isinstance(module, DPRNNBase)


def reject_packed_sequence(module, inputs):
    """DPLSTM/DPGRU/DPRNN on a PackedSequence call their linear maps with a batch that shrinks
    over time; per-sample bookkeeping across those calls is not implemented."""
    if inputs and isinstance(inputs[0], nn.utils.rnn.PackedSequence):
        raise TypeError(
            f"{type(module).__name__} was given a PackedSequence, which private_engine does not "
            "support yet. Pad the batch instead (torch.nn.utils.rnn.pad_packed_sequence / "
            "pad_sequence, batch_first=True) and "
            "pick each sequence's last valid output, or mask the padded positions in the loss."
        )


def flatten_outputs(out):
    """The tensors of a model's outputs (nested lists, tuples and dicts)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flatten_outputs(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in flatten_outputs(o)]
    return []
