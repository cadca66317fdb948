"""The rule of each aten op: the tag of its outputs from the tags of its inputs.

A rule gets the tracker (for :meth:`tag`), the op, its arguments and its outputs, and returns one
tag for all outputs or a list (one per output tensor); it raises :class:`Mix` naming how the op
mixes samples. Rules see no :class:`Mixed` input (the tracker propagates those), except the
value-free ones (``zeros_like``, ``fill_``), whose outputs take no value from their inputs.
Pointwise ops (``torch.Tag.pointwise``) need no entry: :func:`pointwise` aligns their operands.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .tags import Iota, Mix, Rows, Summed, broadcast_shapes, dims_arg, join, norm_dim, reshape_rows

aten = torch.ops.aten
Tag = Any


def flat_tensors(obj) -> List[torch.Tensor]:
    """The tensors of nested lists, tuples and mappings, in order (a flat tuple of arguments,
    the common case, in one pass)."""
    out: List[torch.Tensor] = []
    for o in (obj if type(obj) is tuple else (obj,)):
        if isinstance(o, _Tensor):
            out.append(o)
        elif o is None or type(o) in _SCALARS:
            continue
        elif isinstance(o, (list, tuple)):  # its elements in place (sizes: no tensor)
            for e in o:
                if isinstance(e, _Tensor):
                    out.append(e)
                elif not (e is None or type(e) in _SCALARS):
                    out.extend(flat_tensors(e))
        elif isinstance(o, Mapping):
            out.extend(flat_tensors(tuple(o.values())))
    return out


_Tensor = torch.Tensor
_SCALARS = {int, float, bool, str, torch.dtype, torch.device, torch.memory_format, torch.layout}


def inputs_of(args, kwargs) -> List[torch.Tensor]:
    """The tensors among an op's arguments."""
    return flat_tensors(args) + flat_tensors(tuple(kwargs.values())) if kwargs else \
        flat_tensors(args)


def written(func, args, kwargs) -> List[torch.Tensor]:
    """The tensors an in-place or ``out=`` op writes (its schema's write aliases)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.extend(flat_tensors(args[i] if i < len(args) else kwargs.get(a.name)))
    return out


#: factories whose values are set by position (an arange, a grid): along the batch dimension they
#: would weigh samples by how many come before them
POSITIONAL = {aten.arange, aten.linspace, aten.logspace}


class OpInfo:
    """What the tracker reads of an op overload, read once per overload: its packet, rule,
    whether ATen tags it pointwise, whether its schema writes an argument, and its arguments'
    positions and defaults by name."""

    __slots__ = ("func", "packet", "rule", "value_free", "pointwise", "mutable", "args", "fast",
                 "positional")

    def __init__(self, func):
        self.func = func
        self.packet = func.overloadpacket
        self.rule = RULES.get(self.packet)
        self.value_free = self.rule in VALUE_FREE
        self.pointwise = torch.Tag.pointwise in func.tags
        self.mutable = func._schema.is_mutable
        #: a factory whose values are set by position (``arange``, ``linspace``, ``logspace``)
        self.positional = self.packet in POSITIONAL
        self.args: Dict[str, Tuple[int, bool, Any]] = {
            a.name: (i, a.has_default_value(), a.default_value if a.has_default_value() else None)
            for i, a in enumerate(func._schema.arguments)}
        #: the rule the tracker runs on the tags it read already, for one output tensor
        self.fast = (IDENTITY if self.rule is identity else VIEW if self.rule is view
                     else POINTWISE if self.rule is pointwise or (self.rule is None
                                                                  and self.pointwise)
                     else ADDMM if self.rule is addmm
                     else LAYER_NORM if self.rule is layer_norm else 0)


#: ``OpInfo.fast``: :func:`identity` on one input, :func:`view` on one input's rows,
#: :func:`pointwise`, :func:`addmm` on three positional tensors, :func:`layer_norm` on input,
#: weight and bias given by position
IDENTITY, VIEW, POINTWISE, ADDMM, LAYER_NORM = 1, 2, 3, 4, 5

#: ``id(op overload) → OpInfo`` (an overload's ``__hash__`` runs Python; its ``id`` does not, and
#: every overload lives as long as the process: the entry keeps it)
_OPS: Dict[int, OpInfo] = {}


def op_info(func) -> OpInfo:
    """The :class:`OpInfo` of ``func``, built at its first call."""
    info = _OPS.get(id(func))
    if info is None or info.func is not func:
        info = _OPS[id(func)] = OpInfo(func)
    return info


def arg(func, args, kwargs, name: str, default=None):
    """Argument ``name`` of the call, by the op's schema (its default when not given); the
    schema's positions are read once per op."""
    info = _OPS.get(id(func))
    if info is None or info.func is not func:
        info = op_info(func)
    slot = info.args.get(name)
    if slot is None:
        return default
    i, has_default, value = slot
    if i < len(args):
        return args[i]
    if name in kwargs:
        return kwargs[name]
    return value if has_default else default


def _out(out) -> torch.Tensor:
    return flat_tensors(out)[0]


def _rows(tag: Tag) -> Optional[Rows]:
    return tag if isinstance(tag, Rows) else None


def aligned(pairs, shape: Sequence[int], flow=None) -> Tag:
    """The rows of an elementwise result of shape ``shape`` from operands ``[(tensor, tag)]``
    broadcast to it: every tagged operand's batch dimension lands on the same output dim, with
    its full length (a broadcast single row would spread one sample over the batch). Values set
    by position (:class:`Iota`) that land on the batch dimension weigh each sample by how many
    come before it: they mix. An ``arange`` through arithmetic is no longer exact."""
    rows: Tag = None
    n = len(shape)
    positions: List[int] = []
    iota: Tag = None
    for t, tag in pairs:
        if isinstance(tag, Iota):
            if t.dim():
                d = tag.dim + n - t.dim()
                positions.append(d)
                iota = Iota(d, False) if iota is None or iota.dim == d else None
            continue
        if not isinstance(tag, Rows):
            continue
        d = tag.dim + n - t.dim()
        if d < 0 or t.shape[tag.dim] != shape[d]:
            raise Mix("broadcasts one sample's row over the batch")
        rows = tag.at(d) if rows is None else join(rows, tag.at(d))
    if rows is None:
        return iota
    if rows.dim in positions and shape[rows.dim] > 1:
        raise Mix("weighs samples by their position in the batch")
    return rows


def pointwise(flow, func, args, kwargs, out) -> Tag:
    """Broadcasting elementwise op."""
    outs = flat_tensors(out)
    if not outs:
        return None
    tensors = inputs_of(args, kwargs)
    return aligned([(t, flow.tag(t)) for t in tensors], tuple(outs[0].shape), flow)


def _single(flow, args, kwargs) -> Tuple[torch.Tensor, Tag]:
    """The op's first tensor argument and its tag; per-sample data elsewhere mixes."""
    tensors = inputs_of(args, kwargs)
    tags = [flow.tag(t) for t in tensors]
    if any(isinstance(tag, Rows) for tag in tags[1:]):
        raise Mix("with per-sample data in an argument whose layout is not followed")
    return tensors[0], tags[0]


def _operands(flow, func, args, kwargs, names: Sequence[str]):
    vals = [arg(func, args, kwargs, n) for n in names]
    tags = [_rows(flow.tag(v)) if isinstance(v, torch.Tensor) else None for v in vals]
    return vals, tags


# -- values and views ---------------------------------------------------------------------------
def identity(flow, func, args, kwargs, out):
    return _single(flow, args, kwargs)[1]


def value_free(flow, func, args, kwargs, out):
    """Outputs that take only shapes, dtypes or devices from their inputs (``zeros_like``,
    ``new_empty``, metadata queries)."""
    return None


def view(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    o = _out(out)
    if isinstance(tag, Iota):
        return _iota_reshape(t, tag, o)
    if tag is None:
        return None
    r = reshape_rows(tuple(t.shape), tag, tuple(o.shape))
    if r is None:
        raise Mix("reshapes the batch dimension across several dimensions")
    return r


def _iota_reshape(t, tag: Iota, out) -> Tag:
    """An iota through a reshape that only adds or drops dims of size 1."""
    ins = [s for s in t.shape if s != 1]
    outs = [s for s in out.shape if s != 1]
    if ins != outs or len(ins) != 1:
        return None
    return Iota(next(i for i, s in enumerate(out.shape) if s != 1), tag.exact)


def expand(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    if tag is None:
        return None
    o = _out(out)
    d = tag.dim + o.dim() - t.dim()
    if isinstance(tag, Rows) and t.shape[tag.dim] != o.shape[d]:
        raise Mix("expands one sample's row over the batch")
    return tag._replace(dim=d)


def permute(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    if tag is None:
        return None
    dims = [norm_dim(d, t.dim()) for d in arg(func, args, kwargs, "dims")]
    return tag._replace(dim=dims.index(tag.dim))


def transpose(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    if tag is None:
        return None
    n = t.dim()
    if func.overloadpacket is aten.t:
        d0, d1 = 0, (1 if n == 2 else 0)
    else:
        d0 = norm_dim(arg(func, args, kwargs, "dim0"), n)
        d1 = norm_dim(arg(func, args, kwargs, "dim1"), n)
    d = d1 if tag.dim == d0 else d0 if tag.dim == d1 else tag.dim
    return tag._replace(dim=d)


def unsqueeze(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    if tag is None:
        return None
    d = norm_dim(arg(func, args, kwargs, "dim"), t.dim() + 1)
    return tag._replace(dim=tag.dim + (d <= tag.dim))


def squeeze(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    if tag is None:
        return None
    o = _out(out)
    if isinstance(tag, Iota):
        return _iota_reshape(t, tag, o)
    removed = [d for d in range(t.dim()) if t.shape[d] == 1][:t.dim() - o.dim()]
    dim = arg(func, args, kwargs, "dim")
    if dim is not None:
        dims = dim if isinstance(dim, (list, tuple)) else [dim]
        removed = [d for d in (norm_dim(x, t.dim()) for x in dims) if t.shape[d] == 1]
    if tag.dim in removed:
        raise Mix("squeezes a batch dimension of one row")
    return tag.at(tag.dim - sum(d < tag.dim for d in removed))


def slice_(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    if not isinstance(tag, Rows):
        return None
    dim = norm_dim(arg(func, args, kwargs, "dim", 0), t.dim())
    o = _out(out)
    if dim != tag.dim or o.shape[dim] == t.shape[dim]:
        return tag
    n = t.shape[dim]
    start = arg(func, args, kwargs, "start", 0) or 0
    step = arg(func, args, kwargs, "step", 1) or 1
    start = max(start + n, 0) if start < 0 else min(start, n)
    if step != 1 or start % tag.per or o.shape[dim] % tag.per:
        raise Mix("slices the batch dimension across samples' rows")
    return tag.shifted(start)


def select(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    if not isinstance(tag, Rows):
        return None
    dim = norm_dim(arg(func, args, kwargs, "dim"), t.dim())
    if dim == tag.dim:
        raise Mix("selects one row of the batch dimension")
    return tag.at(tag.dim - (dim < tag.dim))


def split(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    outs = flat_tensors(out)
    if not isinstance(tag, Rows):
        return [None] * len(outs)
    dim = norm_dim(arg(func, args, kwargs, "dim", 0), t.dim())
    if func.overloadpacket is aten.unbind:
        if dim == tag.dim:
            raise Mix("unbinds the batch dimension")
        return [tag.at(tag.dim - (dim < tag.dim))] * len(outs)
    if dim != tag.dim:
        return [tag] * len(outs)
    result, start = [], 0
    for o in outs:
        if start % tag.per or o.shape[dim] % tag.per:
            raise Mix("splits the batch dimension across samples' rows")
        result.append(tag.shifted(start))
        start += o.shape[dim]
    return result


def cat(flow, func, args, kwargs, out):
    tensors = [t for t in arg(func, args, kwargs, "tensors")
               if not (t.dim() == 1 and t.numel() == 0)]
    o = _out(out)
    tags = [_rows(flow.tag(t)) for t in tensors]
    rows = [tag for tag in tags if tag is not None]
    if not rows:
        return None
    if func.overloadpacket is aten.stack:
        dim = norm_dim(arg(func, args, kwargs, "dim", 0), o.dim())
        result = rows[0]
        for tag in rows[1:]:
            result = join(result, tag)
        return result.at(result.dim + (dim <= result.dim))
    dim = norm_dim(arg(func, args, kwargs, "dim", 0), o.dim())
    if all(tag.dim != dim for tag in rows):
        result = rows[0]
        for tag in rows[1:]:
            result = join(result, tag)
        for t, tag in zip(tensors, tags):
            if tag is None and t.shape[result.dim] != o.shape[result.dim]:
                raise Mix("concatenates along another dim tensors of unaligned batches")
        return result
    # along the batch dimension: part i starts at row s_i, its rows are its own shifted by −s_i
    result, start = None, 0
    for t, tag in zip(tensors, tags):
        if tag is not None:
            if tag.dim != dim or start % tag.per:
                raise Mix("concatenates along the batch dimension rows that do not line up")
            part = Rows(dim, tag.per, (tag.off - start // tag.per) % tag.mod, tag.mod)
            result = part if result is None else join(result, part)
        start += t.shape[dim]
    return result


def repeat(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    if not isinstance(tag, Rows):
        return None
    reps = list(arg(func, args, kwargs, "repeats"))
    d = tag.dim + len(reps) - t.dim()
    result = tag.at(d)
    if reps[d] == 1:
        return result
    n = t.shape[tag.dim]
    return join(result, result.shifted(n)) if n % tag.per == 0 else _raise(
        "repeats the batch dimension across samples' rows")


def _raise(what: str):
    raise Mix(what)


def repeat_interleave(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    if not isinstance(tag, Rows):
        return None
    dim = arg(func, args, kwargs, "dim")
    reps = arg(func, args, kwargs, "repeats")
    if dim is None or not isinstance(reps, int):
        raise Mix("repeats elements across the batch dimension")
    if norm_dim(dim, t.dim()) != tag.dim:
        return tag
    return Rows(tag.dim, tag.per * reps, tag.off, tag.mod)


def unfold(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    if not isinstance(tag, Rows):
        return None
    if norm_dim(arg(func, args, kwargs, "dimension"), t.dim()) == tag.dim:
        raise Mix("unfolds the batch dimension")
    return tag


# -- reductions and ops along a dim -------------------------------------------------------------
def reduce(flow, func, args, kwargs, out):
    """Reductions (``dim`` / ``keepdim``; no ``dim``: every dim)."""
    if func._overloadname in ("other", "binary_out"):  # max(a, b): elementwise
        return pointwise(flow, func, args, kwargs, out)
    t, tag = _single(flow, args, kwargs)
    if not isinstance(tag, Rows):
        return None
    dims = dims_arg(arg(func, args, kwargs, "dim"), t.dim())
    keep = bool(arg(func, args, kwargs, "keepdim", False))
    if dims is None or tag.dim in dims:
        if func.overloadpacket in _LINEAR_REDUCTIONS:
            return Summed(f"{func.overloadpacket.__name__} over the batch", tag.mod)
        raise Mix("reduces over the batch dimension")
    return tag if keep else tag.at(tag.dim - sum(x < tag.dim for x in dims))


_LINEAR_REDUCTIONS = {aten.sum, aten.mean, aten.nansum}


def along(flow, func, args, kwargs, out):
    """Ops acting along one ``dim`` (scans, sorts, softmax, top-k)."""
    t, tag = _single(flow, args, kwargs)
    if not isinstance(tag, Rows):
        return None
    if norm_dim(arg(func, args, kwargs, "dim", -1), t.dim()) == tag.dim:
        raise Mix("acts along the batch dimension")
    return tag


def flip_roll(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    if not isinstance(tag, Rows):
        return None
    dims = [norm_dim(d, t.dim()) for d in (arg(func, args, kwargs, "dims") or [])]
    if func.overloadpacket is aten.roll:
        if not dims:
            raise Mix("rolls the flattened tensor")
        shifts = list(arg(func, args, kwargs, "shifts"))
        if tag.dim in dims:
            k = shifts[dims.index(tag.dim)] % t.shape[tag.dim]
            n = t.shape[tag.dim]
            if k % tag.per or (n // tag.per) % tag.mod:
                raise Mix("rolls the batch dimension across samples")
            return tag.shifted(n - k)
        return tag
    if tag.dim in dims:
        raise Mix("flips the batch dimension")
    return tag


def last_dims(k: int) -> Callable:
    """Ops on the last ``k`` dims (spatial ops, pooling, triangular parts, decompositions)."""

    def rule(flow, func, args, kwargs, out):
        t, tag = _single(flow, args, kwargs)
        if not isinstance(tag, Rows):
            return None
        if tag.dim >= t.dim() - k:
            raise Mix("acts across the dimension that holds the batch")
        return tag

    return rule


def pad(flow, func, args, kwargs, out):
    t, tag = _single(flow, args, kwargs)
    if not isinstance(tag, Rows):
        return None
    if tag.dim >= t.dim() - len(arg(func, args, kwargs, "pad")) // 2 and \
            _out(out).shape[tag.dim] != t.shape[tag.dim]:
        raise Mix("pads the batch dimension")
    return tag


# -- linear algebra and layers ------------------------------------------------------------------
def _matmul(a, ta, b, tb, batched: bool) -> Tag:
    """``a @ b`` (``mm``: 2-D; ``bmm``: 3-D with a shared leading dim): a batch dimension on a
    kept dim stays; one on the contracted dim sums over samples."""
    lead = 1 if batched else 0
    result, contracted = None, []
    for tag, keep in ((ta, lead), (tb, lead + 1)):
        if tag is None:
            continue
        if not ((batched and tag.dim == 0) or tag.dim == keep):
            contracted.append(tag)
            continue
        result = tag if result is None else join(result, tag)
    if contracted:
        # Σ_j a_j b_j over the samples' rows: a sum of per-sample terms, unless a kept dim
        # carries samples too (then every output row mixes samples)
        if result is not None or (len(contracted) == 2 and contracted[0].dim != lead + 1):
            raise Mix("contracts the batch dimension (a matrix product over samples)")
        mod = contracted[0].mod
        if len(contracted) == 2:
            mod = join(contracted[0].at(0), contracted[1].at(0)).mod
        return Summed("a matrix product over the batch", mod)
    return result


def mm(flow, func, args, kwargs, out):
    (a, b), (ta, tb) = _operands(flow, func, args, kwargs, ("self", "mat2"))
    return _matmul(a, ta, b, tb, batched=func.overloadpacket is aten.bmm)


def addmm(flow, func, args, kwargs, out):
    names = (("self", "mat1", "mat2") if func.overloadpacket is aten.addmm
             else ("self", "batch1", "batch2"))
    (c, a, b), (tc, ta, tb) = _operands(flow, func, args, kwargs, names)
    return add_matmul(flow, func.overloadpacket is aten.baddbmm, c, tc, a, ta, b, tb, out)


def add_matmul(flow, batched: bool, c, tc: Optional[Rows], a, ta: Optional[Rows], b,
               tb: Optional[Rows], out) -> Tag:
    """``c + a @ b`` (:func:`addmm`) from its operands and their rows (None: no rows)."""
    r = _matmul(a, ta, b, tb, batched=batched)
    o = _out(out)
    if isinstance(r, Summed):
        if tc is not None:
            raise Mix("adds per-sample rows to a matrix product over the batch")
        return r
    return aligned([(c, tc), (o, r)], tuple(o.shape), flow)


def vector_mm(flow, func, args, kwargs, out):
    """``mv`` / ``dot`` / ``addmv``: the batch may only be the matrix's rows."""
    names = {"mv": ("self", "vec"), "dot": ("self", "tensor"),
             "addmv": ("mat", "vec")}[func.overloadpacket.__name__]
    (m, v), (tm, tv) = _operands(flow, func, args, kwargs, names)
    if tv is not None or (tm is not None and (m.dim() != 2 or tm.dim != 0)):
        raise Mix("contracts the batch dimension")
    return tm


def conv(flow, func, args, kwargs, out):
    (x, w, b), (tx, tw, tb) = _operands(flow, func, args, kwargs, ("input", "weight", "bias"))
    if tw is not None or tb is not None:
        raise Mix("with per-sample weights")
    if tx is not None and tx.dim != 0:
        raise Mix("convolves across the dimension that holds the batch")
    return tx


def attention(flow, func, args, kwargs, out):
    (q, k, v), tags = _operands(flow, func, args, kwargs, ("query", "key", "value"))
    mask = arg(func, args, kwargs, "attn_mask")
    if mask is None:
        mask = arg(func, args, kwargs, "attn_bias")
    n = q.dim()
    result = None
    for tag in tags:
        if tag is None:
            continue
        if tag.dim >= n - 2:
            raise Mix("attends across the dimension that holds the batch")
        result = tag if result is None else join(result, tag)
    tm = _rows(flow.tag(mask)) if isinstance(mask, torch.Tensor) else None
    if tm is not None:
        d = tm.dim + n - mask.dim()
        if d >= n - 2 or mask.shape[tm.dim] != q.shape[d]:
            raise Mix("with an attention mask whose batch is not the query's")
        result = tm.at(d) if result is None else join(result, tm.at(d))
    outs = flat_tensors(out)
    if result is None:
        return [None] * len(outs)
    return [result if o.dim() > result.dim else None for o in outs]


def _normalised_over_last(flow, func, args, kwargs, weights: Sequence[str]) -> Tag:
    """A normalisation over the last ``len(normalized_shape)`` dims with affine ``weights``."""
    (x, *ws), (tx, *tws) = _operands(flow, func, args, kwargs, ("input", *weights))
    return normalised_rows(x, tx, tws, arg(func, args, kwargs, "normalized_shape"))


def normalised_rows(x, tx: Optional[Rows], tws: Sequence[Optional[Rows]], shape) -> Tag:
    """:func:`_normalised_over_last` from the operands' rows (None: no rows): ``x`` normalised
    over its last dims ``shape`` with affine weights of rows ``tws``."""
    if any(t is not None for t in tws):
        raise Mix("with per-sample weights")
    if tx is None:
        return None
    k = len(shape) if isinstance(shape, (list, tuple)) else 1
    if tx.dim >= x.dim() - k:
        raise Mix("normalises across the dimension that holds the batch")
    return tx


def layer_norm(flow, func, args, kwargs, out):
    return _normalised_over_last(flow, func, args, kwargs, ("weight", "bias"))


def rms_norm(flow, func, args, kwargs, out):
    return _normalised_over_last(flow, func, args, kwargs, ("weight",))


def group_norm(flow, func, args, kwargs, out):
    (x, w, b), (tx, tw, tb) = _operands(flow, func, args, kwargs, ("input", "weight", "bias"))
    if tw is not None or tb is not None:
        raise Mix("with per-sample weights")
    if tx is not None and tx.dim != 0:
        raise Mix("normalises across the dimension that holds the batch")
    return tx


def batch_norm(flow, func, args, kwargs, out):
    """Training mode normalises by statistics over every dim but the channels (1): per sample
    only when the batch sits in the channel dimension (instance norm's ``(1, B·C, …)``)."""
    x = arg(func, args, kwargs, "input")
    tx = _rows(flow.tag(x))
    outs = flat_tensors(out)
    if tx is None:
        return None
    training = arg(func, args, kwargs, "training", True)
    if func.overloadpacket in (aten._native_batch_norm_legit_no_training,
                               aten._batch_norm_no_update):
        training = False
    if not training:
        return [tx] + [None] * (len(outs) - 1)
    if tx.dim != 1:
        raise Mix("normalises by statistics of the whole batch (batch norm in training mode)")
    return [tx] + [tx.at(0) if o.dim() == 1 else None for o in outs[1:]]


def embedding(flow, func, args, kwargs, out):
    (w, idx), (tw, ti) = _operands(flow, func, args, kwargs, ("weight", "indices"))
    if tw is not None:
        raise Mix("looks up per-sample weights")
    return ti


def losses(flow, func, args, kwargs, out):
    """Losses with a ``reduction``: "none" keeps the rows, "mean" and "sum" reduce over the
    batch (for ``nll_loss`` with ``ignore_index``, a mean divides by a count over all samples)."""
    reduction = arg(func, args, kwargs, "reduction", 1)
    tensors = inputs_of(args, kwargs)
    tags = [flow.tag(t) for t in tensors]
    outs = flat_tensors(out)
    nll = func.overloadpacket in (aten.nll_loss_forward, aten.nll_loss2d_forward)
    if reduction != 0:
        if not any(isinstance(t, Rows) for t in tags):
            return None
        if nll and reduction == 1 and not _one_target_per_row(flow, func, args, kwargs):
            raise Mix("with reduction=\"mean\" over several targets per sample (a mean over the "
                      "batch's non-ignored targets divides by a count over all samples)")
        mods = [t.mod for t in tags if isinstance(t, Rows)]
        return [Summed(f"{func.overloadpacket.__name__} with a reduction", min(mods))] + \
            [None] * (len(outs) - 1)
    shape = tuple(outs[0].shape)
    if not nll:
        return [aligned(list(zip(tensors, tags)), shape, flow)] + [None] * (len(outs) - 1)
    x, target = arg(func, args, kwargs, "self"), arg(func, args, kwargs, "target")
    weight = arg(func, args, kwargs, "weight")
    if isinstance(weight, torch.Tensor) and isinstance(flow.tag(weight), Rows):
        raise Mix("with per-sample class weights")
    pairs = [(target, flow.tag(target))]
    tx = _rows(flow.tag(x))
    if tx is not None:  # (N, C, …) → (N, …): the class dim 1 goes
        if tx.dim == 1 or (x.dim() == 1 and tx.dim == 0):
            raise Mix("sums over classes along the dimension that holds the batch")
        pairs.append((outs[0], tx.at(tx.dim - (tx.dim > 1))))
    return [aligned(pairs, shape, flow)] + [None] * (len(outs) - 1)


def _one_target_per_row(flow, func, args, kwargs) -> bool:
    """``nll_loss`` with ``reduction="mean"`` divides by the number of targets not ignored (their
    class weights, when given): with one target per sample and no class weights, one sample moves
    that count by one, which moves the other samples' terms by at most R in all (their factor
    changes by ``1/n``); with several targets per sample (tokens) or class weights, one sample
    moves it without bound."""
    target, weight = arg(func, args, kwargs, "target"), arg(func, args, kwargs, "weight")
    tag = flow.tag(target)
    if not isinstance(tag, Rows):
        return True  # targets of no sample: the count does not depend on the data
    return (weight is None and target.dim() == 1 and tag.per == 1
            and func.overloadpacket is aten.nll_loss_forward)


# -- sums over the batch ------------------------------------------------------------------------
#: ops through which a sum over the batch stays a sum over the batch: linear in it, with every other
#: operand of no sample
_SUMMED_LINEAR = {aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.clone, aten._to_copy,
                  aten.detach, aten.alias, aten.view, aten._unsafe_view, aten.reshape,
                  aten.expand, aten.squeeze, aten.unsqueeze, aten.permute, aten.transpose, aten.t,
                  aten.select, aten.slice, aten.sum, aten.mean, aten.lift_fresh, aten.add_,
                  aten.sub_, aten.mul_, aten.div_, aten.neg_, aten.copy_, aten.contiguous}


def summed(flow, func, args, kwargs, tags) -> Any:
    """The tag of an op with a :class:`Summed` input: still a sum over the batch when the op is
    linear in it and every other operand is of no sample (a quotient only by such an operand);
    a sum of sums for ``add``/``sub``; else it mixes."""
    packet = func.overloadpacket
    sums = [t for t in tags if isinstance(t, Summed)]
    others = [t for t in tags if t is not None and not isinstance(t, (Summed, Iota))]
    if packet in _SUMMED_LINEAR and not others:
        if len(sums) == 1 or packet in (aten.add, aten.sub, aten.add_, aten.sub_):
            if packet in (aten.div, aten.div_) and not isinstance(tags[0], Summed):
                raise Mix("divides by a sum over the batch")
            return Summed(sums[0].how, min(s.mod for s in sums))
    raise Mix(f"on a sum over the batch ({sums[0].how})")


# -- indexing ------------------------------------------------------------------------------------
def index_select(flow, func, args, kwargs, out):
    (x, idx), (tx, ti) = _operands(flow, func, args, kwargs, ("self", "index"))
    if ti is not None:
        raise Mix("selects with per-sample indices shared by every row")
    if tx is not None and norm_dim(arg(func, args, kwargs, "dim"), x.dim()) == tx.dim:
        raise Mix("selects rows of the batch dimension")
    return tx


def gather(flow, func, args, kwargs, out):
    (x, idx), (tx, ti) = _operands(flow, func, args, kwargs, ("self", "index"))
    dim = norm_dim(arg(func, args, kwargs, "dim"), x.dim())
    result = None
    for t, tag in ((x, tx), (idx, ti)):
        if tag is not None:
            if tag.dim == dim or t.shape[tag.dim] != idx.shape[tag.dim]:
                raise Mix("gathers across the batch dimension")
            result = tag if result is None else join(result, tag)
    return result


def scatter(flow, func, args, kwargs, out):
    x = arg(func, args, kwargs, "self")
    dim = norm_dim(arg(func, args, kwargs, "dim"), x.dim())
    result = None
    for t in inputs_of(args, kwargs):
        tag = _rows(flow.tag(t))
        if tag is not None:
            if tag.dim == dim:
                raise Mix("scatters across the batch dimension")
            result = tag if result is None else join(result, tag)
    return result


def index(flow, func, args, kwargs, out):
    """``x[indices]`` (advanced indexing): the batch dimension not indexed, with indices shared by
    every row; or indexed by an ``arange`` over its whole length (each row selects itself) next to
    per-sample indices (``logits[arange(B), y]``)."""
    x = arg(func, args, kwargs, "self")
    indices = list(arg(func, args, kwargs, "indices"))
    tx = _rows(flow.tag(x))
    tis = [flow.tag(i) if isinstance(i, torch.Tensor) else None for i in indices]
    if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
        if tx is None and not any(isinstance(t, Rows) for t in tis):
            return None
        raise Mix("selects elements by a boolean mask across samples")
    present = [k for k, i in enumerate(indices) if i is not None]
    if not present:
        return tx
    nb = len(broadcast_shapes([tuple(indices[k].shape) for k in present]))
    adjacent = present == list(range(present[0], present[-1] + 1))
    first = present[0] if adjacent else 0
    if tx is not None and tx.dim not in present:
        if any(isinstance(t, Rows) for t in tis):
            raise Mix("indexes another dimension with per-sample indices")
        if adjacent:
            d = tx.dim if tx.dim < first else tx.dim - len(present) + nb
        else:
            d = nb + tx.dim - sum(k < tx.dim for k in present)
        return tx.at(d)
    result: Tag = None
    for k in present:
        t, tag = indices[k], tis[k]
        if isinstance(tag, Iota):
            if tx is None or k != tx.dim:
                continue  # positions along a dim without samples
            if not tag.exact or t.shape[tag.dim] != x.shape[k]:
                raise Mix("indexes the batch dimension with positions that are not all of it")
            mapped = tx.at(tag.dim + nb - t.dim())
        elif isinstance(tag, Rows):
            mapped = tag.at(tag.dim + nb - t.dim())
        else:
            continue
        result = mapped if result is None else join(result, mapped)
    if tx is not None and not (isinstance(tis[tx.dim], Iota) and tis[tx.dim].exact):
        raise Mix("indexes the batch dimension")
    return None if result is None else result.at(result.dim + first)


def index_put(flow, func, args, kwargs, out):
    """``x[indices] = values``: a per-sample boolean mask of x's own leading shape writes element
    by element; indices shared by every row write the same positions in each; writing into chosen
    rows of the batch dimension, or at positions taken from other samples, mixes."""
    x = arg(func, args, kwargs, "self")
    indices = list(arg(func, args, kwargs, "indices"))
    values = arg(func, args, kwargs, "values")
    tx, tv = _rows(flow.tag(x)), _rows(flow.tag(values))
    tis = [flow.tag(i) if isinstance(i, torch.Tensor) else None for i in indices]
    if any(isinstance(t, Iota) for t in tis):
        raise Mix("writes at positions indexed by an arange")
    rows = [t for t in tis if isinstance(t, Rows)]
    if rows:
        mask = (len(indices) == 1 and indices[0].dtype == torch.bool and rows[0].dim == 0
                and tuple(indices[0].shape) == tuple(x.shape[:indices[0].dim()]))
        if not mask or tv is not None or (tx is not None and tx.dim != 0):
            raise Mix("writes at per-sample positions across samples")
        return rows[0] if tx is None else join(tx, rows[0])
    if tx is not None and tx.dim < len(indices) and indices[tx.dim] is not None:
        raise Mix("writes into chosen rows of the batch dimension")
    if tv is not None and tx is None:
        raise Mix("writes per-sample values into a tensor without a batch dimension")
    if tv is not None:  # the values broadcast to x[indices], whose rows must be x's own
        present = [k for k, i in enumerate(indices) if i is not None]
        nb = len(broadcast_shapes([tuple(indices[k].shape) for k in present]))
        adjacent = present == list(range(present[0], present[-1] + 1))
        if adjacent:
            d = tx.dim if tx.dim < present[0] else tx.dim - len(present) + nb
        else:
            d = nb + tx.dim - sum(k < tx.dim for k in present)
        region = x.dim() - len(present) + nb
        dv = tv.dim + region - values.dim()
        if dv != d or values.shape[tv.dim] != x.shape[tx.dim]:
            raise Mix("writes values whose rows are not the rows they land in")
        join(tv.at(tx.dim), tx)
    return tx


def copy(flow, func, args, kwargs, out):
    dst, src = arg(func, args, kwargs, "self"), arg(func, args, kwargs, "src")
    return aligned([(src, flow.tag(src))], tuple(dst.shape), flow)


def copy_from(flow, func, args, kwargs, out):
    """``_copy_from(src, dst)``: dst takes src's rows (written through the schema's alias)."""
    src, dst = arg(func, args, kwargs, "self"), arg(func, args, kwargs, "dst")
    return aligned([(src, flow.tag(src))], tuple(dst.shape), flow)


def random_draw(flow, func, args, kwargs, out):
    """A draw per element with the element's own parameters (``bernoulli(p)``, ``normal(μ, σ)``)."""
    o = _out(out)
    tensors = inputs_of(args, kwargs)
    return aligned([(t, flow.tag(t)) for t in tensors], tuple(o.shape), flow)


def overwrite(flow, func, args, kwargs, out):
    """In-place fills (``fill_``, ``zero_``, ``normal_``): the tensor takes the fill value's
    samples (a tensor value broadcast over it) or none."""
    for t in inputs_of(args, kwargs)[1:]:
        tag = flow.tag(t)
        if isinstance(tag, Rows):
            return pointwise(flow, func, args, kwargs, out)
        if tag is not None and not isinstance(tag, Iota):
            raise Mix("fills a tensor with a value of several samples")
    return None


RULES: Dict[Any, Callable] = {}


def register(rule: Callable, *names: str) -> None:
    """Use ``rule`` for the aten ops ``names`` (every overload)."""
    _OPS.clear()  # an overload's OpInfo holds its rule
    for n in names:
        packet = getattr(aten, n, None)
        if packet is not None:
            RULES[packet] = rule


register(identity, "clone", "_to_copy", "detach", "alias", "lift_fresh", "lift_fresh_copy",
         "contiguous", "_conj", "conj", "resolve_conj", "resolve_neg", "positive",
         "_conj_physical", "to", "_to_dense", "_lazy_clone", "alias_copy", "detach_copy",
         "_autocast_to_reduced_precision", "_autocast_to_full_precision", "dropout",
         "native_dropout", "feature_dropout", "alpha_dropout", "set_")
register(view, "view", "_unsafe_view", "reshape", "_reshape_alias", "view_copy", "flatten",
         "unflatten", "_reshape_copy", "view_as")
register(expand, "expand", "expand_copy", "broadcast_to")
register(permute, "permute", "permute_copy")
register(transpose, "transpose", "t", "transpose_copy", "t_copy", "swapaxes", "swapdims")
register(unsqueeze, "unsqueeze", "unsqueeze_copy")
register(squeeze, "squeeze", "squeeze_copy")
register(slice_, "slice", "slice_copy", "narrow")
register(select, "select", "select_copy")
register(split, "split", "split_with_sizes", "unbind", "unsafe_split", "unsafe_split_with_sizes",
         "split_copy", "split_with_sizes_copy", "unbind_copy")
register(cat, "cat", "stack", "concat", "concatenate")
register(repeat, "repeat")
register(repeat_interleave, "repeat_interleave")
register(unfold, "unfold")
register(reduce, "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "any",
         "all", "var", "std", "var_mean", "std_mean", "logsumexp", "linalg_vector_norm", "norm",
         "count_nonzero", "nansum", "nanmean", "aminmax", "median", "nanmedian", "mode",
         "kthvalue")
register(along, "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "_softmax",
         "_log_softmax", "softmax", "log_softmax", "_safe_softmax", "sort", "argsort", "topk",
         "_masked_softmax", "msort")
register(flip_roll, "flip", "roll")
register(last_dims(1), "max_pool1d", "max_pool1d_with_indices", "avg_pool1d",
         "adaptive_avg_pool1d", "adaptive_max_pool1d", "upsample_nearest1d", "upsample_linear1d",
         "_upsample_nearest_exact1d", "reflection_pad1d", "replication_pad1d", "_fft_r2c",
         "_fft_c2r", "_fft_c2c")
register(last_dims(2), "max_pool2d", "max_pool2d_with_indices", "avg_pool2d",
         "adaptive_avg_pool2d", "_adaptive_avg_pool2d", "adaptive_max_pool2d",
         "upsample_nearest2d", "upsample_bilinear2d", "upsample_bicubic2d",
         "_upsample_nearest_exact2d", "_upsample_bilinear2d_aa", "reflection_pad2d",
         "replication_pad2d", "im2col", "col2im", "tril", "triu", "pixel_shuffle",
         "pixel_unshuffle", "diagonal", "_linalg_svd", "linalg_inv_ex", "_linalg_eigh",
         "linalg_cholesky_ex", "_linalg_det", "_linalg_slogdet", "linalg_solve_ex",
         "_linalg_solve_ex", "trace", "diag_embed")
register(last_dims(3), "max_pool3d", "max_pool3d_with_indices", "avg_pool3d",
         "adaptive_avg_pool3d", "_adaptive_avg_pool3d", "adaptive_max_pool3d",
         "upsample_nearest3d", "upsample_trilinear3d", "_upsample_nearest_exact3d",
         "reflection_pad3d", "replication_pad3d")
register(pad, "constant_pad_nd", "_pad_enum", "pad")
register(mm, "mm", "bmm")
register(addmm, "addmm", "baddbmm")
register(vector_mm, "mv", "dot", "addmv")
register(conv, "convolution", "_convolution", "conv2d", "conv1d", "conv3d", "cudnn_convolution",
         "mkldnn_convolution", "_slow_conv2d_forward", "thnn_conv2d", "conv_transpose2d",
         "conv_transpose1d", "conv_transpose3d", "slow_conv_transpose2d", "slow_conv3d_forward",
         "_nnpack_spatial_convolution", "miopen_convolution", "cudnn_convolution_transpose",
         "convolution_overrideable")
register(attention, "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
         "_efficient_attention_forward", "_flash_attention_forward")
register(layer_norm, "native_layer_norm", "layer_norm")
register(group_norm, "native_group_norm")
register(batch_norm, "native_batch_norm", "_native_batch_norm_legit",
         "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
         "cudnn_batch_norm", "miopen_batch_norm", "_batch_norm_with_update",
         "_batch_norm_no_update")
register(rms_norm, "_fused_rms_norm", "rms_norm")
register(embedding, "embedding")
register(losses, "nll_loss_forward", "nll_loss2d_forward", "mse_loss", "l1_loss",
         "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
         "soft_margin_loss", "kl_div", "multilabel_margin_loss_forward", "multi_margin_loss")
register(index_select, "index_select")
register(gather, "gather")
register(scatter, "scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy",
         "index_fill", "index_reduce")
register(index, "index", "_unsafe_index")
register(index_put, "index_put", "_index_put_impl", "_unsafe_index_put")
register(copy, "copy", "copy_")
register(copy_from, "_copy_from", "_copy_from_and_resize")
register(value_free, "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
         "randn_like", "randint_like", "new_zeros", "new_ones", "new_empty", "new_full",
         "new_empty_strided", "empty_strided", "_local_scalar_dense", "is_nonzero", "equal",
         "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
         "_assert_async", "_assert_tensor_metadata", "_has_compatible_shallow_copy_type",
         "_functional_assert_async", "record_stream", "_nested_tensor_size")
register(random_draw, "bernoulli", "bernoulli_", "poisson", "binomial", "_standard_gamma",
         "_sample_dirichlet", "multinomial", "normal")
register(overwrite, "fill", "fill_", "zero_", "normal_", "uniform_", "random_", "exponential_",
         "geometric_", "cauchy_", "log_normal_")

# elementwise ops ATen does not tag pointwise (activations, in-place variants)
register(pointwise, "hardswish", "hardswish_", "hardsigmoid", "hardsigmoid_", "log_sigmoid_forward",
         "rrelu_with_noise", "rrelu_with_noise_", "gelu_", "silu_", "mish_", "elu_", "celu_",
         "selu_", "leaky_relu_", "hardtanh_", "relu_", "threshold_", "threshold",
         "masked_fill", "masked_fill_", "softplus", "softshrink", "hardshrink", "logit",
         "nan_to_num", "nan_to_num_")
register(identity, "_prelu_kernel", "real", "imag")
register(along, "glu")
#: rules whose outputs take no value from their inputs: they run on mixed inputs too
VALUE_FREE = {value_free}


def is_pointwise(func) -> bool:
    """Whether ATen tags ``func`` pointwise (elementwise with broadcasting); read once per op."""
    return op_info(func).pointwise
