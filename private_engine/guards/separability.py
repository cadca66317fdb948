"""Sample-separability probe: a numerical check, by autograd, that no op mixes samples.

Per-sample clipping bounds one sample's influence on the release by R only when the model is
*sample-separable*: row j of every recorded batch-first tensor (dim 0; k consecutive rows per
sample when a tensor has k·B rows, e.g. Swin windows) depends on sample j's data alone, and entry
j of the loss vector is sample j's loss. An op that mixes rows (``h - h.mean(0)``, ``h.flip(0)``,
``softmax(h, dim=0)``, a Linear on a sequence-first ``(T, B, d)`` tensor, a loss out of batch
order) lets one sample move the release by several times R, silently.

**The test.** The backward pass is linear in the loss cotangent, so the gradient at a recorded
tensor ``t`` of ``Σ_j r_j·L_j`` is ``Σ_j r_j·∂L_j/∂t``. When the model is separable,
``∂L_j/∂t`` is zero outside sample j's rows, hence for every row m of t::

    ∂(Σ_j r_j·L_j)/∂t [m]  =  r_{m // k} · ∂(Σ_j L_j)/∂t [m]      (k = rows of t / B)

With ``r_j = 2^{e_j}`` the two sides are equal *exactly* in IEEE arithmetic: multiplying every
cotangent of sample j by a power of two multiplies every product and partial sum that the
backward forms for sample j's rows by the same power of two, without a new rounding (barring
overflow and subnormals). An op that mixes rows makes row m a combination ``Σ_j r_j·G_j[m]`` of
several samples' weights, which differs from ``r_{m//k}·Σ_j G_j[m]`` unless the weights agree.
The exponents ``e_j`` are a random arrangement of ``lo + (j mod E)`` (E = 16 levels, 0..15; 5
levels, -4..0, when float16 is involved), so up to E samples get distinct weights and any mixing
among them is seen; with more samples, mixing only among samples of equal weight goes unseen,
with small probability, and a re-probe draws new weights.

Two backward passes (``torch.autograd.grad(..., retain_graph=True)``) give both sides at every
recorded output (the engine's ``RecordedCall.edge``, the tracer's ``entry_edges()``, the
fallback's ``out_edges()``) and at the model's float inputs. Rows are compared through per-row
fingerprints (the row's norm and its projection on a random vector, in float64), so only one
pass's gradients are alive at a time. A row fails when a fingerprint differs by more than a
relative tolerance set by the lowest precision in the graph: 1e-5 for float32/64, 2e-2 for
float16 (and float32 on CUDA with TF32 allowed), 5e-2 for bfloat16. Exactness holds op by op,
but a non-deterministic kernel (or CPU flash attention in float16) perturbs a value by one
rounding, which a later low-precision op can turn into a flip of its last bit; mixing changes
rows by a factor of the weights' ratios (≥ 2), far above these tolerances. Float16 also loses
exactness in its subnormal range, so when it is involved both passes are first scaled by a
common 2^s (as a GradScaler would: the largest compared entry near 2^11, s lowered while that
overflows) and the weights only scale down. When the weighted pass overflows where the plain one
does not, it is repeated with smaller, then negative, exponents; rows that are not finite in the
plain pass are not compared (such samples are dropped or rejected by the engine anyway), and the
signature then stays unprobed, to be probed again at its next forward.

**When it runs.** A forward pre-hook on the root module computes an *input signature* (training
flag, shapes with the batch size replaced by -1, dtypes and devices of the tensor arguments, the
values of bool/str/None arguments and the types of other ones) — attribute reads only, no tensor
op. For a signature not probed yet (with grad enabled), every floating tensor argument whose size
along the batch dimension is the batch size (the size of the first tensor argument there) and
that does not require grad is replaced by ``leaf.clone()`` with ``leaf = x.detach()
.requires_grad_()`` (a non-leaf copy, so the model may still change it in place), and the probe
is *pending*. :meth:`SeparabilityProbe.check` (per-sample losses) or
:meth:`SeparabilityProbe.check_outputs` (a random cotangent on the model's outputs) then runs
the comparison once and records the signature as probed (an LRU of 256 signatures, so models
with changing shapes are probed per shape without unbounded memory). Nothing runs afterwards
while the signature stays the same. A batch of one sample cannot show mixing: it leaves the
signature unprobed.

**When it fails** a diagnostic pass (cost irrelevant) hooks every autograd node between the loss
and the offending tensor, repeats both passes with per-node fingerprints, and names the node(s)
whose incoming gradients are still per-sample but whose outgoing ones are not ("mean over dim 0
(MeanBackward1)"). :class:`BatchMixingError` names the layer, the op and what to change.

Limits:

* Mixing is seen only where gradients flow. Integer inputs (token ids) cannot be made
  differentiable: mixing done on them before the first recorded layer (``ids.flip(0)`` or
  ``ids[perm]`` ahead of the Embedding) is not seen. Likewise mixing through detached values
  (``h * h.detach().mean(0)``), through non-float data, or through model state (buffers
  updated in the forward) is invisible to autograd.
* Models whose forward has no float per-sample input (token ids only) cannot tell the probe
  which pending forward a loss came from: a forward that never reaches a loss (an evaluation
  forward with grad enabled) is then marked probed together with the next checked one.
* :meth:`SeparabilityProbe.check_outputs` starts from the model's outputs: mixing inside the
  user's loss function (``loss.flip(0)``) and auxiliary outputs that are not per-sample (a
  scalar load-balancing loss) are not seen there.
* A float tensor argument whose size along the batch dimension equals the batch size is taken as
  per-sample data (as the engine's tracer does): a constant shared by all samples that happens to
  have that size (a ``(T, T)`` float attention mask with T = B) is reported as mixed.
* Tensor hooks that the user registered on intermediate tensors run during the probe's backward
  passes (the engine's own recording hooks are switched off by the engine around the probe).
"""
from __future__ import annotations

import math
import os
import re
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from ..capture.fallback import replaying

#: probed input signatures kept (least recently used dropped first), as ``hooks.py`` caps dims
MAX_SIGNATURES = 256
#: forwards with an unprobed signature remembered until the next check (the most recent ones)
MAX_PENDING = 8
#: probes of one signature that may end without a verdict (a point whose gradient reached fewer than
#: two samples, or rows that were not finite) before the signature is accepted with a warning
MAX_SILENT_PROBES = 8
#: relative tolerance of the row comparison by the lowest precision in the graph (default:
#: DEFAULT_TOLERANCE); float32 on CUDA with TF32 allowed counts as float16 (same mantissa)
TOLERANCES = {torch.float16: 2e-2, torch.bfloat16: 5e-2}
DEFAULT_TOLERANCE = 1e-5
#: float64 elements converted at a time by a fingerprint
_CHUNK = 1 << 24
#: absolute floor of the comparison, relative to the tensor's largest row (subnormal rounding)
_FLOOR = 1e-3
#: exponent ranges ``(lo, hi)`` of the weights 2^e, tried in turn while the weighted pass
#: overflows (float16: both passes are scaled up first, the weights only scale down)
_RANGES_WIDE = ((0, 15), (0, 4), (-4, 0))
_RANGES_FP16 = ((-4, 0),)

_ADVICE = (
    "Per-sample clipping bounds each sample's influence only if every op acts on each sample "
    "(row of dim 0) separately: no reductions, sorting, flipping or softmax over the batch "
    "dimension; inputs must be batch-first; the loss vector's entry i must be sample i's loss."
)


class BatchMixingError(ValueError):
    """The model (or its loss) mixes samples: per-sample clipping would not bound a sample's
    influence. The message names the layer (or model input) and the op that mixes rows."""


@dataclass
class _Forward:
    """One forward pass with an unprobed input signature."""

    signature: tuple
    batch_size: Optional[int]
    #: ``[(name, tensor)]``: the differentiable per-sample inputs (our leaves, or the user's)
    inputs: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    #: autograd nodes of those inputs as the model sees them (to tell whether a loss reaches them)
    nodes: List[object] = field(default_factory=list)


@dataclass
class _Point:
    """A tensor at which rows are compared: a recorded output edge or a model input."""

    name: str
    target: object  # GradientEdge or tensor, as handed to torch.autograd.grad
    node: object  # autograd node whose incoming gradient (or the leaf's) is compared
    order: int  # larger: created later in the forward (closer to the loss); inputs: -1
    #: candidate batch dimensions: the rows are per-sample along one of them (after ``shape``)
    dims: Tuple[int, ...] = (0,)
    #: the logical shape to view the gradient in (a recorded output's shape when the edge is
    #: that of its flat base), or None
    shape: Optional[tuple] = None
    is_input: bool = False


@dataclass
class _Print:
    """Per-row fingerprint of one gradient: norms and a random projection (in float64)."""

    norm: torch.Tensor
    proj: torch.Tensor
    finite: torch.Tensor
    k: int
    dtype: torch.dtype
    amax: float  # largest finite |entry|


def _tensor_sig(t: torch.Tensor, bd: int, B: Optional[int]) -> tuple:
    shape = tuple(t.shape)
    if B is not None and len(shape) > bd and shape[bd] == B:
        shape = shape[:bd] + (-1,) + shape[bd + 1:]
    return (shape, t.dtype, t.device, t.requires_grad)


def _sig(value, bd: int, B: Optional[int], depth: int = 0):
    """Hashable signature of one argument (tensors by metadata only; no tensor op)."""
    if isinstance(value, torch.Tensor):
        return _tensor_sig(value, bd, B)
    if depth < 3 and isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_sig(v, bd, B, depth + 1) for v in value)
    if depth < 3 and isinstance(value, dict):
        return ("dict",) + tuple((k, _sig(v, bd, B, depth + 1)) for k, v in value.items())
    if value is None or isinstance(value, (bool, str)):
        return value
    return type(value).__name__


def _first_batch(value, bd: int, depth: int = 0) -> Optional[int]:
    """Size along ``bd`` of the first tensor argument that has that dimension."""
    if isinstance(value, torch.Tensor):
        return value.shape[bd] if value.dim() > bd else None
    if depth < 3 and isinstance(value, (list, tuple, dict)):
        for v in (value.values() if isinstance(value, dict) else value):
            B = _first_batch(v, bd, depth + 1)
            if B is not None:
                return B
    return None


def _rows_of(g: torch.Tensor, B: int, bd: int) -> Optional[Tuple[torch.Tensor, int]]:
    """``(g as (rows, -1) with the batch dimension first, k)`` or None when rows are not k·B."""
    if not g.is_floating_point() or g.dim() <= bd or B <= 0:
        return None
    if bd:
        g = g.movedim(bd, 0)
    rows = g.shape[0]
    if rows == 0 or rows % B:
        return None
    return g.reshape(rows, -1), rows // B


def _is_batched(g: Optional[torch.Tensor], B: int, bd: int) -> bool:
    """Heuristic of the diagnostic pass: a gradient is per-sample along ``bd`` when its size
    there is k·B (k == 1 for a 1-D tensor: a reduced ``(d,)`` tensor with d a multiple of B is
    not)."""
    if g is None or not g.is_floating_point() or g.dim() <= bd:
        return False
    rows = g.shape[bd]
    return rows > 0 and rows % B == 0 and (g.dim() > 1 or rows == B)


class _Fingerprints:
    """Random projection vectors shared by both passes of one comparison."""

    def __init__(self, gen: torch.Generator):
        self.gen = gen
        self.vectors: Dict[tuple, torch.Tensor] = {}

    def __call__(self, g: Optional[torch.Tensor], B: int, bd: int = 0,
                 shape: Optional[tuple] = None) -> Optional[_Print]:
        if g is None:
            return None
        g = g.detach()
        if shape is not None and g.numel() == math.prod(shape):
            g = g.reshape(shape)
        rk = _rows_of(g, B, bd)
        if rk is None:
            return None
        x, k = rk
        # in float32 (float64 stays), without a copy of a float32 gradient: a float64 copy of every
        # compared gradient would be a large transient (and, through the allocator's caching, a
        # lasting one); scaling by a power of two stays exact in float32 too. Rows whose norm
        # overflows float32 (|x| > 1.8e19) read as not finite: not compared, probed again later
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        key = (x.shape[1], x.device, work)
        u = self.vectors.get(key)
        if u is None:
            u = torch.randn(x.shape[1], generator=self.gen, dtype=torch.float64)
            u = self.vectors[key] = u.to(device=x.device, dtype=work)
        low = None if x.dtype == work else work
        row_max = torch.linalg.vector_norm(x, ord=float("inf"), dim=1, dtype=low).double()
        finite_max = row_max[torch.isfinite(row_max)]
        amax = float(finite_max.max()) if finite_max.numel() else 0.0
        if work == torch.float32 and amax * math.sqrt(max(x.shape[1], 1)) > 1e18:
            # entries whose squares or sums overflow float32: bounded float64 copies instead
            norms, projs = [], []
            step = max(1, _CHUNK // max(x.shape[1], 1))
            u64 = u.double()
            for start in range(0, x.shape[0], step):
                c = x[start:start + step].double()
                norms.append(torch.linalg.vector_norm(c, dim=1))
                projs.append(c @ u64)
            norm, proj = torch.cat(norms), torch.cat(projs)
        else:
            norm = torch.linalg.vector_norm(x, dim=1, dtype=low).double()
            proj = (x.to(work) @ u).double()
        finite = torch.isfinite(norm) & torch.isfinite(proj)
        return _Print(norm, proj, finite, k, g.dtype, amax)


def _samples_reached(prints: Dict[int, "_Print"], B: int) -> int:
    """The most samples with a non-zero, finite gradient row at a point, over its layouts."""
    best = 0
    for q in prints.values():
        rows = (q.norm > 0) & q.finite
        best = max(best, int(rows.reshape(B, q.k).any(1).sum()))
    return best


def _compare(plain: _Print, weighted: _Print, r: torch.Tensor,
             tol: Optional[float] = None) -> Tuple[int, int, int]:
    """``(bad rows, compared rows, overflowed rows)`` of ``weighted`` against ``r·plain``.

    Row m (sample m // k) passes when ``|n_w − ρ n| ≤ τ ρ n + a`` and
    ``|p_w − ρ p| ≤ τ ρ n + a`` with ρ = r_{m//k}, n the row norm, p its projection, τ the
    tolerance (default: that of the gradient's dtype) and ``a = 1e-3·τ·max_m ρ n`` (an absolute
    floor for rows of subnormal size)."""
    rho = r.to(plain.norm.device, plain.norm.dtype).repeat_interleave(plain.k)
    ok = plain.finite & weighted.finite
    overflow = plain.finite & ~weighted.finite
    if tol is None:
        tol = TOLERANCES.get(plain.dtype, DEFAULT_TOLERANCE)
    scale = torch.where(ok, rho * plain.norm, torch.zeros_like(plain.norm))
    thr = tol * scale + _FLOOR * tol * scale.max()
    bad = ok & (((weighted.norm - rho * plain.norm).abs() > thr)
                | ((weighted.proj - rho * plain.proj).abs() > thr))
    counts = torch.stack([bad.sum(), ok.sum(), overflow.sum()]).tolist()
    return counts[0], counts[1], counts[2]


def _overflowed(plain: Optional[_Print], other: Optional[_Print]) -> int:
    """Rows finite in ``plain`` but not in ``other``."""
    if plain is None or other is None or plain.k != other.k:
        return 0
    return int((plain.finite & ~other.finite).sum())


_OP_NAMES = {
    "Mean": "mean", "Sum": "sum", "Nansum": "sum", "Prod": "product", "Softmax": "softmax",
    "LogSoftmax": "log_softmax", "Flip": "flip", "Roll": "roll", "Sort": "sort", "Topk": "topk",
    "Cumsum": "cumulative sum", "Cumprod": "cumulative product", "Logsumexp": "logsumexp",
    "Max": "max", "Min": "min", "Amax": "max", "Amin": "min", "Std": "std", "Var": "variance",
    "StdMean": "std/mean", "VarMean": "variance/mean", "Norm": "norm",
    "LinalgVectorNorm": "norm", "Transpose": "transpose", "Permute": "permute", "T": "transpose",
    "Index": "advanced indexing (x[idx])", "IndexSelect": "index_select", "Gather": "gather",
    "Median": "median", "Kthvalue": "kthvalue", "Mode": "mode",
    "NativeBatchNorm": "batch normalization (statistics over the batch)",
    "CudnnBatchNorm": "batch normalization (statistics over the batch)",
    "Mm": "matrix product", "Bmm": "batched matrix product", "Addmm": "matrix product",
    "View": "view/reshape", "UnsafeView": "view/reshape", "ReshapeAlias": "view/reshape",
    "Slice": "slice", "Select": "select", "Cat": "concatenation", "Stack": "stack",
    "Repeat": "repeat", "Expand": "expand", "Split": "split", "SplitWithSizes": "split",
    "Unbind": "unbind", "Narrow": "narrow", "Scatter": "scatter", "ScatterAdd": "scatter_add",
    "IndexAdd": "index_add", "IndexPut": "index_put", "MaskedScatter": "masked_scatter",
}
#: op names that usually mix samples; listed first among several candidates
_MIXERS = {"Mean", "Sum", "Nansum", "Prod", "Softmax", "LogSoftmax", "Flip", "Roll", "Sort", "Topk",
           "Cumsum", "Cumprod", "Logsumexp", "Max", "Min", "Amax", "Amin", "Std", "Var", "StdMean",
           "VarMean", "Norm", "LinalgVectorNorm", "Transpose", "Permute", "T", "Index",
           "IndexSelect", "Gather", "Median", "Kthvalue", "Mode", "NativeBatchNorm",
           "CudnnBatchNorm"}


def _base_name(node) -> str:
    return re.sub(r"Backward\d*$", "", type(node).__name__)


def _saved(node, attr):
    try:
        return getattr(node, attr, None)
    except RuntimeError:  # a saved value already freed
        return None


def describe_node(node) -> str:
    """Readable name of an autograd node's op, e.g. ``"mean over dim 0 (MeanBackward1)"``."""
    name = type(node).__name__
    base = _base_name(node)
    label = _OP_NAMES.get(base, base)
    detail = ""
    if base in ("Transpose",):
        d0, d1 = _saved(node, "_saved_dim0"), _saved(node, "_saved_dim1")
        if d0 is not None and d1 is not None:
            detail = f" of dims {d0} and {d1}"
    elif base == "Permute":
        dims = _saved(node, "_saved_dims")
        if dims is not None:
            detail = f" {tuple(dims)}"
    elif base == "Index":
        idx = _saved(node, "_saved_indices")
        if isinstance(idx, (list, tuple)):
            pos = next((i for i, t in enumerate(idx) if t is not None), None)
            if pos is not None:
                detail = f" along dim {pos}"
    else:
        dims = _saved(node, "_saved_dim")
        if dims is None:
            dims = _saved(node, "_saved_dims")
        if isinstance(dims, (list, tuple)) and len(dims) == 1:
            dims = dims[0]
        if isinstance(dims, int):
            detail = f" over dim {dims}"
        elif isinstance(dims, (list, tuple)) and dims:
            detail = f" over dims {tuple(dims)}"
    return f"{label}{detail} ({name})"


def _walk(roots: Sequence[object]) -> Tuple[List[object], Dict[object, list]]:
    """All autograd nodes reachable from ``roots`` (each once) and ``{node: [parents]}``."""
    seen, order, parents = set(), [], {}
    stack = [n for n in roots if n is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        for n, _ in node.next_functions:
            if n is not None:
                parents.setdefault(n, []).append(node)
                if n not in seen:
                    stack.append(n)
    return order, parents


def _ancestors(node, parents: Dict[object, list]) -> set:
    """``node`` and every node from which it is reachable."""
    found, stack = {node}, [node]
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p not in found:
                found.add(p)
                stack.append(p)
    return found


def _graph_dtypes(nodes) -> set:
    """Dtypes of the gradients that the autograd nodes ``nodes`` receive (private autograd
    metadata; an empty set where this torch does not expose it)."""
    found = set()
    try:
        for node in nodes:
            for meta in node._input_metadata:
                found.add(meta.dtype)
    except (AttributeError, RuntimeError, TypeError):
        pass
    return found


def _tf32(roots) -> bool:
    """True when float32 matmuls or convolutions on CUDA may round their inputs to TF32 (a
    rounding flip after a non-deterministic kernel then shows at float16-like precision)."""
    if not any(t.is_cuda for t in roots):
        return False
    return bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)


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
            enter the signature unnormalised (each batch size is probed once).
    """

    def __init__(self, model: nn.Module, *, batch_dim: Optional[int] = 0):
        self.model = model
        self.batch_dim = batch_dim
        self._probed: "OrderedDict[tuple, None]" = OrderedDict()
        #: probes without a verdict so far, per signature (see MAX_SILENT_PROBES)
        self._silent: Dict[tuple, int] = {}
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
        """True when a forward with an unprobed input signature ran since the last check."""
        return bool(self._pending)

    def _pre(self, module, args, kwargs):
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or replaying():
            return None
        bd = self.batch_dim
        B = None if bd is None else _first_batch(args, bd)
        if B is None and kwargs and bd is not None:
            B = _first_batch(kwargs, bd)
        sig = (module.training, bd, _sig(args, bd, B), _sig(kwargs, bd, B) if kwargs else ())
        if sig in self._probed:
            self._probed.move_to_end(sig)
            return None
        fwd = _Forward(signature=sig, batch_size=B)
        memo: Dict[int, torch.Tensor] = {}
        new_args = self._arm(args, "args", fwd, memo, 0)
        new_kwargs = {k: self._arm(v, str(k), fwd, memo, 0) for k, v in kwargs.items()}
        self._pending.append(fwd)
        return new_args, new_kwargs

    def _arm(self, value, name: str, fwd: _Forward, memo: Dict[int, torch.Tensor], depth: int):
        """``value`` with its per-sample float tensors replaced by differentiable copies."""
        if isinstance(value, torch.Tensor):
            B, bd = fwd.batch_size, self.batch_dim
            if bd is None:  # layout unknown: every float tensor (compared along dim 0 or 1)
                if not (value.is_floating_point() and value.dim() > 0):
                    return value
            elif not (value.is_floating_point() and value.dim() > bd and value.shape[bd] == B
                      and B is not None):
                return value
            if id(value) in memo:
                return memo[id(value)]
            if value.requires_grad:  # the user's own differentiable input: compared as it is
                fwd.inputs.append((name, value))
                fwd.nodes.append(get_gradient_edge(value).node)
                memo[id(value)] = value
                return value
            leaf = value.detach().requires_grad_()
            copy = leaf.clone()
            fwd.inputs.append((name, leaf))
            fwd.nodes.append(copy.grad_fn)
            memo[id(value)] = copy
            return copy
        if depth < 3 and isinstance(value, (list, tuple)):
            out = [self._arm(v, f"{name}[{i}]", fwd, memo, depth + 1) for i, v in enumerate(value)]
            if isinstance(value, tuple):
                return type(value)(*out) if hasattr(value, "_fields") else tuple(out)
            return out
        if depth < 3 and isinstance(value, dict):
            return {k: self._arm(v, f"{name}[{k!r}]", fwd, memo, depth + 1)
                    for k, v in value.items()}
        return value

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
        inputs and records the input signature(s) as probed; raises :class:`BatchMixingError`
        naming the offending target closest to the loss and the autograd op(s) that mix rows.
        Does nothing when no probe is pending.
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
        _collect(outputs, tensors, 0)
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
        if not root_nodes:
            return
        reached = self._reached(forwards, root_nodes)
        if not reached or B < 2:  # nothing of these forwards in this graph / one sample
            return
        points = _points(targets)
        input_dims = (0, 1) if self.batch_dim is None else (self.batch_dim,)
        for f in reached:
            for name, x in f.inputs:
                points.append(_Point(f"model input {name}", x, get_gradient_edge(x).node, -1,
                                     input_dims, None, True))
        layouts = sorted(set(layouts).union(*(p.dims for p in points)))
        if points:
            bad, complete, silent = self._compare_all(roots, cotangents, B, points)
            if bad:
                raise self._error(roots, cotangents, B, bad, layouts)
            if not complete or silent:
                # no verdict: a batch can hide mixing (a sample that saturates a softmax over the
                # batch zeroes every other row's gradient; a NaN spreads to every row), so the
                # signature is probed again on the next batches, and accepted only after
                # MAX_SILENT_PROBES such probes (a layer whose gradient never reaches two samples)
                sigs = {f.signature for f in reached}
                tries = max(self._silent.get(sig, 0) for sig in sigs) + 1
                if tries < MAX_SILENT_PROBES:
                    for sig in sigs:
                        self._silent[sig] = tries
                    return
                warnings.warn(
                    f"the separability probe could not compare samples at {sorted(set(silent))} "
                    f"in {MAX_SILENT_PROBES} batches (the gradient there reached fewer than two "
                    "samples, or was not finite): mixing of samples there is not ruled out.",
                    RuntimeWarning, stacklevel=4)
        for f in reached:
            self._silent.pop(f.signature, None)
            self._probed[f.signature] = None
            self._probed.move_to_end(f.signature)
        while len(self._probed) > MAX_SIGNATURES:
            self._probed.popitem(last=False)

    @staticmethod
    def _reached(forwards: List[_Forward], root_nodes) -> List[_Forward]:
        """The pending forwards whose inputs the roots depend on (those without differentiable
        inputs cannot be told apart: they count as reached)."""
        wanted = {n for f in forwards for n in f.nodes if n is not None}
        found = set()
        if wanted:
            seen, stack = set(), list(root_nodes)
            while stack and len(found) < len(wanted):
                node = stack.pop()
                if node in seen:
                    continue
                seen.add(node)
                if node in wanted:
                    found.add(node)
                stack.extend(n for n, _ in node.next_functions if n is not None and n not in seen)
        return [f for f in forwards if not f.nodes or any(n in found for n in f.nodes)]

    def _weights(self, B: int, lo: int, hi: int) -> torch.Tensor:
        """``2^{e_j}`` with ``e`` a random arrangement of ``lo + (j mod (hi - lo + 1))``."""
        levels = hi - lo + 1
        e = (torch.arange(B) % levels)[torch.randperm(B, generator=self._gen)] + lo
        return torch.pow(2.0, e.double())

    def _compare_all(self, roots, cotangents, B: int, points: List[_Point]):
        """``([(point, bad rows, compared rows)] of the points whose rows disagree, complete)``;
        ``complete`` is False when some rows could not be compared (not finite).

        The tolerance follows the lowest precision among the gradients of the graph (autograd's
        input metadata), the compared gradients and the roots. Float16 gradients lose the
        exactness of the scaling in their subnormal range (|g| < 6.1e-5): when float16 is
        involved, both passes are scaled by a common 2^s (as a GradScaler would) that brings the
        largest compared entry to about 2^11 (s ≥ 0; lowered by 4 while the scaled pass
        overflows), and the sample weights are 2^e with e ≤ 0, so the weighted pass cannot
        overflow where the plain one did not."""
        fp = _Fingerprints(self._gen)
        # autograd is asked only for the model inputs and the points with no other point below
        # them; the others are fingerprinted by a pre-hook on their node as the backward passes
        # through, so their gradients are freed as in an ordinary backward (asking for every
        # point would hold all of them at once: a peak of one more activation per layer)
        asked = _leading(points, [t.grad_fn for t in roots])

        def prints(weights):
            out: List[Optional[dict]] = [None] * len(points)

            def record(i, g):
                p = points[i]
                per_dim = {d: fp(g, B, d, p.shape) for d in p.dims}
                out[i] = {d: q for d, q in per_dim.items() if q is not None}

            def hook_for(i):
                nr = getattr(points[i].target, "output_nr", 0)

                def hook(grad_outputs):
                    if out[i] is None and nr < len(grad_outputs):
                        record(i, grad_outputs[nr])
                return hook

            handles = [points[i].node.register_prehook(hook_for(i))
                       for i in range(len(points)) if i not in asked]
            try:
                idx = sorted(asked)
                grads = list(torch.autograd.grad(roots, [points[i].target for i in idx],
                                                 cotangents(weights), retain_graph=True,
                                                 allow_unused=True))
            finally:
                for h in handles:
                    h.remove()
            for k, i in enumerate(idx):
                record(i, grads[k])
                grads[k] = None
            return [q if q is not None else {} for q in out]

        ones = torch.ones(B, dtype=torch.float64)
        plain = prints(ones)
        scale = 1.0
        dtypes = _graph_dtypes(_walk([t.grad_fn for t in roots])[0])
        dtypes |= {q.dtype for qs in plain for q in qs.values()} | {t.dtype for t in roots}
        # one rounding flip in a low-precision op shows downstream at its precision
        tol = max(TOLERANCES.get(dt, DEFAULT_TOLERANCE) for dt in dtypes)
        if _tf32(roots):
            tol = max(tol, TOLERANCES[torch.float16])
        if torch.float16 in dtypes:
            ranges = _RANGES_FP16
            amax = max((q.amax for qs in plain for q in qs.values()), default=0.0)
            shift = min(int(math.floor(math.log2(2.0 ** 11 / amax))), 24) if amax else 0
            while shift > 0:
                scaled = prints(ones * 2.0 ** shift)
                if sum(_overflowed(q0.get(d), q1.get(d)) for q0, q1 in zip(plain, scaled)
                       for d in q0) == 0:
                    plain, scale = scaled, 2.0 ** shift
                    break
                shift -= 4
        else:
            ranges = _RANGES_WIDE
        results: list = []
        overflow = 0
        for lo, hi in ranges:
            r = self._weights(B, lo, hi)
            self._last = (scale, r, tol)
            weighted = prints(r * scale)
            results, overflow = [], 0
            for p, q0, q1 in zip(points, plain, weighted):
                # per candidate layout; the point is per-sample when it is so along one of them
                verdicts = [_compare(q0[d], q1[d], r, tol) for d in q0
                            if d in q1 and q0[d].k == q1[d].k]
                if not verdicts:
                    continue
                passed = [v for v in verdicts if v[0] == 0]
                overflow += sum(v[2] for v in (passed or verdicts))
                if not passed:
                    nbad, ncmp, _ = min(verdicts)
                    results.append((p, nbad, ncmp))
            if not overflow:
                break
        # rows that could not be compared (not finite): the signature is probed again next time
        complete = not overflow and all(bool(q.finite.all()) for qs in plain for q in qs.values())
        # points whose gradient reached fewer than two samples show nothing about mixing
        silent = [p.name for p, qs in zip(points, plain) if _samples_reached(qs, B) < 2]
        return results, complete, silent

    # -- diagnosis ----------------------------------------------------------------------------
    def _error(self, roots, cotangents, B: int, bad, layouts) -> BatchMixingError:
        """The error for the offending point closest to the loss, with the op(s) that mix."""
        bad = sorted(bad, key=lambda t: t[0].order)
        point, nbad, ncmp = bad[-1]
        scale, r, tol = self._last
        try:
            ops = self._diagnose(roots, cotangents, B, point, scale, r, tol, layouts)
        except Exception:  # the diagnosis is a courtesy: never hide the finding behind it
            ops = []
        where = (f"{point.name}" if point.is_input else f"layer {point.name}")
        if ops:
            found = "; ".join(ops)
            op_text = f"the op(s) mixing rows between it and the loss: {found}"
        else:
            op_text = "the op that mixes rows could not be located"
        others = [p.name for p, _, _ in bad[:-1]]
        also = f" (also seen at: {', '.join(others[-5:])})" if others else ""
        before = " (before the first clipped layer)" if point.is_input else ""
        return BatchMixingError(
            f"the model mixes samples: the gradient reaching {where}{before} is not per sample "
            f"({nbad} of {ncmp} rows of a batch of {B} change when the samples' losses are "
            f"weighted differently){also}; {op_text}. {_ADVICE}"
        )

    def _diagnose(self, roots, cotangents, B: int, point: _Point, scale: float, r, tol: float,
                  layouts) -> List[str]:
        """Names of the nodes between the roots and ``point`` whose incoming gradients are
        per-sample and whose outgoing ones (towards ``point``) are not.

        ``layouts``: the dimensions that may hold the batch (0, and the inputs' or outputs'
        batch dimension): a gradient is per-sample when it is so along one of them, mixed when
        it is per-sample along none but has k·B rows along one."""
        target_node = point.node
        nodes, parents = _walk([t.grad_fn for t in roots])
        leads = _ancestors(target_node, parents)  # nodes from which target_node is reachable
        fp = _Fingerprints(self._gen)
        records: Dict[object, list] = {}
        handles = []

        def prints(g):
            return {bd: fp(g, B, bd) for bd in layouts if _is_batched(g, B, bd)} or None

        def make_hook(node):
            towards = [n is not None and n in leads for n, _ in node.next_functions]

            def hook(grad_inputs, grad_outputs):
                ins = [prints(g) if i < len(towards) and towards[i] else None
                       for i, g in enumerate(grad_inputs)]
                outs = [prints(g) for g in grad_outputs]
                records.setdefault(node, []).append((ins, outs))

            return hook

        try:
            for node in nodes:
                if node is target_node or node not in leads or hasattr(node, "variable"):
                    continue
                handles.append(node.register_hook(make_hook(node)))
            ones = torch.ones(B, dtype=torch.float64)
            for weights in (ones * scale, r * scale):  # the passes of the failed comparison
                torch.autograd.grad(roots, [point.target], cotangents(weights),
                                    retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()

        def consistent(a: Optional[dict], b: Optional[dict]) -> Optional[bool]:
            """True: per-sample along some layout; False: along none; None: no k·B rows."""
            verdicts = [_compare(a[bd], b[bd], r, tol)[0] == 0 for bd in (a or {})
                        if a[bd] is not None and b and b.get(bd) is not None
                        and a[bd].k == b[bd].k]
            return any(verdicts) if verdicts else None

        mixed_in, mixed_out = {}, {}  # node -> incoming / outgoing gradients not per sample
        for node, recs in records.items():
            if len(recs) != 2:
                continue
            (ins0, outs0), (ins1, outs1) = recs
            mixed_in[node] = any(consistent(a, b) is False for a, b in zip(outs0, outs1))
            mixed_out[node] = [i for i, (a, b) in enumerate(zip(ins0, ins1))
                               if consistent(a, b) is False]
        culprits = []
        for node in records:
            if mixed_in.get(node, True) or not mixed_out.get(node):
                continue
            if _base_name(node) not in _MIXERS:
                # a reduced tensor whose size happens to be a multiple of B (h.mean(0) with
                # d = B) looks per-sample: the mixer is then the node it flows into
                nxt = [node.next_functions[i][0] for i in mixed_out[node]]
                nxt = [n for n in nxt if n is not None and _base_name(n) in _MIXERS
                       and mixed_out.get(n)]
                if nxt:
                    node = nxt[0]
            if node not in culprits:
                culprits.append(node)
        culprits.sort(key=lambda n: (_base_name(n) in _MIXERS, n._sequence_nr()), reverse=True)
        names: List[str] = []
        for n in culprits:
            text = describe_node(n)
            if text not in names:
                names.append(text)
        return names[:3]


def _collect(value, out: list, depth: int) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif depth < 4 and isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for v in value.values():
            _collect(v, out, depth + 1)
    elif depth < 4 and hasattr(value, "__dataclass_fields__"):  # model-output dataclasses
        for name in value.__dataclass_fields__:
            _collect(getattr(value, name, None), out, depth + 1)


def _leading(points: List["_Point"], roots) -> set:
    """Indices of the points autograd must be asked for: model inputs, and recorded points with no
    other point below them in the graph (the backward then runs through every other point)."""
    nodes = {p.node for p in points}
    below: Dict[object, bool] = {}
    stack = [(n, False) for n in roots if n is not None]
    entered = set()
    while stack:
        node, done = stack.pop()
        kids = [n for n, _ in node.next_functions if n is not None]
        if done:
            below[node] = any(k in nodes or below.get(k, False) for k in kids)
            continue
        if node in entered:
            continue
        entered.add(node)
        stack.append((node, True))
        stack.extend((k, False) for k in kids if k not in entered)
    return {i for i, p in enumerate(points) if p.is_input or not below.get(p.node, False)}


def _points(targets) -> List[_Point]:
    """Comparison points from ``targets``: ``(name, edge)``, ``(name, edge, batch_dim)`` or
    ``(name, edge, batch_dim, shape)`` with ``edge`` a GradientEdge or a tensor, ``batch_dim``
    an int (default 0) or None (per-sample along dim 0 or 1: a layout the caller does not know)
    and ``shape`` the logical shape of the gradient (the recorded output's shape when ``edge``
    is that of its flat base)."""
    points = []
    for spec in targets:
        name, t = spec[0], spec[1]
        bd = spec[2] if len(spec) > 2 else 0
        shape = tuple(spec[3]) if len(spec) > 3 and spec[3] is not None else None
        if isinstance(t, torch.Tensor):
            if not t.requires_grad:
                continue
            node = get_gradient_edge(t).node
        else:
            node = getattr(t, "node", None)
            if node is None:
                continue
        try:
            order = node._sequence_nr()
        except (AttributeError, RuntimeError):
            order = 0
        dims = (0, 1) if bd is None else (int(bd),)
        points.append(_Point(str(name), t, node, order, dims, shape))
    return points
