"""A deliberately broken engine for the audit's per-path positive controls (tests only).

``unclipped(path)`` patches the clipping core so that every sample's contribution through one
clipping path is released with clip factor 1 — the sample's raw gradient there — while every
other path is clipped as usual. Norms are computed as before; only the release of that path
ignores them. Both doors (the native ``PrivacyEngine`` and the Opacus door's plain backward) go
through the patched :class:`private_engine.clipping.clipper.PerSampleClipper`, in every
clipping mode:

* a ruled layer whose ``(a, g)`` are kept (ghost layers, book-keeping layers kept as pairs, the
  second backward of the two-pass modes) releases through ``rule.weighted_grads``: patched on the
  rule instances of the registry to use factors 1 for a broken module;
* kept per-sample gradients (instantiated ruled layers, the parameter tracer, the ``torch.func``
  fallback) release through ``weighted_sum_into`` on grouped matrices: a broken path's gradients
  are grouped on their own, and their group's sum uses factors 1.

Paths: ``linear`` (Linear without bias), ``linear_bias`` (Linear with bias, any T), ``conv``,
``embedding``, ``layernorm``, ``groupnorm``, ``sequence`` (any ruled layer that sees T > 1
positions per sample), ``traced`` (raw parameters) and ``fallback`` (torch.func modules).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from private_engine.clipping import clipper as clipper_module
from private_engine.clipping import sums as sums_module
from private_engine.layers.registry import REGISTRY

#: the paths, in the order of ``private_engine.audit.paths.PATHS``
PATHS = ("linear", "linear_bias", "conv", "embedding", "layernorm", "groupnorm", "traced",
         "fallback", "sequence")


def _positions(pairs) -> int:
    """The most positions per sample among a layer's calls (1 for ``(B, D)`` inputs)."""
    most = 1
    for a, _ in pairs:
        if a is not None and a.dim() > 2:
            most = max(most, a[0].numel() // a.shape[-1] if a.shape[0] else 1)
    return most


def _ruled_broken(path: str, module: nn.Module, pairs) -> bool:
    if path == "linear":
        return isinstance(module, nn.Linear) and module.bias is None
    if path == "linear_bias":
        return isinstance(module, nn.Linear) and module.bias is not None
    if path == "conv":
        return isinstance(module, nn.modules.conv._ConvNd)
    if path == "embedding":
        return isinstance(module, nn.Embedding)
    if path == "layernorm":
        return isinstance(module, nn.LayerNorm)
    if path == "groupnorm":
        return isinstance(module, nn.GroupNorm)
    if path == "sequence":
        return not isinstance(module, (nn.modules.conv._ConvNd, nn.GroupNorm)) and \
            _positions(pairs) > 1
    return False


@contextlib.contextmanager
def unclipped(path: str):
    """The engine with clip factor 1 for every sample on ``path`` (one of :data:`PATHS`)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}.")
    broken_modules: set = set()  # ids of ruled modules on the path (decided per layer call)
    broken_params: set = set()  # ids of parameters whose kept per-sample gradients are broken
    broken_mats: set = set()  # ids of the kept-gradient matrices of broken parameters
    clip = [None]  # the clip factors C_i of the running batch

    cls = clipper_module.PerSampleClipper
    saved = {name: getattr(cls, name)
             for name in ("on_layer_ready", "keep_grads", "_keep_extra", "clip_factors")}
    saved_group = clipper_module.group_kept_grads
    saved_sum = sums_module.weighted_sum_into
    rules = list(dict.fromkeys(list(REGISTRY.rules.values()) +
                               list(REGISTRY.named_rules.values())))

    def unclipped_factors(factors):
        """The factors the release uses with C_i = 1: ``factors / C_i`` (the door's scale,
        e.g. the physical batch size of a mean loss in the Opacus door), 0 where C_i = 0."""
        c = clip[0]
        if c is None or c.shape != factors.shape:
            raise RuntimeError("the broken engine has no clip factors for this batch.")
        c = c.to(factors.dtype)
        return torch.where(c > 0, factors / torch.where(c > 0, c, torch.ones_like(c)),
                           torch.zeros_like(factors))

    def clip_factors(self, norms):
        clip[0] = saved["clip_factors"](self, norms)
        return clip[0]

    def on_layer_ready(self, layer):
        if _ruled_broken(path, layer.module, layer.pairs()):
            broken_modules.add(id(layer.module))
        return saved["on_layer_ready"](self, layer)

    def keep_grads(self, module, grads):
        if id(module) in broken_modules:
            broken_params.update(id(getattr(module, n)) for n in grads)
        return saved["keep_grads"](self, module, grads)

    def keep_extra(self, name, layer_type, grads, params):
        if (path == "traced" and layer_type == "param-entry") or \
                (path == "fallback" and layer_type.startswith("fallback:")):
            broken_params.update(id(p) for p in params)
        return saved["_keep_extra"](self, name, layer_type, grads, params)

    def group_kept_grads(items, batch_size, key=None):
        broken_mats.clear()  # one norm pass at a time: ids of freed matrices are reused
        broken = [it for it in items if id(it[0]) in broken_params]
        rest = [it for it in items if id(it[0]) not in broken_params]
        items[:] = [None] * len(items)
        groups, terms = saved_group(rest, batch_size, key=key)
        if broken:
            more, more_terms = saved_group(broken, batch_size, key=key)
            broken_mats.update(id(mat) for _, mat in more)
            groups += more
            terms += more_terms
        return groups, terms

    def weighted_sum_into(out, rows, factors):
        if id(rows) in broken_mats:
            factors = unclipped_factors(factors)
        return saved_sum(out, rows, factors)

    def wrap(rule):
        original = rule.weighted_grads

        def weighted_grads(module, calls, factors, out=None):
            if id(module) in broken_modules:
                factors = unclipped_factors(factors)
            return original(module, calls, factors, out=out)
        return weighted_grads

    try:
        cls.on_layer_ready = on_layer_ready
        cls.keep_grads = keep_grads
        cls._keep_extra = keep_extra
        cls.clip_factors = clip_factors
        clipper_module.group_kept_grads = group_kept_grads
        sums_module.weighted_sum_into = weighted_sum_into
        for rule in rules:
            rule.weighted_grads = wrap(rule)
        yield
    finally:
        for name, fn in saved.items():
            setattr(cls, name, fn)
        clipper_module.group_kept_grads = saved_group
        sums_module.weighted_sum_into = saved_sum
        for rule in rules:
            vars(rule).pop("weighted_grads", None)
