"""Where Opacus' layers see the batch: dimension 1 of sequence-first inputs with
``make_private(batch_first=False)``, except Opacus' ``RNNLinear`` (called per time step on
``(B, H)``) and ``SequenceBias`` (its own ``batch_first`` attribute); and the move of a recorded
layer's tensors to batch-first before the clipping core sees them."""
from __future__ import annotations

from opacus.layers.dp_multihead_attention import SequenceBias
from opacus.layers.dp_rnn import RNNLinear

from ..capture.recorder import RecordedLayer


def layer_batch_dim(layer: RecordedLayer, batch_first: bool) -> int:
    """Where a recorded layer sees the batch (what :func:`to_batch_first` moves)."""
    m = layer.module
    if isinstance(m, SequenceBias):
        return 0 if m.batch_first else 1
    return 0 if (batch_first or type(m) is RNNLinear) else 1


def to_batch_first(layer: RecordedLayer, batch_first: bool) -> None:
    """``batch_first=False``: move the batch dimension (1) of every recorded input and output
    gradient to the front, except for Opacus' ``RNNLinear`` (called per time step on (B, H)) —
    Opacus' own convention. ``SequenceBias`` follows its own ``batch_first`` attribute."""
    if isinstance(layer.module, SequenceBias):
        if layer.module.batch_first:
            return
    elif batch_first or type(layer.module) is RNNLinear:
        return
    for c in layer.calls:
        if c.activation is not None and c.activation.dim() > 1:
            c.activation = c.activation.movedim(1, 0)
        if c.grad is not None and c.grad.dim() > 1:
            c.grad = c.grad.movedim(1, 0)
