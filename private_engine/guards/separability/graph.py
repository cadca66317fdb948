"""The autograd graph as the separability probe reads it: the comparison points (recorded
outputs and model inputs), which pending forwards a loss reaches, which points autograd must be
asked for, the dtypes of the gradients, and the nodes between a loss and a point."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import get_gradient_edge

from ...layers.rounding import operand_unit
from .inputs import PendingForward


@dataclass
class ComparisonPoint:
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


def leading_points(points: List["ComparisonPoint"], roots) -> set:
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


def target_points(targets) -> List[ComparisonPoint]:
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
        points.append(ComparisonPoint(str(name), t, node, order, dims, shape))
    return points


def reached_forwards(forwards: List[PendingForward], root_nodes) -> List[PendingForward]:
    """The pending forwards whose inputs the roots depend on (those without differentiable
    inputs cannot be told apart: they count as reached)."""
    wanted = {n for f in forwards for n in f.nodes if n is not None}
    found: set = set()
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


def walk_graph(roots: Sequence[object]) -> Tuple[List[object], Dict[object, list]]:
    """All autograd nodes reachable from ``roots`` (each once) and ``{node: [parents]}``."""
    seen: set = set()
    order: list = []
    parents: dict = {}
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


def ancestors(node, parents: Dict[object, list]) -> set:
    """``node`` and every node from which it is reachable."""
    found, stack = {node}, [node]
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p not in found:
                found.add(p)
                stack.append(p)
    return found


def graph_dtypes(nodes) -> set:
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


def tf32_allowed(roots) -> bool:
    """True when float32 matmuls or convolutions on the roots' devices may round their inputs
    (TF32 on CUDA, bfloat16 or TF32 in oneDNN on the CPU: :func:`operand_unit`), so that a
    rounding flip after a non-deterministic kernel shows at float16-like precision."""
    devices = {t.device for t in roots}
    return any(operand_unit(torch.float32, d, conv) > 0 for d in devices for conv in (False, True))
