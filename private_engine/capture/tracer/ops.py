"""The op families the parameter-entry tracer tells apart in its ``TorchFunctionMode``: entries
(elementwise with broadcasting, concatenation, matmul), row-preserving shape ops, expands, and
passive attribute reads; and the tensors among an op's arguments and outputs."""
from __future__ import annotations

import torch

#: elementwise ops with broadcasting at which a derived tensor may meet batched data
_ELEMENTWISE_NAMES = ("add", "sub", "mul", "div", "true_divide", "rsub", "where", "addcmul")
ELEMENTWISE = set()
for _n in _ELEMENTWISE_NAMES:
    for _owner in (torch, torch.Tensor):
        for _v in (_n, _n + "_", f"__{_n}__", f"__r{_n}__", f"__i{_n}__"):
            _f = getattr(_owner, _v, None)
            if _f is not None:
                ELEMENTWISE.add(_f)
ELEMENTWISE |= {torch.Tensor.__truediv__, torch.Tensor.__rtruediv__, torch.Tensor.__itruediv__}
CONCAT = {torch.cat, torch.concat, torch.concatenate, torch.stack}
#: ``x @ W`` with a tracked 2-D ``W`` and batched ``x``: a per-sample weight (instantiated)
MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
EXPANDS = {torch.Tensor.expand, torch.Tensor.expand_as}
#: shape ops through which a row-expanded tensor stays row-expanded (each use is verified)
ROWWISE = {torch.Tensor.reshape, torch.Tensor.view, torch.Tensor.permute, torch.Tensor.transpose,
           torch.transpose, torch.Tensor.flatten, torch.flatten, torch.Tensor.contiguous,
           torch.Tensor.unsqueeze, torch.Tensor.to, torch.Tensor.clone, torch.Tensor.float,
           torch.Tensor.double, torch.Tensor.type_as, torch.Tensor.repeat, torch.reshape,
           torch.permute}
#: attribute reads and metadata queries: never an entry (property reads arrive as their getters)
PASSIVE = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
            torch.Tensor.is_contiguous, torch.Tensor.is_floating_point, torch.Tensor.data_ptr,
            torch.Tensor.storage_offset, torch.Tensor.stride}
for _attr in ("shape", "grad_fn", "requires_grad", "dtype", "device", "is_leaf", "_base", "ndim",
              "is_cuda", "layout"):
    _getter = getattr(getattr(torch.Tensor, _attr, None), "__get__", None)
    if _getter is not None:
        PASSIVE.add(_getter)


def tensor_args(args, kwargs):
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def output_tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []
