"""Which of the audit's clipping paths (:data:`~private_engine.audit.paths.PATHS`) a model's
clipping goes through, from the engine's own scan of the model: :func:`paths_of`.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from .paths import PATHS

__all__ = ["ModelPaths", "paths_of"]


class ModelPaths(NamedTuple):
    """The clipping paths a model uses (:func:`paths_of`)."""

    #: the paths, in :data:`~private_engine.audit.paths.PATHS` order
    paths: Tuple[str, ...]
    #: the clipped modules whose rule has no canary head (named, with their class)
    uncovered: List[str]


def paths_of(model: nn.Module, *example_inputs, **example_kwargs) -> ModelPaths:
    """``ModelPaths(paths, uncovered)``: the clipping paths the engine uses for ``model``, in
    :data:`PATHS` order, and the clipped modules whose rule has no canary head here (named).

    From :func:`private_engine.guards.model_check.scan_model`: each ruled layer's kind (Linear
    with or without bias, Conv, Embedding, LayerNorm, GroupNorm), raw parameters (``traced``),
    ``torch.func`` modules (``fallback``). ``sequence`` (a Linear, Embedding or LayerNorm seeing
    T > 1 positions per sample) is found by running the model once on ``example_inputs`` (no
    gradient); without them it is listed whenever such a layer exists.
    """
    from ..guards.model_check import scan_model

    scan = scan_model(model)
    found, uncovered, seq_candidates = set(), [], []
    for name, module, _ in scan.layers:
        kind = _kind(module)
        if kind is None:
            uncovered.append(f"{name or type(model).__name__} ({type(module).__name__})")
            continue
        found.add(kind)
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            seq_candidates.append(module)
    if scan.traced:
        found.add("traced")
    if scan.fallbacks:
        found.add("fallback")
    if seq_candidates and _sees_sequences(model, seq_candidates, example_inputs, example_kwargs):
        found.add("sequence")
    return ModelPaths(tuple(p for p in PATHS if p in found), uncovered)


def _kind(module: nn.Module) -> Optional[str]:
    if type(module) in (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "linear_bias" if module.bias is not None and module.bias.requires_grad \
            else "linear"
    for cls, kind in ((nn.Conv1d, "conv"), (nn.Conv2d, "conv"), (nn.Conv3d, "conv"),
                      (nn.Embedding, "embedding"), (nn.LayerNorm, "layernorm"),
                      (nn.GroupNorm, "groupnorm")):
        if type(module) is cls:
            return kind
    if isinstance(module, nn.Linear):  # timm's Linear and other same-math subclasses
        return "linear_bias" if module.bias is not None and module.bias.requires_grad \
            else "linear"
    return None


def _sees_sequences(model, modules, inputs, kwargs) -> bool:
    if not inputs and not kwargs:
        return True
    seen = []

    def hook(module, args, out):
        x = args[0] if args else None
        if isinstance(x, torch.Tensor):
            width = 1 if isinstance(module, nn.Embedding) else x.shape[-1]
            seen.append(x.dim() >= (2 if isinstance(module, nn.Embedding) else 3) and
                        x[0].numel() // width > 1)

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return any(seen)
