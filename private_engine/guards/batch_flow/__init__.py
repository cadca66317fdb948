"""Batch flow: which samples every tensor of a step depends on, followed op by op, every step.

Per-sample clipping bounds one sample's influence by R only if entry i of the loss vector is a
function of sample i's data alone (Abadi et al. 2016, "Deep Learning with Differential Privacy":
the clipped terms are per-sample gradients). The numerical separability probe
(:mod:`private_engine.guards.separability`) checks this through gradients, once per input
signature; it cannot see a coupling that carries no gradient (a denominator ``mask.sum()`` over
the batch's tokens, a batch-wide maximum behind an inactive ``clamp``) nor one that starts after
the probed step (a flag set by the training loop). :class:`BatchFlow` closes both gaps
structurally: from the model's first forward of a step until the engine takes the loss vector, a
``TorchDispatchMode`` sees every aten op of the forward *and of the user's loss* and tags each
output with the samples it depends on (:mod:`.tags`: rows of the batch, an ``arange``, or mixed),
by a rule per op (:mod:`.rules`): a pointwise op (``torch.Tag.pointwise``) keeps rows aligned
under broadcasting; views and reshapes move the batch dimension; reductions, scans, sorts and
softmax keep it when they act on other dimensions; matmuls, convolutions, attention,
normalisation, embedding, gathers and losses with ``reduction="none"`` keep it when they do not
contract, normalise or index across it. An op without a rule, applied to per-sample data, mixes:
never a silent pass.

The model's tensor arguments of the batch's size along the batch dimension are its rows, and so
is any tensor of that leading size entering an op from outside the step (the loss's labels), the
model's parameters and buffers excepted. A value computed in an earlier region and used again
(state kept across steps) mixes. :meth:`BatchFlow.check_loss` (native door) and
:meth:`BatchFlow.check_outputs` (Opacus door) raise :class:`BatchMixingError` before anything is
computed from a mixed value.

A ``torch.compile``'d model's step is followed the same way: TorchDynamo compiles no frame, and
runs none it compiled, while the mode is on the dispatch stack, so the step's forward runs op by
op; a region opened inside a compiled call keeps the mode's dispatch key on after the call
returns (docs/compile.md).

Limits: a coupling through Python numbers (``n = int(mask.sum())`` used later, a Python ``if``
on a batch statistic) leaves the tensors and is not seen; gradient-only mixing (a custom
``autograd.Function``'s backward, a tensor hook) is the separability probe's, once per input
signature; values computed from the data before the forward (in the data loader) are the batch's
rows when their leading size is the batch's, constants otherwise.
"""
from .mode import BatchFlow, CompiledStepWarning, advice
from .tags import Iota, Mixed, Rows, join, reshape_rows

__all__ = ["BatchFlow", "CompiledStepWarning", "Rows", "Iota", "Mixed", "join", "reshape_rows",
           "advice"]
