"""Clipping: the per-layer plan (ghost norm or instantiation), certified per-sample norms over all
layers, clip factors from a clipping function, and the clipped sums ``Σ_i C_i g_i`` in flat
buffers."""
from .clipper import PerSampleClipper
from .functions import CLIPPING_FUNCTIONS, ClipFn, abadi_clip, automatic_clip, global_clip

__all__ = ["PerSampleClipper", "CLIPPING_FUNCTIONS", "ClipFn", "abadi_clip", "automatic_clip",
           "global_clip"]
