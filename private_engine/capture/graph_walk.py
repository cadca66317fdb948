"""The autograd graph of a loss, walked once before the norm pass.

It finds the trainable parameters the loss reaches other than through a recorded call (their
per-sample gradients would be missing from the norms: refused with :func:`outside_error`) and the
*leading* recorded calls, at whose outputs the norm pass asks autograd for gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch


@dataclass
class GraphWalk:
    """What :meth:`LayerRecorder.walk` found in the autograd graph of a loss."""

    #: trainable parameters reached other than through a recorded call (missing from the norms)
    outside: list
    #: output edges of the leading recorded calls (no recorded call below them)
    leading_edges: list
    #: autograd nodes reached from the loss (recorded calls are stepped over)
    reached: set
    #: id of an outside parameter -> the custom ``torch.autograd.Function`` it is an input of
    custom_functions: Dict[int, str] = field(default_factory=dict)


def walk_graph(recorder, loss: torch.Tensor, params: Sequence[torch.Tensor]) -> GraphWalk:
    """One pass over the autograd graph of ``loss`` (iterative post-order, each node once).

    Steps over each recorded call (and each tracer entry / fallback call) from its output node to
    its input nodes and finds (i) the parameters of ``params`` reached outside such calls, (ii) the
    *leading* calls: reached from the loss with no other recorded call below them. Asking autograd
    for the gradients at the leading calls' outputs (and the extras' edges) makes one backward run
    through every reached call, computing activation gradients only — no second walk, no weight
    gradient.
    """
    wanted = {id(p) for p in params}
    jumps: dict = {}
    for layer in recorder.layers:
        for c in layer.calls:
            jumps.setdefault(c.edge.node, []).append(c.input_node)
    # parameter entries and fallback calls: output node -> batched inputs
    for extra in recorder.extras:
        for node, inputs in extra.jumps().items():
            jumps.setdefault(node, []).extend(inputs)
    found: dict = {}
    custom: dict = {}
    below: dict = {}  # node -> True when a jump node is this node or below it
    kids: dict = {}
    stack = [(loss.grad_fn, False)]
    while stack:
        node, done = stack.pop()
        if done:
            below[node] = node in jumps or any(below.get(k, False) for k in kids[node])
            continue
        if node is None or node in below or node in kids:
            continue
        if node in jumps:
            children = [n for n in jumps[node] if n is not None]
        else:
            var = getattr(node, "variable", None)  # AccumulateGrad of a leaf
            if var is not None:
                if id(var) in wanted:
                    found[id(var)] = var
                below[node] = False
                continue
            children = [n for n, _ in node.next_functions if n is not None]
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                for k in children:  # a parameter handed to a custom autograd.Function
                    var = getattr(k, "variable", None)
                    if var is not None and id(var) in wanted:
                        custom.setdefault(id(var), type(node).__name__.removesuffix("Backward"))
        kids[node] = children
        stack.append((node, True))
        stack.extend((k, False) for k in children if k not in below)
    leading = {n for n in jumps if n in below and not any(below.get(k, False) for k in kids[n])}
    edges = [c.edge for layer in recorder.layers for c in layer.calls if c.edge.node in leading]
    return GraphWalk(outside=list(found.values()), leading_edges=edges, reached=set(below),
                     custom_functions={i: f for i, f in custom.items() if i in found})


def outside_error(names: Sequence[object],
                  custom_functions: Optional[Dict[object, str]] = None) -> ValueError:
    """The error for trainable parameters the loss reaches outside a recorded call of their layer
    (one text for every door); ``custom_functions`` (name -> Function class) names the parameters
    handed to a custom ``torch.autograd.Function``, the cause then."""
    if custom_functions:
        uses = ", ".join(f"{n!r} into {f}.apply" for n, f in custom_functions.items())
        return ValueError(
            f"trainable parameter(s) go into a custom torch.autograd.Function ({uses}): its "
            "backward is opaque to the engine (no layer rule and no parameter-entry tracer sees "
            "inside it), so it cannot split that parameter's gradient per sample. Fix: write the "
            "function with torch ops, or clip the module that calls it by the torch.func "
            "fallback: private_engine.layers.register_fallback(ModuleClass) before building the "
            "engine (the Function then needs a vmap rule: setup_context and "
            "generate_vmap_rule = True), or freeze the parameter. Nothing was updated.")
    return ValueError(
        f"the loss depends on trainable parameters {list(names)} other than through a recorded "
        "call of their layer, so their per-sample gradients would be missing from the clipping "
        "norms. Causes: a weight used outside its module's forward (e.g. a tied weight in "
        "F.linear(h, emb.weight): untie or freeze it); a forward pass run before the engine was "
        "built (or before make_private); or a loss whose forward pass ran before the previous "
        "step (each clipping pass drops the records of all earlier forward passes: run forward "
        "and step batch by batch). Nothing was updated.")
