"""Model state that changes during a private step outside the optimizer's update: refused.

The release of a step is the noised sum of clipped per-sample gradients; everything else the model
holds must be a function of earlier releases (or public data). A parameter or buffer that the step
itself changes — a frozen ``nn.Parameter`` used as running statistics and updated in the forward,
a buffer updated by a tensor hook during the backward (an EMA of gradient statistics), a value
written by the loss — holds this batch's data without noise: it ships in the ``state_dict`` and
reaches later steps' gradients outside the clipping bound.

:class:`StepStateGuard` records every parameter and buffer tensor with its version counter
(``_version``, moved by every in-place write) — the native engine when the optimizer is attached
and again after every check and every update, so that writes between steps (in the loop, or by a
global forward hook that runs before the model's own) are seen too; the Opacus door at the first
forward of a step, a forward pre-hook with grad enabled, on the model or on a submodule a loop
calls directly — and :meth:`StepStateGuard.check` compares them after the step's backward,
before anything is released: an in-place write, a parameter or buffer of the model replaced by
another tensor, or one registered since, raises ``ValueError`` naming it. That is a few integer
comparisons per tensor, no tensor operation. Buffers declared data-free (``data_free_buffers``,
``fnmatch`` patterns) and the audited shape caches of known library classes are skipped, as the
forward's
:class:`private_engine.guards.buffers.BufferGuard` skips them.

A write through ``.data`` moves no version counter: the guard also compares each tensor's data
pointer (``.data = …`` swaps it) and refuses a parameter or buffer whose storage the batch flow saw
written in place during the step (``param.data.mul_(…)`` in the forward or the loss). Not seen:
state kept in Python attributes (numbers, or tensors that are not registered parameters or buffers;
a tensor kept from an earlier batch and used again is refused by the batch flow), and writes that
bypass torch's operators (through a NumPy view of the storage).
"""
from __future__ import annotations

import fnmatch
from typing import Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..capture.fallback import replaying
from .buffers import shape_caches


class StateChangedError(ValueError):
    """A parameter or buffer changed during a private step outside the optimizer's update."""


class StepStateGuard:
    """Refuse a step that changes the model's parameters or buffers (module docstring).

    ``compare_identity``: also refuse a parameter or buffer replaced by another tensor (off for
    FSDP2 models, whose modules swap sharded and unsharded parameters within a step).
    """

    def __init__(self, model: nn.Module, allow: Iterable[str] = (),
                 compare_identity: bool = True):
        if isinstance(allow, str):
            allow = (allow,)
        self.model = model
        self.allow: Tuple[str, ...] = tuple(allow)
        self.compare_identity = compare_identity
        self._slots: List[Tuple[str, nn.Module, str, str]] = []
        self._armed: Optional[List[Tuple[object, int, int]]] = None
        self._modules: Optional[List[Tuple[str, nn.Module]]] = None
        self._counts: List[Tuple[int, int]] = []
        self._handles: list = []

    def install(self) -> "StepStateGuard":
        """Register the forward pre-hooks (on the model and every submodule, so that a loop that
        calls submodules directly is covered) that record the state at a step's first forward."""
        if not self._handles:
            self._handles = [m.register_forward_pre_hook(self._pre, prepend=True)
                             for m in self.model.modules()]
        return self

    def remove(self) -> None:
        """Remove the hooks and forget any recorded state."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._armed = None

    def _pre(self, module, args) -> None:
        if self._armed is None and torch.is_grad_enabled() and not replaying():
            self.arm()
        return None

    def arm(self) -> None:
        """Record every parameter and buffer, its version counter and data pointer, and how many
        each module registers (the modules are those of the model when the guard was installed)."""
        if self._modules is None:
            self._modules = list(self.model.named_modules())
        self._slots = [
            (f"{name}.{attr}" if name else attr, m, attr, kind)
            for name, m in self._modules
            for kind, table in (("parameter", m._parameters), ("buffer", m._buffers))
            for attr in table
            if not (kind == "buffer" and (self._allowed(f"{name}.{attr}" if name else attr)
                                          or attr in shape_caches(m)))]
        self._counts = [(len(m._parameters), len(m._buffers)) for _, m in self._modules]
        self._armed = [(t, _version(t), _data_ptr(t)) for t in self._tensors()]

    @property
    def armed(self) -> bool:
        """Whether a recorded state is waiting for :meth:`check`."""
        return self._armed is not None

    def _allowed(self, qualified: str) -> bool:
        return any(fnmatch.fnmatchcase(qualified, p) for p in self.allow)

    def _tensors(self) -> List[object]:
        out = []
        for _, m, attr, kind in self._slots:
            table = m._parameters if kind == "parameter" else m._buffers
            out.append(table.get(attr))
        return out

    def disarm(self) -> None:
        """Forget the recorded state (the next forward records it again)."""
        self._armed = None

    def check(self, written_storages: Iterable[int] = ()) -> None:
        """Raise :class:`StateChangedError` naming the first parameter or buffer that changed since
        the step's first forward — its version counter moved, it was replaced by another tensor,
        its data was swapped (``.data = …``), or its storage is among ``written_storages`` (the
        storages the batch flow saw written in place: a write through ``.data`` moves no version
        counter); forget the recorded state either way."""
        armed, self._armed = self._armed, None
        if armed is None:
            return
        for (name, m), counts in zip(self._modules, self._counts):
            if (len(m._parameters), len(m._buffers)) != counts:
                raise StateChangedError(_message(
                    name or type(m).__name__, "module", "given a new parameter or buffer"))
        written = set(written_storages)
        now = self._tensors() if self.compare_identity else None
        for k, ((qualified, m, attr, kind), (t, version, ptr)) in enumerate(
                zip(self._slots, armed)):
            if t is None:
                continue
            if _version(t) != version:
                raise StateChangedError(_message(qualified, kind, "modified in place"))
            if now is not None and now[k] is not t and now[k] is not None:
                raise StateChangedError(_message(qualified, kind, "replaced by another tensor"))
            if self.compare_identity and (_data_ptr(t) != ptr or (ptr and ptr in written)):
                raise StateChangedError(_message(qualified, kind, "written through .data"))


#: the likeliest cause of a parameter written outside the optimizer, and its fix
_DATA_DEPENDENT_INIT = (
    " A module that sets its own parameters from a batch's statistics in its forward does this: "
    "data-dependent initialisation (ActNorm, Glow, weight-norm initialisation) at its first "
    "forward. Run that first forward before building the engine, on public data "
    "(with torch.no_grad(): model(public_batch)), so that the private steps find the module "
    "initialised; its parameters then train through the optimizer like any other.")


def _message(qualified: str, kind: str, what: str) -> str:
    return (
        f"{kind} {qualified} was {what} during a private step (in the forward, the loss or a "
        "backward hook), before the release: its value now depends on this batch without noise, "
        "and it would be released (in the state_dict, and to later steps) outside the DP "
        "guarantee. Nothing was released."
        + (_DATA_DEPENDENT_INIT if kind == "parameter" and what != "replaced by another tensor"
           else "")
        + " Keep state that depends on the data out of the model "
        "(compute it inside the forward from the current inputs), update parameters only "
        "through the optimizer, and reload the model before releasing anything. (Weights loaded "
        "on purpose between steps, not from the private data: call engine.state_guard.arm() "
        "after loading; load_checkpoint does.)"
        + (f" If the buffer depends only on shapes (a cache), allow it: "
           f"PrivacyEngine(..., data_free_buffers=[{qualified!r}])." if kind == "buffer" else ""))


def _data_ptr(t) -> int:
    """The data pointer of ``t``'s storage (0 when it has none, e.g. a meta tensor)."""
    if not isinstance(t, torch.Tensor):
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        return 0


def _version(t) -> int:
    if not isinstance(t, torch.Tensor) or t.is_inference():
        return -1
    try:
        return t._version
    except (RuntimeError, AttributeError):
        return -1
