"""The generic slow path: per-sample gradients of one module's parameters by ``torch.func``.

For a module M that no rule and no parameter entry can clip (``nn.MultiheadAttention``, which
uses its weights inside ``F.multi_head_attention_forward``; timm BEiT's Attention, which calls
``F.linear`` with its child's weight; any class given to ``register_fallback``), the forward
records M's full inputs (args, kwargs) and the norm pass its output gradients ``g``. The
per-sample gradient of every trainable parameter θ in M's subtree is then

    ∂L_i/∂θ = ∇_θ ⟨M(θ; x_i), g_i⟩

computed by ``torch.func.vmap(torch.func.grad(...))`` over ``functional_call(M, …)`` — M alone,
not the whole model — with ``x_i`` the rows of sample i (k rows when M sees k·B rows, e.g. Swin
windows). The squared norms add into ``‖g_i‖²``; the kept per-sample gradients give the clipped
sum. Each module on this path is named in one warning at engine construction.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, grad, vmap

from ..foundation.dtypes import accumulation_dtype

_REPLAYING = [False]


def replaying() -> bool:
    """True while the fallback re-runs a module (hooks of the engine must stay silent)."""
    return _REPLAYING[0]


def warn_fallback(names: Sequence[str]) -> None:
    if names:
        warnings.warn(
            "these modules are clipped by the torch.func fallback (per-sample gradients by vmap "
            "over the module's own forward; exact but slower than a rule): "
            f"{', '.join(names)}", stacklevel=3)


@dataclass
class FallbackCall:
    args: tuple
    kwargs: dict
    out_edges: list
    out_nodes: list
    in_nodes: list
    out_shapes: list
    out_index: list
    grads: list = field(default_factory=list)


class FallbackModule:
    """Records the calls of one fallback module and computes its per-sample gradients."""

    def __init__(self, name: str, module: nn.Module, tracer):
        self.name = name
        self.module = module
        self.tracer = tracer  # gives the batch size and which inputs are batched
        self.calls: List[FallbackCall] = []
        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.capturing = False
        self._handle = None
        self.install()

    def install(self) -> None:
        if self._handle is None:
            self._handle = self.module.register_forward_hook(self._hook, with_kwargs=True)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.reset()

    def reset(self) -> None:
        self.calls = []

    def _is_batched(self, t: torch.Tensor) -> bool:
        B = self.tracer.batch_size
        major = self.tracer.sample_major(t)
        # not computed from the inputs (a buffer, a constant) or called outside the model
        if major is None:
            if not self.tracer.active:
                return t.dim() > 0 and t.shape[0] == B
            if t.dim() > 0 and B > 1 and t.shape[0] == B and not self._is_state(t):
                raise ValueError(
                    f"{self.name} ({type(self.module).__name__}) is called with a tensor of shape "
                    f"{tuple(t.shape)} (leading size = the batch size {B}) that the tracer did not "
                    "see computed from the model's inputs; the torch.func fallback would hand the "
                    "whole tensor to every sample. Compute per-sample inputs of this module with "
                    "torch ops inside the model's forward (not through numpy/.tolist()), or make a "
                    "constant's leading dimension differ from the batch size.")
            return False
        if not major or t.dim() == 0 or t.shape[0] % B:
            raise ValueError(
                f"{self.name} ({type(self.module).__name__}) is called with a batched input of "
                f"shape {tuple(t.shape)} whose batch is not in dim 0 (sample-major); the "
                "torch.func fallback slices samples along dim 0. Use a batch-first layout (e.g. "
                "nn.MultiheadAttention(batch_first=True)).")
        return True

    def _is_state(self, t: torch.Tensor) -> bool:
        """True when ``t`` is a parameter or buffer of the model (a constant, whatever its
        shape)."""
        model = getattr(self.tracer, "model", None)
        if model is None:
            return False
        return any(t is s for s in model.buffers()) or any(t is p for p in model.parameters())

    def _hook(self, module, args, kwargs, output):
        if replaying() or not torch.is_grad_enabled() or not self.tracer.batch_size:
            return None  # no forward seen, or an empty (Poisson) batch: nothing to clip
        seq = output if isinstance(output, (tuple, list)) else (output,)
        index = [k for k, o in enumerate(seq) if isinstance(o, torch.Tensor) and o.requires_grad]
        outs = [seq[k] for k in index]
        if not outs:
            return None
        ins = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        # book-keeping: not through the tracer's mode (speed only)
        with torch._C.DisableTorchFunction():
            call = FallbackCall(
                args=tuple(self._wrap(a) for a in args),
                kwargs={k: self._wrap(v) for k, v in kwargs.items()},
                out_edges=[get_gradient_edge(o) for o in outs],
                out_nodes=[get_gradient_edge(o).node for o in outs],
                in_nodes=[get_gradient_edge(t).node for t in ins if t.requires_grad],
                out_shapes=[o.shape for o in outs], out_index=index, grads=[None] * len(outs))
            for k, o in enumerate(outs):
                o.register_hook(self._make_grad_hook(call, k))
        self.calls.append(call)
        return None

    def _wrap(self, a):
        if isinstance(a, torch.Tensor):
            return ("batched" if self._is_batched(a) else "const", a.detach())
        if isinstance(a, (list, tuple, dict)) and any(
                isinstance(t, torch.Tensor) for t in (a.values() if isinstance(a, dict) else a)):
            raise TypeError(
                f"{self.name} ({type(self.module).__name__}) is called with tensors inside a "
                "list/tuple/dict; the torch.func fallback slices only tensor arguments per sample. "
                "Pass tensors as separate arguments.")
        return ("value", a)

    def _make_grad_hook(self, call: FallbackCall, k: int):
        def hook(g):
            if self.capturing and call.grads[k] is None:
                call.grads[k] = g.detach()
            return None

        return hook

    def out_edges(self) -> list:
        return [e for c in self.calls for e in c.out_edges]

    def jumps(self) -> Dict[object, list]:
        out: Dict[object, list] = {}
        for c in self.calls:
            for node in c.out_nodes:
                out.setdefault(node, []).extend(c.in_nodes)
        return out

    def per_sample_grads(self, B: int) -> Dict[str, torch.Tensor]:
        """``{param name: (B, *shape)}`` summed over the recorded calls."""
        total: Dict[str, torch.Tensor] = {}
        for call in self.calls:
            for n, g in self._call_grads(call, B).items():
                total[n] = g if n not in total else total[n] + g
        return total

    def _call_grads(self, call: FallbackCall, B: int) -> Dict[str, torch.Tensor]:
        module = self.module
        trainable = {n: p.detach() for n, p in self.params}
        fixed = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}
        fixed.update(dict(module.named_buffers()))
        batched = []
        for kind, v in list(call.args) + list(call.kwargs.values()):
            if kind == "batched":
                batched.append(v.reshape(B, v.shape[0] // B, *v.shape[1:]))
        gs: list = []
        for g in call.grads:
            if g is None:  # an output the loss does not use
                gs.append(None)
            else:
                gs.append(g.reshape(B, g.shape[0] // B, *g.shape[1:]))
        if all(g is None for g in gs):
            return {}
        used = [call.out_index[k] for k, g in enumerate(gs) if g is not None]

        def rebuild(xs):
            it = iter(xs)
            args = tuple(next(it) if kind == "batched" else v for kind, v in call.args)
            kwargs = {k: (next(it) if kind == "batched" else v)
                      for k, (kind, v) in call.kwargs.items()}
            return args, kwargs

        def inner(params, xs, g_used):
            args, kwargs = rebuild(xs)
            out = functional_call(module, {**params, **fixed}, args, kwargs)
            seq = out if isinstance(out, (tuple, list)) else (out,)
            return sum((seq[k] * gk).sum() for k, gk in zip(used, g_used))

        _REPLAYING[0] = True
        try:
            with torch.enable_grad():
                grads = vmap(grad(inner), in_dims=(None, 0, 0))(
                    trainable, batched, [g for g in gs if g is not None])
        finally:
            _REPLAYING[0] = False
        return {n: g.to(accumulation_dtype(g)) for n, g in grads.items()}
