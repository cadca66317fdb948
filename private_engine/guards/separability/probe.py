"""The separability probe's owner: a forward pre-hook on the root module that notes forwards with an
input signature still to be probed (and makes their per-sample inputs differentiable), the
schedule of the probes (the first ``probed_steps`` checked batches of every signature, whatever
their outcome), the accepted signatures (an LRU) and the checks that run the comparison (the
method is described in :mod:`private_engine.guards.separability`)."""
from __future__ import annotations

import os
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from ...capture.fallback import replaying
from .comparison import Comparison, compare_points
from .diagnosis import mixing_error
from .graph import ComparisonPoint, reached_forwards, target_points
from .inputs import PendingForward, arm, collect_tensors, first_batch, signature

#: probed input signatures kept (least recently used dropped first), as ``hooks.py`` caps dims
MAX_SIGNATURES = 256
#: forwards with a signature still to be probed, remembered until the next check (the latest)
MAX_PENDING = 8
#: checked batches of every input signature that run the comparison, whatever its outcome (a
#: verdict, none, or a batch of one sample): the schedule follows the signatures alone
PROBED_STEPS = 1


@dataclass
class _Progress:
    """The probes run so far for one input signature."""

    runs: int = 0
    #: whether some probe compared at least two samples at every point, with finite rows
    verdict: bool = False
    #: what kept the last probe from a verdict (for the warning)
    unseen: List[str] = field(default_factory=list)


class SeparabilityProbe:
    """Verifies numerically that a model (and its loss) never mixes samples; see the module doc.

    Usage (what the engine does)::

        probe = SeparabilityProbe(model); probe.install()
        out = model(x)                      # first forward of this input signature: pending
        if probe.pending:
            probe.check(per_sample_losses, [(name, edge), ...])   # raises BatchMixingError

    Args:
        model: the root module (its forward pre-hook computes the input signature).
        batch_dim: the batch dimension of the model's tensor arguments (1 for sequence-first
            inputs), or None when it is not known (Opacus' ``batch_first=False``, whose models
            may take batch-first token ids and transpose them): every float argument is then
            made differentiable and compared as per-sample along dim 0 or dim 1, whichever
            holds (mixing is still seen; a sequence-first layout is not an error), and shapes
            enter the signature unnormalised (each batch size is a signature of its own).
        probed_steps: K, the checked batches of every input signature that run the comparison
            (default :data:`PROBED_STEPS`), each at the cost of two backward passes (three when
            float16 is involved). The first K checks of a signature are probed whatever came
            out of them — a verdict, none (a sample whose gradient is not finite, one that zeroes
            the others' gradients) or a batch of one sample —, so which batches run the probe's
            passes is a function of the sequence of input signatures alone, never of a sample's
            values or of the batch size. When none of the K gave a verdict a ``RuntimeWarning``
            names the points that were not compared, and the signature is accepted.
    """

    def __init__(self, model: nn.Module, *, batch_dim: Optional[int] = 0,
                 probed_steps: int = PROBED_STEPS):
        if type(probed_steps) is not int or probed_steps < 1:
            raise ValueError(f"probed_steps must be an integer >= 1 (got {probed_steps!r}): the "
                             "number of checked batches of each input signature the probe runs on.")
        self.model = model
        self.batch_dim = batch_dim
        self.probed_steps = probed_steps
        #: accepted signatures: probed ``probed_steps`` times (an LRU)
        self._probed: "OrderedDict[tuple, None]" = OrderedDict()
        #: signatures probed fewer than ``probed_steps`` times so far (an LRU)
        self._progress: "OrderedDict[tuple, _Progress]" = OrderedDict()
        self._pending: deque = deque(maxlen=MAX_PENDING)
        self._handle = None
        self._gen = torch.Generator()
        self._gen.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    def __getstate__(self):
        """Copies (``copy.deepcopy(model)`` copies its hooks) and pickles keep the probed
        signatures but no pending forward: its tensors belong to the original's graph."""
        state = dict(self.__dict__)
        state["_pending"] = None
        state["_gen"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._pending = deque(maxlen=MAX_PENDING)
        self._gen = torch.Generator()
        self._gen.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    # -- hooks --------------------------------------------------------------------------------
    def install(self) -> None:
        """Register the root forward pre-hook (first among the root's pre-hooks, so that hooks
        that look at the inputs, like the engine's tracer, see the differentiable copies)."""
        if self._handle is None:
            self._handle = self.model.register_forward_pre_hook(self._pre, with_kwargs=True,
                                                                prepend=True)

    def remove(self) -> None:
        """Remove the hook and forget pending forwards (probed signatures are kept)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._pending.clear()

    @property
    def pending(self) -> bool:
        """True when a forward with an input signature still to be probed ran since the last
        check."""
        return bool(self._pending)

    def reset(self) -> None:
        """Forget the probed signatures and pending forwards: every signature is probed again
        (its next ``probed_steps`` checked batches). The model's hooks see those passes: call it
        for public reasons (a changed model), not in answer to what the probe found on data."""
        self._probed.clear()
        self._progress.clear()
        self._pending.clear()

    def _pre(self, module, args, kwargs):
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or replaying():
            return None
        bd = self.batch_dim
        B = None if bd is None else first_batch(args, bd)
        if B is None and kwargs and bd is not None:
            B = first_batch(kwargs, bd)
        sig = (module.training, bd, signature(args, bd, B),
               signature(kwargs, bd, B) if kwargs else ())
        if sig in self._probed:
            self._probed.move_to_end(sig)
            return None
        fwd = PendingForward(signature=sig, batch_size=B)
        memo: Dict[int, torch.Tensor] = {}
        new_args = arm(args, "args", fwd, bd, memo)
        new_kwargs = {k: arm(v, str(k), fwd, bd, memo) for k, v in kwargs.items()}
        self._pending.append(fwd)
        return new_args, new_kwargs

    # -- checks -------------------------------------------------------------------------------
    def check(self, loss: torch.Tensor, targets) -> None:
        """Verify separability from per-sample losses ``loss`` (B,), if a probe is pending.

        ``targets``: ``[(name, edge)]`` with ``edge`` a GradientEdge (or a tensor) of a recorded
        batch-first output (k·B rows, k consecutive rows per sample) and ``name`` the layer or
        module name for messages; an entry may add the output's batch dimension and logical
        shape, ``(name, edge, batch_dim, shape)`` (batch_dim None: dim 0 or 1, whichever is
        per-sample), for layers that see sequence-first tensors by design (Opacus'
        ``batch_first=False``); targets without k·B rows are left to the engine's own shape
        checks, and those the loss does not reach are skipped. Runs the backward of ``Σ_j L_j``
        and of ``Σ_j 2^{e_j}·L_j`` (``retain_graph=True``) and compares, at every target and at
        the remembered model inputs that reach the loss, row m of the weighted gradient with
        ``2^{e_{m//k}}`` times the plain one (module doc). Clears ``pending`` and the remembered
        inputs and counts one probe of the input signature(s) (accepted after ``probed_steps``);
        raises :class:`BatchMixingError` naming the offending target closest to the loss and the
        autograd op(s) that mix rows. Does nothing when no probe is pending or the batch is
        empty (B = 0: nothing is counted).
        """
        if not self._pending:
            return
        if not isinstance(loss, torch.Tensor) or loss.dim() != 1:
            self._pending.clear()
            raise ValueError("the separability probe needs a vector of per-sample losses (B,).")
        B = loss.shape[0]

        def cotangents(r):
            return [r.to(loss.device, loss.dtype)]

        self._run([loss], cotangents, B, targets, [0])

    def check_outputs(self, outputs, targets, batch_dim: Optional[int] = 0,
                      batch_size: Optional[int] = None) -> None:
        """The same check without per-sample losses (a reduced loss, Opacus' front door).

        The backward passes start from the model's ``outputs`` (a tensor or nested
        lists/tuples/dicts/dataclasses of tensors) with a random cotangent V and with ``r·V``
        (row m along the output's batch dimension times ``2^{e_{m//k}}``), so mixing inside the
        user's loss function is not seen here. ``batch_dim``: the outputs' batch dimension, or
        None to take, per output, whichever of dims 0 and 1 alone has k·B rows (outputs where
        both or neither do are not used). ``batch_size``: B (default: the size along the probe's
        ``batch_dim`` of the first tensor argument of the pending forward). Outputs without k·B
        rows along their batch dimension are not used. ``targets`` as in :meth:`check`. Does
        nothing when no probe is pending.
        """
        if not self._pending:
            return
        B = batch_size or next((f.batch_size for f in reversed(self._pending) if f.batch_size),
                               None)
        tensors: list = []
        collect_tensors(outputs, tensors)
        if not B and batch_dim is not None:
            B = next((t.shape[batch_dim] for t in tensors if t.dim() > batch_dim), 0)
        roots, dims = [], []
        for t in tensors:
            if not (B and t.requires_grad and t.is_floating_point()):
                continue
            cands = [d for d in ((0, 1) if batch_dim is None else (batch_dim,))
                     if t.dim() > d and t.shape[d] and t.shape[d] % B == 0]
            if len(cands) == 1:
                roots.append(t)
                dims.append(cands[0])
        if not roots:
            self._pending.clear()
            return
        noise = [torch.randn(t.shape, generator=self._gen).to(t.device, t.dtype) for t in roots]

        def cotangents(r):
            out = []
            for t, v, d in zip(roots, noise, dims):
                rho = r.repeat_interleave(t.shape[d] // B).to(t.device, t.dtype)
                shape = [1] * t.dim()
                shape[d] = -1
                out.append(v * rho.view(shape))
            return out

        self._run(roots, cotangents, B, targets, [0, *dims])

    # -- the comparison -----------------------------------------------------------------------
    def _run(self, roots, cotangents, B: int, targets, layouts) -> None:
        forwards = list(self._pending)
        self._pending.clear()
        root_nodes = [t.grad_fn for t in roots if t.grad_fn is not None]
        if not root_nodes or B < 1:  # no graph / an empty batch: nothing to compare or count
            return
        reached = reached_forwards(forwards, root_nodes)
        if not reached:  # nothing of these forwards in this graph
            return
        points = target_points(targets)
        input_dims = (0, 1) if self.batch_dim is None else (self.batch_dim,)
        for f in reached:
            for name, x in f.inputs:
                points.append(ComparisonPoint(f"model input {name}", x,
                                              get_gradient_edge(x).node, -1, input_dims, None,
                                              True))
        layouts = sorted(set(layouts).union(*(p.dims for p in points)))
        verdict = None
        if points:
            # the same passes for a batch of one sample (which cannot show mixing): their number
            # does not tell the batch size
            verdict = compare_points(self._gen, roots, cotangents, B, points)
            if verdict.bad:  # a refusal: the signature stays to be probed
                raise mixing_error(self._gen, roots, cotangents, B, verdict.bad, layouts,
                                   verdict.weights)
        self._count({f.signature for f in reached}, verdict, B)

    def _count(self, sigs, verdict: Optional[Comparison], B: int) -> None:
        """One probe of the signatures ``sigs`` done, whatever its outcome; a signature probed
        ``probed_steps`` times is accepted (with a warning when none of its probes had a
        verdict: a crafted sample can leave a batch without one, see the module doc)."""
        if verdict is None:  # nothing to compare: no point, no model input
            seen, unseen = True, []
        elif B < 2:
            seen, unseen = False, ["every point (a batch of one sample)"]
        else:
            seen = verdict.complete and not verdict.silent
            unseen = sorted(set(verdict.silent)) or ["rows that were not finite"]
        for sig in sigs:
            prog = self._progress.pop(sig, None) or _Progress()
            prog.runs += 1
            prog.verdict = prog.verdict or seen
            if not seen:
                prog.unseen = unseen
            if prog.runs < self.probed_steps:
                self._progress[sig] = prog
                continue
            if not prog.verdict:
                warnings.warn(
                    f"the separability probe could not compare samples at {prog.unseen} in the "
                    f"{prog.runs} batch(es) it probes of this input signature (the gradient there "
                    "reached fewer than two samples, or was not finite): mixing of samples there "
                    "is not ruled out. The batch flow still refuses mixing in the forward; to "
                    "probe more batches, raise probed_steps.",
                    RuntimeWarning, stacklevel=5)
            self._probed[sig] = None
            self._probed.move_to_end(sig)
        while len(self._progress) > MAX_SIGNATURES:
            self._progress.popitem(last=False)
        while len(self._probed) > MAX_SIGNATURES:
            self._probed.popitem(last=False)
