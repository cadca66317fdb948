"""The separability probe's owner: a forward pre-hook on the root module that notes forwards with an
input signature due for a probe (and makes their per-sample inputs differentiable), the schedule
of the probes (the n-th forward of a signature is probed for n ≤ ``probed_steps`` and n = 4, 8,
16, …, whatever came out of the earlier ones), what the probes found (a non-private record per
signature) and the checks that run the comparison (the method is described in
:mod:`private_engine.guards.separability`)."""
from __future__ import annotations

import logging
import os
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from ...capture.fallback import replaying
from .comparison import Comparison, compare_points
from .diagnosis import mixing_error
from .graph import ComparisonPoint, reached_forwards, target_points
from .inputs import PendingForward, arm, collect_tensors, first_batch, signature

log = logging.getLogger(__name__)

#: input signatures whose forwards are counted (least recently used dropped first: a signature
#: seen again after that starts its schedule over)
MAX_SIGNATURES = 256
#: forwards due for a probe, remembered until the next check (the latest)
MAX_PENDING = 8
#: K: the first forwards of every input signature that are probed (then its 4th, 8th, 16th, ...)
PROBED_STEPS = 1
#: probes of a signature after which points that were never compared are told in a warning
STRUCTURAL_PROBES = 3


def probed_at(n: int, k: int = PROBED_STEPS) -> bool:
    """Whether the n-th forward (n ≥ 1) of an input signature is probed: ``n ≤ k`` or ``n`` a
    power of two from 4 on (``n = 2^j``, ``j ≥ 2``). Over N forwards of one signature that is
    ``k + #{j ≥ 2 : k < 2^j ≤ N}`` probes, 13 for N = 10,000 and k = 1 (n = 1, 4, 8, …, 8192)."""
    return n <= k or (n >= 4 and n & (n - 1) == 0)


@dataclass
class ProbeRecord:
    """What the probes of one input signature found so far (NOT private: it depends on the
    batches' values, like the engine's dropped-sample count; read it for debugging)."""

    #: probes run (forwards of the signature that reached a check with a non-empty batch)
    probes: int = 0
    #: probes that compared at least two samples at every point
    verdicts: int = 0
    #: ``{point: probes in which it compared fewer than two samples}``
    unseen: Dict[str, int] = field(default_factory=dict)
    #: whether the warning about points never compared was given
    warned: bool = False


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
        probed_steps: K (default :data:`PROBED_STEPS`): the first K forwards of every input
            signature are probed, and after them its 4th, 8th, 16th, … (:func:`probed_at`), each
            probe at the cost of two backward passes (three when float16 is involved): 13 probes
            of a signature over 10,000 forwards with K = 1. Which forwards run the probe's passes
            is a function of how many forwards of the signature came before, never of a sample's
            values, of a verdict or of the batch size. What the probes found is in
            :attr:`records` (not private: for debugging); points that compared fewer than two
            samples at every one of a signature's first three probes are told in one
            ``RuntimeWarning``.
    """

    def __init__(self, model: nn.Module, *, batch_dim: Optional[int] = 0,
                 probed_steps: int = PROBED_STEPS):
        if type(probed_steps) is not int or probed_steps < 1:
            raise ValueError(f"probed_steps must be an integer >= 1 (got {probed_steps!r}): the "
                             "number of checked batches of each input signature the probe runs on.")
        self.model = model
        self.batch_dim = batch_dim
        self.probed_steps = probed_steps
        #: forwards (with grad) of every input signature so far (an LRU)
        self._forwards: "OrderedDict[tuple, int]" = OrderedDict()
        #: signatures whose last probe refused the model: their next forward is probed too
        self._refused: set = set()
        #: what the probes of every signature found (an LRU, not private)
        self._records: "OrderedDict[tuple, ProbeRecord]" = OrderedDict()
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
        """True when a forward due for a probe ran since the last check."""
        return bool(self._pending)

    @property
    def records(self) -> Dict[tuple, ProbeRecord]:
        """``{input signature: ProbeRecord}``: the probes run, those with a verdict and the
        points not compared. NOT private (it follows the batches' values, as
        ``engine.dropped_samples`` does): read it for debugging, do not publish it."""
        return dict(self._records)

    def reset(self) -> None:
        """Forget the forward counts, records and pending forwards: every signature's schedule
        starts over (its next forward is probed). The model's hooks see those passes: call it for
        public reasons (a changed model), not in answer to what the probe found on data."""
        self._forwards.clear()
        self._refused.clear()
        self._records.clear()
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
        n = self._forwards.pop(sig, 0) + 1
        self._forwards[sig] = n
        while len(self._forwards) > MAX_SIGNATURES:
            self._forwards.popitem(last=False)
        if not (probed_at(n, self.probed_steps) or sig in self._refused):
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
        inputs and records the probe of the input signature(s) (:attr:`records`); raises
        :class:`BatchMixingError` naming the offending target closest to the loss and the
        autograd op(s) that mix rows. Does nothing when no probe is pending or the batch is
        empty (B = 0).
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
            if verdict.bad:  # a refusal: the signature's next forward is probed too
                self._refused.update(f.signature for f in reached)
                raise mixing_error(self._gen, roots, cotangents, B, verdict.bad, layouts,
                                   verdict.weights)
        self._record({f.signature for f in reached}, verdict)

    def _record(self, sigs, verdict: Optional[Comparison]) -> None:
        """Note one probe of the signatures ``sigs`` in :attr:`records`. Points that compared
        fewer than two samples (finite, non-zero rows in both passes) go to a DEBUG log record;
        those that did so at every one of a signature's first :data:`STRUCTURAL_PROBES` probes
        to one ``RuntimeWarning`` (a structural limit of the probe, module doc)."""
        # a batch of one sample compares one sample at every point: all of them are unseen
        unseen = [] if verdict is None else sorted(set(verdict.silent))
        if unseen:
            log.debug("separability probe: fewer than two samples compared at %s", unseen)
        for sig in sigs:
            self._refused.discard(sig)
            rec = self._records.pop(sig, None) or ProbeRecord()
            self._records[sig] = rec
            rec.probes += 1
            rec.verdicts += not unseen
            for name in unseen:
                rec.unseen[name] = rec.unseen.get(name, 0) + 1
            never = sorted(n for n, c in rec.unseen.items() if c == rec.probes)
            if rec.probes == STRUCTURAL_PROBES and never and not rec.warned:
                rec.warned = True
                warnings.warn(
                    f"the separability probe compared fewer than two samples at {never} in each "
                    f"of the first {rec.probes} batches it probed of this input signature: the "
                    "gradient there reaches at most one sample (or is not finite), so mixing of "
                    "samples in the backward there is not ruled out (the batch flow still "
                    "refuses mixing in the forward). See probe.records.",
                    RuntimeWarning, stacklevel=5)
        while len(self._records) > MAX_SIGNATURES:
            self._records.popitem(last=False)
