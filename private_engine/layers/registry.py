"""The one registry of how each module class is clipped: by a layer rule, or by the ``torch.func``
fallback, and which subclasses keep their ruled parent's math.

Lookups walk the class hierarchy (a subclass inherits its parent's rule unless it redefines
``forward``). Classes named by their qualified name are matched without importing their library
(timm, opacus).
"""
from __future__ import annotations

from typing import Dict, Optional, Set, Type, TypeVar, cast

from torch import nn

from .base import LayerRule

R = TypeVar("R", bound=LayerRule)


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class: how the registry names classes it need not import."""
    return f"{cls.__module__}.{cls.__qualname__}"


class Registry:
    """Rules by module class, the fallback's classes, and subclasses with their parent's math."""

    def __init__(self) -> None:
        self.rules: Dict[type, LayerRule] = {}
        #: rules for classes of optional libraries, by qualified name (matched without importing
        #: the library)
        self.named_rules: Dict[str, LayerRule] = {}
        #: module classes clipped by the torch.func fallback (qualified names)
        self.fallback_classes: Set[str] = {
            # weights used inside F.multi_head_attention_forward
            "torch.nn.modules.activation.MultiheadAttention",
        }
        #: subclasses that override ``forward`` without changing their registered parent's math
        #: (checked against the sample-by-sample reference in the tests)
        self.same_math_subclasses: Set[str] = {
            "timm.layers.norm.LayerNorm",  # F.layer_norm (or its fused twin), same arguments
            "timm.layers.norm.GroupNorm",
            "timm.layers.norm.GroupNorm1",
            "timm.layers.linear.Linear",  # F.linear; only TorchScript takes another branch
        }

    def register_rule(self, rule: R, *module_types: Type[nn.Module]) -> R:
        """Clip ``module_types`` (default: ``rule.module_types``) by ``rule``."""
        for cls in module_types or rule.module_types:
            self.rules[cls] = rule
        return rule

    def register_named_rule(self, rule: R, *qualified_names: str) -> R:
        """Clip the classes called ``qualified_names`` (``module.QualName``) by ``rule``, without
        importing their library."""
        for name in qualified_names:
            self.named_rules[name] = rule
        return rule

    def register_fallback(self, cls: type) -> type:
        """Clip every module of class ``cls`` (and its subtree) by the ``torch.func`` fallback."""
        self.fallback_classes.add(qualified_name(cls))
        return cls

    def unregister(self, cls: type) -> None:
        """Forget whatever was registered for ``cls`` (a rule or the fallback)."""
        self.rules.pop(cls, None)
        self.named_rules.pop(qualified_name(cls), None)
        self.fallback_classes.discard(qualified_name(cls))

    def find_rule(self, module: nn.Module) -> Optional[LayerRule]:
        """The rule for ``module``: the registered class nearest along its MRO, or None.

        A class on the way that defines its own ``forward`` ends the search with None (unless it
        is registered itself or keeps its parent's math): a rule describes its class's forward,
        and a subclass that permutes dimensions, adds an activation or transforms its weight
        (timm's LayerNorm2d, GroupNormAct, StdConv2d) would get per-sample norms that are wrong
        without any error — a sensitivity above max_grad_norm. Such a module is reported as
        unsupported before training (or clipped by the fallback: :meth:`overrides_ruled_class`).
        """
        for cls in type(module).__mro__:
            rule = self.rules.get(cls)
            if rule is None and self.named_rules:
                rule = self.named_rules.get(qualified_name(cls))
            if rule is not None:
                return rule
            if "forward" in vars(cls) and qualified_name(cls) not in self.same_math_subclasses:
                return None
        return None

    def uses_fallback(self, module: nn.Module) -> bool:
        """True when ``module``'s class (or a parent class) is registered for the fallback, or when
        its weight is reparametrised by weight normalisation (:func:`weight_normalized`)."""
        return weight_normalized(module) or \
            any(qualified_name(c) in self.fallback_classes for c in type(module).__mro__)

    def overrides_ruled_class(self, module: nn.Module) -> bool:
        """True for a module without a rule whose class derives from one that has a rule (a
        subclass that overrides ``forward``): it is clipped by the torch.func fallback."""
        return self.find_rule(module) is None and \
            any(cls in self.rules or qualified_name(cls) in self.named_rules
                for cls in type(module).__mro__)


#: parametrizations that are pure functions of their parameters (no buffers, no state written in
#: the forward): a module using them is clipped by the torch.func fallback. ``spectral_norm`` is
#: not one: its power iteration writes its ``_u``/``_v`` buffers from the data in every training
#: forward, which the buffer guard refuses.
PURE_PARAMETRIZATIONS = {"torch.nn.utils.parametrizations._WeightNorm"}


def weight_normalized(module: nn.Module) -> bool:
    """True for a module whose weight is ``W = g·v/‖v‖`` (Salimans & Kingma 2016, "Weight
    Normalization"), by ``torch.nn.utils.parametrizations.weight_norm`` (trainable ``original0`` =
    g, ``original1`` = v) or the older hook of ``torch.nn.utils.weight_norm`` (``weight_g``,
    ``weight_v``).

    Such a module is clipped by the torch.func fallback: the per-sample gradients of g and v are
    those of its own forward, ``∇_{g,v} ⟨M(g, v; x_i), g_i⟩`` — the chain rule through
    ``W(g, v)`` of the per-sample ``∂L_i/∂W``, ``∂L_i/∂g_r = ⟨∂L_i/∂W_r, v_r⟩/‖v_r‖`` and
    ``∂L_i/∂v_r = (g_r/‖v_r‖)(∂L_i/∂W_r − ⟨∂L_i/∂W_r, v̂_r⟩ v̂_r)`` per normalised slice r — computed
    exactly, whatever the layer inside (Linear, Conv, ConvTranspose, …)."""
    parametrizations = getattr(module, "parametrizations", None)
    if isinstance(parametrizations, nn.ModuleDict) and len(parametrizations):
        return all(qualified_name(type(p)) in PURE_PARAMETRIZATIONS
                   for plist in parametrizations.values() for p in cast(nn.ModuleList, plist))
    from torch.nn.utils.weight_norm import WeightNorm

    return any(isinstance(h, WeightNorm) for h in module._forward_pre_hooks.values())


REGISTRY = Registry()
register_rule = REGISTRY.register_rule
register_named_rule = REGISTRY.register_named_rule
register_fallback = REGISTRY.register_fallback
unregister = REGISTRY.unregister
find_rule = REGISTRY.find_rule
uses_fallback = REGISTRY.uses_fallback
overrides_ruled_class = REGISTRY.overrides_ruled_class

