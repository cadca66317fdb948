"""Where the batch dimension of a batched tensor goes through an op (:func:`out_batch_dim`), as
the parameter-entry tracer follows the model's inputs through its forward."""
from __future__ import annotations

import torch
import torch.nn.functional as F

_TRANSPOSES = {torch.Tensor.transpose, torch.transpose, torch.Tensor.swapaxes, torch.swapaxes,
               torch.Tensor.swapdims, torch.swapdims}
_PERMUTES = {torch.Tensor.permute, torch.permute}
_MOVEDIMS = {torch.Tensor.movedim, torch.movedim, torch.Tensor.moveaxis, torch.moveaxis}


def out_batch_dim(func, args, kwargs, src, bdim, out, B) -> int:
    """Position of the batch dimension in ``out`` (-1: unknown), given it is ``bdim`` in the batched
    input ``src``.

    Followed through permute/transpose/movedim/.T/.mT, unbind/select, basic indexing, unsqueeze,
    stack, reductions over other dims, embedding, reshapes that keep the dims up to it, and reshapes
    that merge or split dim 0 sample-major (Swin's window partition and reverse,
    ``flatten(0, 1)``); any other op keeps it when the rank and the batch dimension's size are
    unchanged (cat/repeat along it stack rows, not samples). An entry needs the batch known in
    dim 0; a layer may see k·B rows only then, and is refused when its batch is known elsewhere.
    """
    if bdim < 0 or not isinstance(src, torch.Tensor):
        return -1
    try:
        nd = src.dim()
        # same rank, no dimension moved: the batch stays in place
        if func not in _MOVES_BATCH and out.dim() == nd:
            # only when its size is unchanged (cat/repeat along it stack rows, not samples); every
            # op of _MOVES_BATCH returns from its own branch below
            return bdim if out.shape[bdim] == src.shape[bdim] else -1
        if func in _TRANSPOSES:
            d0 = (args[1] if len(args) > 1 else kwargs.get("dim0")) % nd
            d1 = (args[2] if len(args) > 2 else kwargs.get("dim1")) % nd
            return d1 if bdim == d0 else d0 if bdim == d1 else bdim
        if func in _PERMUTES:
            dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            dims = [d % nd for d in (dims or kwargs.get("dims"))]
            return dims.index(bdim)
        if func in _MOVEDIMS:
            perm = torch.movedim(torch.arange(nd),
                                 args[1] if len(args) > 1 else kwargs.get("source"),
                                 args[2] if len(args) > 2 else kwargs.get("destination"))
            return perm.tolist().index(bdim)
        if func in _UNBINDS:
            d = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % nd
            return -1 if d == bdim else bdim - (d < bdim)
        if func is torch.Tensor.__getitem__:
            r = _getitem_bdim(args[1], nd, bdim)
            return r if 0 <= r < out.dim() and out.shape[r] == src.shape[bdim] else -1
        if func in _UNSQUEEZES:
            d = (args[1] if len(args) > 1 else kwargs.get("dim")) % (nd + 1)
            r = bdim + (d <= bdim)
            return r if out.dim() == nd + 1 and out.shape[r] == src.shape[bdim] else -1
        if func in _RESHAPES:
            if (bdim > 0 and out.dim() > bdim
                    and tuple(out.shape[:bdim + 1]) == tuple(src.shape[:bdim + 1])):
                return bdim  # the dims up to the batch are kept (e.g. (T, B, H·D) -> (T, B, H, D))
            if bdim != 0 or out.dim() == 0:
                return -1
            n_in, n_out = src.shape[0], out.shape[0]
            if n_out % B == 0 and (n_out % n_in == 0 or n_in % n_out == 0):
                return 0  # dim 0 merged with following dims, or split: rows stay sample-major
            return -1
        # .t(), .T, .H reverse dims; .mT, .mH swap
        if func in (torch.Tensor.t, torch.t) or func in _T_GETTERS:
            if func not in _MT_GETTERS:
                r = nd - 1 - bdim
            else:
                r = {nd - 2: nd - 1, nd - 1: nd - 2}.get(bdim, bdim)
            return r if out.dim() == nd and out.shape[r] == src.shape[bdim] else -1
        if func in _EMBEDDINGS:  # (B, T) ids -> (B, T, d): the indices' dims come first
            return bdim if out.dim() == nd + 1 and out.shape[bdim] == src.shape[bdim] else -1
        if func is torch.stack:  # stacking batched tensors along another dim
            d = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % (nd + 1)
            r = bdim + (d <= bdim)
            return r if out.dim() == nd + 1 and out.shape[r] == src.shape[bdim] else -1
        # x.mean(1), x.amax(dim=(-2, -1)), …
        if out.dim() < nd and getattr(func, "__name__", "") in _REDUCTIONS:
            d = args[1] if len(args) > 1 else kwargs.get("dim")
            ds = [d] if isinstance(d, int) else list(d) if isinstance(d, (tuple, list)) else []
            ds = {k % nd for k in ds if isinstance(k, int) and not isinstance(k, bool)}
            if ds and bdim not in ds and out.dim() == nd - len(ds):
                r = bdim - sum(k < bdim for k in ds)
                return r if out.shape[r] == src.shape[bdim] else -1
    except Exception:  # an unexpected signature: unknown
        return -1
    return -1


_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "std", "var", "logsumexp",
               "squeeze", "argmax", "argmin", "all", "any", "nansum", "nanmean", "median",
               "count_nonzero"}
#: ``x.T`` etc. arrive in ``__torch_function__`` as the property getters
_T_GETTERS, _MT_GETTERS = set(), set()
for _attr in ("T", "mT", "H", "mH"):
    _getter = getattr(getattr(torch.Tensor, _attr, None), "__get__", None)
    if _getter is not None:
        _T_GETTERS.add(_getter)
        if _attr.startswith("m"):
            _MT_GETTERS.add(_getter)


def _getitem_bdim(index, nd: int, bdim: int) -> int:
    """Position of the batch dimension after basic indexing (ints, slices, None, ``...``); -1 when
    the batch is indexed (anything but a full slice) or for advanced indexing."""
    index = index if isinstance(index, tuple) else (index,)
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool)
           for i in index):
        return -1
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    if consumed > nd or sum(1 for i in index if i is Ellipsis) > 1:
        return -1
    d = o = 0  # input and output positions
    for i in index:
        if i is None:
            o += 1
        elif i is Ellipsis:
            k = nd - consumed
            if d <= bdim < d + k:
                return o + bdim - d
            d += k
            o += k
        else:
            if d == bdim:
                return o if isinstance(i, slice) and i == slice(None) else -1
            d += 1
            o += isinstance(i, slice)
    return o + bdim - d  # after the index: dims kept in order


_EMBEDDINGS = {F.embedding, torch.embedding, F.one_hot}
_UNSQUEEZES = {torch.Tensor.unsqueeze, torch.unsqueeze}
_UNBINDS = {torch.Tensor.unbind, torch.unbind, torch.Tensor.select, torch.select}
_RESHAPES = {torch.Tensor.reshape, torch.reshape, torch.Tensor.view, torch.Tensor.flatten,
             torch.flatten, torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.unflatten}


#: ops that ``out_batch_dim`` handles before its same-rank rule (they can move the batch dimension
#: without changing the rank); any other op of the same rank keeps the batch where it was when its
#: size is unchanged
_MOVES_BATCH = (_TRANSPOSES | _PERMUTES | _MOVEDIMS | _UNBINDS | _UNSQUEEZES | _RESHAPES
                | _T_GETTERS | {torch.Tensor.__getitem__, torch.Tensor.t, torch.t})
