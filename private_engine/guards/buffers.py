"""Modules whose buffers change with the data: refused before training, or caught in the forward.

A DP release must be the only thing that depends on the private data. A buffer that a module
updates from its input in training mode (running statistics, an EMA of activations, a counter of
samples) breaks this twice: its value ships in the ``state_dict`` without noise, and the next
forward passes read it, so a sample's gradient at a later step depends on other samples' data
and the per-sample sensitivity bound no longer holds.

Two checks:

* :func:`check_no_running_stats`, static, at engine construction: the known classes that keep
  running statistics (``InstanceNorm`` with ``track_running_stats=True``, timm's batch-statistic
  EvoNorms). BatchNorm is refused before it, by ``model_check.check_no_batchnorm``.
* :class:`BufferGuard`, dynamic, for any module: between a module's forward pre-hook and forward
  hook, a buffer modified in place (its ``_version`` moved) or re-assigned raises a ValueError.
"""
from __future__ import annotations

import fnmatch
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..capture.fallback import replaying

#: classes (qualified names, so that timm need not be imported) that normalise by batch
#: statistics in training mode and keep running estimates of them, as BatchNorm does
BATCH_STATISTICS_CLASSES = {
    "timm.layers.evo_norm.EvoNorm2dB0",
    "timm.layers.evo_norm.EvoNorm2dB1",
    "timm.layers.evo_norm.EvoNorm2dB2",
    "timm.layers.inplace_abn.InplaceAbn",
}


def _display(name: str, model: nn.Module) -> str:
    return name or type(model).__name__


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:8]) + (f", … ({len(names)} in all)" if len(names) > 8 else "")


def _tracks_running_stats(module: nn.Module) -> bool:
    """True for a non-BatchNorm ``_NormBase`` (InstanceNorm*, LazyInstanceNorm*) that would update
    running statistics: ``track_running_stats=True``, or running buffers left in place after the
    flag was turned off (``F.instance_norm`` updates any running buffers it is given, in training
    and in eval mode alike; Opacus' ``ModuleValidator.fix`` leaves them so)."""
    if not isinstance(module, nn.modules.batchnorm._NormBase) or \
            isinstance(module, nn.modules.batchnorm._BatchNorm):
        return False
    return bool(module.track_running_stats) or getattr(module, "running_mean", None) is not None \
        or getattr(module, "running_var", None) is not None


def _uses_batch_statistics(module: nn.Module) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" in BATCH_STATISTICS_CLASSES
               for c in type(module).__mro__)


def running_stats_modules(model: nn.Module) -> List[str]:
    """Names of the modules (other than BatchNorm) that keep running statistics of their inputs in
    buffers: InstanceNorm with ``track_running_stats=True`` (frozen or ``affine=False`` included:
    the statistics are buffers, not parameters) and the classes of ``BATCH_STATISTICS_CLASSES``."""
    return [_display(name, model) for name, m in model.named_modules()
            if _tracks_running_stats(m) or _uses_batch_statistics(m)]


def check_no_running_stats(model: nn.Module) -> None:
    """Refuse modules whose buffers track statistics of the private data (see module docstring).

    Raises a ValueError naming them: in training mode their running statistics are computed from
    each private batch and released without noise in the ``state_dict`` (and used by later forward
    passes), which no DP guarantee covers. BatchNorm is checked before, by ``check_no_batchnorm``.
    """
    batch = [_display(n, model) for n, m in model.named_modules() if _uses_batch_statistics(m)]
    if batch:
        raise ValueError(
            "the model has layers that normalise by batch statistics and keep running estimates "
            f"of them ({_shown(batch)}): like BatchNorm, they mix samples, so per-sample clipping "
            "is not defined, and their running statistics, computed from the private batches, "
            "would be released without noise in the state_dict. Replace them with GroupNorm or a "
            "per-sample variant (timm's EvoNorm2dS*)."
        )
    norms = [f"{_display(n, model)} ({type(m).__name__})" for n, m in model.named_modules()
             if _tracks_running_stats(m)]
    if norms:
        raise ValueError(
            f"the model has normalisation layers that track running statistics: {_shown(norms)}. "
            "In training mode their running_mean/running_var are computed from each private batch "
            "and released without noise in the state_dict (and used by later forward passes), "
            "outside the DP guarantee. Build them with track_running_stats=False (training "
            "normalises each sample by its own statistics either way; "
            "model = private_engine.fix_batchnorm(model) does this), or use GroupNorm."
        )


def drop_running_stats(model: nn.Module) -> List[str]:
    """Turn every InstanceNorm that tracks running statistics into one that does not, in place.

    Sets ``track_running_stats=False`` and the ``running_mean``/``running_var``/
    ``num_batches_tracked`` buffers to None, as ``InstanceNorm(..., track_running_stats=False)``
    builds them (turning the flag off alone is not enough: ``F.instance_norm`` still updates the
    buffers it is passed). Training is unchanged: in training mode InstanceNorm normalises each
    sample by its own statistics anyway. In eval mode the layer then normalises by the sample's own
    statistics too, instead of the running estimates; and its ``state_dict`` no longer holds them
    (load older checkpoints with ``strict=False``). Returns the names of the modules changed.
    """
    changed = []
    for name, m in model.named_modules():
        if _tracks_running_stats(m):
            m.track_running_stats = False
            for buf in ("running_mean", "running_var", "num_batches_tracked"):
                if buf in m._buffers:
                    m._buffers[buf] = None
            changed.append(_display(name, m))
    return changed


_ABSENT = object()


#: buffers that known library classes build from shapes only (audited caches, never from the data),
#: by the qualified class name that owns them: skipped by :class:`BufferGuard` as if allowed
SHAPE_CACHES = {
    # relative positions of the N patches, one table per N
    "timm.models.convit.GPSA": frozenset({"rel_indices"}),
}


def shape_caches(module: nn.Module) -> frozenset:
    """The audited shape-cache buffers of ``module``'s class (:data:`SHAPE_CACHES`)."""
    return SHAPE_CACHES.get(f"{type(module).__module__}.{type(module).__qualname__}", frozenset())


class BufferGuard:
    """Raise a ValueError when a training-mode forward changes a module buffer.

    ``install()`` registers a forward pre-hook and a forward hook on every module that owns
    buffers (``module._buffers`` non-empty, not recursing); ``remove()`` takes them off. A forward
    is checked when grad is enabled and the module owning the buffer is in training mode
    (evaluation, in eval mode or under ``torch.no_grad()``, trains nothing), and never while the
    torch.func fallback replays a module. The pre-hook records, per buffer, the tensor and its
    ``_version``; the hook compares: an in-place update (``_version`` moved), a re-assignment
    (``module._buffers[name]`` now another tensor) or a buffer registered during the forward
    raises, naming ``module.buffer`` and the fix. That is a few integer comparisons per buffer,
    no tensor operation.

    Every buffer is checked, floating-point or not, persistent or not: a counter
    (``self.seen += x.shape[0]``) releases the Poisson batch sizes, which depend on who is in the
    data set; a non-persistent buffer is not in the ``state_dict`` but is read by later forward
    passes, so one sample's data would reach other samples' gradients (and the model's outputs)
    outside the clipping bound. Constant buffers (timm's relative position index tables, RoPE
    tables) are never written, so they raise nothing. Two cases are not flagged because they carry
    no data: a buffer re-assigned to a tensor of equal values (a device or dtype move such as
    ``self.pe = self.pe.to(x.device)``; this one compares values, once per re-assignment) and a
    buffer set to None or deleted. A buffer that a module fills from *shapes* only (a lazily built
    cache) cannot be told apart from one filled from the data by looking at the tensors, so it is
    flagged; declare it with ``allow``, patterns matched (``fnmatch``) against qualified buffer
    names such as ``"blocks.*.attn.rope_cache"``: only the user can vouch that a value is data-free.

    The error comes out of the forward, before the loss and so before any release; but the buffer
    already holds the batch's value, so reload the model before releasing anything. Not seen: a
    buffer changed outside its own module's forward (module A writing module B's buffer while B is
    not running), and buffers registered on a module that owned none at ``install()``.
    """

    def __init__(self, model: nn.Module, allow: Iterable[str] = ()):
        if not isinstance(model, nn.Module):
            raise TypeError(f"BufferGuard expects an nn.Module, got {type(model).__name__}.")
        if isinstance(allow, str):
            allow = (allow,)
        self.model = model
        self.allow: Tuple[str, ...] = tuple(allow)
        self._handles: list = []

    @property
    def installed(self) -> bool:
        """True while the hooks are registered."""
        return bool(self._handles)

    def allowed(self, qualified_name: str) -> bool:
        """True when ``qualified_name`` (``"module.buffer"``) matches a pattern of ``allow``."""
        return any(fnmatch.fnmatchcase(qualified_name, p) for p in self.allow)

    def install(self) -> "BufferGuard":
        """Register the hooks on every module that owns buffers (again after ``remove()``); returns
        the guard. Calling it while installed does nothing."""
        if self._handles:
            return self
        for name, module in self.model.named_modules():
            if not module._buffers:
                continue
            prefix = f"{name}." if name else ""
            allowed = frozenset(b for b in module._buffers if self.allowed(prefix + b))
            skip = allowed | shape_caches(module)
            if skip and len(skip) == len(module._buffers):
                continue  # every buffer it has is allowed; a new one is still checked by others
            pre, post = self._hooks(name or type(module).__name__, prefix, skip)
            self._handles.append(module.register_forward_pre_hook(pre, prepend=True))
            self._handles.append(module.register_forward_hook(post, always_call=True))
        return self

    def remove(self) -> None:
        """Remove the hooks (the model runs as before ``install()``)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "BufferGuard":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    def _hooks(self, shown: str, prefix: str, skip: frozenset):
        frames: List[Optional[List[tuple]]] = []  # one per call in progress (recursion)
        grad_enabled = torch.is_grad_enabled

        def pre(module, args):
            if module.training and grad_enabled() and not replaying():
                frames.append([(b, t, _version(t)) for b, t in module._buffers.items()
                               if b not in skip])
            else:
                frames.append(None)
            return None

        def post(module, args, output):
            if not frames:  # an earlier pre-hook raised before ours ran
                return None
            before = frames.pop()
            if before is None:
                return None
            bufs = module._buffers
            if len(bufs) == len(before) + len(skip):
                for b, t, v in before:
                    if bufs.get(b, _ABSENT) is not t or (t is not None and _version(t) != v):
                        break
                else:
                    return None  # the common case: nothing changed
            problem = self._first_change(module, prefix, before, skip)
            if problem is not None:
                raise ValueError(self._message(shown, module, prefix, *problem))
            return None

        return pre, post

    def _first_change(self, module: nn.Module, prefix: str, before: List[tuple],
                      skip: frozenset) -> Optional[Tuple[str, str]]:
        """``(buffer name, what happened)`` for the first buffer changed with data, or None."""
        bufs = module._buffers
        for b, t, v in before:
            now = bufs.get(b, _ABSENT)
            if now is _ABSENT or now is None:
                continue  # deleted or set to None: nothing released
            if t is not None and _version(t) != v:
                return b, "modified in place"
            if now is not t:
                if t is not None and _same_values(t, now):
                    continue  # moved to another device or dtype
                return b, "re-assigned" if t is not None else "assigned (it was None)"
        known = {b for b, _, _ in before}
        for b, now in bufs.items():
            if b not in known and b not in skip and now is not None \
                    and not self.allowed(prefix + b):
                return b, "registered"
        return None

    def _message(self, shown: str, module: nn.Module, prefix: str, buf: str, what: str) -> str:
        qualified = prefix + buf
        return (
            f"buffer {shown}.{buf} of {type(module).__name__} was {what} during a training-mode "
            "forward: its value now depends on the private batch, and a buffer is released without "
            "noise (in the state_dict, and to the later forward passes that read it), outside the "
            "DP guarantee. Fix: do not update buffers from the data in training mode (compute the "
            "value inside forward, or from public data before training; for normalisation layers "
            "use track_running_stats=False or GroupNorm). If the value depends only on shapes, not "
            "on the data (a cache), allow it: "
            f"PrivacyEngine(..., data_free_buffers=[{qualified!r}]) "
            f"(BufferGuard(model, allow=[{qualified!r}])). The "
            "buffer already holds this batch's value: reload the model before releasing anything."
        )


def _version(t: Optional[torch.Tensor]) -> int:
    """The tensor's version counter; -1 for None and inference tensors (which have none, and cannot
    be modified in place outside inference mode, where grad is off and nothing is checked)."""
    if t is None or t.is_inference():
        return -1
    return t._version


def _same_values(old: torch.Tensor, new) -> bool:
    if not isinstance(new, torch.Tensor) or new.shape != old.shape:
        return False
    with torch.no_grad():
        return bool(torch.equal(old.to(device=new.device, dtype=new.dtype), new))
