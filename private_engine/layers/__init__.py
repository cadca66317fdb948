"""Per-layer rules: how a layer's recorded ``(a, g)`` become certified per-sample gradient norms and
clipped sums; and the one registry that says how each module class is clipped."""
from . import activation, conv, conv_transpose, embedding, linear, normalization  # noqa: F401
from .base import LayerDims, LayerRule
from .conv import unfold_conv_input
from .recurrent import check_no_recurrent, fix_recurrent
from .registry import REGISTRY, find_rule, register_fallback, register_rule, unregister
from .ruled import KeptPairs, RuledLayer

__all__ = ["LayerDims", "LayerRule", "RuledLayer", "KeptPairs", "REGISTRY", "find_rule",
           "register_rule", "register_fallback", "unregister", "unfold_conv_input",
           "check_no_recurrent", "fix_recurrent"]
