"""The model's arguments as the separability probe sees them: the input signature (metadata only,
no tensor op), the batch size, and the differentiable copies of the per-sample float inputs that
let the probe compare gradients at the model's inputs (one :class:`PendingForward` per forward
with a signature still to be probed)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch.autograd.graph import get_gradient_edge


@dataclass
class PendingForward:
    """One forward pass with an input signature still to be probed."""

    signature: tuple
    batch_size: Optional[int]
    #: ``[(name, tensor)]``: the differentiable per-sample inputs (our leaves, or the user's)
    inputs: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    #: autograd nodes of those inputs as the model sees them (to tell whether a loss reaches them)
    nodes: List[object] = field(default_factory=list)


def _tensor_sig(t: torch.Tensor, bd: int, B: Optional[int]) -> tuple:
    shape = tuple(t.shape)
    if B is not None and len(shape) > bd and shape[bd] == B:
        shape = shape[:bd] + (-1,) + shape[bd + 1:]
    return (shape, t.dtype, t.device, t.requires_grad)


def signature(value, bd: int, B: Optional[int], depth: int = 0):
    """Hashable signature of one argument (tensors by metadata only, their size ``B`` along the
    batch dimension ``bd`` replaced by -1; no tensor op)."""
    if isinstance(value, torch.Tensor):
        return _tensor_sig(value, bd, B)
    if depth < 3 and isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(signature(v, bd, B, depth + 1) for v in value)
    if depth < 3 and isinstance(value, dict):
        return ("dict",) + tuple((k, signature(v, bd, B, depth + 1)) for k, v in value.items())
    if value is None or isinstance(value, (bool, str)):
        return value
    return type(value).__name__


def first_batch(value, bd: int, depth: int = 0) -> Optional[int]:
    """Size along ``bd`` of the first tensor argument that has that dimension."""
    if isinstance(value, torch.Tensor):
        return value.shape[bd] if value.dim() > bd else None
    if depth < 3 and isinstance(value, (list, tuple, dict)):
        for v in (value.values() if isinstance(value, dict) else value):
            B = first_batch(v, bd, depth + 1)
            if B is not None:
                return B
    return None


def arm(value, name: str, fwd: PendingForward, batch_dim: Optional[int],
        memo: Dict[int, torch.Tensor], depth: int = 0):
    """``value`` with its per-sample float tensors replaced by differentiable copies
    ``leaf.clone()`` (``leaf = x.detach().requires_grad_()``, remembered in ``fwd``); a tensor
    that already requires grad is remembered as it is. ``batch_dim`` None: every float tensor
    (the layout is unknown; compared along dim 0 or 1)."""
    if isinstance(value, torch.Tensor):
        B, bd = fwd.batch_size, batch_dim
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
        out = [arm(v, f"{name}[{i}]", fwd, batch_dim, memo, depth + 1)
               for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return type(value)(*out) if hasattr(value, "_fields") else tuple(out)
        return out
    if depth < 3 and isinstance(value, dict):
        return {k: arm(v, f"{name}[{k!r}]", fwd, batch_dim, memo, depth + 1)
                for k, v in value.items()}
    return value


def collect_tensors(value, out: list, depth: int = 0) -> None:
    """Append to ``out`` the tensors of a model's outputs (nested lists, tuples, dicts and
    dataclasses, 4 levels deep)."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif depth < 4 and isinstance(value, (list, tuple)):
        for v in value:
            collect_tensors(v, out, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for v in value.values():
            collect_tensors(v, out, depth + 1)
    elif depth < 4 and hasattr(value, "__dataclass_fields__"):  # model-output dataclasses
        for name in value.__dataclass_fields__:
            collect_tensors(getattr(value, name, None), out, depth + 1)
