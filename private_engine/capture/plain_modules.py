"""Submodules the parameter-entry tracer does not need to follow: their forwards run without its
mode.

The tracer (:mod:`private_engine.capture.tracer`) is a ``TorchFunctionMode`` over the model's
forward: every op of the forward costs a Python call that looks its operands up, whether or not a
tracked parameter is anywhere near. In a timm ViT the tracked parameters (``cls_token``,
``pos_embed``) enter before the first block, and the blocks are most of the ops: on the ViT-B
structure at tiny size (``bench/investigate/host_overhead.py``) following them was about a fifth of
a private step's host time.

A *plain candidate* is a maximal submodule with children that owns no tracked parameter and
contains no torch.func fallback module. Its forward on inputs of a given *signature* (shapes,
dtypes, devices, ``requires_grad`` and batch dimension of each tensor argument, the other
arguments' values, its ``training`` flag, grad and autocast state) is traced once, like any other
forward, to *verify* it: it is plain when the tracer saw nothing there beyond ops on batched data —
no tracked or derived tensor (so no entry, no hand-over of a layer on a constant), and every
recorded layer call inside had the batch sample-major in dim 0 with exactly B rows. Subsequent
calls with the same signature run with the mode off the stack; their outputs are marked with the
batch dimensions the verification found. What the tracer would have done inside is nothing, so the
norms and sums are unchanged, and what it provides there is not needed: a layer call inside gets no
row information (``rows_ok=None``), which only matters for k·B rows, and those were verified
absent.

If a skipped forward did differ from its verification (data-dependent control flow) the failure is
loud, not silent: a tracked parameter reaching the batch inside is reached outside every recorded
call and entry by the graph walk of the step (``LayerRecorder.walk``: an error naming it), and a
layer seeing other than B rows has no row information (an error in the norm pass).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

#: signatures remembered per module; a module whose inputs keep changing shape starts over past
#: this many
MAX_SIGNATURES = 64
_SCALARS = (type(None), bool, int, float, str, torch.dtype, torch.device)
#: the verdict of a module on a signature where the tracer did find work inside
TRACED = None


def plain_candidates(model: nn.Module, tracked: set,
                     opaque: Sequence[nn.Module]) -> List[nn.Module]:
    """The maximal submodules of ``model`` (not ``model`` itself) that have children, own no
    parameter whose id is in ``tracked`` and contain no module of ``opaque`` (torch.func fallback
    modules, which read the tracer)."""
    opaque_ids = {id(m) for m in opaque}
    clean: Dict[int, bool] = {}

    def is_clean(m: nn.Module) -> bool:
        if id(m) not in clean:
            own = any(id(p) in tracked for p in m.parameters(recurse=False))
            clean[id(m)] = (id(m) not in opaque_ids and not own
                            and all(is_clean(c) for c in m.children()))
        return clean[id(m)]

    found: List[nn.Module] = []
    seen: set = set()

    def visit(m: nn.Module) -> None:
        for c in m.children():
            if id(c) in seen:
                continue
            seen.add(id(c))
            if is_clean(c) and next(c.children(), None) is not None:
                found.append(c)
            elif not is_clean(c):
                visit(c)

    visit(model)
    return found


class PlainModules:
    """Forward hooks on the plain candidates of the tracer's model: verify each signature once,
    then skip."""

    def __init__(self, tracer, modules: Sequence[nn.Module]):
        self.tracer = tracer
        self.modules = list(modules)
        #: ``{id(module): {signature: output batch dims, or TRACED}}``
        self.verdicts: Dict[int, Dict[tuple, Optional[tuple]]] = {}
        # per open candidate call: None, ("verify", signature, events) or ("skip", dims)
        self._stack: list = []
        self._handles: list = []

    def install(self) -> None:
        if not self._handles:
            for m in self.modules:
                self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._post, always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack = []

    def reset(self) -> None:
        """A new forward of the model begins (calls left open by an error are dropped)."""
        self._stack = []

    # -- signature -----------------------------------------------------------------------
    def _arg_key(self, a):
        if isinstance(a, torch.Tensor):
            tracer = self.tracer
            if tracer.is_tracked(a):
                raise _NotPlain
            return (tuple(a.shape), a.dtype, a.device, a.requires_grad, tracer.batched.get(a))
        if isinstance(a, _SCALARS):
            return a
        if isinstance(a, (tuple, list)):
            return (type(a).__name__,) + tuple(self._arg_key(x) for x in a)
        raise _NotPlain  # an object the signature cannot describe: always traced

    def signature(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        """The signature of a call (see the module docstring), or None when it cannot be skipped."""
        try:
            key = tuple(self._arg_key(a) for a in args)
            if kwargs:
                key += tuple((k, self._arg_key(v)) for k, v in sorted(kwargs.items()))
        except _NotPlain:
            return None
        autocast = tuple(torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None
                         for d in ("cpu", "cuda"))
        return key + (module.training, autocast)

    # -- hooks -----------------------------------------------------------------------------
    def _pre(self, module, args, kwargs):
        tracer = self.tracer
        state = None
        if (tracer.active and not tracer.skipping and tracer.skip_plain_modules
                and torch.is_grad_enabled()):
            key = self.signature(module, args, kwargs)
            if key is not None:
                known = self.verdicts.get(id(module), {})
                if key not in known:
                    state = ("verify", key, tracer.events)
                elif known[key] is not TRACED:
                    state = ("skip", known[key])
                    tracer.pause()
        self._stack.append(state)
        return None

    def _post(self, module, args, output):
        state = self._stack.pop() if self._stack else None
        if state is None:
            return None
        tracer = self.tracer
        outs = _output_tensors(output)
        if state[0] == "skip":
            tracer.resume()
            dims = state[1]
            # not the verified structure: its batch is unknown
            if outs is None or len(outs) != len(dims):
                dims = (-1,) * len(outs or ())
            for t, d in zip(outs or (), dims):
                if d is not None:
                    tracer.batched[t] = d
            return None
        _, key, events = state
        verdict = TRACED
        if tracer.events == events and outs is not None:
            verdict = tuple(tracer.batched.get(t) for t in outs)
        known = self.verdicts.setdefault(id(module), {})
        if len(known) >= MAX_SIGNATURES:
            known.clear()
        known[key] = verdict
        return None


class _NotPlain(Exception):
    pass


def _scalars_only(v) -> bool:
    return isinstance(v, _SCALARS) or (isinstance(v, (tuple, list))
                                       and all(_scalars_only(x) for x in v))


def _output_tensors(output) -> Optional[list]:
    """The tensors of a module's output: a tensor, or a tuple/list of tensors and scalars (or
    containers of scalars only, e.g. timm's ``(x, (H, W))``); None for other structures (tensors in
    nested containers, dicts, objects), whose batched tensors are not marked: always traced."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)) and all(isinstance(t, torch.Tensor) or _scalars_only(t)
                                                 for t in output):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return None
