"""What the separability probe says when samples mix: a diagnostic pass that names the autograd
op(s) whose incoming gradients are per-sample but whose outgoing ones are not, readable names of
autograd ops, and :class:`BatchMixingError`."""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

import torch

from .fingerprints import Fingerprints, compare_rows, is_batched
from .graph import ComparisonPoint, ancestors, walk_graph

_ADVICE = (
    "Per-sample clipping bounds each sample's influence only if every op acts on each sample "
    "(row of dim 0) separately: no reductions, sorting, flipping or softmax over the batch "
    "dimension; inputs must be batch-first; the loss vector's entry i must be sample i's loss."
)


class BatchMixingError(ValueError):
    """The model (or its loss) mixes samples: per-sample clipping would not bound a sample's
    influence. The message names the layer (or model input) and the op that mixes rows."""


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


def mixing_error(gen: torch.Generator, roots, cotangents, B: int, bad, layouts,
                 weights: Tuple[float, torch.Tensor, float]) -> BatchMixingError:
    """The error for the offending point closest to the loss, with the op(s) that mix
    (``weights``: the ``(scale, r, tol)`` of the failed comparison)."""
    bad = sorted(bad, key=lambda t: t[0].order)
    point, nbad, ncmp = bad[-1]
    scale, r, tol = weights
    try:
        ops = diagnose(gen, roots, cotangents, B, point, scale, r, tol, layouts)
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


def diagnose(gen: torch.Generator, roots, cotangents, B: int, point: ComparisonPoint,
             scale: float, r, tol: float, layouts) -> List[str]:
    """Names of the nodes between the roots and ``point`` whose incoming gradients are
    per-sample and whose outgoing ones (towards ``point``) are not.

    ``layouts``: the dimensions that may hold the batch (0, and the inputs' or outputs'
    batch dimension): a gradient is per-sample when it is so along one of them, mixed when
    it is per-sample along none but has k·B rows along one."""
    target_node = point.node
    nodes, parents = walk_graph([t.grad_fn for t in roots])
    leads = ancestors(target_node, parents)  # nodes from which target_node is reachable
    fp = Fingerprints(gen)
    records: Dict[object, list] = {}
    handles = []

    def prints(g):
        return {bd: fp(g, B, bd) for bd in layouts if is_batched(g, B, bd)} or None

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
        verdicts = [compare_rows(a[bd], b[bd], r, tol)[0] == 0 for bd in (a or {})
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
