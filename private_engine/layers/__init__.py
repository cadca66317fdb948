"""Registry of layer rules, looked up along the class hierarchy (subclasses inherit rules)."""
from .base import LayerDims, LayerRule, find_rule, register_rule
from . import conv, embedding, linear, normalization  # noqa: F401  (registers the rules)
from .conv import unfold_conv_input
from ..fallback import register_fallback  # noqa: E402  (torch.func fallback for a module class)

__all__ = ["LayerDims", "LayerRule", "find_rule", "register_rule", "unfold_conv_input", "register_fallback"]
